"""Tensors that shared one storage when saved get one storage again (``load_tensors``).

A torch file keeps views (a tied embedding saved twice, ``w`` and ``w[2:]``,
``w.t()``) as one storage record. Materialized one by one they would be
independent copies: memory paid twice, and writes to one no longer seen by
the other. Instead each group is read once, as the byte span its members
cover, into one destination, and every member becomes a view of it, as
``torch.load`` gives them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from ..checkpoint import TensorInfo
from ..checkpoint.base import contiguous_strides


@dataclass(frozen=True)
class SharedSpan:
    """One read covering every member of a storage group: ``span`` describes it as a flat tensor."""

    span: TensorInfo
    members: list[TensorInfo]

    def view(self, base: torch.Tensor, member: TensorInfo) -> torch.Tensor:
        stride = member.stride if member.stride is not None else contiguous_strides(member.shape)
        return base.as_strided(member.shape, stride, (member.offset - self.span.offset) // member.itemsize)


def shared_spans(infos: Iterable[TensorInfo]) -> list[SharedSpan]:
    """Groups of non-empty tensors viewing one storage record, of one dtype, element-aligned.

    A group of one is kept too when its elements overlap in memory (a stride
    of 0, as ``expand`` makes): it stays a view of its few bytes, as
    ``torch.load`` gives it, instead of a copy that may be vastly larger
    (a file can claim billions of elements backed by one).
    """
    groups: dict[tuple, list[TensorInfo]] = defaultdict(list)
    for info in infos:
        if info.storage is not None and info.numel > 0:
            groups[(info.path, info.storage)].append(info)
    spans = []
    for members in groups.values():
        overlapping = len(members) == 1 and members[0].read_nbytes < members[0].nbytes
        if (len(members) < 2 and not overlapping) or len({m.dtype_name for m in members}) != 1:
            continue  # views of one storage as different dtypes stay separate copies
        start = min(m.offset for m in members)
        end = max(m.offset + m.read_nbytes for m in members)
        itemsize = members[0].itemsize
        if (end - start) % itemsize or any((m.offset - start) % itemsize for m in members):
            continue
        span = replace(members[0], shape=((end - start) // itemsize,), offset=start, stride=None, span_nbytes=None)
        spans.append(SharedSpan(span, members))
    return spans
