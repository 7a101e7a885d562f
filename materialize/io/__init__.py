"""Moving bytes: files read into allocated tensors, staged to GPUs, mapped zero-copy, memory measured."""
