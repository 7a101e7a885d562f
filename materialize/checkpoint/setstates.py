"""A pickled module's own ``__setstate__`` that changes its tensors, run again once a load filled them.

``torch.load(weights_only=False)`` rebuilds each module of a pickled model
with its tensors' values from the file, then calls the module's
``__setstate__``; one that changes them there (``self.w.mul_(2)``, an
older layout converted in place) gives the values ``torch.load`` returns.
A trusted load (``trust_pickle=True``) rebuilds the module on meta, where
the same call changes nothing, and reads the file's bytes afterwards: the
values before it. So:

1. where the pickle names a module class whose ``__setstate__`` is its own
   (not ``nn.Module``'s or another of torch's), it is read by Python's own
   unpickler, which hands each such ``__setstate__`` call to
   :func:`watched_build`: the state it was given is kept (a shallow copy),
   and whether it wrote a tensor (an op writing in place, ``.data`` writes
   included) or put another tensor in the place of one it was given;
2. one that put another tensor in place of one of the file is refused by
   name: that value is computed from the file's, and a lazy load has none
   to compute it from;
3. one that wrote is run again by :func:`setstates_again`, in the order the
   pickle ran them (a module's children before it), on the very module once
   a load has filled its tensors (from this file, into this module): its
   attributes cleared as the unpickler found them, and handed the state it
   was given, whose tensors are those the load filled.

Its values then equal ``torch.load``'s, computed on the loaded tensors
(their device and dtype, where the load cast them).
"""

from __future__ import annotations

import itertools
import pickle
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import CheckpointError, first_line, summarize_names

# The module -> (the order its __setstate__ ran in, the state it was given), for those that wrote a tensor.
_WRITERS: "weakref.WeakKeyDictionary[nn.Module, tuple[int, Any]]" = weakref.WeakKeyDictionary()
_ORDER = itertools.count()
_REGISTRIES = ("_parameters", "_buffers")


def has_own_setstate(cls: Any) -> bool:
    """Whether ``cls`` is a module class whose ``__setstate__`` is defined outside torch (torch's own, an
    ``nn.Conv2d``'s or an RNN's, set attributes only)."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        return False
    owner = next((k for k in cls.__mro__ if "__setstate__" in vars(k)), nn.Module)
    return not (owner.__module__ == "torch" or owner.__module__.startswith("torch."))


def names_own_setstate(named: list[str]) -> bool:
    """Whether any global a pickle names (``"module name"``) is a module class with its own ``__setstate__``:
    resolved as the (trusted) unpickling about to run resolves it."""
    finder = pickle.Unpickler(_EMPTY)
    for global_name in named:
        module, _, name = global_name.partition(" ")
        try:
            found = finder.find_class(module, name)
        except Exception:  # noqa: BLE001  (the unpickling itself reports what it cannot find)
            continue
        if has_own_setstate(found):
            return True
    return False


class _Empty:
    def read(self, size: int = -1) -> bytes:
        return b""

    def readline(self) -> bytes:
        return b""


_EMPTY = _Empty()


class _Writes(TorchDispatchMode):
    """Whether an op wrote into a tensor (in place, or an ``out=``) while it was on."""

    def __init__(self) -> None:
        super().__init__()
        self.wrote = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func._schema.is_mutable:
            self.wrote = True
        return func(*args, **(kwargs or {}))


def watched_build(inst: Any, state: Any, build: Callable[[], None], path: Path) -> None:
    """pickle's BUILD of ``inst`` with ``state`` (``build()`` runs it), watched where ``inst`` is a module whose
    ``__setstate__`` is its own (see the module's docstring)."""
    if not (isinstance(inst, nn.Module) and has_own_setstate(type(inst))):
        build()
        return
    given = dict(state) if isinstance(state, dict) else state
    before = _registered(state)
    with _Writes() as writes:
        build()
    replaced = [name for (registry, name), tensor in before.items()
                if inst.__dict__.get(registry, {}).get(name) is not tensor]
    if replaced:
        raise CheckpointError(
            f"{type(inst).__qualname__}.__setstate__ puts tensors of its own in place of the file's "
            f"({summarize_names(replaced)}) as the module is unpickled; their values are computed from the file's, "
            "which a load on meta does not have: load it with torch.load(weights_only=False), or save its "
            "state_dict() and load that", path=path)
    if writes.wrote:
        _WRITERS[inst] = (next(_ORDER), given)


def _registered(state: Any) -> dict[tuple[str, str], torch.Tensor]:
    """The tensors a module's state registers, by (registry, name)."""
    if not isinstance(state, dict):
        return {}
    return {(registry, name): tensor for registry in _REGISTRIES if isinstance(state.get(registry), dict)
            for name, tensor in state[registry].items() if isinstance(tensor, torch.Tensor)}


def setstates_again(model: nn.Module, path: Path) -> None:
    """Run again each ``__setstate__`` of ``model``'s modules that wrote a tensor while the file was unpickled,
    now that a load filled ``model``'s tensors from that file (see the module's docstring)."""
    writers = [(_WRITERS[module][0], module) for module in model.modules() if module in _WRITERS]
    for _, module in sorted(writers, key=lambda pair: pair[0]):
        given = _WRITERS[module][1]
        state = ({key: module.__dict__.get(key, value) if isinstance(value, torch.Tensor) else value
                  for key, value in given.items()} if isinstance(given, dict) else given)
        module.__dict__.clear()  # as the unpickler made it, before its state: attributes the call set are set anew
        try:
            module.__setstate__(state)
        except Exception as exc:
            raise CheckpointError(
                f"{type(module).__qualname__}.__setstate__, which changes the module's tensors as torch.load "
                f"unpickles it, failed when run again on the loaded tensors: {type(exc).__name__}: {first_line(exc)}; "
                "load it with torch.load(weights_only=False)", path=path) from exc


def refuse_setstate_values_elsewhere(pickled: nn.Module, path: Path) -> None:
    """Refuse to load a file whose pickled module's ``__setstate__`` changed its tensors into another model:
    the file's bytes are not the values ``torch.load`` gives (its module's ``state_dict()``), and only the
    pickled module itself can have its ``__setstate__`` run on them."""
    writers = [(name or "<root>", module) for name, module in pickled.named_modules() if module in _WRITERS]
    if not writers:
        return
    classes = ", ".join(dict.fromkeys(type(module).__qualname__ for _, module in writers))
    raise CheckpointError(
        f"the __setstate__ of {classes} changes tensors of the pickled module (at "
        f"{summarize_names([name for name, _ in writers])}) as torch.load unpickles it, so the file's bytes are not "
        "the values torch.load gives; load the pickled module "
        "itself (mz.load_model(path, trust_pickle=True) with no model; CLI: --trust-pickle without --model) and "
        "take its state_dict()", path=path)
