"""Whether a module's saved extra state can be handed over as ``torch.load`` makes it: asked while planning.

Apart from :mod:`materialize.planning.extrastate` (which hands states over once the load is done, and reads
the plan) so that planning can ask it without an import running back from the plan.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..checkpoint.plainrecords import PlainTensor
from ..checkpoint.standins import StandIn
from ..errors import CheckpointError


def refuse_unreadable(value: Any, name: str, module: nn.Module, path: str) -> None:
    """Refuse, while planning, a saved extra state the load cannot hand over as ``torch.load`` makes it: an
    object of a class a weights-only read does not rebuild, or a tensor this loader does not read (one
    inside an object; the file's tensors inside dicts, lists and tuples are read, see :class:`SavedTensor`)."""
    pending = [value]
    seen: set[int] = set()
    while pending:
        item = pending.pop()
        if isinstance(item, StandIn):
            raise CheckpointError(
                f"holds a {item.stands_in_for or type(item).__name__}, which a weights-only read does not rebuild; "
                "pass trust_pickle=True (CLI: --trust-pickle) if you trust the file", path=path, tensor=name)
        if type(item) is PlainTensor or (isinstance(item, torch.Tensor) and item.is_meta):
            raise CheckpointError(
                f"holds a tensor inside a {type(value).__name__} that this loader does not read, which "
                f"{type(module).__name__}.set_extra_state would be given without its values; save the tensor "
                "itself as the extra state, or inside a dict, list or tuple", path=path, tensor=name)
        if id(item) in seen:
            continue
        if isinstance(item, dict):
            seen.add(id(item))
            pending.extend(dict.keys(item))
            pending.extend(dict.values(item))
        elif isinstance(item, (list, tuple, set, frozenset)):
            seen.add(id(item))
            pending.extend(item)
        elif not isinstance(item, (type, torch.Tensor)) and isinstance(getattr(item, "__dict__", None), dict):
            seen.add(id(item))  # an object of a trusted file's class: its attributes
            pending.extend(vars(item).values())
