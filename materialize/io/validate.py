"""Checks on loaded values that the file format itself cannot express."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..checkpoint import TensorInfo
from ..errors import CheckpointError


def distinct_elements(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of a tensor's values, each stored element once.

    A view whose elements overlap in memory (stride 0, from ``expand``) can
    claim billions of elements backed by a few: checking it element by
    element would allocate for all of them, so its memory span is checked
    instead (for such views, that span holds exactly the values it shows,
    unless it also skips elements, which no writer produces).
    """
    if tensor.is_contiguous() or tensor.numel() == 0:
        return tensor.reshape(-1)
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    if span >= tensor.numel():
        return tensor.reshape(-1)
    return torch.as_strided(tensor, (span,), (1,), tensor.storage_offset())


def check_bools(loaded: Iterable[tuple[TensorInfo, torch.Tensor]]) -> None:
    """Refuse bool tensors whose bytes are not 0 or 1.

    torch stores a bool as one byte and trusts it to be 0 or 1; any other
    byte makes comparisons and indexing with the mask disagree with its
    printed value. Masks are small, so this costs next to nothing.
    """
    for info, tensor in loaded:
        if tensor.dtype != torch.bool or tensor.numel() == 0 or tensor.is_meta:
            continue
        if bool((distinct_elements(tensor.detach()).view(torch.uint8) > 1).any()):
            raise CheckpointError("holds bytes other than 0 and 1, which is not a valid bool", path=info.path, tensor=info.name)
