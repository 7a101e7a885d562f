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
such as ``os.system``, or a class with arguments, as an ``Enum`` member is
rebuilt from its value) never calls the real thing either: the stand-in
only keeps the arguments. Such a call is accepted where the name reads as
a class (capitalized: ``Color``, ``TrainingMode``) of a module that does not
run things (see :data:`CODE_RUNNING_MODULES`) and its arguments are plain
values (numbers, strings, containers of them). Otherwise
:class:`CalledStandIn` refuses the file: a call of a function
(``runpy.run_path``) on unpickling is what hostile files do, and a call
given a tensor might have built weights from it, which a stand-in would
lose. Modules named by ``sys``, ``os``, ``posix`` and ``nt`` stay refused by
torch itself, at their name (and ``eval``, ``getattr`` and the other
builtins by us).
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

import _compat_pickle
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
        if cls.inert_calls or (cls.plain_calls and _holds_only_plain_values(args) and _holds_only_plain_values(kwargs)):
            return cls.__new__(cls, *args)
        raise CalledStandIn(cls.stands_in_for)


# Modules whose classes run things when made (subprocess.Popen, ctypes.CDLL): a file calling them is refused.
CODE_RUNNING_MODULES = frozenset({
    "builtins", "code", "codeop", "ctypes", "importlib", "marshal", "multiprocessing", "os", "pickle", "posix",
    "nt", "pty", "runpy", "shutil", "socket", "subprocess", "sys", "threading", "webbrowser", "_posixsubprocess",
})


def _reads_as_a_class(full_name: str) -> bool:
    """``module.Name`` capitalized, as classes are named (an Enum, a config class), outside code-running modules.

    Pickles of protocol 2 and below name some modules as Python 2 did
    (``commands.Popen`` for ``subprocess.Popen``): those are read as Python 3
    reads them before the module is judged.
    """
    module, _, name = full_name.rpartition(".")
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    return name[:1].isupper() and module.split(".", 1)[0] not in CODE_RUNNING_MODULES


_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_MAX_PLAIN_DEPTH = 16


def _holds_only_plain_values(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is built of numbers, strings and containers of them (and stand-ins of such): no tensor.

    A stand-in called with such arguments (an ``Enum`` member rebuilt from
    its value, a config class from its fields) only keeps them: whatever the
    real class would make of them is not weights. Given a tensor or a
    storage, the real call might build weights from it, so it is refused.
    Deep or self-referencing values count as not plain.
    """
    if isinstance(value, _PLAIN_SCALARS):
        return True
    if depth >= _MAX_PLAIN_DEPTH:
        return False
    if isinstance(value, (tuple, list, set, frozenset)):
        return all(_holds_only_plain_values(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return all(_holds_only_plain_values(key, depth + 1) and _holds_only_plain_values(item, depth + 1)
                   for key, item in value.items())
    if isinstance(value, StandIn):
        return all(_holds_only_plain_values(part, depth + 1) for part in (value.args, value.state, value.items))
    return False


class StandIn(metaclass=_NoCalls):
    """An object of a class that was never imported; it holds what the pickle gave it, and does nothing."""

    stands_in_for = ""
    inert_calls = False  # any call keeps its arguments (numpy, pathlib)
    plain_calls = False  # a call given plain values keeps them (a name that reads as a class)

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
                                       "inert_calls": inert, "plain_calls": _reads_as_a_class(full_name)})


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
