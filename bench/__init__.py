"""Benchmarks: torch-materialize against the loaders people use, on the same files."""
