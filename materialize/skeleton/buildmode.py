"""A build in a dtype of its own, and bounded by what it is built for, with no process-wide state changed.

torch's default dtype is one per process: setting it for a build would make
another thread's ``torch.zeros(1)`` and new layers come out in it too. A
build in a dtype is a :class:`~torch.overrides.TorchFunctionMode` instead
(modes are per thread): what torch would make in its default dtype is made
in the build's, as ``torch.set_default_dtype`` would have made it.

The same mode bounds the build (see :class:`BuildBounds`): a config asking
for millions of layers, or a buffer of gigabytes, is refused early instead
of building for hours or allocating without end.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode

from ..sizes import format_bytes
from .sharedhooks import SharedHooks

_torch_default_dtype = torch.get_default_dtype
_torch_set_default_dtype = torch.set_default_dtype
_local = threading.local()
_hook_handles: list = []

# Factories whose floating output is in torch's default dtype unless given one.
_FLOAT_FACTORIES = frozenset({
    torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn, torch.linspace, torch.logspace, torch.eye,
    torch.empty_strided, torch.normal, torch.bartlett_window, torch.blackman_window, torch.hamming_window,
    torch.hann_window, torch.kaiser_window,
})
# Factories whose dtype follows their values: the default one only for Python floats.
_VALUE_FACTORIES = frozenset({torch.full, torch.arange, torch.range, torch.tensor, torch.as_tensor,
                              torch.scalar_tensor})
_FACTORIES = _FLOAT_FACTORIES | _VALUE_FACTORIES | {
    torch.randint, torch.randperm, torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
    torch.rand_like, torch.randn_like,
}
# Ops that name their output's dtype themselves (``.float()``, ``.to(dtype)``): kept as asked.
_EXPLICIT = frozenset({"float", "double", "half", "bfloat16", "to", "type", "type_as", "view", "new_tensor",
                       "new_empty", "new_zeros", "new_ones", "new_full", "as_subclass"})
# Ops on real tensors that allocate nothing new, or nothing a meta run would size: not run on meta first.
_NO_ALLOCATION = frozenset({
    "__get__", "__set__", "detach", "dim", "size", "numel", "stride", "storage_offset", "is_floating_point",
    "is_complex", "element_size", "data_ptr", "untyped_storage", "__len__", "__format__", "__repr__", "tolist", "item",
    "__bool__", "__int__", "__float__", "__index__", "__iter__", "__getitem__", "view", "expand", "reshape", "unsqueeze",
    "squeeze", "t", "transpose", "permute", "as_strided", "narrow", "select", "chunk", "split", "unbind",
    "__hash__", "__eq__", "__ne__", "register_hook", "requires_grad", "is_contiguous", "equal", "allclose",
})
# Ops that copy a tensor whole: a module copied N times (``copy.deepcopy(layer)``) registers nothing anew.
_COPIES = frozenset({"clone", "__deepcopy__"})


@dataclass
class BuildBounds:
    """What a build may make before it is refused: ``max_tensors`` tensors registered in modules (parameters and
    buffers) or copied whole, and ``max_real_bytes`` bytes held at once by tensors not on meta. ``refuse(what)``
    gives the error to raise, ``what`` saying which bound and by how much."""

    max_tensors: int
    max_real_bytes: int
    refuse: Callable[[str], BaseException]
    tensors: int = 0
    real_bytes: int = 0
    _storages: dict = field(default_factory=dict)

    def count(self, tensors: int = 1) -> None:
        self.tensors += tensors
        if self.tensors > self.max_tensors:
            raise self.refuse(f"its construction made more than {self.max_tensors:,} tensors")

    def asks(self, nbytes: int, what: str) -> None:
        if nbytes and self.real_bytes + nbytes > self.max_real_bytes:
            raise self.refuse(f"its construction asked for {format_bytes(nbytes)} at once ({what}) beside "
                              f"{format_bytes(self.real_bytes)} held, more than {format_bytes(self.max_real_bytes)}")

    def holds(self, tensor: torch.Tensor, what: str) -> None:
        """Count ``tensor``'s storage until it is freed (once, whatever views of it there are)."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if not key or key in self._storages:
            return
        nbytes = storage.nbytes()
        self._storages[key] = nbytes
        self.real_bytes += nbytes
        weakref.finalize(storage, self._freed, key)
        if self.real_bytes > self.max_real_bytes:
            raise self.refuse(f"its construction held {format_bytes(self.real_bytes)} of tensors not on meta ({what}), "
                              f"more than {format_bytes(self.max_real_bytes)}")

    def _freed(self, key: int) -> None:
        self.real_bytes -= self._storages.pop(key, 0)


def _thread_build() -> Optional["_BuildMode"]:
    stack = getattr(_local, "modes", None)
    return stack[-1] if stack else None


def _get_default_dtype() -> torch.dtype:
    """torch's default dtype, or in a thread building in a dtype, that dtype (``emb.to(torch.get_default_dtype())``
    in constructors); every other thread gets torch's answer."""
    mode = _thread_build()
    return mode.dtype if mode is not None and mode.dtype is not None else _torch_default_dtype()


def _set_default_dtype(dtype: torch.dtype) -> None:
    """torch.set_default_dtype, or in a thread building, the build's dtype: a constructor building a part of
    itself with transformers' ``from_config`` sets it and puts back what ``torch.get_default_dtype()`` answered,
    which must stay this thread's."""
    mode = _thread_build()
    if mode is None:
        _torch_set_default_dtype(dtype)
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError("only floating-point types are supported as the default type")
    mode.dtype = None if dtype == _torch_default_dtype() else dtype


def _tensor_new(cls: type, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.Tensor(...)`` (the legacy constructor, which no torch function mode sees), in a thread building, made
    in the build's dtype where torch's default would be taken, and its size asked of the bounds first."""
    mode = _thread_build() if cls is torch.Tensor else None
    if mode is not None and mode.bounds is not None and args and all(type(a) is int for a in args):
        mode.bounds.asks(math.prod(args) * _torch_default_dtype().itemsize, f"torch.Tensor{args}")
    made = torch._C.TensorBase.__new__(cls, *args, **kwargs)
    if mode is not None and mode.dtype is not None and made.dtype == _torch_default_dtype():
        made = made.to(mode.dtype)
    if mode is not None and mode.bounds is not None and not made.is_meta:
        mode.bounds.holds(made, "torch.Tensor")
    return made


def _count_registration(module: nn.Module, name: str, value: Any) -> None:
    mode = _thread_build()
    if mode is not None and mode.bounds is not None and value is not None:
        mode.bounds.count()


def _install() -> None:
    # Answered per thread: threads not building get torch's own answer, and set torch's own default.
    torch.get_default_dtype = _get_default_dtype
    torch.set_default_dtype = _set_default_dtype
    torch.Tensor.__new__ = _tensor_new
    _hook_handles[:] = [
        module_hooks.register_module_parameter_registration_hook(_count_registration),
        module_hooks.register_module_buffer_registration_hook(_count_registration),
    ]


def _uninstall() -> None:
    torch.get_default_dtype = _torch_default_dtype
    torch.set_default_dtype = _torch_set_default_dtype
    del torch.Tensor.__new__  # torch's own again, inherited
    for handle in _hook_handles:
        handle.remove()
    _hook_handles.clear()


_HOOKS = SharedHooks(_install, _uninstall)


def _import_dynamo() -> None:
    try:
        # Imported first: on import, dynamo checks the signature of torch.Tensor.__new__ against its own, which the
        # build's would fail. transformers' models import it anyway (its masking code does).
        import torch._dynamo  # noqa: F401
    except ImportError:
        pass


def _has_float_tensor(values: Any) -> bool:
    return any(t.is_floating_point() or t.is_complex() for value in values for t in _tensors(value))


def _has_real_tensor(values: Any) -> bool:
    return any(not t.is_meta for value in values for t in _tensors(value))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """``value`` if a tensor, else the tensors of the lists and tuples it nests."""
    if isinstance(value, torch.Tensor):
        yield value
    elif type(value) in (list, tuple):
        for item in value:
            yield from _tensors(item)


def _on_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value if value.is_meta else value.to("meta")
    if type(value) in (list, tuple):
        return type(value)(_on_meta(item) for item in value)
    return value


class _BuildMode(TorchFunctionMode):
    """The thread's build: ``dtype`` for what torch would make in its default dtype, ``bounds`` on what it makes."""

    def __init__(self, dtype: Optional[torch.dtype], bounds: Optional[BuildBounds]) -> None:
        super().__init__()
        self.dtype = dtype
        self.bounds = bounds

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        bounds = self.bounds
        if bounds is not None and name in _COPIES:
            bounds.count()
        factory = func in _FACTORIES
        if factory:
            func, kwargs = self._factory(func, args, kwargs)
        elif (bounds is not None and name not in _NO_ALLOCATION and not name.endswith("_")
              and (_has_real_tensor(args) or _has_real_tensor(kwargs.values()))):
            self._ask(func, name, args, kwargs)
        result = func(*args, **kwargs)
        if (self.dtype is not None and not factory and isinstance(result, torch.Tensor) and result.is_floating_point()
                and kwargs.get("dtype") is None and name not in _EXPLICIT and result.dtype == _torch_default_dtype()
                and result.dtype != self.dtype and not _has_float_tensor(args) and not _has_float_tensor(kwargs.values())):
            # Integers promoted to torch's default float (``torch.arange(n) / n``) come out in the build's dtype.
            result = result.to(self.dtype)
        if bounds is not None:
            for tensor in _tensors(result):
                if not tensor.is_meta:
                    bounds.holds(tensor, f"torch.{name}" if factory else name)
        return result

    def _factory(self, func: Callable, args: tuple, kwargs: dict) -> tuple[Callable, dict]:
        """The factory call as made in the build: the build's dtype where torch's default would be taken, and its
        size asked of the bounds before anything is allocated."""
        if kwargs.get("out") is not None:
            return func, kwargs
        needs_dtype = self.dtype is not None and kwargs.get("dtype") is None and func in _FLOAT_FACTORIES | _VALUE_FACTORIES
        if func in (torch.tensor, torch.as_tensor) and args and isinstance(args[0], torch.Tensor) or (
                func is torch.as_tensor and args and hasattr(args[0], "__array_interface__")):
            needs_dtype = False  # the data's own dtype
        if not needs_dtype and self.bounds is None:
            return func, kwargs
        try:
            shaped = func(*args, **{**kwargs, "device": "meta"})
        except Exception:  # noqa: BLE001 - the real call says what is wrong with it
            return func, kwargs
        # torch's meta kernels written in Python ask torch.get_default_dtype(), which answers the build's dtype here.
        if needs_dtype and shaped.dtype in (_torch_default_dtype(), self.dtype):
            kwargs["dtype"] = self.dtype
            shaped = shaped.to(self.dtype)
        device = kwargs.get("device")
        on_meta = torch.device(device).type == "meta" if device is not None else torch.get_default_device().type == "meta"
        if self.bounds is not None and not on_meta:
            self.bounds.asks(shaped.nbytes, f"torch.{func.__name__} of {tuple(shaped.shape)} {shaped.dtype}")
        return func, kwargs

    def _ask(self, func: Callable, name: str, args: tuple, kwargs: dict) -> None:
        """An op on real tensors may make a larger one (an outer product): its size, found on meta, is asked first."""
        try:
            shaped = func(*_on_meta(args), **{key: _on_meta(value) for key, value in kwargs.items()})
        except Exception:  # noqa: BLE001 - no meta kernel, or a value asked: counted once made
            return
        nbytes = sum(t.nbytes for t in _tensors(shaped) if not t._is_view())
        self.bounds.asks(nbytes, f"{name} making {format_bytes(nbytes)}")


@contextmanager
def building(dtype: Optional[torch.dtype] = None, bounds: Optional[BuildBounds] = None) -> Iterator[None]:
    """Build in this thread as if torch's default dtype were ``dtype`` (a floating one; None: torch's), refused
    past ``bounds``; other threads see torch as it was.

    Factories given no dtype (``torch.zeros``, ``nn.Linear``'s ``torch.empty``, ``torch.arange(0.0, n)``) make
    ``dtype``, integers promoted to a float (``torch.arange(n) / n``) come out in ``dtype``, and
    ``torch.get_default_dtype()`` answers ``dtype`` in this thread (``torch.set_default_dtype`` sets this
    thread's build dtype, as transformers' ``from_config`` does for a part built inside); a tensor made in a dtype named
    (``dtype=torch.float32``, ``.float()``) keeps it, as under ``torch.set_default_dtype(dtype)``. torch's
    C++ code making tensors of its own still takes torch's default. ``torch.Tensor(n)`` (the legacy
    constructor, which modes do not see) is made in ``dtype`` by a ``torch.Tensor.__new__`` that answers
    other threads as torch's does.
    """
    if dtype is not None and (not dtype.is_floating_point or dtype == _torch_default_dtype()):
        dtype = None
    mode = _BuildMode(dtype, bounds)
    _import_dynamo()
    _HOOKS.acquire()
    stack = getattr(_local, "modes", None)
    if stack is None:
        stack = _local.modes = []
    stack.append(mode)
    try:
        with mode:
            yield
    finally:
        stack.pop()
        _HOOKS.release()
