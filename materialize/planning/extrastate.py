"""Modules' extra state, handed over as ``load_state_dict`` hands it.

A module that overrides ``get_extra_state`` saves what it returns beside its
tensors, as ``<module>._extra_state``; ``load_state_dict`` gives it back to
the module's ``set_extra_state``. Planning pairs each such module with its
saved state (see :func:`materialize.planning.plan.make_plan`): a checkpoint tensor,
read with the rest of the load, or a torch file's plain value, read with its
header by the restricted unpickler. The handing-over comes last, once every
tensor is in place, and a module that refuses its state puts back the states
handed over before it, so a failed load leaves the modules as they were.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checkpoint import TensorInfo
from ..checkpoint.standins import StandIn
from ..checkpoint.pieces import Job
from ..errors import CheckpointError, described
from .plan import Plan


def extra_state_reads(plan: Plan) -> tuple[list[Job], dict[str, torch.Tensor]]:
    """Reads for the extra states saved as tensors (onto the CPU, where ``load_state_dict`` finds them too)."""
    jobs: list[Job] = []
    values: dict[str, torch.Tensor] = {}
    for name, (_, source) in plan.extra_states.items():
        if isinstance(source, TensorInfo):
            values[name] = torch.empty(source.shape, dtype=source.dtype)
            jobs.append(Job(values[name], source))
    return jobs, values


def hand_over(plan: Plan, read: dict[str, torch.Tensor]) -> None:
    """Give each module its saved extra state; on a refusal, put back what the others held."""
    previous: list[tuple[Any, Any]] = []
    try:
        for name, (module, source) in plan.extra_states.items():
            value = read[name] if isinstance(source, TensorInfo) else _plain(source, name, plan.path)
            previous.append((module, module.get_extra_state()))
            try:
                module.set_extra_state(value)
            except Exception as error:  # noqa: BLE001 - the module's own code: any refusal is the checkpoint's
                previous.pop()
                raise CheckpointError(
                    f"{type(module).__name__}.set_extra_state refused it: {described(error)}",
                    path=plan.path, tensor=name) from None
    except BaseException:
        for module, state in reversed(previous):
            module.set_extra_state(state)
        raise


def _plain(value: Any, name: str, path: str) -> Any:
    """A value the restricted unpickler rebuilt whole: no class it stood in for, no tensor it left unread."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, StandIn):
            raise CheckpointError(
                f"holds a {item.stands_in_for or type(item).__name__}, which a weights-only read does not rebuild; "
                "pass trust_pickle=True (CLI: --trust-pickle) if you trust the file", path=path, tensor=name)
        if isinstance(item, torch.Tensor):
            raise CheckpointError(
                f"holds tensors inside a {type(value).__name__}, which this loader does not read; save the tensor "
                "itself as the extra state", path=path, tensor=name)
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            pending.extend(item)
    return value
