"""Modules' extra state, handed over as ``load_state_dict`` hands it.

A module that overrides ``get_extra_state`` saves what it returns beside its
tensors, as ``<module>._extra_state``; ``load_state_dict`` gives it back to
the module's ``set_extra_state``. Planning pairs each such module with its
saved state (see :func:`materialize.planning.plan.make_plan`): a checkpoint tensor,
read with the rest of the load, or a torch file's plain value, read with its
header by the restricted unpickler; the file's tensors inside such a value
(``{"scale": tensor, "steps": 3}``, in dicts, lists and tuples) are read with
the load onto the CPU and put in their places, as ``torch.load`` makes them.
A value the load cannot hand over so (an object a weights-only read does not
rebuild, a tensor inside one) is refused while planning, before any byte is
read (:func:`materialize.planning.savedstate.refuse_unreadable`). The handing-over comes last, once every
tensor is in place, and a module that refuses its state puts back the states
handed over before it, so a failed load leaves the modules as they were.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable

import torch
from torch import nn

from ..checkpoint import TensorInfo
from ..checkpoint.base import SavedTensor
from ..checkpoint.pieces import Job
from ..errors import CheckpointError, described

from .plan import Plan


def extra_state_reads(plan: Plan) -> tuple[list[Job], dict[Hashable, torch.Tensor]]:
    """Reads for the extra states saved as tensors, and for the tensors inside those saved as dicts, lists and
    tuples (onto the CPU, where ``load_state_dict`` finds them too): by name, and by (name, id of the saved
    tensor)."""
    jobs: list[Job] = []
    values: dict[Hashable, torch.Tensor] = {}
    for name, (_, source) in plan.extra_states.items():
        if isinstance(source, TensorInfo):
            values[name] = torch.empty(source.shape, dtype=source.dtype)
            jobs.append(Job(values[name], source))
            continue
        for saved in _saved_tensors(source):
            if (name, id(saved)) not in values:
                values[name, id(saved)] = torch.empty(saved.info.shape, dtype=saved.info.dtype)
                jobs.append(Job(values[name, id(saved)], saved.info))
    return jobs, values


def hand_over(plan: Plan, read: dict[Hashable, torch.Tensor]) -> None:
    """Give each module its saved extra state; on a refusal, put back what the others held."""
    previous: list[tuple[Any, Any]] = []
    try:
        for name, (module, source) in plan.extra_states.items():
            value = read[name] if isinstance(source, TensorInfo) else _with_tensors(source, name, read, {})
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


_CONTAINERS = (dict, OrderedDict, list, tuple)  # those the reader puts saved tensors in (and rebuilds here)


def _saved_tensors(value: Any) -> list[SavedTensor]:
    """The :class:`SavedTensor` objects inside a saved extra state, each once."""
    found: dict[int, SavedTensor] = {}
    pending = [value]
    seen: set[int] = set()
    while pending:
        item = pending.pop()
        if type(item) is SavedTensor:
            found[id(item)] = item
        elif type(item) in _CONTAINERS and id(item) not in seen:
            seen.add(id(item))
            pending.extend(dict.values(item) if isinstance(item, dict) else item)
    return list(found.values())


def _with_tensors(value: Any, name: str, read: dict[Hashable, torch.Tensor], made: dict[int, Any]) -> Any:
    """``value`` with each :class:`SavedTensor` in it the tensor ``torch.load`` makes of it (the one read, as a
    parameter or requiring gradients where saved so), the containers holding one new, as ``torch.load``
    makes them; what the file made once (a tensor, a container referred to twice) one object."""
    known = made.get(id(value))
    if known is not None:
        return known
    if type(value) is SavedTensor:
        tensor = read[name, id(value)]
        if value.info.stride is not None and value.info.view_shape is None:  # a strided view: its strides kept
            tensor = torch.empty_strided(value.info.shape, value.info.stride, dtype=tensor.dtype).copy_(tensor)
        if value.parameter:
            tensor = nn.Parameter(tensor, requires_grad=value.requires_grad)
        elif value.requires_grad:
            tensor.requires_grad_()
        made[id(value)] = tensor
        return tensor
    if type(value) not in _CONTAINERS:
        return value
    made[id(value)] = value  # while it is walked: a container holding itself (no saved tensor in it) stays
    if isinstance(value, dict):
        pairs = [(key, _with_tensors(item, name, read, made)) for key, item in dict.items(value)]
        changed = any(item is not dict.__getitem__(value, key) for key, item in pairs)
        rebuilt: Any = type(value)(pairs) if changed else value
    else:
        items = [_with_tensors(item, name, read, made) for item in value]
        rebuilt = type(value)(items) if any(new is not old for new, old in zip(items, value)) else value
    made[id(value)] = rebuilt
    return rebuilt
