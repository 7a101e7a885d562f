"""Where a key map may send a checkpoint tensor besides one model name: types only, no behaviour.

A key map returns, for a checkpoint name, the model name it loads into, or
one of these: a slot of a stacked model tensor (:class:`StackSlot`), the
model tensors a fused one is cut into (:class:`Chunks`), a model tensor it
fills with two dimensions swapped (:class:`Transposed`) or its elements
moved (:class:`Rearranged`, by a :class:`Deinterleave`). Each is the same
bytes of the file seen another way. They sit here, beside the pieces they
become (:mod:`.pieces`), because both sides name them: the planner turns them
into sources (:mod:`materialize.planning.stacking`), and
:mod:`materialize.integrations.hf` makes them from transformers' conversions
without importing the planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class StackSlot:
    """Where a checkpoint tensor goes in a stacked model tensor.

    ``index`` is its position along the stacked (first) dimension, the
    expert number; ``group`` orders the tensors concatenated along the next
    dimension within one position (gate before up). With ``new_dim=False``
    nothing is stacked: the groups are concatenated along the first
    dimension, and ``index`` is always 0. With ``along_rows``, tensors
    already stacked (``[experts, inner, hidden]``) are concatenated along
    their second dimension (Step-3.7's ``gate_proj`` and ``up_proj`` into
    ``gate_up_proj``): each row along the first is stacked at its own
    position, as if saved one tensor per expert (see
    :func:`materialize.planning.stacking.rows_of`).
    """

    target: str
    index: int
    group: int
    pattern: str = ""  # which checkpoint tensors this group holds, for messages: ".experts.*.w3.weight"
    new_dim: bool = True
    along_rows: bool = False  # concatenated along the second dimension: each first-dimension row is a position


@dataclass(frozen=True)
class Chunks:
    """A checkpoint tensor cut along its first dimension into the model tensors ``targets``, in order.

    ``rows`` gives each target's share; without it the parts are as
    ``torch.chunk`` makes them (equal, the last one smaller if need be).
    With ``rest_unread``, the shares may end before the tensor does and the
    rows after them go nowhere: a vocabulary padded in the checkpoint beyond
    the rows the model keeps (transformers' ``Inkling2UnpadVocab``), as
    ``from_pretrained`` drops them.
    """

    targets: tuple[str, ...]
    rows: Optional[tuple[int, ...]] = None
    rest_unread: bool = False
    rearrange: tuple[Optional["Deinterleave"], ...] = ()  # per target, applied to its part (a RoPE permutation)
    interleaved: Optional["Deinterleave"] = None  # the whole tensor first: its two halves along that dim are the parts


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


@dataclass(frozen=True)
class Deinterleave:
    """Pairs interleaved along ``dim`` gathered into two halves, within each of ``groups`` equal blocks.

    transformers' ``Interleave(dim)`` (one block) and ``PermuteForRope`` (a
    block per attention head: rotary pairs to the rotate-half layout); with
    ``inverse``, halves interleaved into pairs. Tensors of a rank outside
    ``ranks`` (when given) are left as they are, as ``PermuteForRope`` leaves
    them. The result is the checkpoint's bytes seen under another shape, a
    strided view read like a transposed tensor (see
    :func:`materialize.planning.stacking.deinterleave`).
    """

    dim: int = 0
    groups: int = 1
    inverse: bool = False
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Rearranged:
    """A checkpoint tensor that goes to ``target`` with its elements moved as ``how`` says."""

    target: str
    how: Deinterleave
