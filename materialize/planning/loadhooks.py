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
``torch.nn.utils`` (weight norm, spectral norm) and ``torch.ao``'s observers, fake quantizers,
fused QAT modules and ``QFunctional`` (its scale and zero point, kept as numbers): torch's distributed
wrappers' hooks (FSDP, activation checkpointing), its lazy modules' and its
batch norms' are what the rest of the loader already does in its own way.
Each module's code gets the metadata the file saved for it, as
``load_state_dict`` hands it (a torch file's ``_metadata``: the version of
the module that saved it; none, ``{}``, for safetensors), so a conversion
of an older version's save runs where torch's would. Code that changes a
checkpoint tensor in place (``state_dict[key].mul_(3)``; writes into a
stand-in are seen by a dispatch mode, :class:`_Writes`), or writes into its
own module's tensors otherwise than torch's copy (``self.weight.mul_(2)``
after ``super()``), runs again once the load is done (below), given such a
tensor as the file holds it. Code that fails on stand-ins (it needs values:
``int(state_dict.pop(key))``) is given the values it asked for, of
checkpoint entries that are no tensor of the model (a saved version
number), read while planning within a small budget, and runs again. Code that needs values, or that uses what it reads
(sets its module's attributes from it, copies it into its own tensor as
torch's ``CustomState`` test does), runs again on the real module once the
load is done (:class:`LoadCodeRun`, see :mod:`materialize.planning.loadruns`),
as ``load_state_dict`` would have run it. Code that still fails leaves the
names as they were and is named if the load then finds them mismatched, as
is a class's own ``load_state_dict`` (it would load, so it is never called);
code that computes a new tensor from checkpoint values cannot run without
the values, and a load it would feed is refused, naming the code and the
tensors. Load
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
from torch.utils._python_dispatch import TorchDispatchMode

from ..checkpoint import TensorInfo
from ..checkpoint.base import is_extra_state
from ..errors import KeyMismatchError, described
from ..skeleton.meta import is_lazy
from .keymap import unchanged


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
    # The model's tensors the code writes into in place (``state_dict[key].mul_(3)``), by the name it finds
    # them under, with the checkpoint tensor each is: read again for it, as torch.load makes them.
    rewritten: dict[str, TensorInfo] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  # what load_state_dict hands it (local_metadata)

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
    classes: Optional[set[type]] = None, saved_metadata: Optional[dict[str, dict[str, Any]]] = None,
) -> Replayed:
    """Run the load code of a model's ``modules`` (each under each of its names, in the order
    ``load_state_dict`` visits them) over ``sources`` (model name -> checkpoint tensor).

    ``model_names`` are the names of the model's tensors; ``path`` names the
    checkpoint in errors. ``fetch`` reads the value of a checkpoint entry
    that code failing on stand-ins asked for (none: such code stays unrun).
    ``hooked`` is :func:`load_hooked` of ``modules`` and ``classes`` the set of their classes, where the
    caller has them (each module's registries are then read once for every use): where no class has load
    code of its own, only the hooked modules are asked, not every module again.
    ``saved_metadata`` is the checkpoint's ``_metadata`` (:attr:`Checkpoint.module_metadata`) by the model's
    module names (:func:`saved_module_metadata`): each module's code gets its entry, as
    ``load_state_dict`` hands it (none: ``{}``, as torch hands a state dict without one).
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
    by_module = saved_metadata
    reads: list[tuple[str, nn.Module, list[str], str]] = []
    runs: list[LoadCodeRun] = []
    verdicts: list[Verdict] = []
    made_by: dict[str, tuple[str, nn.Module, dict[str, Any]]] = {}  # a name -> the code that last set it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the code's notes on meta copies and old versions are not the user's
        for prefix, module in adapting:
            metadata = local_metadata(by_module, prefix)
            mark = state.mark()
            outcome, values = _run_with_values(module, state, f"{prefix}." if prefix else "", stand_ins, sources,
                                               model_names, fetch, metadata)
            read = list(state.seen)
            made_by.update((key, (prefix, module, metadata)) for key in state.set_since(mark))
            if isinstance(outcome, str):  # still raised: it needs values it was not given, or of the model's tensors
                unrun.append(f"{prefix or '<root>'} ({outcome})")
                reads.append((prefix, module, read, outcome))
                runs.append(LoadCodeRun(prefix, module, {}, metadata=metadata))  # on the loaded values, where names
                continue                                                        # agree without it
            missing, unexpected, changed, written = outcome
            if _own_override(module):
                verdicts.append(Verdict(prefix, module, frozenset(missing), frozenset(unexpected)))
            left_unused = [key for key in read if key in state and key not in model_names]
            rewritten = {key: sources[stand_ins[id(value)]] for key, value in _stand_ins_in(state, written)
                         if key in model_names and id(value) in stand_ins}
            if values or changed or left_unused or rewritten:  # it uses what it reads: it runs again on the module
                fed = {key: sources[stand_ins[id(value)]] for key, value in state.seen.items()
                       if key not in model_names and id(value) in stand_ins}
                runs.append(LoadCodeRun(prefix, module, fed, {key: value for key, value in state.seen.items()
                                                              if key in fed and not value.is_meta},
                                        rewritten=rewritten, metadata=metadata))
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
            f"the model's own load code{_whose(made_by.get(computed[0]))} puts tensors of its making under "
            f"{', '.join(computed[:5])}{' and more' if len(computed) > 5 else ''} (computed from checkpoint values), "
            "which a load reading tensors straight into the model cannot do; load the checkpoint once with torch's "
            "load_state_dict and save model.state_dict() again (a change in place, state_dict[key].mul_(...), is "
            "followed)",
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
        own = [f"{run.prefix}.{attr}" if run.prefix else attr for attr in own_tensor_names(run.module)]
        run.fills = [name for name in own if name not in renamed and replayed.left_alone(name, "missing")]
    return replayed


def _whose(maker: Optional[tuple[str, nn.Module, dict[str, Any]]]) -> str:
    """``, Class._load_from_state_dict of 'prefix', handed a version-1 save of a version-2 module,``: the code
    that made a tensor, and the version it was handed where it is not its module's own."""
    if maker is None:
        return ""
    prefix, module, metadata = maker
    saved, current = metadata.get("version"), getattr(module, "_version", None)
    version = (f", handed a version-{saved} save of a version-{current} module" if "version" in metadata
               and saved != current else "")
    return f", {describe_code(module)} of '{prefix or '<root>'}'{version},"


def saved_module_metadata(saved: Optional[dict[str, dict[str, Any]]], rename: Callable[[str], object]
                          ) -> Optional[dict[str, dict[str, Any]]]:
    """A checkpoint's ``_metadata`` by the model's module names: each saved module's name renamed as the
    names of its tensors are (a ``module.`` prefix stripped with theirs, as torch's
    ``consume_prefix_in_state_dict_if_present`` strips it from both; the wrapper's own entry then gives way
    to the model's). A name the rename does not map to a module name is left out."""
    if saved is None or rename is unchanged:
        return saved
    kept: dict[str, dict[str, Any]] = {}
    moved: dict[str, dict[str, Any]] = {}
    for name, entry in saved.items():
        probe = f"{name}.{_PROBE}" if name else _PROBE
        try:
            target = rename(probe)
        except Exception:  # noqa: BLE001 - a rename of tensor names may refuse a name of no tensor
            continue
        if isinstance(target, str) and target.endswith(_PROBE):
            module_name = target[:-len(_PROBE)].removesuffix(".")
            (kept if target == probe else moved)[module_name] = entry
    return {**kept, **moved}


_PROBE = "\x00module"  # the name of no tensor: what a rename makes of a module's name before it


def local_metadata(by_module: Optional[dict[str, dict[str, Any]]], prefix: str) -> dict[str, Any]:
    """What ``load_state_dict`` hands the load code of the module named ``prefix`` (a copy: torch adds to it)."""
    return dict(by_module.get(prefix, {})) if by_module is not None else {}


def describe_code(module: nn.Module) -> str:
    """A module's own load code, in words."""
    return f"{type(module).__name__}" + ("._load_from_state_dict" if _own_override(module)
                                         else "'s load_state_dict pre-hook")


def own_tensor_names(module: nn.Module) -> list[str]:
    """The names of a module's own parameters and persistent buffers, as its ``state_dict`` holds them."""
    persistent = [name for name, buffer in module._buffers.items()
                  if buffer is not None and name not in module._non_persistent_buffers_set]
    return [name for name, param in module._parameters.items() if param is not None] + persistent


_MAX_ROUNDS = 16  # values asked for, one round each: a version, then what the version says to read


def _run_with_values(module: nn.Module, state: "_Journaled", prefix: str, stand_ins: dict[int, str],
                     sources: dict[str, TensorInfo], model_names: set[str], fetch: Optional[Fetch],
                     metadata: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """Run a module's load code on the stand-ins; where it fails, read the values of the checkpoint entries
    it looked up that are no tensor of the model, put them in the stand-ins' place, and run it again.

    Returns the code's outcome (its missing and unexpected names, whether it changed its module, and the
    storages it wrote into), or, where it still fails, what it raised; and the values read for it, by name.
    """
    values: dict[str, torch.Tensor] = {}
    raised = ""
    for _ in range(_MAX_ROUNDS):
        mark = state.mark()
        state.seen = {}
        try:
            return _run_load_code(module, state, prefix, metadata), values
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


def _run_load_code(module: nn.Module, state: "_Journaled", prefix: str, metadata: dict[str, Any]
                   ) -> tuple[list[str], list[str], bool, set[int]]:
    """What ``load_state_dict`` runs for one module, less torch's own hooks; the copies go to a twin on meta.

    Returns what the code called missing and unexpected (``strict``, as
    ``load_state_dict`` passes it), whether it changed its module (set an
    attribute, replaced a tensor, wrote into one otherwise than torch's copy
    of its entry: ``self.weight.mul_(2)`` after ``super()``): what it did
    there is lost with the twin; and the storages it wrote into in place (a
    stand-in's: ``state_dict[key].mul_(3)``).
    """
    missing: list[str] = []
    unexpected: list[str] = []
    if not _own_override(module):
        with _Writes(state, prefix, {}) as writes:
            for hook in own_hooks(module._load_state_dict_pre_hooks).values():  # the copy at the end of torch's own code is all it adds
                hook(state, prefix, dict(metadata), True, missing, unexpected, [])
        return missing, unexpected, False, writes.storages
    twin = object.__new__(type(module))
    attributes = dict(module.__dict__)
    for registry in ("_parameters", "_buffers"):
        attributes[registry] = {name: None if tensor is None else _on_meta(tensor)
                                for name, tensor in module.__dict__[registry].items()}
    attributes["_load_state_dict_pre_hooks"] = OrderedDict(own_hooks(module._load_state_dict_pre_hooks))
    twin.__dict__.update(attributes)
    before = _identities(twin)
    own = {tensor.untyped_storage()._cdata: name for registry in ("_parameters", "_buffers")
           for name, tensor in attributes[registry].items() if tensor is not None}
    with _Writes(state, prefix, own) as writes:
        twin._load_from_state_dict(state, prefix, dict(metadata), True, missing, unexpected, [])
    own_written = not writes.storages.isdisjoint(own)
    return missing, unexpected, own_written or _identities(twin) != before, writes.storages - own.keys()


class _Writes(TorchDispatchMode):
    """The storages the code run in its block writes into (in place, ``out=``), but for torch's own copy of a
    module's entry into its tensor (``param.copy_(state_dict[prefix + name])``, the stand-in under that name)."""

    def __init__(self, state: "_Journaled", prefix: str, own: dict[int, str]) -> None:
        super().__init__()
        self.state, self.prefix, self.own = state, prefix, own
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is _COPY and len(args) > 1 and self._entry_copied(args[0], args[1]):
            return func(*args, **kwargs)
        schema = getattr(func, "_schema", None)  # (an operator without one writes nothing of the code's)
        for index, argument in enumerate(schema.arguments if schema is not None else ()):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[index] if index < len(args) else kwargs.get(argument.name)
                for tensor in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(tensor, torch.Tensor):
                        self.storages.add(tensor.untyped_storage()._cdata)
        return func(*args, **kwargs)

    def _entry_copied(self, into: Any, source: Any) -> bool:
        name = self.own.get(into.untyped_storage()._cdata) if isinstance(into, torch.Tensor) else None
        return name is not None and OrderedDict.get(self.state, self.prefix + name) is source


_COPY = torch.ops.aten.copy_.default


def _stand_ins_in(state: "_Journaled", storages: set[int]) -> list[tuple[str, torch.Tensor]]:
    """The entries of the state dict whose value is a meta tensor (a stand-in) of one of ``storages``: a pass
    over the state dict only where the code wrote into some storage, which it seldom does."""
    if not storages:
        return []
    return [(key, value) for key, value in OrderedDict.items(state)
            if isinstance(value, torch.Tensor) and value.is_meta and value.untyped_storage()._cdata in storages]


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
    return ((origin == "torch" or origin.startswith("torch.")) and not origin.startswith("torch.nn.utils.")
            and not origin.startswith(_TORCH_AO_RUN))


# torch.ao's load code that converts what it reads as load_state_dict runs it: observers' and fake quantizers'
# (an older save's eps, their shapes), QFunctional's scale and zero point (kept as numbers), fused QAT modules'.
# The rest of torch.ao's is what the loader does its own way (reference modules' qparams) or reads what it
# refuses (packed quantized weights): left unrun, as before.
_TORCH_AO_RUN = ("torch.ao.quantization.", "torch.ao.nn.quantized.modules.functional_modules",
                 "torch.ao.nn.intrinsic.qat.")


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

    def set_since(self, mark: int) -> list[Any]:
        """The keys set or removed since ``mark``."""
        return [key for key, _ in self._journal[mark:]]

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
