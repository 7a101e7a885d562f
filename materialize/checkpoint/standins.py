"""Inert stand-ins for the classes a torch file names but the weights-only unpickler does not know.

Checkpoints often carry more than weights: ``{"args": argparse.Namespace(...),
"state_dict": ...}``, a trainer's hyper-parameters, or a whole pickled
``nn.Module``. torch's weights-only unpickler refuses all of these, and the
usual way out, ``weights_only=False``, lets the file run any code it likes.

A stand-in takes the place of such a class without importing anything: a
fresh class with the same name whose objects only keep what the pickle hands
them (constructor arguments, state, items). Building an object that way
(``NEWOBJ`` then ``BUILD``, how pickle restores plain objects) runs no code
from the file. Calling a stand-in (``REDUCE``: how a pickle calls a function
such as ``os.system`` or ``eval``, or a class with arguments) raises
:class:`CalledStandIn` instead, so such files are still refused. Modules
named by ``sys``, ``os``, ``posix`` and ``nt`` stay refused by torch itself.
Types that hyper-parameter containers name as values (OmegaConf's
``DictConfig`` records ``object_type=dict``, ``ref_type=typing.Any`` and a
``defaultdict(dict)`` cache) are let through as themselves
(:data:`INERT_GLOBALS`): building containers of already unpickled values,
or a scalar from one, runs no code from the file.
The exceptions are numpy and pathlib: a training script's metrics
(``best_acc`` as a ``numpy.float64``) pickle as calls of numpy's
constructors, and a path among its arguments as a call of ``PosixPath`` with
the path's parts, so calls of their stand-ins are inert too (they build a
stand-in holding the arguments; neither module is used). A numpy array where
a tensor is expected is an error, not skipped.
"""

from __future__ import annotations

import collections
import typing
from collections.abc import Iterator
from typing import Any

import torch


class CalledStandIn(Exception):
    """The pickle tried to call something it named: refused, since the real thing could run code."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


INERT_CALL_MODULES = frozenset({"numpy", "pathlib"})
# As torch's unpickler names them in its refusals (builtins without their module).
INERT_GLOBALS: dict[str, Any] = {
    **{kind.__name__: kind for kind in (dict, list, tuple, set, frozenset, int, float, complex, bool, str)},
    "typing.Any": typing.Any,
    "collections.defaultdict": collections.defaultdict,
}
NUMPY_ARRAY_BUILDERS = frozenset({"numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct"})


class _NoCalls(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls.inert_calls:
            return cls.__new__(cls, *args)
        raise CalledStandIn(cls.stands_in_for)


class StandIn(metaclass=_NoCalls):
    """An object of a class that was never imported; it holds what the pickle gave it, and does nothing."""

    stands_in_for = ""
    inert_calls = False

    def __new__(cls, *args: Any) -> "StandIn":
        instance = object.__new__(cls)
        instance.__dict__.update(args=args, state=None, items={})
        return instance

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state

    def __setitem__(self, key: Any, value: Any) -> None:  # dict subclasses: pickled items come after the object
        self.items[key] = value

    def __repr__(self) -> str:
        return f"<stand-in for {self.stands_in_for}>"


def stand_in_class(full_name: str) -> type:
    """A stand-in class that torch's allowlist files under ``full_name`` (its module and name joined)."""
    module, _, name = full_name.rpartition(".")
    inert = full_name.split(".", 1)[0] in INERT_CALL_MODULES
    return _NoCalls(name, (StandIn,), {"__module__": module, "__qualname__": name, "stands_in_for": full_name,
                                       "inert_calls": inert})


def is_numpy_array(candidate: Any) -> bool:
    """Whether a stand-in is what pickled numpy arrays rebuild into."""
    return isinstance(candidate, StandIn) and type(candidate).stands_in_for in NUMPY_ARRAY_BUILDERS


def module_state(candidate: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The state-dict entries of a pickled ``nn.Module`` rebuilt from stand-ins, as ``state_dict()`` names them."""
    state = candidate.state
    for name, tensor in _entries(state.get("_parameters")):
        yield prefix + name, tensor
    transient = state.get("_non_persistent_buffers_set")
    transient = transient if isinstance(transient, (set, frozenset)) else set()
    for name, tensor in _entries(state.get("_buffers")):
        if name not in transient:
            yield prefix + name, tensor
    modules = state.get("_modules")
    for name, child in (modules.items() if isinstance(modules, dict) else ()):
        if is_module_state(child):
            yield from module_state(child, f"{prefix}{name}.")


def is_module_state(candidate: Any) -> bool:
    """Whether a stand-in holds what ``nn.Module`` pickles: its parameters, buffers and submodules."""
    state = getattr(candidate, "state", None) if isinstance(candidate, StandIn) else None
    return isinstance(state, dict) and all(isinstance(state.get(key), dict) for key in ("_parameters", "_buffers", "_modules"))


def _entries(mapping: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(mapping, dict):
        for name, tensor in mapping.items():
            if isinstance(tensor, torch.Tensor):
                yield str(name), tensor
