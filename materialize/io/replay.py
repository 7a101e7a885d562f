"""The replay of a recorded construction as ``load``'s init, and the box of it a DTensor shard takes.

The replay itself is :mod:`materialize.skeleton.replaying`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..errors import ReplayError
from ..integrations.sharded import ShardSpec, local_of
from ..planning.plan import Plan
from ..skeleton.program import Program
from ..skeleton.replaying import Sink, Target, replay

__all__ = ["ReplayInit", "allocated_together", "replay", "shard_box"]


class ReplayInit:
    """``load``'s init for a model :func:`~materialize.skeleton.deferred.deferred_init` recorded: the tensors
    the plan initializes are replayed together, in one pass over the recording (see :func:`replay`)."""

    def __init__(self, program: Program) -> None:
        self.program = program

    def __call__(self, module: nn.Module) -> None:
        raise ReplayError("a recorded construction is replayed for the whole load at once, not module by module")

    def fill(self, plan: Plan) -> None:
        targets: dict[str, Target] = {}
        for entry in plan.of("init"):
            if math.prod(entry.local_shape) == 0:
                continue  # nothing to make
            tensor = entry.held()
            targets[entry.name] = shard_box(local_of(tensor), entry.shard) if entry.shard is not None else tensor
        replay(self.program, targets, plan.device)


def shard_box(local: torch.Tensor, shard: ShardSpec) -> Sink:
    """A DTensor shard takes its boxes of the whole tensor's values (made whole once, one tensor at a time)."""

    def take(values: torch.Tensor) -> None:
        for box in shard.boxes:
            local[box.local].copy_(values[box.whole])

    return take


def allocated_together(program: Program, tensors: list[tuple[str, torch.Tensor]], device: torch.device
                       ) -> dict[str, torch.Tensor]:
    """The tensors of ``tensors`` (``(qualified name, model tensor)``) that eager construction made as views of
    one storage (``rows, cols = torch.triu_indices(...)``, peft's OFT), allocated as such: one storage each
    group, each tensor its recorded view of it, so they share memory as eager construction's do. A group is
    only two or more of the model's tensors over one recorded storage, each as recorded (a tensor cast after
    construction, ``.half()``, is made alone); the others are not in the result."""
    by_storage: dict[int, list[tuple[str, torch.Tensor, Any]]] = {}
    for name, tensor in tensors:
        ref = program.bindings.get(name)
        if ref is not None and ref.dtype == tensor.dtype and ref.size == tuple(tensor.shape) \
                and ref.stride == tuple(tensor.stride()):
            by_storage.setdefault(ref.sid, []).append((name, tensor, ref))
    made: dict[str, torch.Tensor] = {}
    for sid, group in by_storage.items():
        if len({id(tensor) for _, tensor, _ in group}) < 2:
            continue
        refs = [ref for _, _, ref in group]
        extent = max(_end(ref) for ref in refs)
        whole = torch.empty(extent, dtype=refs[0].dtype, device=device)
        for name, _, ref in group:
            made[name] = whole.as_strided(ref.size, ref.stride, ref.offset)
    return made


def _end(ref: Any) -> int:
    """One past the last element a recorded view reaches in its storage."""
    if math.prod(ref.size) == 0:
        return ref.offset
    return ref.offset + sum((size - 1) * stride for size, stride in zip(ref.size, ref.stride)) + 1
