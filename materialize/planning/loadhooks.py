"""A model's own ``load_state_dict`` code, run on names before any byte is read.

Modules adapt older checkpoints in their load code: a pre-hook renames
keys (``torch.nn.utils.parametrizations.weight_norm`` turns a save's
``weight_g``/``weight_v`` into ``parametrizations.weight.original0/1``;
transformers' Mamba renames ``embedding.``), or an overridden
``_load_from_state_dict`` drops one (a frozen batch norm drops
``num_batches_tracked``). ``load_state_dict`` runs that code; a load that
reads bytes straight into the model must run it too, or it calls such
checkpoints mismatched.

So the code runs here, as ``load_state_dict`` would run it, over a state dict
of stand-ins: one meta tensor per checkpoint tensor, with its shape and
dtype. What the code does to the keys is then read off the stand-ins: a
stand-in under a new key is a rename, one gone is a tensor the model drops.
An override runs on a twin of its module whose tensors are on meta, so the
copy at its end touches no memory of the model.

Only code from outside torch is run, and torch's own compatibility hooks of
``torch.nn.utils`` (weight norm, spectral norm): torch's distributed
wrappers' hooks (FSDP, activation checkpointing), its lazy modules' and its
batch norms' are what the rest of the loader already does in its own way.
Each module's code gets the metadata a save by the current code carries
(its ``_version``), so legacy conversions keyed on older versions stay out.
Code that fails on stand-ins (it needs values: ``int(state_dict.pop(key))``)
is given the values it asked for, of checkpoint entries that are no tensor
of the model (a saved version number), read while planning within a small
budget, and runs again. Code that needs values, or that uses what it reads
(sets its module's attributes from it, copies it into its own tensor as
torch's ``CustomState`` test does), runs again on the real module once the
load is done (:class:`LoadCodeRun`, see :mod:`materialize.planning.loadruns`),
as ``load_state_dict`` would have run it. Code that still fails leaves the
names as they were and is named if the load then finds them mismatched, as
is a class's own ``load_state_dict`` (it would load, so it is never called);
code that computes a new tensor from checkpoint values cannot run without
the values, and a load it would feed is refused, naming the tensors. Load
post-hooks run once the load is done (:func:`run_post_hooks`).
"""

from __future__ import annotations

import functools
import re
import weakref
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys

from ..checkpoint import TensorInfo
from ..checkpoint.base import is_extra_state
from ..errors import KeyMismatchError, described
from ..skeleton.meta import is_lazy


# A checkpoint tensor's value read for load code while planning; None once the budget for such reads is spent.
Fetch = Callable[[TensorInfo], Optional[torch.Tensor]]


@dataclass
class LoadCodeRun:
    """A module's own load code that takes checkpoint values: run on the module once its tensors are in place.

    ``fed`` are the checkpoint entries the code reads that are no tensor of
    the model (a saved version, torch's ``CustomState`` ``serialized``), by
    the name it reads them under; ``values`` those read while planning (the
    code needed them to go on), the others are read with the load.
    ``fills`` are its module's own tensors the checkpoint lacks which its code
    did not call missing: the code makes them (``CustomState.param``).
    """

    prefix: str
    module: nn.Module
    fed: dict[str, TensorInfo]
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    fills: list[str] = field(default_factory=list)

    @property
    def overrides(self) -> bool:
        """Whether the code is an override of ``_load_from_state_dict`` (else: load pre-hooks)."""
        return _own_override(self.module)

    @property
    def what(self) -> str:
        """The code, in words: ``Class._load_from_state_dict`` or ``Class's load_state_dict pre-hook``."""
        return describe_code(self.module)


@dataclass(frozen=True)
class Verdict:
    """What an overridden ``_load_from_state_dict`` called missing and unexpected, run on stand-ins with
    ``strict`` as ``load_state_dict`` runs it: for the names only its module judges, its word is torch's."""

    prefix: str
    module: nn.Module
    missing: frozenset[str]
    unexpected: frozenset[str]

    def judges(self, name: str) -> bool:
        """Whether ``name`` is the module's own to call missing or unexpected (not inside a child of it)."""
        inside = f"{self.prefix}." if self.prefix else ""
        if not name.startswith(inside):
            return False
        first, dot, _ = name[len(inside):].partition(".")
        return not dot or first not in self.module._modules


@dataclass
class Replayed:
    """What the model's load code made of the checkpoint's names."""

    sources: dict[str, TensorInfo]  # model name -> source, after the code's renames
    dropped: list[TensorInfo] = field(default_factory=list)  # sources the code removed
    renamed: dict[str, str] = field(default_factory=dict)  # name before the code -> name after, where it changed
    # Load code that did not run on names: "module (Class, which raised ...)" for code that needed values,
    # "module (Class overrides load_state_dict, ...)" for code a load never calls.
    unrun: list[str] = field(default_factory=list)
    # Load code that needs checkpoint values: (the module's prefix, what it is, the names it read on stand-ins).
    # It raised on them (``int(state_dict.pop(key))``), or read a name it then left where no tensor of the
    # model takes it (torch's CustomState: a param saved as ``serialized = param + 1`` and copied back).
    needs_values: list[tuple[str, str, list[str]]] = field(default_factory=list)
    runs: list[LoadCodeRun] = field(default_factory=list)  # code to run again on the real module, with values
    verdicts: list[Verdict] = field(default_factory=list)  # of the overrides that ran on stand-ins
    ran_code: bool = False  # whether any of the model's load code ran (on stand-ins): it may have changed hooks

    def left_alone(self, name: str, kind: str) -> bool:
        """Whether the code judging ``name`` (an override that ran) did not call it ``kind`` ("missing" or
        "unexpected"): ``load_state_dict`` then does not either (the code did not call ``super()``, or
        consumed the name)."""
        return any(verdict.judges(name) and name not in getattr(verdict, kind) for verdict in self.verdicts)


def load_hooked(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Those of ``modules`` with a ``load_state_dict`` pre-hook or post-hook, in their order: one pass reading
    both registries of each module while it is at hand (on a model of experts, each pass over its modules
    costs half a microsecond a tensor), for :func:`replay_load_hooks` and :func:`post_hooked`."""
    return [(prefix, module) for prefix, module in modules
            if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks]


def replay_load_hooks(
    modules: list[tuple[str, nn.Module]], sources: dict[str, TensorInfo], model_names: set[str], path: object = None,
    fetch: Optional[Fetch] = None, hooked: Optional[list[tuple[str, nn.Module]]] = None,
    classes: Optional[set[type]] = None,
) -> Replayed:
    """Run the load code of a model's ``modules`` (each under each of its names, in the order
    ``load_state_dict`` visits them) over ``sources`` (model name -> checkpoint tensor).

    ``model_names`` are the names of the model's tensors; ``path`` names the
    checkpoint in errors. ``fetch`` reads the value of a checkpoint entry
    that code failing on stand-ins asked for (none: such code stays unrun).
    ``hooked`` is :func:`load_hooked` of ``modules`` and ``classes`` the set of their classes, where the
    caller has them (each module's registries are then read once for every use): where no class has load
    code of its own, only the hooked modules are asked, not every module again.
    """
    unrun: list[str] = []
    adapting: list[tuple[str, nn.Module]] = []
    by_class: dict[type, tuple[bool, bool]] = {}  # the weak cache costs a weak reference a lookup
    if hooked is None:
        hooked = load_hooked(modules)
    pre_hooked = {id(module) for _, module in hooked if module._load_state_dict_pre_hooks}
    asked = modules
    if classes is not None and not any(any(_class_code(cls)) for cls in classes):
        asked = [(prefix, module) for prefix, module in hooked if id(module) in pre_hooked]  # in the same order
    for prefix, module in asked:  # one pass, each class asked once: an MoE has more modules than tensors
        cls = type(module)
        known = by_class.get(cls)
        if known is None:
            known = by_class[cls] = _class_code(cls)
        own_load_from, own_load = known
        if own_load:
            unrun.append(f"{prefix or '<root>'} ({cls.__name__} overrides load_state_dict, which a load does not call)")
        if (own_load_from or id(module) in pre_hooked) and _has_own_load_code(module):
            adapting.append((prefix, module))
    if not adapting:
        return Replayed(sources, unrun=unrun)
    # Extra states go to set_extra_state, which on a stand-in could change what the twin shares with its module.
    state = _Journaled((name, torch.empty(info.shape, dtype=info.dtype, device="meta")) for name, info in sources.items()
                       if not is_extra_state(name))
    stand_ins = {id(stand_in): name for name, stand_in in state.items()}  # values read while planning too
    reads: list[tuple[str, nn.Module, list[str], str]] = []
    runs: list[LoadCodeRun] = []
    verdicts: list[Verdict] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the code's notes on meta copies and old versions are not the user's
        for prefix, module in adapting:
            outcome, values = _run_with_values(module, state, f"{prefix}." if prefix else "", stand_ins, sources,
                                               model_names, fetch)
            read = list(state.seen)
            if isinstance(outcome, str):  # still raised: it needs values it was not given, or of the model's tensors
                unrun.append(f"{prefix or '<root>'} ({outcome})")
                reads.append((prefix, module, read, outcome))
                runs.append(LoadCodeRun(prefix, module, {}))  # on the loaded values, where names agree without it
                continue
            missing, unexpected, changed = outcome
            if _own_override(module):
                verdicts.append(Verdict(prefix, module, frozenset(missing), frozenset(unexpected)))
            left_unused = [key for key in read if key in state and key not in model_names]
            if values or changed or left_unused:  # it uses what it reads: it runs again on the real module
                fed = {key: sources[stand_ins[id(value)]] for key, value in state.seen.items()
                       if key not in model_names and id(value) in stand_ins}
                runs.append(LoadCodeRun(prefix, module, fed, {key: value for key, value in state.seen.items()
                                                              if key in fed and not value.is_meta}))
    renamed: dict[str, TensorInfo] = {}
    moves: dict[str, str] = {}
    derived: list[str] = []
    for key, value in state.items():
        origin = stand_ins.get(id(value))
        if origin is not None:
            renamed[key] = sources[origin]
            if key != origin:
                moves[origin] = key
        elif isinstance(value, torch.Tensor) and (value.is_meta or any(run.values for run in runs)):
            derived.append(key)  # made by the code (from stand-ins, or from values read for it)
    computed = [key for key in derived if key in model_names]
    if computed:
        raise KeyMismatchError(
            f"the model's own load_state_dict code puts tensors of its making under {', '.join(computed[:5])}"
            f"{' and more' if len(computed) > 5 else ''} (computed from checkpoint values), which a load reading "
            "tensors straight into the model cannot do; load the checkpoint once with torch's load_state_dict "
            "and save model.state_dict() again",
            path=path,
        )
    renamed.update((name, info) for name, info in sources.items() if is_extra_state(name))
    kept = {id(info) for info in renamed.values()}
    fed = {id(info) for run in runs for info in run.fed.values()}  # consumed by code that uses them: not dropped
    dropped = [info for name, info in sources.items() if id(info) not in kept and id(info) not in fed]
    needs_values = []
    for prefix, module, read, raised in reads:
        left_unused = [key for key in read if key in renamed and key not in model_names]
        needs_values.append((prefix, f"{describe_code(module)} ({raised})", left_unused))
    replayed = Replayed(renamed, dropped, moves, unrun, needs_values, runs, verdicts, ran_code=True)
    for run in runs:
        own = [f"{run.prefix}.{attr}" if run.prefix else attr for attr in _own_tensor_names(run.module)]
        run.fills = [name for name in own if name not in renamed and replayed.left_alone(name, "missing")]
    return replayed


def describe_code(module: nn.Module) -> str:
    """A module's own load code, in words."""
    return f"{type(module).__name__}" + ("._load_from_state_dict" if _own_override(module)
                                         else "'s load_state_dict pre-hook")


def _own_tensor_names(module: nn.Module) -> list[str]:
    """The names of a module's own parameters and persistent buffers, as its ``state_dict`` holds them."""
    persistent = [name for name, buffer in module._buffers.items()
                  if buffer is not None and name not in module._non_persistent_buffers_set]
    return [name for name, param in module._parameters.items() if param is not None] + persistent


_MAX_ROUNDS = 16  # values asked for, one round each: a version, then what the version says to read


def _run_with_values(module: nn.Module, state: "_Journaled", prefix: str, stand_ins: dict[int, str],
                     sources: dict[str, TensorInfo], model_names: set[str], fetch: Optional[Fetch]
                     ) -> tuple[Any, dict[str, torch.Tensor]]:
    """Run a module's load code on the stand-ins; where it fails, read the values of the checkpoint entries
    it looked up that are no tensor of the model, put them in the stand-ins' place, and run it again.

    Returns the code's outcome (its missing and unexpected names, and whether it changed its module), or,
    where it still fails, what it raised; and the values read for it, by name.
    """
    values: dict[str, torch.Tensor] = {}
    raised = ""
    for _ in range(_MAX_ROUNDS):
        mark = state.mark()
        state.seen = {}
        try:
            return _run_load_code(module, state, prefix), values
        except Exception as error:  # noqa: BLE001 - any failure means: it needs values, not names
            state.undo_to(mark)
            raised = f"{type(module).__name__}, which raised {described(error)}"
        wanted = {key: stand_ins[id(value)] for key, value in state.seen.items()
                  if key not in model_names and isinstance(value, torch.Tensor) and value.is_meta
                  and id(value) in stand_ins and key in state}
        if fetch is None or not wanted:
            break
        got = {key: fetch(sources[origin]) for key, origin in wanted.items()}
        if any(value is None for value in got.values()):
            break
        for key, value in got.items():
            stand_ins[id(value)] = wanted[key]
            values[key] = value
            state.put(key, value)
    return raised, values


def post_hooked(modules: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """The modules (of a model's, in ``load_state_dict``'s order) with load post-hooks from outside
    torch, each after its children, as ``load_state_dict`` calls them."""
    ordered: list[nn.Module] = []
    open_: list[tuple[str, nn.Module]] = []  # hooked ancestors of the module at hand, outermost first
    hooked = [(prefix, module) for prefix, module in modules if module._load_state_dict_post_hooks]  # few have any
    for prefix, module in hooked:
        if not own_hooks(module._load_state_dict_post_hooks):
            continue
        while open_ and not _within(prefix, open_[-1][0]):
            ordered.append(open_.pop()[1])
        open_.append((prefix, module))
    ordered.extend(module for _, module in reversed(open_))
    return ordered


def _within(prefix: str, ancestor: str) -> bool:
    return ancestor == "" or prefix.startswith(ancestor + ".")


def run_post_hooks(hooked: list[nn.Module], missing: list[str], unexpected: list[str]) -> None:
    """Call the post-hooks from outside torch of the modules :func:`post_hooked` found, once the load
    is done, with what it missed, as ``load_state_dict`` calls them.

    Such code finishes a load (ties tensors again, recomputes what it derives from
    the loaded ones); torch's own (FSDP2's) is what the loader does its own way.
    """
    incompatible = IncompatibleKeys(missing, unexpected)
    for module in hooked:
        for hook in list(own_hooks(module._load_state_dict_post_hooks).values()):
            hook(module, incompatible)


_PARAMETRIZED_WEIGHT_NORM = re.compile(r"^(?P<owner>(?:.+\.)?)parametrizations\.(?P<name>[^.]+)\.original(?P<part>[01])$")


def as_older_weight_norm(sources: dict[str, TensorInfo], model_names: set[str]) -> dict[str, TensorInfo]:
    """A newer weight-norm save (``parametrizations.weight.original0/1``) under an older model's names.

    torch's weight norm parametrization takes an older save's ``weight_g`` and
    ``weight_v`` (its hook, run above); a model still built with the older
    ``torch.nn.utils.weight_norm`` gets no such help from torch for a newer
    save, though the two hold the same tensors: magnitude and direction.
    Those names are mapped back here, as transformers maps them.
    """
    renamed = {}
    for name in sources:
        found = _PARAMETRIZED_WEIGHT_NORM.match(name) if name not in model_names else None
        if found is not None:
            older = f"{found['owner']}{found['name']}_{'gv'[int(found['part'])]}"
            if older in model_names and older not in sources:
                renamed[name] = older
    return {renamed.get(name, name): info for name, info in sources.items()} if renamed else sources


def _has_own_load_code(module: nn.Module) -> bool:
    if not module._load_state_dict_pre_hooks and not _own_override(module):
        return False
    if any(is_lazy(tensor) for tensor in [*module._parameters.values(), *module._buffers.values()]):
        return False  # not sized yet: torch's lazy hook sizes it, and the loader does that its own way
    return bool(own_hooks(module._load_state_dict_pre_hooks)) or _own_override(module)


def own_hooks(hooks: dict[Any, Any]) -> dict[Any, Any]:
    """The hooks (a module's pre- or post-hooks) whose code comes from outside torch."""
    return {key: hook for key, hook in hooks.items() if not _torch_internal(_origin(hook))}


_FUNCTION = type(own_hooks)


def _own_override(module: nn.Module) -> bool:
    return _class_code(type(module))[0]


def _class_code(cls: type) -> tuple[bool, bool]:
    """Whether ``cls`` has, from outside torch, its own ``_load_from_state_dict`` and its own
    ``load_state_dict``; asked per module, answered once per class."""
    known = _CLASS_CODE.get(cls)
    if known is None:
        known = tuple(_defined_outside_torch(cls, method) for method in ("_load_from_state_dict", "load_state_dict"))
        _CLASS_CODE[cls] = known
    return known


# Weak: parametrizations give each module a class of its own, which a plain cache would keep alive.
_CLASS_CODE: "weakref.WeakKeyDictionary[type, tuple[bool, bool]]" = weakref.WeakKeyDictionary()


def _defined_outside_torch(cls: type, method: str) -> bool:
    owner = next(base for base in cls.__mro__ if method in vars(base))
    return owner is not nn.Module and not _torch_internal(owner.__module__)


def _run_load_code(module: nn.Module, state: dict, prefix: str) -> tuple[list[str], list[str], bool]:
    """What ``load_state_dict`` runs for one module, less torch's own hooks; the copies go to a twin on meta.

    Returns what the code called missing and unexpected (``strict``, as
    ``load_state_dict`` passes it), and whether it changed its module (set an
    attribute, replaced a tensor): what it did there is lost with the twin.
    """
    metadata = {"version": getattr(module, "_version", None)}
    missing: list[str] = []
    unexpected: list[str] = []
    if not _own_override(module):
        for hook in own_hooks(module._load_state_dict_pre_hooks).values():  # the copy at the end of torch's own code is all it adds
            hook(state, prefix, metadata, True, missing, unexpected, [])
        return missing, unexpected, False
    twin = object.__new__(type(module))
    attributes = dict(module.__dict__)
    for registry in ("_parameters", "_buffers"):
        attributes[registry] = {name: None if tensor is None else _on_meta(tensor)
                                for name, tensor in module.__dict__[registry].items()}
    attributes["_load_state_dict_pre_hooks"] = OrderedDict(own_hooks(module._load_state_dict_pre_hooks))
    twin.__dict__.update(attributes)
    before = _identities(twin)
    twin._load_from_state_dict(state, prefix, metadata, True, missing, unexpected, [])
    return missing, unexpected, _identities(twin) != before


def _identities(module: nn.Module) -> dict[Any, int]:
    """What a module holds, by identity: its attributes and the tensors of its registries."""
    held: dict[Any, int] = {key: id(value) for key, value in module.__dict__.items()}
    for registry in ("_parameters", "_buffers"):
        held.update(((registry, name), id(tensor)) for name, tensor in module.__dict__[registry].items())
    return held


def _overrides_load_state_dict(module: nn.Module) -> bool:
    """Whether the module's class has its own ``load_state_dict`` (fairseq's upgrades keys there): code
    that would load, so it cannot run here; named if the names then disagree."""
    return _class_code(type(module))[1]


@functools.lru_cache(maxsize=1024)
def _torch_internal(origin: str) -> bool:
    # Asked per hook, of a few modules' names: FSDP2 hooks every module that holds a parameter.
    return (origin == "torch" or origin.startswith("torch.")) and not origin.startswith("torch.nn.utils.")


def _origin(hook: Any) -> str:
    """The module a hook's code comes from (through torch's wrapper, partials and bound methods)."""
    if type(hook) is _FUNCTION and "hook" not in hook.__dict__:  # the usual hook (FSDP2's, one per module holding
        return hook.__module__ or "builtins"                        # a parameter): nothing to unwrap
    fn = getattr(hook, "hook", hook)
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__module__", None) or type(fn).__module__ or ""


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")


_ABSENT = object()


class _Journaled(OrderedDict):
    """A state dict that can take back what load code did to it (the code may fail halfway)."""

    def __init__(self, entries: Iterable[tuple[Any, Any]]) -> None:
        super().__init__(entries)
        self._journal: list[tuple[Any, Any]] = []
        self.seen: dict[Any, Any] = {}  # the names the code at hand looked up, with what it got

    def __getitem__(self, key: Any) -> Any:
        value = super().__getitem__(key)
        self.seen.setdefault(key, value)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        value = super().get(key, default)
        self.seen.setdefault(key, value)
        return value

    def put(self, key: Any, value: Any) -> None:
        """Set ``key`` for good: no undo takes it back (a value read in a stand-in's place)."""
        super().__setitem__(key, value)

    def mark(self) -> int:
        return len(self._journal)

    def undo_to(self, mark: int) -> None:
        while len(self._journal) > mark:
            key, before = self._journal.pop()
            if before is _ABSENT:
                super().pop(key, None)
            else:
                super().__setitem__(key, before)

    def _note(self, key: Any) -> None:
        if hasattr(self, "_journal"):  # OrderedDict's own __init__ may set items before ours runs
            self._journal.append((key, super().get(key, _ABSENT)))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._note(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._note(key)
        super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        if key in self:
            self._note(key)
            self.seen.setdefault(key, super().__getitem__(key))
        return super().pop(key, *default)

    def popitem(self, last: bool = True) -> tuple[Any, Any]:
        key = next(reversed(self)) if last else next(iter(self))
        self._note(key)
        return super().popitem(last)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self._note(key)
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def clear(self) -> None:
        for key in list(self):
            self._note(key)
        super().clear()
