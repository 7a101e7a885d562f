"""Time-boxed fuzzing of the checkpoint readers: ``python -m fuzz.run --seconds N``."""
