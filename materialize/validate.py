"""Checks on loaded values that the file format itself cannot express."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .checkpoint import TensorInfo
from .errors import CheckpointError


def check_bools(loaded: Iterable[tuple[TensorInfo, torch.Tensor]]) -> None:
    """Refuse bool tensors whose bytes are not 0 or 1.

    torch stores a bool as one byte and trusts it to be 0 or 1; any other
    byte makes comparisons and indexing with the mask disagree with its
    printed value. Masks are small, so this costs next to nothing.
    """
    for info, tensor in loaded:
        if tensor.dtype != torch.bool or tensor.numel() == 0 or tensor.is_meta:
            continue
        if bool((tensor.detach().reshape(-1).view(torch.uint8) > 1).any()):
            raise CheckpointError("holds bytes other than 0 and 1, which is not a valid bool", path=info.path, tensor=info.name)
