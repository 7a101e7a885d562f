"""DTensor tensors (FSDP2, tensor parallel): each rank allocates and reads only its own shard.

A model sharded while on meta (``fully_shard``, ``parallelize_module``)
holds DTensors whose shape is the whole tensor's, and the checkpoint holds
whole tensors. With ``Shard(d)`` and ``Replicate`` placements, on any number
of mesh dimensions, a rank's local tensor is one box of the whole tensor.
That box is read as a view of the checkpoint tensor (one run of the file
when it is a range of rows, as FSDP2's ``Shard(0)`` gives; strided
otherwise, as a row-wise parallel ``Shard(1)`` gives) straight into a local
tensor allocated on the mesh's device, which becomes the DTensor's local
tensor under the original placements. Nothing is communicated: every rank
reads its own bytes from the files, so no rank ever holds a whole tensor.

``Partial`` placements (a sum still to be made) and ``_StridedShard`` (FSDP2
over tensor parallel, where a rank's shard is not one box) are refused,
naming the tensor.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .checkpoint import TensorInfo
from .checkpoint.base import contiguous_strides
from .errors import ShardingError
from .stacking import Piece, Stacked


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's part of a DTensor lies in the whole tensor, and how to rebuild the DTensor."""

    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    placements: tuple[Any, ...]
    offsets: tuple[int, ...]  # of the local box in the whole tensor
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]

    @property
    def device(self) -> torch.device:
        """The mesh's device on this rank (a CUDA mesh: the current device, as DTensor expects)."""
        kind = self.mesh.device_type
        if kind == "cpu":
            return torch.device("cpu")
        return torch.device(kind, getattr(torch, kind).current_device())

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=torch.Size(self.global_shape), stride=self.global_stride)


def _dtensor_module() -> Optional[Any]:
    # Never imported just to ask: without it loaded, no tensor can be a DTensor.
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(tensor: torch.Tensor) -> bool:
    module = _dtensor_module()
    return module is not None and isinstance(tensor, module.DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (this rank's memory); any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def shard_spec(tensor: torch.Tensor, name: str) -> Optional[ShardSpec]:
    """This rank's box of ``tensor`` if it is a DTensor, else None; refuses placements that are not a box."""
    module = _dtensor_module()
    if module is None or not isinstance(tensor, module.DTensor):
        return None
    placements = tuple(tensor.placements)
    for placement in placements:
        if not (type(placement) is module.Shard or placement.is_replicate()):
            raise ShardingError(
                f"is a DTensor placed {placement!r} on its mesh; only Shard(dim) and Replicate placements "
                "can be read from a checkpoint (redistribute it, or load before sharding that way)",
                tensor=name,
            )
    mesh = tensor.device_mesh
    if mesh.get_coordinate() is None:
        raise ShardingError("is a DTensor on a mesh this rank is not part of", tensor=name)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offsets = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    return ShardSpec(mesh, placements, tuple(offsets), tuple(local_shape), tuple(tensor.shape), tuple(tensor.stride()))


def region(info: TensorInfo, offsets: Sequence[int], sizes: Sequence[int]) -> TensorInfo:
    """The box ``[offsets, offsets + sizes)`` of the checkpoint tensor ``info``, as a view of the same bytes.

    A range of whole rows stays one run of the file; any other box is a
    strided view. Raises naming ``info`` where the box cannot be a view: a
    tensor read rearranged, or one assembled from several checkpoint
    tensors, cut anywhere but along its first dimension between them.
    """
    offsets, sizes = tuple(offsets), tuple(sizes)
    if sizes == tuple(info.shape):
        return info
    if isinstance(info, Stacked):
        return _stacked_rows(info, offsets, sizes)
    if info.view_shape is not None:
        raise ShardingError("is read rearranged from the checkpoint (its layout differs from the model's), "
                            "which cannot be sharded in the same read; load it unsharded", path=info.path, tensor=info.name)
    strides = info.stride if info.stride is not None else contiguous_strides(info.shape)
    offset = info.offset + sum(o * s for o, s in zip(offsets, strides)) * info.itemsize
    whole_box = all(stride == expected for size, stride, expected in zip(sizes, strides, contiguous_strides(sizes)) if size > 1)
    if math.prod(sizes) == 0 or whole_box:
        return dataclasses.replace(info, shape=sizes, offset=offset, stride=None, span_nbytes=None, storage=None)
    span = (sum((size - 1) * stride for size, stride in zip(sizes, strides)) + 1) * info.itemsize
    return dataclasses.replace(info, shape=sizes, offset=offset, stride=tuple(strides), span_nbytes=span, storage=None)


def _stacked_rows(info: Stacked, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Stacked:
    """Rows ``[offsets[0], offsets[0] + sizes[0])`` of a stacked tensor: the pieces within them, cut where they cross."""
    shape = tuple(info.shape)
    if any(offsets[d] != 0 or sizes[d] != shape[d] for d in range(1, len(shape))):
        raise ShardingError(f"is assembled from {len(info.pieces)} checkpoint tensors and can be sharded only along "
                            "its first dimension", path=info.path, tensor=info.name)
    row = math.prod(shape[1:])
    low, high = offsets[0] * row, (offsets[0] + sizes[0]) * row
    pieces = []
    for piece in info.pieces:
        start, stop = piece.start, piece.start + piece.info.numel
        if stop <= low or start >= high:
            continue
        if low <= start and stop <= high:
            pieces.append(Piece(piece.info, start - low))
            continue
        if start % row or piece.info.numel % row or not piece.info.contiguous:
            raise ShardingError(f"is assembled from checkpoint tensors, and this rank's rows cut '{piece.info.name}' "
                                "where it is not whole rows", path=piece.info.path, tensor=info.name)
        as_rows = dataclasses.replace(piece.info, shape=(piece.info.numel // row, *shape[1:]))
        first, last = max(start, low) // row, min(stop, high) // row
        part = region(as_rows, (first - start // row,) + (0,) * (len(shape) - 1), (last - first, *shape[1:]))
        pieces.append(Piece(part, first * row - low))
    return dataclasses.replace(info, shape=sizes, pieces=tuple(pieces))
