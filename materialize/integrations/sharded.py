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
from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint import TensorInfo
from ..checkpoint.base import contiguous_strides
from ..errors import ShardingError
from ..checkpoint.pieces import Piece, Stacked


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's part of a DTensor lies in the whole tensor, and how to rebuild the DTensor."""

    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    placements: tuple[Any, ...]
    offsets: tuple[int, ...]  # of the local box in the whole tensor
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]
    local_device: Optional[torch.device] = None  # where this rank's shard already lives, if it is real

    @property
    def device(self) -> torch.device:
        """Where this rank's shard is filled: where it already lives if it is real (a rank that never called
        ``set_device`` still owns the GPU its shard is on), else the mesh's device on this rank (a CUDA mesh:
        the current device, as ``fully_shard`` takes it)."""
        if self.local_device is not None and self.local_device.type != "meta":
            return self.local_device
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


READABLE_PLACEMENTS = ("only Shard(dim) and Replicate placements can be read from a checkpoint (redistribute it, "
                       "or load before sharding that way)")


def unreadable_placement(tensor: torch.Tensor) -> Optional[Any]:
    """The first placement of a DTensor that no box of the checkpoint describes (``Partial``, a strided
    shard); None for any other tensor."""
    module = _dtensor_module()
    if module is None or not isinstance(tensor, module.DTensor):
        return None
    return next((p for p in tensor.placements if not (type(p) is module.Shard or p.is_replicate())), None)


def refuse_unreadable_placements(named: Sequence[tuple[str, torch.Tensor]], path: Optional[Path] = None) -> None:
    """One error naming every DTensor whose placement cannot be read (see :func:`unreadable_placement`)."""
    refused = [(name, placement) for name, tensor in named
               if (placement := unreadable_placement(tensor)) is not None]
    if not refused:
        return
    listed = ", ".join(f"'{name}' ({placement!r})" for name, placement in refused[:8])
    more = f" and {len(refused) - 8} more" if len(refused) > 8 else ""
    raise ShardingError(f"{len(refused)} DTensor(s) placed in a way no checkpoint can be read into: {listed}{more}; "
                        f"{READABLE_PLACEMENTS}", path=path)


def shard_spec(tensor: torch.Tensor, name: str, path: Optional[Path] = None) -> Optional[ShardSpec]:
    """This rank's box of ``tensor`` if it is a DTensor, else None; refuses placements that are not a box.

    ``path`` is the checkpoint being loaded, named in the error.
    """
    module = _dtensor_module()
    if module is None or not isinstance(tensor, module.DTensor):
        return None
    placements = tuple(tensor.placements)
    refused = unreadable_placement(tensor)
    if refused is not None:
        raise ShardingError(
            f"is a DTensor placed {refused!r} on its mesh; {READABLE_PLACEMENTS}", path=path, tensor=name)
    mesh = tensor.device_mesh
    if mesh.get_coordinate() is None:
        raise ShardingError("is a DTensor on a mesh this rank is not part of", path=path, tensor=name)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offsets = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    return ShardSpec(mesh, placements, tuple(offsets), tuple(local_shape), tuple(tensor.shape), tuple(tensor.stride()),
                     local_device=tensor.to_local().device)


def region(info: TensorInfo, offsets: Sequence[int], sizes: Sequence[int]) -> TensorInfo:
    """The box ``[offsets, offsets + sizes)`` of the checkpoint tensor ``info``, as a view of the same bytes.

    A range of whole rows stays one run of the file; any other box is a
    strided view. A tensor assembled from several checkpoint tensors keeps
    the part of each piece that lies in the box. Raises naming ``info``
    where the box cannot be a view (a tensor read rearranged).
    """
    offsets, sizes = tuple(offsets), tuple(sizes)
    if sizes == tuple(info.shape):
        return info
    if isinstance(info, Stacked):
        return _stacked_part(info, offsets, sizes)
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


def _stacked_part(info: Stacked, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Stacked:
    """The box ``[offsets, offsets + sizes)`` of a stacked tensor: each piece's part within it, placed in the box."""
    pieces = []
    for piece in info.pieces:
        place = piece.box or _run_as_box(piece.start, piece.info.numel, tuple(info.shape))
        if place is None:
            if piece.info.numel == 0:
                continue
            raise ShardingError(f"is assembled from checkpoint tensors, and '{piece.info.name}' is not a block of it",
                                path=piece.info.path, tensor=info.name)
        at, extent = place
        low = tuple(max(a, o) for a, o in zip(at, offsets))
        high = tuple(min(a + n, o + m) for a, n, o, m in zip(at, extent, offsets, sizes))
        if any(h <= lo for lo, h in zip(low, high)):
            continue
        source = piece.info
        if tuple(source.shape) != extent:
            if not source.contiguous:
                raise ShardingError(f"is assembled from checkpoint tensors, and '{source.name}' is a strided view "
                                    "that cannot be cut", path=source.path, tensor=info.name)
            source = dataclasses.replace(source, shape=extent)  # a run seen as its block: the same elements in order
        part = region(source, tuple(lo - a for lo, a in zip(low, at)), tuple(h - lo for lo, h in zip(low, high)))
        pieces.append(Piece(part, 0, box=(tuple(lo - o for lo, o in zip(low, offsets)), tuple(part.shape))))
    return dataclasses.replace(info, shape=sizes, pieces=tuple(pieces))


def _run_as_box(start: int, numel: int, shape: tuple[int, ...]) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The block ``[offsets, offsets + sizes)`` that elements ``[start, start + numel)`` of a tensor make, or None.

    A run is a block when it covers whole trailing dimensions and a range of
    the dimension before them, within one index of every dimension before
    that (an expert's gate rows in a stacked gate-and-up tensor, say).
    """
    if numel <= 0:
        return None
    inner, whole = 1, len(shape)
    while whole > 0 and start % (inner * shape[whole - 1]) == 0 and numel % (inner * shape[whole - 1]) == 0:
        inner *= shape[whole - 1]
        whole -= 1
    if whole == 0:
        return (0,) * len(shape), shape
    count, index = numel // inner, start // inner
    position = index % shape[whole - 1]
    if position + count > shape[whole - 1]:
        return None
    leading, outer = [], index // shape[whole - 1]
    for size in reversed(shape[:whole - 1]):
        leading.append(outer % size)
        outer //= size
    offsets = tuple(reversed(leading)) + (position,) + (0,) * (len(shape) - whole)
    return offsets, (1,) * (whole - 1) + (count,) + shape[whole:]
