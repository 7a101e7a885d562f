"""Model tensors and checkpoint tensors that are not one to one, but still contiguous runs of each other.

Stacked: mixture-of-experts models in transformers 5 hold each layer's
experts as one tensor (``experts.gate_up_proj`` of shape ``[experts, 2 *
inner, hidden]``), while their checkpoints keep one tensor per expert and
projection (``experts.3.w1.weight``). Stacking along a new first dimension,
then concatenating along the next one (or only concatenating along the first,
as ``q``, ``k`` and ``v`` convolutions fused into one), puts every checkpoint
tensor in one contiguous block of the model tensor, so each is read straight
into its block: no temporary, no second copy, as for any other tensor. A key
map marks such a checkpoint tensor by returning a :class:`StackSlot` instead
of a name; the planner gathers the slots of one target into a
:class:`Stacked` source.

Transposed: a checkpoint tensor saved with two dimensions swapped (Qwen3-VL-MoE
keeps its stacked experts as ``[experts, hidden, 2 * inner]``) is a strided
view of its bytes: the engine reads it a block along the first dimension at
a time and copies each block into place.

Cut: the other way round, a checkpoint may hold one fused tensor (``Wqkv``)
where the model has several (``q_proj``, ``k_proj``, ``v_proj``). Each part
along the first dimension is a contiguous run of the file, a tensor in its
own right, so it is read, cast or mapped like any other. A key map marks such
a checkpoint tensor by returning :class:`Chunks`; :func:`cut` gives the parts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from .checkpoint import TensorInfo
from .errors import CheckpointError


@dataclass(frozen=True)
class StackSlot:
    """Where a checkpoint tensor goes in a stacked model tensor.

    ``index`` is its position along the stacked (first) dimension, the
    expert number; ``group`` orders the tensors concatenated along the next
    dimension within one position (gate before up). With ``new_dim=False``
    nothing is stacked: the groups are concatenated along the first
    dimension, and ``index`` is always 0.
    """

    target: str
    index: int
    group: int
    pattern: str = ""  # which checkpoint tensors this group holds, for messages: ".experts.*.w3.weight"
    new_dim: bool = True


@dataclass(frozen=True)
class Chunks:
    """A checkpoint tensor cut along its first dimension into the model tensors ``targets``, in order.

    ``rows`` gives each target's share; without it the parts are as
    ``torch.chunk`` makes them (equal, the last one smaller if need be).
    """

    targets: tuple[str, ...]
    rows: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class Piece:
    info: TensorInfo
    start: int  # element offset of its block in the stacked tensor


@dataclass(frozen=True)
class Stacked(TensorInfo):
    """A model tensor assembled from checkpoint tensors, described as one.

    Its name, path and offset are its first piece's, for messages; it is
    never one run of one file, so it is never read or mapped as a whole.
    """

    pieces: tuple[Piece, ...] = ()

    @property
    def contiguous(self) -> bool:
        return False  # cannot stay mapped

    @property
    def read_nbytes(self) -> int:
        return sum(piece.info.read_nbytes for piece in self.pieces)


def pieces_of(source: TensorInfo) -> tuple[Piece, ...]:
    return source.pieces if isinstance(source, Stacked) else (Piece(source, 0),)


def stack(target: str, slots: list[tuple[StackSlot, TensorInfo]]) -> Stacked:
    """The stacked source for ``target``; raises naming a tensor if the pieces do not fit together.

    Every position must hold one tensor of each group; a group's tensors
    share one shape, and groups differ at most in their first dimension.
    """
    groups = sorted({slot.group for slot, _ in slots})
    indexes = sorted({slot.index for slot, _ in slots})
    by_place: dict[tuple[int, int], TensorInfo] = {}
    for slot, info in slots:
        if (slot.index, slot.group) in by_place:
            raise CheckpointError(f"is stacked into '{target}' at the same place as '{by_place[slot.index, slot.group].name}'",
                                  path=info.path, tensor=info.name)
        by_place[slot.index, slot.group] = info
    if indexes != list(range(len(indexes))):
        gap = next(i for i in range(len(indexes) + 1) if i not in indexes)
        first = slots[0][1]
        raise CheckpointError(f"is one of the tensors stacked into '{target}', which lacks number {gap} of them",
                              path=first.path, tensor=first.name)
    patterns = {slot.group: slot.pattern for slot, _ in slots}
    for index in indexes:
        for group in groups:
            if (index, group) not in by_place:
                other = by_place[index, next(g for g in groups if (index, g) in by_place)]
                wanted = f"'{patterns[group]}'" if patterns[group] else "the other tensors"
                raise CheckpointError(
                    f"is stacked into '{target}' with number {index} of {wanted}, which the checkpoint lacks",
                    path=other.path, tensor=other.name)
    model_block = [by_place[0, group] for group in groups]
    for index in indexes:
        for group, reference in zip(groups, model_block):
            info = by_place[index, group]
            if info.shape != reference.shape or info.dtype_name != reference.dtype_name:
                raise CheckpointError(
                    f"is {info.dtype_name} {list(info.shape)} but '{reference.name}', stacked into '{target}' with it, "
                    f"is {reference.dtype_name} {list(reference.shape)}", path=info.path, tensor=info.name)
    tails = {tuple(info.shape[1:]) for info in model_block}
    dtypes = {info.dtype_name for info in model_block}
    if len(tails) > 1 or len(dtypes) > 1 or any(not info.shape for info in model_block):
        shapes = ", ".join(f"'{i.name}' {i.dtype_name} {list(i.shape)}" for i in model_block)
        raise CheckpointError(f"cannot be concatenated into '{target}': {shapes}", path=model_block[0].path,
                              tensor=model_block[0].name)
    rows = sum(info.shape[0] for info in model_block)
    new_dim = slots[0][0].new_dim
    block_numel = sum(info.numel for info in model_block)
    pieces = []
    for index in indexes:
        start = index * block_numel
        for group in groups:
            info = by_place[index, group]
            pieces.append(Piece(info, start))
            start += info.numel
    first = pieces[0].info
    return Stacked(
        name=first.name,
        dtype_name=first.dtype_name,
        itemsize=first.itemsize,
        shape=(len(indexes), rows, *first.shape[1:]) if new_dim else (rows, *first.shape[1:]),
        path=first.path,
        offset=first.offset,
        pieces=tuple(pieces),
    )


def cut(info: TensorInfo, chunks: Chunks) -> list[tuple[str, TensorInfo]]:
    """Each target with the run of ``info`` it gets, named ``info.name[first:last]`` (rows); raises naming ``info``."""
    into = ", ".join(f"'{target}'" for target in chunks.targets)
    if not info.shape:
        raise CheckpointError(f"is a scalar and cannot be cut into {into}", path=info.path, tensor=info.name)
    if not info.contiguous:
        raise CheckpointError(f"is a strided view and cannot be cut into {into}", path=info.path, tensor=info.name)
    total = info.shape[0]
    if chunks.rows is not None:
        if sum(chunks.rows) != total or len(chunks.rows) != len(chunks.targets):
            raise CheckpointError(
                f"has {total} rows, but {into} take {' + '.join(map(str, chunks.rows))}", path=info.path, tensor=info.name)
        sizes = list(chunks.rows)
    else:
        size = -(-total // len(chunks.targets))
        sizes = [min(size, total - start) for start in range(0, total, size)] if total else [0] * len(chunks.targets)
    row_bytes = info.nbytes // total if total else 0
    parts, first = [], 0
    for target, rows in zip(chunks.targets, sizes):
        parts.append((target, dataclasses.replace(
            info, name=f"{info.name}[{first}:{first + rows}]", shape=(rows, *info.shape[1:]),
            offset=info.offset + first * row_bytes, storage=None)))
        first += rows
    return parts


@dataclass(frozen=True)
class Transposed:
    """A checkpoint tensor that goes to ``target`` with dimensions ``dim0`` and ``dim1`` swapped.

    With ``unless_shape``, a tensor already of that shape goes as it is
    (transformers' ``Transpose(check_dims=True)``: checkpoints of both layouts exist).
    """

    target: str
    dim0: int
    dim1: int
    unless_shape: Optional[tuple[int, ...]] = None


def transpose(info: TensorInfo, swap: Transposed) -> TensorInfo:
    """``info`` seen with two dimensions swapped: a strided view of the same bytes; raises naming ``info``."""
    if swap.unless_shape is not None and info.shape == swap.unless_shape:
        return info
    rank = len(info.shape)
    if not info.contiguous:
        raise CheckpointError("is a strided view and cannot be transposed", path=info.path, tensor=info.name)
    if not (-rank <= swap.dim0 < rank and -rank <= swap.dim1 < rank):
        raise CheckpointError(f"has {rank} dimensions and cannot have {swap.dim0} and {swap.dim1} swapped",
                              path=info.path, tensor=info.name)
    first, second = swap.dim0 % rank, swap.dim1 % rank
    strides = [math.prod(info.shape[i + 1:]) for i in range(rank)]
    shape = list(info.shape)
    shape[first], shape[second] = shape[second], shape[first]
    strides[first], strides[second] = strides[second], strides[first]
    if first == second or info.numel <= 1:
        return dataclasses.replace(info, shape=tuple(shape))
    return dataclasses.replace(info, shape=tuple(shape), stride=tuple(strides), span_nbytes=info.nbytes)
