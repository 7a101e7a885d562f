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

What a key map returns (:class:`StackSlot`, :class:`Chunks`, :class:`Transposed`,
:class:`Rearranged`) is defined in :mod:`materialize.checkpoint.targets`, below
the planner, where the key maps of :mod:`materialize.integrations` make them
too; this module turns them into sources.
"""

from __future__ import annotations

import dataclasses

from ..checkpoint import TensorInfo
from ..checkpoint.base import contiguous_strides
from ..checkpoint.pieces import Piece, Stacked
from ..checkpoint.targets import Chunks, Deinterleave, StackSlot, Transposed
from ..errors import CheckpointError


def rows_of(slot: StackSlot, info: TensorInfo) -> list[tuple[StackSlot, TensorInfo]]:
    """A slot ``along_rows`` as one slot per row of ``info`` along its first dimension, named ``NAME[row]``."""
    if not slot.along_rows:
        return [(slot, info)]
    if len(info.shape) < 2 or not info.contiguous:
        raise CheckpointError(f"cannot be concatenated into '{slot.target}' along its second dimension: it is "
                              f"{'a strided view' if len(info.shape) >= 2 else f'of shape {list(info.shape)}'}",
                              path=info.path, tensor=info.name)
    row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
    return [
        (dataclasses.replace(slot, index=row, new_dim=True, along_rows=False),
         dataclasses.replace(info, name=f"{info.name}[{row}]", shape=info.shape[1:],
                             offset=info.offset + row * row_bytes, storage=None))
        for row in range(info.shape[0])
    ]


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
    """Each target with the part of ``info`` it gets (see :class:`Chunks`); raises naming ``info``."""
    if chunks.interleaved is not None:
        return list(zip(chunks.targets, halves(info, chunks.interleaved, len(chunks.targets))))
    parts = _cut_rows(info, chunks)
    if not chunks.rearrange:
        return parts
    return [(target, part if how is None else deinterleave(part, how))
            for (target, part), how in zip(parts, chunks.rearrange)]


def _cut_rows(info: TensorInfo, chunks: Chunks) -> list[tuple[str, TensorInfo]]:
    """Each target with the run of ``info`` it gets, named ``info.name[first:last]`` (rows)."""
    into = ", ".join(f"'{target}'" for target in chunks.targets)
    if not info.shape:
        raise CheckpointError(f"is a scalar and cannot be cut into {into}", path=info.path, tensor=info.name)
    if not info.contiguous:
        raise CheckpointError(f"is a strided view and cannot be cut into {into}", path=info.path, tensor=info.name)
    total = info.shape[0]
    if chunks.rows is not None:
        taken = sum(chunks.rows)
        if taken > total or (taken < total and not chunks.rest_unread) or len(chunks.rows) != len(chunks.targets):
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
    strides = list(contiguous_strides(info.shape))
    shape = list(info.shape)
    shape[first], shape[second] = shape[second], shape[first]
    strides[first], strides[second] = strides[second], strides[first]
    if first == second or info.numel <= 1:
        return dataclasses.replace(info, shape=tuple(shape))
    return dataclasses.replace(info, shape=tuple(shape), stride=tuple(strides), span_nbytes=info.nbytes)


def _pairs(info: TensorInfo, how: Deinterleave, verb: str) -> tuple[int, int, int]:
    """``(dim, first, second)``: the block of ``dim`` read as ``first x second``; raises naming ``info``."""
    rank = len(info.shape)
    if not info.contiguous:
        raise CheckpointError(f"is a strided view and cannot be {verb}", path=info.path, tensor=info.name)
    if not -rank <= how.dim < rank:
        raise CheckpointError(f"has {rank} dimensions and cannot be {verb} along dimension {how.dim}",
                              path=info.path, tensor=info.name)
    dim = how.dim % rank
    size = info.shape[dim]
    if how.groups < 1 or size % (2 * how.groups):
        blocks = f" in {how.groups} blocks" if how.groups != 1 else ""
        raise CheckpointError(f"has {size} elements along dimension {dim}, which cannot be {verb} as pairs{blocks}",
                              path=info.path, tensor=info.name)
    half = size // how.groups // 2
    return (dim, 2, half) if how.inverse else (dim, half, 2)


def deinterleave(info: TensorInfo, how: Deinterleave) -> TensorInfo:
    """``info`` rearranged as ``how`` says: same bytes, read as a strided view under ``view_shape``.

    Dimension ``dim`` is read as ``(groups, first, second)`` and written as
    ``(groups, second, first)``: the destination, viewed under that shape,
    takes the file's elements with the last two swapped.
    """
    if how.ranks and len(info.shape) not in how.ranks:
        return info
    dim, first, second = _pairs(info, how, "rearranged")
    if first == 1 or second == 1:
        return info  # one pair or one element per half: nothing moves
    strides = contiguous_strides(info.shape)
    inner = strides[dim]
    return dataclasses.replace(
        info,
        stride=(*strides[:dim], first * second * inner, inner, second * inner, *strides[dim + 1:]),
        view_shape=(*info.shape[:dim], how.groups, second, first, *info.shape[dim + 1:]),
        span_nbytes=info.nbytes,
        storage=None,
    )


def halves(info: TensorInfo, how: Deinterleave, count: int) -> list[TensorInfo]:
    """The two halves of ``info`` deinterleaved along ``how.dim`` (transformers' ``Interleave`` then ``Chunk``).

    Half ``k`` is every other element along that dimension, from the ``k``-th:
    a strided view of the same rank, no reshaping needed.
    """
    if count != 2 or how.groups != 1 or how.inverse:
        raise CheckpointError(f"cannot be deinterleaved into {count} parts", path=info.path, tensor=info.name)
    dim, first, _ = _pairs(info, how, "deinterleaved")
    strides = list(contiguous_strides(info.shape))
    inner = strides[dim]
    strides[dim] = 2 * inner
    shape = (*info.shape[:dim], first, *info.shape[dim + 1:])
    span = (sum((size - 1) * step for size, step in zip(shape, strides)) + 1) * info.itemsize
    return [
        dataclasses.replace(info, name=f"{info.name}[{part}::2]", shape=shape, stride=tuple(strides),
                            offset=info.offset + part * inner * info.itemsize, span_nbytes=span, storage=None)
        for part in range(2)
    ]
