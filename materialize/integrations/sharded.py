"""DTensor tensors (FSDP2, tensor parallel): each rank allocates and reads only its own shard.

A model sharded while on meta (``fully_shard``, ``parallelize_module``)
holds DTensors whose shape is the whole tensor's, and the checkpoint holds
whole tensors. With ``Shard(d)``, ``_StridedShard(d)`` and ``Replicate``
placements, on any number of mesh dimensions, a rank's local tensor is a
union of boxes of the whole tensor: one box for ``Shard`` and
``Replicate`` alone; with ``_StridedShard`` (FSDP2 over tensor parallel on
the same dimension, torchtitan's 2-D layout) the rank's indices along a
dimension may come in several runs, and its part is every combination of
runs, each a box placed at its own offset of the local tensor (one box
where the runs meet, as they always do under FSDP2 over a tensor parallel
that divides the dimension). Each box is read
as a view of the checkpoint tensor (one run of the file when it is a range
of rows, as FSDP2's ``Shard(0)`` gives; strided otherwise, as a row-wise
parallel ``Shard(1)`` gives) straight into its place in a local tensor
allocated on the mesh's device, which becomes the DTensor's local tensor
under the original placements. Nothing is communicated: every rank reads
its own bytes from the files, so no rank ever holds a whole tensor.

A rank's indices follow the placements left to right, as DTensor defines
them: ``Shard`` takes the rank's chunk of what the placements before it left
(``torch.chunk``'s sizes: the last chunks may be short or empty);
``_StridedShard(split_factor=k)`` cuts that into ``k`` chunks, and takes the
rank's chunk of each. The local shape found is checked against the
DTensor's own, so a torch that meant something else is an error, not a
wrong load.

Refused before anything is allocated, every such tensor named in one
error: ``Partial`` placements (a sum still to be made), and a
``_StridedShard`` whose split factor does not divide the length it splits
(see :func:`unreadable`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint import TensorInfo
from ..checkpoint.base import contiguous_strides, view_of
from ..errors import ShardingError
from ..checkpoint.pieces import Piece, Stacked


_CPU = torch.device("cpu")  # a device made once: asked for each of a sharded model's tensors
Runs = list[tuple[int, int]]  # indices of one dimension, as (first, count), in the order a local tensor holds them


@dataclass(frozen=True)
class ShardBox:
    """A block of a rank's local tensor, and the block of the whole tensor it holds."""

    at: tuple[int, ...]  # offsets in the local tensor
    offsets: tuple[int, ...]  # offsets in the whole tensor
    sizes: tuple[int, ...]

    @property
    def local(self) -> tuple[slice, ...]:
        return tuple(slice(a, a + n) for a, n in zip(self.at, self.sizes))

    @property
    def whole(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes))


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's part of a DTensor lies in the whole tensor, and how to rebuild the DTensor."""

    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    placements: tuple[Any, ...]
    boxes: tuple[ShardBox, ...]  # the local tensor's blocks, together all of it (none where it is empty)
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]
    local_device: Optional[torch.device] = None  # where this rank's shard already lives, if it is real
    # The layout's DTensorSpec by dtype, made once (see wrap).
    dtensor_specs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def device(self) -> torch.device:
        """Where this rank's shard is filled: where it already lives if it is real (a rank that never called
        ``set_device`` still owns the GPU its shard is on), else the mesh's device on this rank (a CUDA mesh:
        the current device, as ``fully_shard`` takes it)."""
        if self.local_device is not None and self.local_device.type != "meta":
            return self.local_device
        kind = self.mesh.device_type
        if kind == "cpu":
            return _CPU
        return torch.device(kind, getattr(torch, kind).current_device())

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local``, this rank's shard, as the DTensor it is part of (no autograd history, not requiring grad).

        ``DTensor.from_local`` costs an autograd call and a new DTensorSpec
        (with its checks) per tensor: tens of microseconds, for each of a
        sharded mixture of experts' hundred thousand. Its spec is made once
        per layout and dtype, and each shard wrapped in it as FSDP2 wraps its
        own parameters' (``DTensor(local, spec, requires_grad=...)``, torch's
        ``_from_local_no_grad``): a DTensorSpec is not changed once made.
        """
        from torch.distributed.tensor import DTensor

        spec = self.dtensor_specs.get(local.dtype)
        if spec is None:
            made = DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                      shape=torch.Size(self.global_shape), stride=self.global_stride)
            spec = self.dtensor_specs[local.dtype] = made._spec
        return DTensor(local, spec, requires_grad=False)


def _dtensor_module() -> Optional[Any]:
    # Never imported just to ask: without it loaded, no tensor can be a DTensor.
    return sys.modules.get("torch.distributed.tensor")


# Exactly these types are never a DTensor (a parameter holding a DTensor is a DTensor: nn.Parameter keeps a
# tensor subclass's type)
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))


def is_dtensor(tensor: torch.Tensor) -> bool:
    if type(tensor) in _PLAIN:
        return False
    module = _dtensor_module()
    return module is not None and isinstance(tensor, module.DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (this rank's memory); any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def held_local(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`local_of` for asking what a tensor is (its device, dtype, memory), not for computing with it: a
    DTensor's local tensor as it holds it, without ``to_local``'s autograd call (tens of microseconds, for
    each of a sharded model's tensors)."""
    if not is_dtensor(tensor):
        return tensor
    held = getattr(tensor, "_local_tensor", None)
    return held if isinstance(held, torch.Tensor) else tensor.to_local()


UNREADABLE_REMEDY = "load the model before sharding it"


def _is_strided(placement: Any) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def _is_shard(placement: Any) -> bool:
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) or _is_strided(placement)  # a subclass of Shard in torch 2.7, not in 2.13


def unreadable(tensor: torch.Tensor) -> Optional[str]:
    """Why no checkpoint can be read into this DTensor's shards, or None (any other tensor: None).

    ``Partial`` is a sum still to be made. A ``_StridedShard(split_factor=k)``
    over a length ``k`` does not divide (tensor parallel over a dimension
    its size does not divide, under FSDP2) is ambiguous: DTensor's placements
    give a rank other rows than FSDP2 cut for it (torch's own
    ``distribute_tensor`` refuses such a layout), so reading either would
    risk a model that is not the user's. The rule looks at sizes only, so
    every rank refuses together.
    """
    module = _dtensor_module()
    if module is None or not isinstance(tensor, module.DTensor):
        return None
    return _unreadable_layout(tuple(tensor.placements), tuple(tensor.shape), tuple(tensor.device_mesh.shape))


@functools.lru_cache(maxsize=4096)
def _unreadable_layout(placements: tuple[Any, ...], shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> Optional[str]:
    # Asked once a layout: a sharded model of thousands of experts has a few.
    other = next((p for p in placements if not (p.is_replicate() or _is_shard(p))), None)
    if other is not None:
        return f"{other!r}"
    ambiguous = ambiguous_split(shape, mesh_shape, placements)
    if ambiguous is None:
        return None
    placement, dim = ambiguous
    return (f"{placement!r}: a dim {dim} of {shape[dim]}, which a split in {int(placement.split_factor)} does not "
            "divide evenly; DTensor and FSDP2 then disagree on which indices a rank holds")


def ambiguous_split(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                    placements: Sequence[Any]) -> Optional[tuple[Any, int]]:
    """The first ``_StridedShard`` whose split factor does not divide the length it splits on every rank
    (with the tensor dimension it splits), or None: where it does, the placements' left-to-right meaning
    and FSDP2's chunk of a tensor-parallel chunk give every rank the same indices."""
    lengths = list(global_shape)  # of a shard, while every split before is even
    even = [True] * len(lengths)
    for mesh_dim, placement in enumerate(placements):
        if not _is_shard(placement):
            continue
        dim, count = placement.dim % len(lengths), mesh_shape[mesh_dim]
        split = int(placement.split_factor) if _is_strided(placement) else 1
        if split > 1 and not (even[dim] and lengths[dim] % split == 0):
            return placement, dim
        even[dim] = even[dim] and lengths[dim] % (split * count) == 0
        lengths[dim] //= count
    return None


def refuse_unreadable_placements(named: Iterable[tuple[str, torch.Tensor]], path: Optional[Path] = None) -> None:
    """One error naming every DTensor whose placement cannot be read (see :func:`unreadable`)."""
    if _dtensor_module() is None:  # not imported: no tensor is a DTensor (``named`` is not even walked)
        return
    refused = []
    verdicts: dict[int, tuple[Any, Optional[str]]] = {}  # by the DTensorSpec a tensor holds, which keeps its id
    for name, tensor in named:
        if type(tensor) in _PLAIN:
            continue
        layout = getattr(tensor, "_spec", None)  # FSDP2 places the tensors of one shape by one
        known = verdicts.get(id(layout)) if layout is not None else None
        if known is not None and known[0] is layout:
            why = known[1]
        else:
            why = unreadable(tensor)
            if layout is not None:
                verdicts[id(layout)] = (layout, why)
        if why is not None:
            refused.append((name, why))
    if not refused:
        return
    by_reason: dict[str, list[str]] = {}
    for name, why in refused:
        by_reason.setdefault(why, []).append(name)
    groups = list(by_reason.items())
    listed = "; ".join(_some_names(names) + f" ({why})" for why, names in groups[:4])
    if len(groups) > 4:
        listed += f"; and {sum(len(names) for _, names in groups[4:])} more"
    raise ShardingError(f"{len(refused)} DTensor(s) placed in a way no checkpoint can be read into: {listed}; "
                        f"{UNREADABLE_REMEDY}", path=path)


def _some_names(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(f"'{name}'" for name in names[:limit]) + more


def shard_spec(tensor: torch.Tensor, name: str, path: Optional[Path] = None,
               known: Optional[dict[tuple, Any]] = None) -> Optional[ShardSpec]:
    """This rank's boxes of ``tensor`` if it is a DTensor, else None; refuses placements no box describes.

    ``path`` is the checkpoint being loaded, named in the error. ``known``: the specs found so far for
    tensors of the same mesh, placements, shape and local tensor (a plan's, while its meshes live), each
    found once: by those (``ShardSpec`` values), and by the DTensorSpec the tensor holds with its local
    tensor's shape and device (``(DTensorSpec, ShardSpec)`` values).
    """
    if type(tensor) in _PLAIN:  # most tensors of most models: nothing to ask of a DTensor's module
        return None
    module = _dtensor_module()
    if module is None or not isinstance(tensor, module.DTensor):
        return None
    # The local tensor without to_local's autograd call, where DTensor keeps it (its shape and device alone).
    held = getattr(tensor, "_local_tensor", None)
    if known is None or not isinstance(held, torch.Tensor):
        return _found_spec(tensor, name, path, tuple(tensor.placements), tensor.device_mesh)
    # The DTensorSpec the tensor is placed by (its mesh, placements, shape and strides): FSDP2 makes one for
    # the tensors of a shape, so it is one key for them, taken without asking each its placements (whose hash
    # is a Python call a placement). Kept in the value, so that its id is never another's while known.
    layout = getattr(tensor, "_spec", None)
    quick = ("layout", id(layout), held.shape, held.device) if layout is not None else None
    if quick is not None:
        found = known.get(quick)
        if found is not None and found[0] is layout:
            return found[1]
    placements, mesh = tuple(tensor.placements), tensor.device_mesh
    key = (id(mesh), placements, tuple(tensor.shape), tuple(tensor.stride()), tuple(held.shape), held.device)
    spec = known.get(key)
    if spec is None:
        spec = known[key] = _found_spec(tensor, name, path, placements, mesh)
    if quick is not None:
        known[quick] = (layout, spec)
    return spec


def _found_spec(tensor: torch.Tensor, name: str, path: Optional[Path], placements: tuple[Any, ...],
                mesh: Any) -> ShardSpec:
    refused = unreadable(tensor)
    if refused is not None:
        raise ShardingError(f"is a DTensor placed {refused} on its mesh; {UNREADABLE_REMEDY}", path=path, tensor=name)
    if mesh.get_coordinate() is None:
        raise ShardingError("is a DTensor on a mesh this rank is not part of", path=path, tensor=name)
    local = tensor.to_local()
    runs = local_runs(tuple(tensor.shape), tuple(mesh.shape), tuple(mesh.get_coordinate()), placements)
    local_shape = tuple(sum(count for _, count in dim) for dim in runs)
    if local_shape != tuple(local.shape):
        raise ShardingError(
            f"is a DTensor placed {list(placements)} whose local shape is {list(local.shape)} on this rank, where the "
            f"placements give {list(local_shape)}: this torch shards in a way not understood here; "
            f"{UNREADABLE_REMEDY}", path=path, tensor=name)
    return ShardSpec(mesh, placements, boxes_of(runs), local_shape, tuple(tensor.shape), tuple(tensor.stride()),
                     local_device=local.device)


def local_runs(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
               placements: Sequence[Any]) -> list[Runs]:
    """Per dimension of the whole tensor, the indices the rank at ``coordinate`` holds, in local order.

    The placements apply left to right over the mesh's dimensions, as
    DTensor defines them (see the module's docstring).
    """
    runs: list[Runs] = [[(0, size)] for size in global_shape]
    for mesh_dim, placement in enumerate(placements):
        if not _is_shard(placement):
            continue  # Replicate (Partial is refused before)
        dim = placement.dim % len(global_shape)
        split = int(placement.split_factor) if _is_strided(placement) else 1
        runs[dim] = _chunk_of_each_split(runs[dim], split, mesh_shape[mesh_dim], coordinate[mesh_dim])
    return runs


def _chunk_bounds(length: int, count: int, index: int) -> tuple[int, int]:
    """Chunk ``index`` of ``count`` along ``length``, as ``torch.chunk`` cuts (missing chunks empty)."""
    size = -(-length // count)
    return min(index * size, length), min((index + 1) * size, length)


def _chunk_of_each_split(runs: Runs, split: int, count: int, index: int) -> Runs:
    """Of the indices ``runs`` hold, cut in ``split`` chunks: chunk ``index`` of ``count`` of each, one after another."""
    total = sum(length for _, length in runs)
    taken: Runs = []
    for part in range(split):
        low, high = _chunk_bounds(total, split, part)
        first, last = _chunk_bounds(high - low, count, index)
        taken.extend(_positions(runs, low + first, low + last))
    merged: Runs = []
    for start, length in taken:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    return merged


def _positions(runs: Runs, low: int, high: int) -> Runs:
    """The indices at positions ``[low, high)`` of those ``runs`` hold."""
    out: Runs = []
    position = 0
    for start, length in runs:
        a, b = max(low, position), min(high, position + length)
        if a < b:
            out.append((start + a - position, b - a))
        position += length
    return out


def boxes_of(runs: Sequence[Runs]) -> tuple[ShardBox, ...]:
    """Every combination of one run per dimension, as a box placed where the local tensor holds it."""
    per_dim = []
    for dim_runs in runs:
        at, placed = 0, []
        for start, length in dim_runs:
            placed.append((at, start, length))
            at += length
        per_dim.append(placed)
    return tuple(ShardBox(tuple(p[0] for p in combo), tuple(p[1] for p in combo), tuple(p[2] for p in combo))
                 for combo in itertools.product(*per_dim))


def shard_region(info: TensorInfo, spec: ShardSpec) -> TensorInfo:
    """The part of the checkpoint tensor ``info`` this rank's shard holds, laid out as its local tensor.

    One box is :func:`region` of it; several are one source whose pieces
    each fill their place of the local tensor (a tensor assembled from
    checkpoint tensors contributes the part of each piece within each box).
    """
    if len(spec.boxes) == 1:
        return region(info, spec.boxes[0].offsets, spec.boxes[0].sizes)
    if not spec.boxes:  # an empty shard
        return region(info, (0,) * len(spec.local_shape), spec.local_shape)
    pieces: list[Piece] = []
    for box in spec.boxes:
        part = region(info, box.offsets, box.sizes)
        if not isinstance(part, Stacked):
            pieces.append(Piece(part, 0, box=(box.at, box.sizes)))
            continue
        for piece in part.pieces:
            assert piece.box is not None  # every piece of a cut stacked tensor is placed by its box
            within, sizes = piece.box
            pieces.append(Piece(piece.info, 0, box=(tuple(a + w for a, w in zip(box.at, within)), sizes)))
    return Stacked(name=info.name, dtype_name=info.dtype_name, itemsize=info.itemsize, shape=spec.local_shape,
                   path=info.path, offset=info.offset, pieces=tuple(pieces))


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
    start, stride, span = _box_layout(tuple(info.shape), info.stride, info.itemsize, offsets, sizes)
    return _with(info, sizes, info.offset + start, stride, span)


@functools.lru_cache(maxsize=4096)
def _box_layout(shape: tuple[int, ...], stride: Optional[tuple[int, ...]], itemsize: int, offsets: tuple[int, ...],
                sizes: tuple[int, ...]) -> tuple[int, Optional[tuple[int, ...]], Optional[int]]:
    """Where the box ``[offsets, offsets + sizes)`` of a tensor of ``shape`` and ``stride`` (None: contiguous)
    starts, in bytes after the tensor's start; and its strides and span where it is no one run (else None,
    None). Asked once a layout: the experts of a sharded model have a few."""
    strides = stride if stride is not None else _contiguous_strides_of(shape)
    start = sum(o * s for o, s in zip(offsets, strides)) * itemsize
    whole_box = all(stride == expected for size, stride, expected in zip(sizes, strides, _contiguous_strides_of(sizes))
                    if size > 1)
    if math.prod(sizes) == 0 or whole_box:
        return start, None, None
    return start, tuple(strides), (sum((size - 1) * stride for size, stride in zip(sizes, strides)) + 1) * itemsize


@functools.lru_cache(maxsize=4096)
def _contiguous_strides_of(shape: tuple[int, ...]) -> tuple[int, ...]:
    # A sharded model of many tensors has few shapes: an expert's three, repeated thousands of times.
    return contiguous_strides(shape)


def _with(info: TensorInfo, shape: tuple[int, ...], offset: int, stride: Optional[tuple[int, ...]],
          span_nbytes: Optional[int]) -> TensorInfo:
    """``info`` as a view of other bytes of its file (its storage no longer whole)."""
    if type(info) is TensorInfo:  # made without the frozen dataclass's __init__: one for each of a model's tensors
        return view_of(info, shape, offset, stride, span_nbytes)
    return dataclasses.replace(info, shape=shape, offset=offset, stride=stride, span_nbytes=span_nbytes, storage=None)


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
