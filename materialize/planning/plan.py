"""What a load will do, decided before any tensor byte is read.

Pure bookkeeping: model names are matched to checkpoint names, tied tensors
are grouped, every tensor gets an action (load, init or keep), a dtype and a
device, and every error a load would hit with names and shapes is raised
here first.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Optional, Union

import torch
from torch import nn

from ..checkpoint import Checkpoint, TensorInfo
from ..checkpoint.base import EXTRA_STATE
from ..dtypes import dtype_name
from ..options import DtypeRule, InitFn, PlanOptions, Tolerated
from ..errors import (
    DeviceError,
    InitError,
    KeyMismatchError,
    MaterializeError,
    MaterializeWarning,
    MostlyInitializedWarning,
    NothingLoadedError,
    ShapeMismatchError,
    ShardingError,
    summarize_names,
)
from .keymap import KeyMap, KeyMapLike, as_key_map, auto_strip_wrapper_prefix, unchanged
from .savedstate import refuse_unreadable
from .loadhooks import (Fetch, LoadCodeRun, Replayed, as_older_weight_norm, post_hooked,
                        replay_load_hooks, saved_module_metadata)
from ..skeleton.meta import is_lazy
from ..skeleton.modtree import named_modules
from ..skeleton.plainattrs import PlainTensor, plain_meta_tensors
from .adapterhints import adapter_words, is_adapter_name
from .namehints import mismatch_hint, nearest_names
from .shapehints import body_words, classifier_hint, classifier_modules, head_sizes, inside, missing_body_words
from ..text import printable
from ..integrations.sharded import ShardSpec, is_dtensor, refuse_unreadable_placements, shard_region, shard_spec
from ..checkpoint.pieces import Stacked, pieces_of
from ..checkpoint.targets import Chunks, Rearranged, StackSlot, Transposed
from .stacking import cut, deinterleave, rows_of, stack, transpose

# "code": the model's own load code makes the tensor from checkpoint values (torch's CustomState), once loaded.
Action = Literal["load", "init", "keep", "code"]


class Owner(NamedTuple):
    """One place a tensor is registered: ``module.<attr>`` (a tuple: a load makes one per tensor)."""

    module: nn.Module
    attr: str
    is_parameter: bool
    persistent: bool


@dataclass(slots=True)  # slots: a load of a hundred thousand tensors makes (and frees) one each
class Entry:
    """One unique tensor (a tie group counts once) and what to do with it."""

    names: tuple[str, ...]
    owners: Sequence[Owner]  # a tuple for an untied tensor
    original: torch.Tensor
    action: Action
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    source: Optional[TensorInfo] = None  # for a sharded tensor, this rank's part of the checkpoint tensor
    on_disk: bool = False  # left in the checkpoint file, mapped copy-on-write
    shard: Optional[ShardSpec] = None  # a DTensor: this rank's box of it (see materialize.integrations.sharded)
    split_from_tie: bool = False  # names of a tied tensor read from a checkpoint tensor of their own (see _tie_units)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the memory this process allocates: this rank's shard of a DTensor, else the tensor's."""
        return self.shard.local_shape if self.shard is not None else self.shape

    def stays_in_file(self, mmap: bool) -> bool:
        """Whether a load leaves this tensor as a view of the file instead of copying it."""
        if not (self.on_disk or (mmap and self.device.type == "cpu")):  # first: most loads map nothing
            return False
        return (self.action == "load" and self.source is not None and self.shard is None
                and self.source.dtype == self.dtype and self.source.mappable)

    @property
    def nbytes(self) -> int:
        # local_shape's choice inline: summed over every entry of a plan (its host peak, its bytes by device)
        return math.prod(self.shape if self.shard is None else self.shard.local_shape) * self.dtype.itemsize

    def held(self) -> torch.Tensor:
        """The tensor the modules hold now: an init may have replaced the one allocated."""
        owner = self.owners[0]
        return (owner.module._parameters if owner.is_parameter else owner.module._buffers)[owner.attr]

    def put(self, tensor: torch.Tensor) -> None:
        """Register ``tensor`` under every name of this entry, recording nothing (a fresh parameter's undo
        record is the entry itself: each name held its ``original``)."""
        for owner in self.owners:
            (owner.module._parameters if owner.is_parameter else owner.module._buffers)[owner.attr] = tensor

    def hold(self, tensor: torch.Tensor, undo: list) -> None:
        """Register ``tensor`` under every name of this entry; what each held before goes on ``undo``."""
        for owner in self.owners:
            registry = owner.module._parameters if owner.is_parameter else owner.module._buffers
            undo.append((owner.module, owner.attr, owner.is_parameter, registry[owner.attr]))
            registry[owner.attr] = tensor


@dataclass
class Plan:
    """What a load would do, decided before any tensor byte is read: what :func:`plan` returns, and what
    :func:`load` carries out. :meth:`to_dict` is its JSON form (``materialize plan --json``); most fields are
    the load's own bookkeeping, and the lists of names are the report's to be.

    Fields:
        path: the checkpoint's path.
        device: the device tensors go to, where no device map or mesh places them.
        entries: one per tensor of the model (a tie group counts once): its names, what the load does with
            it (``load``, ``init``, ``keep``, or ``code``: made by the model's own load code), its shape,
            dtype, device and checkpoint source.
        missing: the model's tensors the checkpoint lacks (``strict=False``).
        unexpected: the checkpoint's tensors the model lacks (``strict=False``).
        ignored: checkpoint tensors left unread: the model declares it does not load them, or the caller
            ignores them (``ignore_unexpected``).
        mismatched: ``(name, model shape, checkpoint shape)`` of each tensor whose shapes differ: an error,
            unless ``ignore_mismatched_sizes`` moves it to ``reinitialized``.
        init_modules: ``(name, module)`` of each module whose init makes a tensor the load does not read.
        fits: filled by :func:`plan`: per device (``"cpu"`` for the expected peak of host memory), the bytes
            ``needed``, the bytes ``available`` now (``None`` where unknown) and whether it ``fits``.
        tie_checks: entries (by index) of one tensor the model ties, each read from its own checkpoint
            tensor: tied again after the load where their values are equal.
        extra_states: ``"<module>._extra_state"`` -> (the module, its source): a plain value, or a
            checkpoint tensor to read.
        post_hooked: modules whose load post-hooks run once the load is done.
        strict_after_hooks: a strict load of a model with load post-hooks: missing and unexpected names are
            judged after the hooks ran, as ``load_state_dict`` judges them (a hook may forgive a name).
        built_on_meta: the model's parameters were on meta (built by :func:`meta_init`, or on meta): its
            real buffers follow them.
        reinitialized: checkpoint tensors of another shape than the model's (``ignore_mismatched_sizes``),
            left out and initialized by their module instead.
        key_map: how checkpoint names were renamed: the caller's ``key_map``, or the wrapper prefix stripped
            (or a base model's prefix added) automatically, in words; ``""`` for none.
        renamed_by_model: checkpoint name -> model name, for the renames the model's own load code makes.
        state_dict_key: the entry of a training checkpoint the model state is taken from.
        load_code_runs: the modules' own load code that takes checkpoint values, run once the tensors are in
            place.
        fed_to_load_code: the checkpoint entries that code reads that are no tensor of the model.
        mmap: planned for a load with ``mmap=True``: what can stay mapped from the files is not read.
        shard_specs: the DTensor layouts met while planning, each found once (mesh, placements, shapes ->
            this rank's boxes; see :func:`~materialize.integrations.sharded.shard_spec`); not in :meth:`to_dict`.
        rnn_modules: the model's RNNs, whose list of weights (``_flat_weights``) a load refreshes once it
            replaced them; not in :meth:`to_dict`.
        plain_on_meta: tensors the model's modules hold as plain attributes on meta (views of its
            parameters, remade over the real ones once the load is done: see
            :mod:`materialize.skeleton.plainattrs`); found only for a model built on meta; not in :meth:`to_dict`.
    """

    path: str
    device: torch.device
    entries: list[Entry]
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    init_modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    fits: dict[str, dict] = field(default_factory=dict)
    tie_checks: list[tuple[int, ...]] = field(default_factory=list)
    extra_states: dict[str, tuple[nn.Module, object]] = field(default_factory=dict)
    post_hooked: list[nn.Module] = field(default_factory=list)
    strict_after_hooks: bool = False
    built_on_meta: bool = False
    reinitialized: list[str] = field(default_factory=list)
    key_map: str = ""
    renamed_by_model: dict[str, str] = field(default_factory=dict)
    state_dict_key: Optional[str] = None
    load_code_runs: list[LoadCodeRun] = field(default_factory=list)
    fed_to_load_code: list[str] = field(default_factory=list)
    mmap: bool = False
    shard_specs: dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)
    rnn_modules: list[nn.Module] = field(default_factory=list, repr=False, compare=False)
    plain_on_meta: list[PlainTensor] = field(default_factory=list, repr=False, compare=False)

    def of(self, action: Action) -> list[Entry]:
        """The entries the load handles so: ``"load"``, ``"init"``, ``"keep"`` or ``"code"``."""
        return [e for e in self.entries if e.action == action]

    @property
    def tied_groups(self) -> list[tuple[str, ...]]:
        """The groups of names that share one tensor."""
        return [e.names for e in self.entries if len(e.names) > 1]

    @property
    def bytes_by_device(self) -> dict[str, int]:
        """The bytes the model's tensors take on each device (``"disk"``: left mapped in the file)."""
        by_device: dict[object, int] = {}  # by device object first: its name is made once a device, not a tensor
        for entry in self.entries:
            key = "disk" if entry.on_disk else entry.device
            by_device[key] = by_device.get(key, 0) + entry.nbytes
        totals: Counter[str] = Counter()
        for key, nbytes in by_device.items():
            totals[str(key)] += nbytes
        return dict(totals)

    @property
    def not_from_checkpoint(self) -> list[str]:
        """The model's tensors the checkpoint gives no value (each tie once, by its first name): those missing
        from it (initialized, or kept as a real model holds them) and those in it in another shape
        (reinitialized). Computed buffers, never saved, and tensors the model declares it may miss (a batch
        norm's count older saves lack, a transformers model's own list) are not counted: no checkpoint gives
        them. Set against the loaded tensors, it says whether a load is mostly initialized."""
        absent = set(self.missing) | set(self.reinitialized)
        return [entry.name for entry in self.entries
                if entry.action not in ("load", "code") and not absent.isdisjoint(entry.names)]

    @property
    def load_nbytes(self) -> int:
        """The file bytes behind every tensor to load, read or mapped."""
        return sum(e.source.read_nbytes for e in self.of("load") if e.source is not None)

    @property
    def read_bytes(self) -> int:
        """The file bytes the load reads into memory: those of the tensors it loads, less those it leaves mapped."""
        return sum(e.source.read_nbytes for e in self.of("load") if e.source is not None and not e.stays_in_file(self.mmap))

    @property
    def mapped_bytes(self) -> int:
        """The file bytes the load leaves mapped, read by the pages' first use (``mmap``, a device map's disk)."""
        return sum(e.source.nbytes for e in self.of("load") if e.source is not None and e.stays_in_file(self.mmap))

    def to_dict(self) -> dict:
        """The plan as JSON-ready values: what ``materialize plan --json`` prints."""
        return {
            "checkpoint": self.path,
            "into": "model",
            "state_dict_key": self.state_dict_key,
            "device": str(self.device),
            "tensors": {action: len(self.of(action)) for action in ("load", "init", "keep")},
            "bytes_by_device": self.bytes_by_device,
            "read_bytes": self.read_bytes,
            "mapped_bytes": self.mapped_bytes,
            "tied_groups": [list(group) for group in self.tied_groups],
            "ties_to_compare": [[list(self.entries[i].names) for i in check] for check in self.tie_checks],
            "missing": self.missing,
            "unexpected": self.unexpected,
            "ignored": self.ignored,
            "reinitialized": self.reinitialized,
            "not_from_checkpoint": self.not_from_checkpoint,
            "key_map": self.key_map,
            "mismatched": [
                {"name": n, "model_shape": list(m), "checkpoint_shape": list(c)} for n, m, c in self.mismatched
            ],
            "initialized_modules": [name or "<root>" for name, _ in self.init_modules],
            "extra_states": list(self.extra_states),
            "renamed_by_model": self.renamed_by_model,
            "fed_to_load_code": self.fed_to_load_code,
            "filled_by_load_code": [e.name for e in self.of("code")],
            "memory": self.fits,
            "dtypes": dict(Counter(dtype_name(e.dtype) for e in self.entries)),
        }


@dataclass
class TensorsPlan:
    """What a load of a checkpoint's tensors as a plain dict would do (:func:`~materialize.load_tensors`, and
    :func:`~materialize.plan` where there is no model to build).

    :meth:`to_dict` has the keys of :meth:`Plan.to_dict` (``"into"``:
    ``"dict"``), those about a model empty: every tensor is loaded, none is
    initialized, kept, tied, missing or renamed.

    Fields:
        path: the checkpoint's path.
        device: the device the tensors go to.
        tensors: how many tensors the checkpoint holds (each one loaded).
        bytes_by_device: the bytes placed on each device.
        read_bytes: the file bytes read into memory.
        mapped_bytes: the file bytes left mapped (``mmap``), read by the pages' first use.
        dtypes: how many tensors of each dtype the load makes (after ``dtype``'s cast).
        state_dict_key: the entry of a training checkpoint the tensors are taken from.
        mmap: planned for a load with ``mmap=True``.
        fits: as :attr:`Plan.fits`.
    """

    path: str
    device: torch.device
    tensors: int
    bytes_by_device: dict[str, int]
    read_bytes: int
    mapped_bytes: int
    dtypes: dict[str, int]
    state_dict_key: Optional[str] = None
    mmap: bool = False
    fits: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The plan as JSON-ready values, with :meth:`Plan.to_dict`'s keys: what ``materialize plan --json`` prints."""
        return {
            "checkpoint": self.path,
            "into": "dict",
            "state_dict_key": self.state_dict_key,
            "device": str(self.device),
            "tensors": {"load": self.tensors, "init": 0, "keep": 0},
            "bytes_by_device": self.bytes_by_device,
            "read_bytes": self.read_bytes,
            "mapped_bytes": self.mapped_bytes,
            "tied_groups": [],
            "ties_to_compare": [],
            "missing": [],
            "unexpected": [],
            "ignored": [],
            "reinitialized": [],
            "key_map": "",
            "mismatched": [],
            "initialized_modules": [],
            "extra_states": [],
            "renamed_by_model": {},
            "fed_to_load_code": [],
            "filled_by_load_code": [],
            "memory": self.fits,
            "dtypes": self.dtypes,
        }


# One unique tensor of the model: itself, its first name and owner, and, for a tensor registered under several
# names (tied), every (name, owner) pair, else None. One tuple for an untied tensor (nearly all): a load of a
# hundred thousand makes and frees one each.
Group = tuple[torch.Tensor, str, Owner, Optional[list[tuple[str, Owner]]]]


class _Walked(NamedTuple):
    """What planning gathers in its one pass over the model's modules."""

    groups: list[Group]
    hooked: list[tuple[str, nn.Module]]  # :func:`~materialize.planning.loadhooks.load_hooked` of the modules
    classes: set[type]


def _collect_groups(modules: list[tuple[str, nn.Module]]) -> _Walked:
    """Every unique tensor of the model (its ``modules``, each under each name) with all the names it is
    registered under; and, read while each module is at hand (a pass over the modules of a model of experts
    costs half a microsecond a tensor, its objects scattered in memory), the modules with load hooks and the
    modules' classes."""
    groups: dict[int, Group] = {}
    hooked: list[tuple[str, nn.Module]] = []
    classes: set[type] = set()
    add_class = classes.add
    shared = False
    make = tuple.__new__  # Owner(...) through its NamedTuple __new__ costs twice as much, a tensor each
    for prefix, module in modules:
        add_class(type(module))
        if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:  # loadhooks.load_hooked's test,
            hooked.append((prefix, module))  # inline: a call a module is what this pass saves
        dot = f"{prefix}." if prefix else ""
        for attr, param in module._parameters.items():
            if param is not None:
                group = groups.get(id(param))
                if group is None:
                    groups[id(param)] = (param, dot + attr, make(Owner, (module, attr, True, True)), None)
                else:
                    shared = True
                    groups[id(param)] = _joined(group, dot + attr, make(Owner, (module, attr, True, True)))
        if not module._buffers:
            continue
        non_persistent = module._non_persistent_buffers_set
        for attr, buffer in module._buffers.items():
            if buffer is not None:
                group = groups.get(id(buffer))
                owner = make(Owner, (module, attr, False, attr not in non_persistent))
                if group is None:
                    groups[id(buffer)] = (buffer, dot + attr, owner, None)
                else:
                    shared = True
                    groups[id(buffer)] = _joined(group, dot + attr, owner)
    if shared:  # a module registered in two places is walked twice: each name once, its first owner
        for key, group in groups.items():
            named = group[3]
            if named is not None:
                unique: dict[str, Owner] = {}
                for name, owner in named:
                    unique.setdefault(name, owner)
                named[:] = list(unique.items())
                if len(named) == 1:  # one name after all: untied
                    groups[key] = (group[0], group[1], group[2], None)
    return _Walked(list(groups.values()), hooked, classes)


def _joined(group: Group, name: str, owner: Owner) -> Group:
    """``group`` with one more name: the list of every (name, owner) made at the second."""
    tensor, first, first_owner, named = group
    if named is None:
        return (tensor, first, first_owner, [(first, first_owner), (name, owner)])
    named.append((name, owner))
    return group


def _map_checkpoint_names(ckpt: Checkpoint, rename: Callable[[str], object]) -> dict[str, TensorInfo]:
    """Model name -> its source: one checkpoint tensor, several stacked, or a run of one (see :mod:`materialize.planning.stacking`)."""
    if rename is unchanged:  # each name its own (most loads): no call and no question a tensor
        return dict(ckpt.items())
    mapped: dict[str, TensorInfo] = {}
    slots: dict[str, list[tuple[StackSlot, TensorInfo]]] = {}
    for ckpt_name in ckpt:
        try:
            model_name = rename(ckpt_name)
        except MaterializeError as error:
            error.path = error.path or str(ckpt.path)  # a key map knows names, not files
            raise
        if isinstance(model_name, StackSlot):
            slots.setdefault(model_name.target, []).extend(rows_of(model_name, ckpt[ckpt_name]))
            continue
        if isinstance(model_name, Chunks):
            parts = cut(ckpt[ckpt_name], model_name)
        elif isinstance(model_name, Transposed):
            parts = [(model_name.target, transpose(ckpt[ckpt_name], model_name))]
        elif isinstance(model_name, Rearranged):
            parts = [(model_name.target, deinterleave(ckpt[ckpt_name], model_name.how))]
        else:
            parts = [(model_name, ckpt[ckpt_name])]
        for target, info in parts:
            if target in mapped:
                raise KeyMismatchError(
                    f"checkpoint tensors '{mapped[target].name}' and '{info.name}' both map to model name "
                    f"'{target}'; fix the key_map",
                    path=ckpt.path,
                )
            mapped[target] = info
    for target, gathered in slots.items():
        if target in mapped:
            raise KeyMismatchError(
                f"checkpoint tensor '{mapped[target].name}' maps to model name '{target}', which '{gathered[0][1].name}' "
                "is stacked into too; fix the key_map",
                path=ckpt.path,
            )
        mapped[target] = stack(target, gathered)
    return mapped


# Modules that wrap one module and name it inside: activation checkpointing's wrapper, a torch.compile'd
# block, FSDP1. torch's own distributed state dicts drop them from names (torch.distributed.checkpoint's
# _get_fqns) and load_state_dict adds back the first; a model wrapped before it is loaded (torchtitan builds
# on meta, wraps blocks for activation checkpointing and compiles them, then loads) names its tensors with them.
WRAPPER_ATTRIBUTES = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def _through_wrappers(to_ckpt: dict[str, TensorInfo], model_names: set[str]) -> dict[str, TensorInfo]:
    """Sources whose names differ from a model name only by wrapper modules, under that model name.

    Either side may hold the wrappers: a wrapped model loading a plain
    checkpoint, or a checkpoint saved from wrapped blocks loading into a plain
    model. Names that match as they are, or that would match two model
    names, are left alone.
    """
    strays = [name for name in to_ckpt if name not in model_names]
    if not strays or not any(_has_wrapper(name) for name in [*strays, *model_names]):
        return to_ckpt
    by_bare: dict[str, list[str]] = {}
    for name in model_names:
        if name not in to_ckpt:
            by_bare.setdefault(_bare(name), []).append(name)
    renamed = {}
    for name in strays:
        found = by_bare.get(_bare(name), [])
        if len(found) == 1:
            renamed[name] = found[0]
            by_bare[_bare(name)] = []  # one source per model name
    return {renamed.get(name, name): info for name, info in to_ckpt.items()}


def _has_wrapper(name: str) -> bool:
    return any(part in WRAPPER_ATTRIBUTES for part in name.split("."))


def _bare(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_ATTRIBUTES)


def _refuse_wrappers(plan: Plan, ckpt: Checkpoint) -> None:
    """A tensor subclass that wraps others (its own ``__torch_dispatch__``: a quantized or a two-part tensor)
    holds no memory of its own to read into, and made on meta a view of plain memory as that class would lack
    what it wraps; ``load_state_dict`` copies into it through its own code. Refused, where it is to be made or
    loaded, with the way to load it with torch."""
    for entry in plan.entries:
        tensor = entry.original
        # The class first: a plain tensor's or parameter's answers at once, for a model of many.
        if type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ and \
                (tensor.is_meta or entry.action == "load") and not is_lazy(tensor) and not is_dtensor(tensor):
            raise InitError(f"is a {type(tensor).__name__}, a tensor subclass wrapping others (its own "
                            "__torch_dispatch__), which a load reading bytes into plain memory cannot make or fill. "
                            f"{torch_load_hint(ckpt.format)}", path=ckpt.path, tensor=entry.name)


def _follow_load_code(plan: Plan, replayed: Replayed, strays: list[tuple[str, TensorInfo]]) -> None:
    """What the model's own load code decides: names its override did not call missing or unexpected are
    not (it made the tensor, or consumed the entry), and code that uses what it reads runs again on the
    real module once the load is done, with the values it reads (see :mod:`materialize.planning.loadruns`)."""
    plan.load_code_runs = replayed.runs
    fed = {info.name for run in replayed.runs for info in run.fed.values()}
    loaded = {id(entry.source) for entry in plan.entries if entry.action == "load"} if fed else set()
    plan.fed_to_load_code = sorted({info.name for run in replayed.runs for info in run.fed.values()
                                    if id(info) not in loaded})  # the others the code moved into the model
    plan.ignored.extend(info.name for m, info in strays if replayed.left_alone(m, "unexpected") and info.name not in fed)
    plan.missing = [name for name in plan.missing if not replayed.left_alone(name, "missing")]
    fills = {name for run in replayed.runs for name in run.fills}
    for entry in plan.entries if fills else ():
        if entry.source is None and entry.action != "load" and set(entry.names) <= fills:
            entry.action = "code"


def _under(model_name: str, vacant: frozenset[str]) -> bool:
    """Whether ``model_name`` lies inside a submodule registered as ``None``: ``load_state_dict`` neither
    loads such a name nor calls it unexpected (its parent has the name among its modules), so it is left
    unread and listed as ignored."""
    if not vacant:
        return False
    parts = model_name.split(".")
    return any(".".join(parts[:end]) in vacant for end in range(1, len(parts)))


def _set_aside_tolerated(plan: Plan, strays: list[tuple[str, TensorInfo]], tolerated: Tolerated) -> None:
    if tolerated.missing is not None:
        plan.missing = [name for name in plan.missing if not tolerated.missing.search(name)]
    plan.unexpected = []
    for model_name, info in strays:
        (plan.ignored if tolerated.lets_go(model_name, info) else plan.unexpected).append(info.name)


def _float_dtype_of_loads(entries: list[Entry]) -> Optional[torch.dtype]:
    """The floating dtype holding most loaded bytes; initialized tensors follow it."""
    weights: Counter[torch.dtype] = Counter()
    for entry in entries:
        if entry.action == "load" and entry.dtype.is_floating_point:
            weights[entry.dtype] += entry.nbytes
    return weights.most_common(1)[0][0] if weights else None


def _float_dtypes_loaded_by_module(entries: list[Entry]) -> dict[int, torch.dtype]:
    """id(module) -> the float dtype of the first tensor loaded into it."""
    found: dict[int, torch.dtype] = {}
    for entry in entries:
        if entry.action == "load" and entry.dtype.is_floating_point:
            for owner in entry.owners:
                found.setdefault(id(owner.module), entry.dtype)
    return found


def make_plan(
    model: nn.Module,
    ckpt: Checkpoint,
    options: PlanOptions,
    *,
    placement: Optional[Callable[[str], Union[torch.device, str]]] = None,
    dtype_rule: Optional[DtypeRule] = None,
    tolerated: Optional[Tolerated] = None,
    fetch: Optional[Fetch] = None,
) -> Plan:
    """Match, group and place every tensor of ``model``; raise what a load would hit.

    ``options.ignore_mismatched_sizes`` (as ``from_pretrained``'s): a checkpoint
    tensor whose shape differs from the model's (a classifier for another
    number of classes) is not loaded; the model's tensor is initialized by
    its module instead (a real model keeps its own values), and named in
    ``plan.reinitialized`` and the report, never silently.

    ``placement`` maps a tensor name to its device or ``"disk"`` (see
    :mod:`materialize.integrations.devicemap`); without one everything goes to ``options.device``.
    ``dtype_rule`` has the last word on each floating tensor's dtype
    (transformers models keep some tensors in fp32: :func:`~materialize.integrations.hf.hf_dtype_rule`).
    ``tolerated`` names differences the model expects, neither missing nor
    unexpected (see :func:`~materialize.integrations.hf.hf_tolerated`): such missing
    tensors are initialized, such unexpected ones listed as ignored (and,
    with ``computed_buffers_stand``, so are checkpoint values of buffers the
    model computes). Without it, a non-persistent buffer the checkpoint holds
    is loaded: a plain model's checkpoint is taken to know best.

    ``fetch`` reads the few values the model's own load code needs to decide
    what it does with names (a saved version number); without it such code
    stays unrun (see :mod:`materialize.planning.loadhooks`).
    """
    device, dtype, strict, key_map, init = options.device, options.dtype, options.strict, options.key_map, options.init
    ignore_mismatched_sizes = options.ignore_mismatched_sizes
    vacant_slots: list[str] = []
    modules = named_modules(model, remove_duplicate=False, vacant=vacant_slots)
    groups, hooked, classes = _collect_groups(modules)
    model_names = {group[1] for group in groups}
    model_names.update(name for group in groups if group[3] is not None for name, _ in group[3])
    if isinstance(key_map, KeyMap):
        idle = key_map.unmatched(ckpt)
        if idle:  # a typo, or a prefix the checkpoint does not have: a rename that renames nothing is not silent
            raise KeyMismatchError(f"key_map rule {idle[0]} matches no checkpoint name "
                                   f"(they read like {summarize_names(list(ckpt)[:3])})", path=ckpt.path)
    rename = as_key_map(key_map) if key_map is not None else auto_strip_wrapper_prefix(ckpt, model_names)
    to_ckpt = _through_wrappers(_map_checkpoint_names(ckpt, rename), model_names)
    replayed = replay_load_hooks(modules, to_ckpt, model_names, ckpt.path, fetch=fetch, hooked=hooked, classes=classes,
                                 saved_metadata=saved_module_metadata(ckpt.module_metadata, rename))
    to_ckpt = as_older_weight_norm(replayed.sources, model_names)
    # (code that ran may have hooked modules anew: then every module is asked again)
    after_load = post_hooked(modules if replayed.ran_code else hooked)

    plan = Plan(path=str(ckpt.path), device=device, entries=[], state_dict_key=ckpt.state_dict_key, post_hooked=after_load,
                key_map=rename.describe() if isinstance(rename, KeyMap) else "",
                renamed_by_model=replayed.renamed,
                built_on_meta=any(tensor.is_meta for tensor, _, owner, _ in groups if owner.is_parameter))
    plan.rnn_modules = list({id(module): module for _, module in modules if isinstance(module, nn.RNNBase)}.values()
                            ) if any(issubclass(cls, nn.RNNBase) for cls in classes) else []
    plan.plain_on_meta = plain_meta_tensors(modules) if plan.built_on_meta else []
    refuse_unreadable_placements(((name, tensor) for tensor, name, _, _ in groups), ckpt.path)  # all, not the first
    reinitialized_shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    entries = plan.entries
    entry_of = _entry_maker(plan, ckpt, device, dtype, placement, tolerated)
    for tensor, name, owner, named in groups:
        if named is None:  # an untied tensor (nearly all of them): one unit, made without the loop's tuples
            info = to_ckpt.get(name)
            if info is None or not ignore_mismatched_sizes:
                entries.append(entry_of(tensor, (name,), (owner,), info))
                continue
            units = [((name,), (owner,), info)]
        else:
            units = _tie_units(named, to_ckpt)
        if len(units) > 1:
            plan.tie_checks.append(tuple(len(entries) + i for i in range(len(units))))
        for index, (names, owners, info) in enumerate(units):
            reinit = (info is not None and ignore_mismatched_sizes and not is_lazy(tensor)
                      and info.shape != tuple(tensor.shape))
            entry = entry_of(tensor, names, owners, None if reinit else info)
            if reinit:  # not missing: the checkpoint holds it, in another shape
                plan.reinitialized.extend(names)
                reinitialized_shapes.append((names[0], tuple(tensor.shape), info.shape))
                plan.missing[:] = [name for name in plan.missing if name not in names]
            entry.split_from_tie = index > 0
            entries.append(entry)

    extra_state_owners = _extra_state_owners(modules, classes)
    saved_tensors = {name: to_ckpt.pop(name) for name in extra_state_owners if name in to_ckpt}
    strays = [(m, piece.info) for m, source in to_ckpt.items() if m not in model_names for piece in pieces_of(source)]
    vacant = frozenset(vacant_slots)
    plan.ignored.extend(info.name for m, info in strays if _under(m, vacant))
    strays = [(m, info) for m, info in strays if not _under(m, vacant)]
    _follow_load_code(plan, replayed, strays)
    strays = [(m, info) for m, info in strays if not replayed.left_alone(m, "unexpected")]
    plan.unexpected = [info.name for _, info in strays]
    plan.ignored.extend(piece.info.name for info in replayed.dropped for piece in pieces_of(info))
    if tolerated is not None:
        _set_aside_tolerated(plan, strays, tolerated)
    _match_extra_states(plan, extra_state_owners, saved_tensors, ckpt, rename, strict, tolerated, vacant)
    _refuse_load_code_needing_values(plan, ckpt, replayed.needs_values)
    _refuse_wrappers(plan, ckpt)
    plan.strict_after_hooks = strict and bool(plan.post_hooked)
    raise_for_mismatch(plan, ckpt.path, strict and not plan.strict_after_hooks, replayed.unrun, model, key_map)
    refuse_loading_nothing(plan, reinitialized_shapes, key_map)
    _raise_for_unmappable_disk(plan, ckpt)

    initialized = plan.of("init")
    # Both only for what is initialized: a load of every tensor skips two passes over them.
    follow = (dtype or _float_dtype_of_loads(plan.entries)) if initialized else None
    loaded_beside = _float_dtypes_loaded_by_module(plan.entries) if dtype is None and initialized else {}
    for entry in initialized:
        # Computed buffers (never saved, like a rotary inv_freq) keep the dtype their module gives them.
        computed = not any(owner.persistent for owner in entry.owners)
        if follow is not None and entry.dtype.is_floating_point and not computed:
            # A bias the checkpoint lacks takes the dtype its module's weight was loaded in; the
            # checkpoint's dominant one only where its module loaded nothing.
            entry.dtype = loaded_beside.get(id(entry.owners[0].module), follow)
    if dtype_rule is not None:
        for entry in plan.entries:
            if entry.action != "keep" and entry.dtype.is_floating_point:
                entry.dtype = dtype_rule(entry.name, entry.dtype)
    plan.init_modules = _init_modules(model, plan, init, ckpt)
    warn_if_mostly_not_loaded(plan)
    return plan


def _extra_state_owners(modules: list[tuple[str, nn.Module]], classes: set[type]) -> dict[str, nn.Module]:
    """``<module>._extra_state`` -> the module, for each module that keeps state beside its tensors
    (overrides ``get_extra_state``, as torch's ``state_dict`` asks); ``classes``: the modules' classes."""
    if all(cls.get_extra_state is nn.Module.get_extra_state for cls in classes):
        return {}
    return {f"{prefix}.{EXTRA_STATE}" if prefix else EXTRA_STATE: module
            for prefix, module in modules
            if type(module).get_extra_state is not nn.Module.get_extra_state}


def _match_extra_states(plan: Plan, owners: dict[str, nn.Module], saved_tensors: dict[str, TensorInfo],
                        ckpt: Checkpoint, rename: Callable[[str], object], strict: bool,
                        tolerated: Optional[Tolerated], vacant: frozenset[str] = frozenset()) -> None:
    """Pair each module's saved extra state with the module, as ``load_state_dict`` hands it to
    ``set_extra_state``: a checkpoint tensor (TransformerEngine saves its FP8 metadata so) or a torch
    file's plain value. One missing is missing (when strict), a value without its module unexpected."""
    saved: dict[str, tuple[str, object]] = {}
    for name, value in ckpt.extra_states.items():
        target = rename(name)
        saved[target if isinstance(target, str) else name] = (name, value)
    for name, module in owners.items():
        if name in saved_tensors:
            plan.extra_states[name] = (module, saved_tensors[name])
        elif name in saved:
            plan.extra_states[name] = (module, saved.pop(name)[1])
            refuse_unreadable(plan.extra_states[name][1], name, module, plan.path)
        elif strict:
            plan.missing.append(name)
    for target, (name, _) in saved.items():
        let_go = _under(target, vacant) or (tolerated is not None and tolerated.lets_name_go(name))
        (plan.ignored if let_go else plan.unexpected).append(name)


def _tie_units(named: list[tuple[str, Owner]], to_ckpt: dict[str, TensorInfo]
               ) -> list[tuple[tuple[str, ...], list[Owner], Optional[TensorInfo]]]:
    """A tied tensor's names, split by the checkpoint tensor each is read from where the checkpoint holds several.

    A torch file saves a tied tensor once under every name (one storage): one
    source, one tensor. Two different tensors for names the model ties (a
    config saying ``tie_word_embeddings`` over a checkpoint with its own
    ``lm_head``) stay tied only if their values are equal, as
    ``from_pretrained`` decides: the first is loaded, the others compared
    with it (see :mod:`materialize.planning.ties`). Names the
    checkpoint lacks go with the first source.
    """
    by_source: dict[object, tuple[list[str], list[Owner], TensorInfo]] = {}
    unsourced: list[tuple[str, Owner]] = []
    for name, owner in named:
        info = to_ckpt.get(name)
        if info is None:
            unsourced.append((name, owner))
            continue
        key = _bytes_key(info)
        names, owners, _ = by_source.setdefault(key, ([], [], info))
        names.append(name)
        owners.append(owner)
    if len(by_source) <= 1:
        info = next(iter(by_source.values()))[2] if by_source else None
        return [(tuple(name for name, _ in named), [owner for _, owner in named], info)]
    units = [(names, owners, info) for names, owners, info in by_source.values()]
    units[0][0].extend(name for name, _ in unsourced)
    units[0][1].extend(owner for _, owner in unsourced)
    return [(tuple(names), owners, info) for names, owners, info in units]


def _bytes_key(info: TensorInfo) -> object:
    """What identifies the bytes a source reads: a tensor saved under two names is one source."""
    if isinstance(info, Stacked):  # a DCP save's chunks (written once for tied names), experts stacked
        return (info.shape, info.dtype_name, tuple((_bytes_key(p.info), p.start, p.box) for p in info.pieces))
    if type(info) is not TensorInfo:
        return id(info)
    return (info.path, info.offset, info.shape, info.dtype_name, info.stride, info.view_shape)


EntryOf = Callable[[torch.Tensor, tuple[str, ...], Sequence[Owner], Optional[TensorInfo]], Entry]


def _entry_maker(
    plan: Plan, ckpt: Checkpoint, device: torch.device, dtype: Optional[torch.dtype],
    placement: Optional[Callable[[str], Union[torch.device, str]]], tolerated: Optional[Tolerated],
) -> EntryOf:
    """The function that makes each unit's :class:`Entry` (a tensor, its names and owners, its source) for ``plan``.

    What is the same for every tensor of a plan is bound once: a closure reads those names as fast as its
    arguments, and a plan of a hundred thousand tensors passes four per call, not ten.
    """

    def entry_of(tensor: torch.Tensor, names: tuple[str, ...], owners: Sequence[Owner],
                 info: Optional[TensorInfo]) -> Entry:
        spec = shard_spec(tensor, names[0], ckpt.path, plan.shard_specs)
        if info is not None and tolerated is not None and tolerated.computed_buffers_stand and \
                not any(owner.persistent for owner in owners):
            plan.ignored.extend(piece.info.name for piece in pieces_of(info))
            info = None
        if spec is not None and placement is not None:
            raise ShardingError("is a DTensor, placed by its mesh: it cannot be placed by a device_map too",
                                path=ckpt.path, tensor=names[0])
        place = spec.device if spec is not None else placement(names[0]) if placement is not None else device
        on_disk = place is not device and place == "disk"  # (a device compared with a string costs, a tensor each)
        # A lazy module's tensor takes its shape from the checkpoint, as load_state_dict gives it one; without
        # a checkpoint tensor it stays uninitialized, for the module to size at its first forward.
        lazy = is_lazy(tensor)
        shape = (info.shape if info is not None else ()) if lazy else tuple(tensor.shape)
        if info is None:
            # Entry's fields in order, none by keyword: a keyword costs as much as the rest of the call
            entry = Entry(names, owners, tensor, "init" if tensor.device.type == "meta" else "keep", shape,
                          tensor.dtype, torch.device("cpu") if on_disk else place, None, on_disk, spec)
            if all(owner.persistent for owner in owners) and not _counter_older_saves_lack(owners):
                plan.missing.extend(names)  # every name of a tie, as load_state_dict lists them
        else:
            info_dtype = info.dtype
            floating = info_dtype.is_floating_point
            # Cast where asked (floating tensors only), else the checkpoint's dtype
            entry = Entry(names, owners, tensor, "load", shape, dtype if dtype is not None and floating else info_dtype,
                          torch.device("cpu") if on_disk else place, info, on_disk, spec)
            if info.shape != shape:
                plan.mismatched.append((names[0], shape, info.shape))
            elif spec is not None:
                entry.source = shard_region(info, spec)
            follows_checkpoint = tensor.is_meta or lazy or (plan.built_on_meta and not owners[0].is_parameter)
            if dtype is None and floating and tensor.dtype.is_floating_point and (
                    spec is not None or not follows_checkpoint):
                # A DTensor keeps the dtype it was sharded with: FSDP2 recorded it (its fp32 master
                # weights, which a mixed-precision policy casts from), and so did the model's author.
                # So does a real tensor, as load_state_dict keeps it: the model was made in that dtype.
                # Not a buffer meta_init kept real in a model built on meta: the model is one dtype
                # decision, and its parameters take the checkpoint's (batch-norm statistics beside bf16
                # weights would fail the forward pass).
                entry.dtype = tensor.dtype
        return entry

    return entry_of


def _counter_older_saves_lack(owners: Sequence[Owner]) -> bool:
    """A batch norm's ``num_batches_tracked``: checkpoints saved before torch 0.4.1 lack it (torchvision's
    classic weights among them), and torch's ``load_state_dict`` keeps the module's own count (0) rather
    than call it missing; so does a load here."""
    return all(owner.attr == "num_batches_tracked" and isinstance(owner.module, nn.modules.batchnorm._NormBase)
               for owner in owners)


def _refuse_load_code_needing_values(plan: Plan, ckpt: Checkpoint, needs_values: list[tuple[str, str, list[str]]]) -> None:
    """Refuse, strict or not, a load whose names disagree where a module's own load code needs values to agree.

    Code that still fails with the values planning reads for it (more than
    the budget for them, or values of the model's own tensors: ``.item()`` of
    a weight) may rename or consume what it reads: skipping what it would
    consume, or initializing what it would fill, gives another model than
    the user's, silently; so it is an error, naming the code. Where names
    agree without it, it runs on the loaded values once the load is done.
    """
    for prefix, what, read in needs_values:
        inside = f"{prefix}." if prefix else ""
        # Anything under the module may be the code's to take: it sees, and may rename, its children's names too.
        missing = [name for name in plan.missing if name.startswith(inside)]
        unexpected = [name for name in plan.unexpected if name.startswith(inside) or name in read]
        if not (missing or unexpected or read):
            continue
        names = summarize_names(unexpected + missing, limit=4)
        raise KeyMismatchError(
            f"the model's own load code, {what} of '{prefix or '<root>'}', decides from checkpoint values what it "
            f"does with {names or summarize_names(read, limit=4)}, which a load reading bytes straight into the "
            f"model cannot follow; skipping what it reads would load another model than yours. {torch_load_hint(ckpt.format)}",
            path=ckpt.path, missing=missing, unexpected=unexpected,
        )


def torch_load_hint(checkpoint_format: str) -> str:
    """How to load a checkpoint of this format with torch instead, in its words."""
    if checkpoint_format == "safetensors":
        state = "safetensors.torch.load_file(path)"
    elif checkpoint_format in ("torch", "torch-module"):
        state = "torch.load(path, weights_only=True)"
    else:  # sharded files, a DCP folder: torch's own readers of those
        return ("Load this checkpoint with torch instead: build the model on the CPU and call model.load_state_dict "
                "with the state dict its format's own reader makes (transformers' from_pretrained for a sharded "
                "folder, torch.distributed.checkpoint.load for a DCP save)")
    return f"Load this checkpoint with torch instead: build the model on the CPU and call model.load_state_dict({state})"


def raise_for_mismatch(plan: Plan, path: object, strict: bool, unrun: list[str], model: Optional[nn.Module] = None,
                       key_map: KeyMapLike = None) -> None:
    """Raise what a load of ``plan`` disagrees on: shapes always, missing and unexpected names when ``strict``.

    With ``model``, the error says what the differences point to (see
    :mod:`materialize.planning.shapehints`): a classifier sized for other
    classes gets the model argument that sizes it (and only then a new
    head); shapes that differ anywhere else, or tensors outside the
    classifier that the checkpoint lacks with no rename explaining them,
    another architecture (``error.architecture_differs``). Where no tensor
    of the model would be read, the options that would let the load go on
    reading nothing are not offered: the nearest names are shown instead.
    A rename hint is for the names ``key_map`` (the one the load was given)
    makes, and adds to it (see :func:`~materialize.planning.namehints.mismatch_hint`).
    """
    if not strict:
        _warn_if_adapters_left_out(plan)
    shapes = [f"{n} (model {list(m)}, checkpoint {list(c)})" for n, m, c in plan.mismatched]
    problems = []
    if strict and plan.missing:
        problems.append(f"{len(plan.missing)} missing from the checkpoint: {summarize_names(plan.missing)}")
    if strict and plan.unexpected:
        problems.append(f"{len(plan.unexpected)} unexpected in the checkpoint: {summarize_names(plan.unexpected)}")
    if shapes:
        problems.append(f"{len(shapes)} with a different shape: {summarize_names(shapes)}")
    if not problems:
        return
    names_differ = strict and bool(plan.missing or plan.unexpected)
    error = ShapeMismatchError if (shapes and not names_differ) else KeyMismatchError
    adapters = adapter_words(plan.unexpected, _model_names(plan)) if strict else ""
    if adapters:  # an unmerged LoRA save: no rename and no strict=False makes the model's weights of it
        raise error("model and checkpoint disagree: " + "; ".join([*problems, adapters]), path=path,
                    missing=plan.missing, unexpected=plan.unexpected, mismatched=[n for n, _, _ in plan.mismatched])
    hint = mismatch_hint(plan.missing, plan.unexpected, key_map) if strict else ""
    if hint:
        problems.append(hint)
    if unrun and (plan.missing or plan.unexpected):
        problems.append(f"the model's own load code, which could not run on names alone, may rename some of these: "
                        f"{summarize_names(unrun)}")
    classifier = classifier_modules(model) if model is not None else ()
    head = head_sizes(plan.mismatched, classifier) if model is not None else None
    architecture_differs = False
    if head is not None:
        problems.append(classifier_hint(model, head))
    elif plan.mismatched:
        outside = [m for m in plan.mismatched if not inside(m[0], classifier)]
        problems.append(body_words(outside or plan.mismatched, in_body=bool(outside)))
        architecture_differs = True
    differing = {name for name, _, _ in plan.mismatched}
    reads_some = any(entry.action in ("load", "code") and entry.name not in differing for entry in plan.entries) or \
        not (plan.missing or plan.mismatched)  # nothing missing or differing: the load reads all the model has
    if strict and plan.missing and not hint and not architecture_differs and reads_some:
        # Names that match in part, and a body the checkpoint lacks more of: a larger model of the same family.
        lacking = [name for name in plan.missing if not inside(name, classifier)]
        if lacking:
            problems.append(missing_body_words(lacking))
            architecture_differs = True
    remedies = []
    if not reads_some:  # strict=False, ignore_mismatched_sizes: each would load nothing, which is refused too
        problems.append("no tensor of the model would be read from the checkpoint as it is, so neither strict=False "
                        "nor ignore_mismatched_sizes would load anything")
        if plan.missing and not hint:
            nearest = nearest_names(plan.missing, plan.unexpected + plan.ignored)
            if nearest:
                problems.append(nearest)
    else:
        if shapes:  # what --no-strict alone would not get past
            remedies.append("ignore_mismatched_sizes=True (CLI: --ignore-mismatched-sizes) to initialize "
                            + ("a new head of the model's size instead" if head is not None
                               else "the tensors of another shape instead (they are then not the checkpoint's)"))
        if strict and plan.unexpected and not plan.missing:  # a pipeline stage, a model of part of the checkpoint's
            remedies.append("ignore_unexpected=True (CLI: --ignore-unexpected) to leave the checkpoint's other tensors "
                            "unread and still require all of the model's")
        if names_differ:
            remedies.append("strict=False (CLI: --no-strict) to initialize missing and skip unexpected tensors")
    hint = (("; or pass " if head is not None else "; pass ") + ", and ".join(remedies)) if remedies else ""
    raise error(
        "model and checkpoint disagree: " + "; ".join(problems) + hint,
        path=path,
        missing=plan.missing,
        unexpected=plan.unexpected,
        mismatched=[n for n, _, _ in plan.mismatched],
        architecture_differs=architecture_differs,
    )


def _model_names(plan: Plan) -> Iterator[str]:
    """Every name of the model's tensors (each of a tie), as a plan holds them."""
    yield from (name for entry in plan.entries for name in entry.names)
    yield from plan.missing


def _split_absent(plan: Plan) -> tuple[list[str], list[str]]:
    """:attr:`Plan.not_from_checkpoint` in two: missing from the checkpoint, and in it in another shape."""
    reinitialized = set(plan.reinitialized)
    absent = plan.not_from_checkpoint
    redone = {entry.name for entry in plan.entries if not reinitialized.isdisjoint(entry.names)}
    return [name for name in absent if name not in redone], [name for name in absent if name in redone]


def refuse_loading_nothing(plan: Plan, reinitialized_shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
                           key_map: KeyMapLike = None) -> None:
    """Refuse a plan that reads nothing from the checkpoint while the model has tensors a checkpoint gives.

    ``strict=False``, ``ignore_mismatched_sizes`` and ``ignore_unexpected``
    each let differences go so that the rest loads; where nothing is left to
    load, the model would come out initialized and only the report would say
    so (0 tensors loaded, 0 bytes read): an error instead, naming what lines
    the names up where something does (a prefix, the nearest names) and
    calling shapes that all differ another architecture.
    """
    if any(entry.action in ("load", "code") for entry in plan.entries) or plan.extra_states or plan.fed_to_load_code:
        return
    if not plan.not_from_checkpoint:
        return  # the model has no tensor a checkpoint gives (every one computed)
    missing, redone = _split_absent(plan)
    checkpoint_names = plan.unexpected + plan.ignored
    if not redone:
        whose = f"none of the model's {len(missing)} tensors is" if len(missing) != 1 else "the model's one tensor is not"
        said = [f"nothing would be loaded: {whose} in the checkpoint under its name"]
    elif not missing:
        whose = f"each of the model's {len(redone)} tensors" if len(redone) != 1 else "the model's one tensor"
        said = [f"nothing would be loaded: {whose} the checkpoint holds has another shape there"]
    else:
        said = [f"nothing would be loaded: of the model's {len(missing) + len(redone)} tensors, {len(missing)} "
                f"{'are' if len(missing) != 1 else 'is'} not in the checkpoint under their names and the other "
                f"{len(redone)} {'have' if len(redone) != 1 else 'has'} another shape there"]
    if redone:
        shown = [f"{n} (model {list(m)}, checkpoint {list(c)})" for n, m, c in reinitialized_shapes]
        said[0] += f", e.g. {summarize_names(shown, limit=2)}"
    if not checkpoint_names and not redone:
        said.append("the checkpoint holds no tensor")
    adapters = adapter_words(checkpoint_names, _model_names(plan))
    hint = mismatch_hint(missing, checkpoint_names, key_map) if missing and not adapters else ""
    nearest = nearest_names(missing, checkpoint_names) if missing and not hint and not adapters else ""
    said += [adapters] if adapters else []
    said += [text for text in (hint, nearest) if text]
    if redone:
        said.append("the checkpoint was saved from another architecture, or another size of it")
    said.append("a load that reads nothing would leave the model initialized, not loaded, whatever strict, "
                "ignore_mismatched_sizes and ignore_unexpected say")
    raise NothingLoadedError("; ".join(said), path=plan.path, missing=missing, unexpected=plan.unexpected,
                             mismatched=redone, architecture_differs=bool(redone) or bool(nearest))


def _warn_if_adapters_left_out(plan: Plan) -> None:
    """Warn where a load that forgives names (``strict=False``) leaves out a LoRA save's adapter tensors: the
    model gets the base weights alone, not the fine-tuned model the file holds, so it is said aloud."""
    words = adapter_words(plan.unexpected, _model_names(plan))
    if words:
        warnings.warn(MaterializeWarning(f"{printable(plan.path)}: strict=False (--no-strict) leaves out "
                                         f"{sum(map(is_adapter_name, plan.unexpected))} LoRA adapter tensors, so the "
                                         f"model gets the base weights without the fine-tune: {words}"),
                      stacklevel=_caller_outside_the_package())


def warn_if_mostly_not_loaded(plan: Plan) -> None:
    """Warn where more of the model's tensors get no value from the checkpoint than get one (see
    :attr:`Plan.not_from_checkpoint`): the load goes on, as asked, and the warning and
    ``report.mostly_not_loaded`` say what it gave."""
    taken = len(plan.of("load")) + len(plan.of("code"))
    if len(plan.not_from_checkpoint) <= taken:
        return
    missing, redone = _split_absent(plan)
    why = []
    if missing:
        why.append(f"{len(missing)} missing from it")
    if redone:
        why.append(f"{len(redone)} in it in another shape")
    warning = MostlyInitializedWarning(
        f"{printable(plan.path)}: {len(missing) + len(redone)} of the model's tensors get no value from the checkpoint "
        f"({', '.join(why)}), more than the {taken} loaded from it, e.g. {summarize_names(missing + redone, limit=3)}: "
        "the model is mostly initialized, not the checkpoint's; is it the architecture the checkpoint was saved from?")
    warnings.warn(warning, stacklevel=_caller_outside_the_package())


def _caller_outside_the_package() -> int:
    """The ``stacklevel`` that names the first caller outside this package: a warning is then the caller's
    line's, and Python's default filter shows it once per line of the caller's, not once per process."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _raise_for_unmappable_disk(plan: Plan, ckpt: Checkpoint) -> None:
    """Disk tensors stay in the file: they cannot be cast or stacked, and must be there to map."""
    loads = [e for e in plan.entries if e.on_disk and e.action == "load" and e.source is not None]
    cast = [e.name for e in loads if e.source.dtype != e.dtype]
    if cast:
        raise DeviceError(
            f"tensors placed on disk stay mapped from the file and cannot be cast: {summarize_names(cast)}; "
            "drop the dtype or place those modules on cpu",
            path=ckpt.path,
        )
    stacked = [e.name for e in loads if isinstance(e.source, Stacked)]
    if stacked:
        raise DeviceError(
            f"tensors placed on disk stay mapped from the file, and these are stacked from several checkpoint "
            f"tensors: {summarize_names(stacked)}; place those modules on cpu or a GPU",
            path=ckpt.path,
        )


def initializer_of(module: nn.Module, computed_only: bool = False) -> Optional[Callable[[], None]]:
    """How a module initializes itself: ``reset_parameters()``; where only buffers it computes are
    wanted, timm's ``init_non_persistent_buffers()`` too (its modules recompute such buffers so)."""
    for method, usable in (("reset_parameters", True), ("init_non_persistent_buffers", computed_only)):
        found = getattr(module, method, None)
        if usable and callable(found):
            return found
    return None


def _forgiven_without_value(plan: Plan, names: list[str]) -> str:
    """Why a strict load of a model with load post-hooks stops at tensors the checkpoint lacks, built on meta.

    A hook may forgive a name (clear it from ``missing_keys``); ``load_state_dict``
    then leaves the tensor as the model holds it. A model built on meta holds
    no value, so the honest equivalent is its module's init (listed in
    ``report.initialized``); without one, what would give the tensor the
    value eager construction gave it is named.
    """
    buffers_only = all(not owner.is_parameter for entry in plan.of("init") if entry.name in names for owner in entry.owners)
    builds = "mz.deferred_init(...) (it then gets eager construction's value)"
    if buffers_only:
        builds = f"mz.meta_init() (buffers stay real, with their values) or {builds}"
    return (f"no initializer for {summarize_names(names)}: the checkpoint lacks them, which a load post-hook may "
            "forgive (load_state_dict then leaves them as the model has them), but built on meta they have no value "
            f"and their modules no reset_parameters(); build the model with {builds}, or pass init=fn(module) "
            "or a checkpoint that holds them")


def _init_modules(model: nn.Module, plan: Plan, init: Optional[InitFn], ckpt: Checkpoint) -> list[tuple[str, nn.Module]]:
    """The modules that own a tensor to initialize, each once, in model order."""
    wanted: dict[int, nn.Module] = {}
    computed_only: dict[int, bool] = {}  # the module's tensors to initialize are all buffers it computes
    to_fill = [entry for entry in plan.of("init") if math.prod(entry.local_shape) > 0]  # an empty one is made whole
    for entry in to_fill:
        owner = entry.owners[0].module
        wanted[id(owner)] = owner
        computed = not any(o.is_parameter or o.persistent for o in entry.owners)
        computed_only[id(owner)] = computed_only.get(id(owner), True) and computed
    uninitializable = [entry.name for entry in to_fill if init is None
                       and initializer_of(entry.owners[0].module, computed_only[id(entry.owners[0].module)]) is None]
    if uninitializable and plan.strict_after_hooks:
        raise InitError(_forgiven_without_value(plan, uninitializable), path=ckpt.path)
    if uninitializable:
        raise InitError(
            f"no initializer for {summarize_names(uninitializable)}: the checkpoint lacks them and their modules "
            "have no reset_parameters(); pass init=fn(module) or a checkpoint that holds them",
            path=ckpt.path,
        )
    if not wanted:
        return []
    return [(name, module) for name, module in named_modules(model) if id(module) in wanted]
