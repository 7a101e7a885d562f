"""Tensors read rearranged whose rows stay whole: each row read straight into its place.

A conversion that reorders whole rows (transformers' ``Interleave`` of an
expert's gate and up rows, ``PermuteForRope`` of attention heads) makes the
destination a permutation of the file's rows. Such a tensor is read with
``preadv`` into the destination rows, listed in file order (a thousand a
call), rather than into a temporary block and copied from there: one copy
of each byte instead of two. Rows shorter than :data:`MIN_ROW_BYTES` (a
transpose moves single elements) go the block way, where one strided copy
beats a system call's worth of bookkeeping per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..checkpoint import TensorInfo
from ..checkpoint.base import contiguous_strides

MIN_ROW_BYTES = 1024


@dataclass(frozen=True)
class RowScatter:
    """Where each of a tensor's rows goes: ``rows[i]`` is the ``(address, row_bytes)`` of the file's i-th row."""

    rows: torch.Tensor  # (n, 2) int64: the iovec array read_scattered takes
    row_bytes: int


def row_scatter(info: TensorInfo, dest: torch.Tensor) -> Optional[RowScatter]:
    """How ``dest`` (CPU, the file's dtype) is filled from ``info``'s rows read in file order, or None.

    None unless the file's elements are whole rows of at least
    :data:`MIN_ROW_BYTES` that follow each other with no gap, each landing
    in one contiguous stretch of ``dest``.
    """
    shape = tuple(info.view_shape or info.shape)
    if not dest.is_cpu or dest.dtype != info.dtype or math.prod(shape) == 0:
        return None
    try:
        target = dest.view(shape)
    except RuntimeError:  # a box of a larger tensor that this shape cannot view
        return None
    file_strides = info.stride if info.stride is not None else contiguous_strides(shape)
    dest_strides = target.stride()
    leading, row = len(shape), 1
    while leading > 0 and (shape[leading - 1] == 1 or (file_strides[leading - 1] == row == dest_strides[leading - 1])):
        row *= shape[leading - 1]
        leading -= 1
    row_bytes = row * info.itemsize
    if leading == 0 or row_bytes < MIN_ROW_BYTES:
        return None
    in_file = torch.zeros((), dtype=torch.int64)
    in_dest = torch.zeros((), dtype=torch.int64)
    for size, file_stride, dest_stride in zip(shape[:leading], file_strides[:leading], dest_strides[:leading]):
        index = torch.arange(size, dtype=torch.int64)
        in_file = in_file.unsqueeze(-1) + index * file_stride
        in_dest = in_dest.unsqueeze(-1) + index * dest_stride
    in_file, order = torch.sort(in_file.flatten())
    if not torch.equal(in_file, torch.arange(in_file.numel(), dtype=torch.int64) * row):
        return None  # rows with gaps between them, or overlapping: read in blocks
    rows = torch.empty((in_file.numel(), 2), dtype=torch.int64)
    rows[:, 0] = in_dest.flatten()[order] * info.itemsize + dest.data_ptr()
    rows[:, 1] = row_bytes
    return RowScatter(rows, row_bytes)
