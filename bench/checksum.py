"""The checksum every bench verifies a load's tensors by; it imports nothing of the library, so a child
running an earlier checkout's library (``bench.many --baseline``) can use it."""

from __future__ import annotations

import zlib

import torch


def crc(tensor: torch.Tensor) -> int:
    """Checksum of a tensor's bytes (what every method's result is compared by)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(memoryview(flat.numpy()))
