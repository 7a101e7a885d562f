"""A model's own init of the tensors a checkpoint lacks, checked: what it leaves unwritten is made by the
module's own construction, or refused by name. A plain model's init is its modules' own
(``reset_parameters()``, :func:`own_init`), checked the same way: one that leaves a tensor unwritten
(a scale its constructor set with ``torch.ones`` and its ``reset_parameters()`` never touches) no longer
leaves memory nobody wrote behind a report calling it initialized.

transformers' ``_init_weights`` knows the modules of its models; a module it
does not know (an adapter, a peft layer: AdaLoRA's ``ranknum``, BOFT's and
OFT's blocks) it passes over. ``from_pretrained`` (transformers 5.24) gives
such a module's missing tensors ``torch.empty`` memory and leaves it so,
non-persistent buffers included; eager construction (``Class(config)``, or
peft inserting its layers into a built model) gives them the values the
module's constructor gave them. A load matches eager construction or says
why it cannot, in four steps:

1. each tensor to initialize is poisoned (NaN for floating dtypes, the
   largest value for integers) and its version counter noted, then the
   model's init runs for each module owning one, as before;
2. a floating tensor still holding NaN, all of it or a part, was not given
   values, whatever its counter says (an init may only rescale it); an
   integer one was not written where its counter did not move and it holds
   only the poison (older ``_init_weights`` write through ``.data``, which
   moves no counter but changes the values);
3. its module makes it as its construction did: a module built by
   :func:`~materialize.skeleton.deferred.deferred_init` (or inside one)
   replays its recorded construction, eager construction's values bit for
   bit under the same seed (its tensors are not handed to ``_init_weights``
   at all: such a module is inserted after the model's construction, as
   peft inserts its layers, so eager's ``post_init`` never saw it); else a
   module with ``reset_parameters()`` runs it, then the model's init again
   over it, eager construction's order (the constructor, then ``post_init``);
4. a tensor still unwritten, or written in part, is an :class:`InitError`
   naming it, its module's class, and the ways out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional, Union

import torch
from torch import nn

from ..errors import InitError, summarize_names
from ..integrations.sharded import held_local, local_of
from ..planning.plan import Entry, Plan, initializer_of
from ..skeleton.deferred import program_of
from ..skeleton.modtree import named_modules
from .replay import replay, shard_box

_NAN_POISONED = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128}
_MAX_POISONED = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


def own_init(module: nn.Module) -> None:
    """A module's own init (``reset_parameters()``; timm's ``init_non_persistent_buffers()`` for computed
    buffers), the default of a load: planning made sure each module it is called for has one."""
    initializer = initializer_of(module, computed_only=True)
    if initializer is not None:
        initializer()


own_init.name_for = lambda module: f"{type(module).__name__}.reset_parameters()"  # type: ignore[attr-defined]


class CheckedInit:
    """``init_one(module)`` for each module owning a tensor to initialize (as ``load`` calls an init), then
    the check and fallbacks above. ``init_one`` may carry ``name_for(module)``, the words naming the
    function that initialized a module (``"LlamaForCausalLM._init_weights"``) in errors."""

    def __init__(self, model: nn.Module, init_one: Callable[[nn.Module], None]) -> None:
        self.model = model
        self.init_one = init_one

    def __call__(self, module: nn.Module) -> None:  # an InitFn still, for whoever calls it module by module
        self.init_one(module)

    def fill(self, plan: Plan) -> list[str]:
        """Initialize the plan's ``init`` tensors; the names of those replayed from a recorded construction."""
        entries = [entry for entry in plan.of("init") if math.prod(entry.local_shape) > 0]
        if not entries:
            return []
        recorded = _recorded_modules(self.model)
        replayed: dict[str, list[Entry]] = {}  # by the recorded module's name
        own: list[Entry] = []
        for entry in entries:
            root = _recorded_root(entry.name, recorded)
            (replayed.setdefault(root, []) if root is not None else own).append(entry)
        skipped = {id(module) for root in replayed for _, module in named_modules(recorded[root])}
        watched = [_Watched(entry) for entry in own]
        for _, module in plan.init_modules:
            if id(module) not in skipped:
                self.init_one(module)
        unwritten = _unwritten(watched)
        if unwritten:
            self._by_modules_own_init(plan, unwritten, skipped)
            unwritten = _unwritten(unwritten)
        if unwritten:
            raise InitError(self._refusal(unwritten), path=plan.path)
        for root, under in replayed.items():
            prefix = f"{root}." if root else ""
            targets = {entry.name[len(prefix):]: (shard_box(local_of(entry.held()), entry.shard)
                                                  if entry.shard is not None else entry.held()) for entry in under}
            replay(program_of(recorded[root]), targets, plan.device)
        return [entry.name for under in replayed.values() for entry in under]

    def _by_modules_own_init(self, plan: Plan, unwritten: list["_Watched"], skipped: set[int]) -> None:
        """Each module owning an unwritten tensor runs its ``reset_parameters()`` (timm's
        ``init_non_persistent_buffers()`` for computed buffers alone), then the model's init again over it."""
        owners: dict[int, nn.Module] = {}
        computed_only: dict[int, bool] = {}
        for watched in unwritten:
            module = watched.entry.owners[0].module
            owners[id(module)] = module
            computed = not any(o.is_parameter or o.persistent for o in watched.entry.owners)
            computed_only[id(module)] = computed_only.get(id(module), True) and computed
        for key, module in owners.items():
            if self.init_one is own_init:
                continue  # that is the init which ran already
            initializer = initializer_of(module, computed_only[key])
            if initializer is None:
                continue
            initializer()
            inside = {id(m) for m in module.modules()}
            for _, again in plan.init_modules:
                if id(again) in inside and id(again) not in skipped:
                    self.init_one(again)

    def _refusal(self, unwritten: list["_Watched"]) -> str:
        name_for = getattr(self.init_one, "name_for", None)
        modules = [w.entry.owners[0].module for w in unwritten]
        initializer = name_for(modules[0]) if callable(name_for) else "the init"
        untouched = [w for w in unwritten if not w.partly]
        partly = [w.entry.name for w in unwritten if w.partly]
        parts = []
        if untouched:
            owners = [w.entry.owners[0].module for w in untouched]
            classes = ", ".join(dict.fromkeys(type(m).__name__ for m in owners))
            if self.init_one is own_init:  # a plain model: its modules' own init is all there is
                parts.append(f"{summarize_names([w.entry.name for w in untouched])} (of {classes}): {initializer} "
                             "leaves them unwritten")
            else:
                own = ("their reset_parameters() leaves them unwritten too" if any(initializer_of(m, True)
                                                                                   for m in owners)
                       else "they have no reset_parameters()")
                parts.append(f"{summarize_names([w.entry.name for w in untouched])} (of {classes}): {initializer} "
                             f"does not initialize such modules and {own}")
        if partly:
            parts.append(f"{summarize_names(partly)}: {initializer} writes only part of them")
        own = ("have their reset_parameters() initialize them" if self.init_one is own_init
               else "give their class a reset_parameters()")
        return ("no initializer for tensors the checkpoint lacks: " + "; ".join(parts) + "; build those modules "
                "with mz.deferred_init(...) (a load then replays their construction, as eager construction made "
                f"them), {own}, or pass init=fn(module) or a checkpoint that holds them")


class _Watched:
    """One tensor to initialize: the tensor allocated for it, poisoned, and its version counter then."""

    __slots__ = ("entry", "tensor", "poison", "version", "partly")

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.tensor = entry.held()
        local = held_local(self.tensor)
        poison: Optional[Union[float, int]] = None
        if not local.is_meta and local.dtype in _NAN_POISONED:
            poison = math.nan
        elif not local.is_meta and local.dtype in _MAX_POISONED:
            poison = torch.iinfo(local.dtype).max
        self.poison = poison
        if self.poison is not None:
            with torch.no_grad():
                local.fill_(self.poison)
        self.version = local._version
        self.partly = False

    def left(self) -> Optional[torch.Tensor]:
        """How many elements still hold the poison (a tensor, not yet synchronized); None where unpoisoned."""
        if self.poison is None:
            return None
        local = held_local(self.tensor)
        return (torch.isnan(local) if isinstance(self.poison, float) else local == self.poison).sum()


def _unwritten(watched: list[_Watched]) -> list[_Watched]:
    """The tensors no init wrote whole: untouched (no counter moved, only poison held) or written in part.
    A tensor an init replaced with one of its own (registered in its place) counts as written."""
    held = [w for w in watched if w.entry.held() is w.tensor]
    counts = [w.left() for w in held]
    by_device: dict[torch.device, list[int]] = {}
    for index, count in enumerate(counts):
        if count is not None:
            by_device.setdefault(count.device, []).append(index)
    left: dict[int, int] = {}
    for indices in by_device.values():  # one synchronization per device
        left.update(zip(indices, torch.stack([counts[i] for i in indices]).tolist()))
    found = []
    for index, w in enumerate(held):
        local = held_local(w.tensor)
        remaining, total = left.get(index), local.numel()
        # NaN left anywhere is never an init's value, whatever the counter says (an init that only rescales);
        # an integer's largest value may be one: there a moved counter says written
        trusted = isinstance(w.poison, float) or local._version == w.version
        w.partly = trusted and remaining is not None and 0 < remaining < total
        untouched = remaining == total if remaining is not None else local._version == w.version
        if w.partly or (trusted and untouched):
            found.append(w)
    return found


def _recorded_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's modules :func:`~materialize.skeleton.deferred.deferred_init` built (their recordings), by name."""
    return {name: module for name, module in named_modules(model) if program_of(module) is not None}


def _recorded_root(name: str, recorded: dict[str, nn.Module]) -> Optional[str]:
    """The outermost recorded module holding tensor ``name``, by its name; None where none does."""
    if not recorded:
        return None
    parts = name.split(".")[:-1]
    for depth in range(len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if prefix in recorded:
            return prefix
    return None
