"""Names a model ties but the checkpoint holds as separate tensors: tied again where their values are equal.

A config saying ``tie_word_embeddings`` over a checkpoint whose ``lm_head``
is its own must leave the two apart (``from_pretrained`` compares them);
a conversion that wrote the tied tensor twice, or a DCP save (one copy per
name), must not cost the model a second tensor. So the first name is
loaded, and every other name's checkpoint tensor read in blocks and
compared with it before it has any memory of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import EllipsisType
from typing import Optional, Union

import torch
from torch import nn

from ..checkpoint import TensorInfo
from ..checkpoint.base import contiguous_strides
from ..checkpoint.pieces import Job
from ..dtypes import check_cast_range
from ..errors import ShardingError
from .plan import Entry, Plan
from ..integrations.sharded import ShardSpec, local_of, region

# What a failed load puts back: (module, attr, is_parameter, tensor held before), or an Entry whose owners all
# held its original (a fresh parameter's record, one for all its names: see materialize.loading._undo)
Undo = list[Union[tuple[nn.Module, str, bool, torch.Tensor], Entry]]


def compared_before_allocating(the_plan: Plan, mmap: bool) -> set[int]:
    """Entries split off a tie that are compared with the tensor already loaded before any memory is theirs.

    Where the checkpoint holds equal values (the usual case: a tied
    tensor saved under both names), the second copy is then never
    allocated. Left out: names left as views of the file (they cost no
    memory) and names of another device or dtype than the tensor they are
    compared with (they could not share it anyway).
    """
    deferred = set()
    for check in the_plan.tie_checks:
        first = the_plan.entries[check[0]]
        if first.action != "load" or first.stays_in_file(mmap):
            continue
        for index in check[1:]:
            other = the_plan.entries[index]
            if (other.action == "load" and other.source is not None and not other.stays_in_file(mmap)
                    and other.device == first.device and other.dtype == first.dtype
                    and other.local_shape == first.local_shape == tuple(other.source.shape)):
                deferred.add(index)
    return deferred


COMPARE_BLOCK_BYTES = 32 * 1024 * 1024  # of the file's bytes, read and compared at once
BlockIndex = tuple[Union[slice, EllipsisType], ...]  # where a block lies in the tensor


class TieSettling:
    """Tie again the names of a tied tensor read from separate checkpoint tensors where their values are equal.

    :meth:`settle` returns the groups tied again, and those left apart
    (their values differ: the checkpoint holds tensors the model's config
    ties, as an ``lm_head`` of its own under ``tie_word_embeddings``), as
    ``from_pretrained`` decides. A name in ``in_file`` has no memory yet: its
    checkpoint tensor is read in blocks of :data:`COMPARE_BLOCK_BYTES` and
    compared with the loaded one, and only if they differ is it allocated
    and loaded, so an equal copy never costs a second tensor. The others
    were loaded (views of the file, or of another device or dtype); one
    found equal is dropped. ``allocate`` gives an entry memory and
    registers it, returning the job that fills it.
    A sharded model's tie (a DCP save writes a tied tensor once per name)
    is compared on each rank's own shard, and the ranks of its mesh then
    agree (one all-reduce per tie): ranks cannot leave it apart without each
    other, so values that differ in any rank's rows are an error on every
    rank, where one rank going on alone would hang at the next collective.
    """

    def __init__(self, the_plan: Plan, in_file: set[int], read: Callable[[list[Job]], int], undo: Undo, *,
                 allocate: Callable[[Entry], list[Job]], allow_overflow: bool) -> None:
        self.plan, self.in_file, self.read, self.undo = the_plan, in_file, read, undo
        self.allocate, self.allow_overflow = allocate, allow_overflow

    def settle(self) -> tuple[list[list[str]], list[list[str]]]:
        retied, untied = [], []
        for check in self.plan.tie_checks:
            first = self.plan.entries[check[0]]
            kept = first.held()
            together, apart = list(first.names), [first.name]
            for index in check[1:]:
                other = self.plan.entries[index]
                equal = self._equal(local_of(kept), index)
                if first.shard is not None:
                    equal = _on_every_rank(equal, first.shard)
                if equal:
                    other.hold(kept, self.undo)
                    together.extend(other.names)
                elif first.shard is not None:
                    raise ShardingError(
                        f"is tied to '{other.name}' in the model, and the checkpoint holds different values for "
                        "them: a sharded model cannot leave the tie apart on one rank; load it before sharding, or "
                        "untie it", path=self.plan.path, tensor=first.name,
                    )
                else:
                    apart.append(other.name)
            if len(together) > 1:
                retied.append(together)
            if len(apart) > 1:
                untied.append(apart)
        return retied, untied

    def _equal(self, kept: torch.Tensor, index: int) -> bool:
        other = self.plan.entries[index]
        if index in self.in_file:
            assert other.source is not None
            blocks = _blocks(other.source)
            if blocks is not None:
                return self._equal_to_file(kept, other, blocks)
            # Read rearranged, it cannot be cut in blocks: loaded whole, then compared (and dropped if equal).
            self.read(self.allocate(other))
        return _same_values(kept, local_of(other.held()))

    def _equal_to_file(self, kept: torch.Tensor, other: Entry, blocks: list[tuple[BlockIndex, TensorInfo]]) -> bool:
        """Whether ``kept`` holds the values of ``other``'s blocks in the file, as a load would make them.

        Where they differ, ``other`` gets memory of its own and is loaded:
        the blocks compared equal are copied from ``kept``, the one that
        differed from the block read, the rest read. Its bytes are read once
        either way.
        """
        for number, (where, part) in enumerate(blocks):
            block = torch.empty(part.shape, dtype=part.dtype)  # the file's dtype, on the host: a plain read
            self.read([Job(block, part)])
            # As a load makes them: moved to the device as they are, then cast there.
            values = block.to(kept.device).to(kept.dtype)
            if torch.equal(values, kept[where]):
                continue
            if other.shard is not None:
                return False  # ranks cannot leave a tie apart alone: the caller raises
            if not self.allow_overflow and part.dtype != kept.dtype:
                check_cast_range(block, kept.dtype, part)  # as the load would have: equal blocks passed with kept
            (job,) = self.allocate(other)
            for earlier, _ in blocks[:number]:
                job.dest[earlier].copy_(kept[earlier])
            job.dest[where].copy_(values)
            self.read([Job(job.dest[later], rest) for later, rest in blocks[number + 1:]])
            return False
        return True


def _on_every_rank(holds: bool, shard: ShardSpec) -> bool:
    """Whether ``holds`` is true on every rank of ``shard``'s mesh (each of its dimensions reduced in turn)."""
    import torch.distributed as dist

    flag = torch.tensor([int(holds)], dtype=torch.int32, device=shard.device)
    for dim in range(shard.mesh.ndim):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=shard.mesh.get_group(dim))
    return bool(flag.item())


def _blocks(info: TensorInfo) -> Optional[list[tuple[BlockIndex, TensorInfo]]]:
    """``info`` cut in blocks of about :data:`COMPARE_BLOCK_BYTES`, or None where it cannot be cut.

    The cut is along the dimension of the largest stride (rows, unless a
    torch file holds a transposed view), so each block is one stretch of
    the file rather than elements spread over all of it.
    """
    shape = tuple(info.shape)
    if len(shape) == 0 or math.prod(shape) == 0:
        return [((...,), info)]
    strides = info.stride if info.stride is not None else contiguous_strides(shape)
    dim = max(range(len(shape)), key=lambda d: strides[d] if shape[d] > 1 else -1)
    step = max(1, COMPARE_BLOCK_BYTES // max(1, info.nbytes // shape[dim]))
    blocks = []
    try:
        for first in range(0, shape[dim], step):
            count = min(step, shape[dim] - first)
            offsets = tuple(first if d == dim else 0 for d in range(len(shape)))
            sizes = tuple(count if d == dim else size for d, size in enumerate(shape))
            blocks.append(((slice(None),) * dim + (slice(first, first + count),), region(info, offsets, sizes)))
    except ShardingError:
        return None
    return blocks


def _same_values(first: torch.Tensor, second: torch.Tensor) -> bool:
    return first.dtype == second.dtype and first.shape == second.shape and bool(torch.equal(first, second))
