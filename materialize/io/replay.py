"""The replay of a recorded construction as ``load``'s init, and the box of it a DTensor shard takes.

The replay itself is :mod:`materialize.skeleton.replaying`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ReplayError
from ..integrations.sharded import ShardSpec, local_of
from ..planning.plan import Plan
from ..skeleton.program import Program
from ..skeleton.replaying import Sink, Target, replay

__all__ = ["ReplayInit", "replay", "shard_box"]


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
