"""Modules' own load code that takes checkpoint values, run on the real module once its tensors are in place.

``load_state_dict`` hands a module's ``_load_from_state_dict`` (and its load
pre-hooks) the checkpoint's values. Code that uses them beyond their names
(a module reading its saved version, ``int(state_dict.pop(prefix +
"version"))``; torch's ``CustomState``, copying ``serialized - 1`` into its
parameter) is found while planning (see
:mod:`materialize.planning.loadhooks`), and runs again here, as
``load_state_dict`` would have run it: on the module itself, with a state
dict holding the module's loaded tensors under their names (already in
place: a copy of one into itself changes nothing) and the values of the
checkpoint entries it reads that are no tensor of the model (read with the
load, onto the CPU, where ``load_state_dict`` finds them too).

The model's tensors come to it as views of themselves (asking no gradient,
as ``torch.load``'s do not), so what it changes in them in place lands in
the model; those it changed in place on stand-ins while planning
(``state_dict[key].mul_(3)``) come as the file holds them, read again onto
the CPU, and are copied into the model's tensors after it, cast as torch's
copy casts them. Each is handed the metadata the file saved for its module.

What the code does with names was followed while planning. Should it do
otherwise with the values (replace, rename or drop a tensor of the model),
the load cannot follow and says so, rather than leave another model than
``load_state_dict`` would.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from ..checkpoint import TensorInfo
from ..checkpoint.pieces import Job
from ..errors import CheckpointError, KeyMismatchError, described, summarize_names
from .loadhooks import LoadCodeRun, own_tensor_names, own_hooks
from .plan import Plan, torch_load_hint

# What planning may read for load code that fails without values, in all (a version number, a flag, a scale).
VALUES_BUDGET = 1 << 20


def load_code_reads(plan: Plan) -> tuple[list[Job], dict[tuple[int, str], torch.Tensor]]:
    """Reads for the values load code takes that planning did not read and the model does not load (an entry
    the code renames into the model is the model's tensor, read once), onto the CPU, by (run, name); and of
    the model's tensors it changes in place, read again as the file holds them (its dtype, the CPU)."""
    if not plan.load_code_runs:
        return [], {}  # the usual case: no pass over every loaded tensor for nothing
    loaded = _loaded_from(plan)
    jobs: list[Job] = []
    values: dict[tuple[int, str], torch.Tensor] = {}
    for index, run in enumerate(plan.load_code_runs):
        for key, info in run.fed.items():
            if key not in run.values and id(info) not in loaded:
                values[index, key] = torch.empty(info.shape, dtype=info.dtype)
                jobs.append(Job(values[index, key], info))
        for key, info in run.rewritten.items():  # (names of the model: never a key of run.fed)
            if type(info) is TensorInfo:  # a stacked or rearranged source: the code finds the loaded tensor
                values[index, key] = torch.empty(info.shape, dtype=info.dtype)
                # Under a name of its own: the sanitizer counts the model's tensor's read by the source's name.
                jobs.append(Job(values[index, key], replace(info, name=f"{info.name} (again, for load code)")))
    return jobs, values


def run_load_code(plan: Plan, read: dict[tuple[int, str], torch.Tensor], checkpoint_format: str) -> None:
    """Run each module's load code that takes values, in ``load_state_dict``'s order, on its module."""
    loaded = _loaded_from(plan)
    names = [(name, entry) for entry in plan.of("load") for name in entry.names]
    # The entries code changed in place, as it left them: later code finds them so, as in torch's one state dict.
    carried: dict[str, torch.Tensor] = {}
    for index, run in enumerate(plan.load_code_runs):
        inside = f"{run.prefix}." if run.prefix else ""
        fed = {id(info) for info in run.fed.values()}
        # An entry the code moves to a name of the model (a rename it decided on values) was loaded into the
        # model's tensor: the code finds that tensor under the entry's name, and is to leave it there. The
        # model's tensors come as views of themselves (asking no gradient, as torch.load's do not): what the
        # code changes in place lands in the model, as torch's copy after the code would put it; those it
        # changes in place on names alone come as the file holds them, read again, and are copied in after it.
        given = OrderedDict((name, carried.get(name) if name in carried else entry.held().detach())
                            for name, entry in names if name.startswith(inside) and id(entry.source) not in fed)
        if run.rewritten:
            by_name = {name: entry for name, entry in names if name in run.rewritten}
            given.update((key, carried[key] if key in carried else read[index, key] if (index, key) in read
                          else by_name[key].held().detach()) for key in run.rewritten if key in by_name)
        expected = {name: given.get(name, entry.held()) for name, entry in names
                    if name.startswith(inside) or id(entry.source) in fed or name in run.rewritten}
        state = OrderedDict(given)
        state.update((key, loaded[id(info)] if id(info) in loaded else run.values[key] if key in run.values
                      else read[index, key]) for key, info in run.fed.items())
        errors = _run(run, state, inside, plan.path)
        if errors:
            raise CheckpointError(f"the model's own load code, {run.what} of '{run.prefix or '<root>'}', refused "
                                  f"the checkpoint's values: {' '.join(errors[0].split())}", path=plan.path)
        changed = [name for name, tensor in expected.items() if state.get(name) is not tensor]
        if changed:
            raise KeyMismatchError(
                f"the model's own load code, {run.what} of '{run.prefix or '<root>'}', replaced or removed "
                f"{summarize_names(changed, limit=4)} once given the checkpoint's values, which it did not do on "
                f"names alone: a load reading bytes straight into the model cannot follow it. "
                f"{torch_load_hint(checkpoint_format)}", path=plan.path)
        if run.rewritten:
            carried.update((key, state[key]) for key in run.rewritten if key in state)
            _copy_rewritten(run, state, {name: entry.held() for name, entry in names if name in run.rewritten})


def _copy_rewritten(run: LoadCodeRun, state: OrderedDict, held: dict[str, torch.Tensor]) -> None:
    """torch's copy of the entries the code changed in place into the model's tensors (cast as it casts):
    those of children, whose own load comes after the code, and, where the code is pre-hooks, its module's
    own (an override's ``super()`` copied them, or it chose not to)."""
    inside = f"{run.prefix}." if run.prefix else ""
    own = {inside + name for name in own_tensor_names(run.module)} if run.overrides else set()
    with torch.no_grad():
        for key in run.rewritten:
            value, target = state.get(key), held.get(key)
            if key not in own and target is not None and isinstance(value, torch.Tensor) and value is not target:
                target.copy_(value)


def _loaded_from(plan: Plan) -> dict[int, torch.Tensor]:
    """id of a checkpoint entry -> the model's tensor loaded from it."""
    return {id(entry.source): entry.held() for entry in plan.of("load") if entry.source is not None}


def _run(run: LoadCodeRun, state: OrderedDict, prefix: str, path: str) -> list[str]:
    """Call the code as ``load_state_dict`` calls it (``strict``, the saved module's metadata); its error
    messages, as ``load_state_dict`` collects them."""
    module = run.module
    metadata = dict(run.metadata)  # what load_state_dict hands it (see loadhooks.local_metadata)
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []
    try:
        with _own_pre_hooks_only(module):
            if run.overrides:
                module._load_from_state_dict(state, prefix, metadata, True, missing, unexpected, errors)
            else:  # pre-hooks: the copy torch's own code adds after them is done already
                for hook in list(module._load_state_dict_pre_hooks.values()):
                    hook(state, prefix, metadata, True, missing, unexpected, errors)
    except Exception as error:  # noqa: BLE001 - the model's own code: whatever it raises is its verdict on the file
        raise CheckpointError(f"the model's own load code, {run.what} of '{run.prefix or '<root>'}', raised "
                              f"{described(error)} on the checkpoint's values", path=path) from None
    return errors


@contextmanager
def _own_pre_hooks_only(module: nn.Module) -> Iterator[None]:
    """The module's load pre-hooks from outside torch only, for the length of the block: torch's own (FSDP's,
    a lazy module's) are what the loader did its own way already."""
    every = module._load_state_dict_pre_hooks
    module._load_state_dict_pre_hooks = OrderedDict(own_hooks(every))
    try:
        yield
    finally:
        module._load_state_dict_pre_hooks = every
