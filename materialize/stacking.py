"""Stacked tensors: one model tensor filled from several checkpoint tensors.

Mixture-of-experts models in transformers 5 hold each layer's experts as one
tensor (``experts.gate_up_proj`` of shape ``[experts, 2 * inner, hidden]``),
while their checkpoints keep one tensor per expert and projection
(``experts.3.w1.weight``). Stacking along a new first dimension, then
concatenating along the next one, puts every checkpoint tensor in one
contiguous block of the model tensor, so each is read straight into its
block: no temporary, no second copy, as for any other tensor.

A key map marks such a checkpoint tensor by returning a :class:`StackSlot`
instead of a name; the planner gathers the slots of one target into a
:class:`Stacked` source.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checkpoint import TensorInfo
from .errors import CheckpointError


@dataclass(frozen=True)
class StackSlot:
    """Where a checkpoint tensor goes in a stacked model tensor.

    ``index`` is its position along the stacked (first) dimension, the
    expert number; ``group`` orders the tensors concatenated along the next
    dimension within one position (gate before up).
    """

    target: str
    index: int
    group: int
    pattern: str = ""  # which checkpoint tensors this group holds, for messages: ".experts.*.w3.weight"


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
        shape=(len(indexes), rows, *first.shape[1:]),
        path=first.path,
        offset=first.offset,
        pieces=tuple(pieces),
    )
