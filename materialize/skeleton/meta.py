"""Build models without memory: parameters on ``meta``, buffers kept real.

Buffers such as a rotary ``inv_freq`` are computed in ``__init__`` and are
usually absent from checkpoints, so putting them on ``meta`` would lose them;
parameters are what checkpoints hold. The interception point is torch's
supported global hook on parameter (and buffer) registration, installed while
any thread is inside :func:`meta_init` and acting only in those threads.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode

from ..errors import MetaInitError
from .sharedhooks import SharedHooks

_state = threading.local()
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
_hook_handles: list = []


def _thread_state(name: str, empty: Callable[[], Any]) -> Any:
    """This thread's ``name`` (meta_init acts only in the threads inside it), made empty on first use."""
    value = getattr(_state, name, None)
    if value is None:
        value = empty()
        setattr(_state, name, value)
    return value


def _depth_flags() -> list[bool]:
    return _thread_state("stack", list)


def is_lazy(tensor: torch.Tensor) -> bool:
    """A lazy module's tensor not yet given a shape (``nn.LazyLinear``): it holds no memory, and has no size to read."""
    return isinstance(tensor, nn.parameter.UninitializedTensorMixin)


def _to_meta_parameter(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> Optional[nn.Parameter]:
    if not _depth_flags() or param is None:
        return None
    # The hook runs inside _SkipInPlaceOnMeta, which would see each attribute read and move of a plain
    # parameter (five a tensor) to change none of them: without it, a model of many small modules builds
    # faster. A subclass's own __torch_function__ may act on them, so it keeps the mode.
    with _NO_TORCH_FUNCTION() if type(param) is nn.Parameter else nullcontext():
        if is_lazy(param) or param.device.type == "meta":
            return None
        return parameter_like(param, param.detach().to("meta"), param.requires_grad)


def fresh_parameter_like(original: nn.Parameter, fresh: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """:func:`parameter_like` for a tensor the caller just made and holds alone, which may become the parameter
    itself.

    ``nn.Parameter`` makes a tensor subclass (a DTensor) a parameter by
    marking a detached alias of it; the detach is a call through the
    subclass's dispatch, tens of microseconds each. A subclass tensor without
    autograd history, of the original's class, is marked itself instead.
    """
    kind = type(fresh)
    if kind is torch.Tensor or kind is not type(original) or fresh.grad_fn is not None or fresh.requires_grad:
        return parameter_like(original, fresh, requires_grad)
    fresh.requires_grad_(requires_grad)
    fresh._is_param = True  # as nn.Parameter marks a subclass's tensor
    if original.__dict__:
        fresh.__dict__.update(original.__dict__)
    return fresh


def parameter_like(original: nn.Parameter, tensor: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """``tensor`` as a parameter of ``original``'s class (what a lazy one becomes), with its Python attributes.

    As ``load_state_dict`` keeps a model's own parameter objects: a
    subclass (Megatron's, a ``__torch_function__`` one) stays that class, and
    attributes a script set (``p.no_decay = True``, ``tensor_model_parallel``)
    stay set. A subclass is made as ``nn.Parameter`` makes one
    (``Tensor._make_subclass``), not through its own ``__new__`` or
    ``__init__``: they ran already, with the caller's arguments, which
    defaults would replace.
    """
    kind = type(original)
    if kind is nn.Parameter and type(tensor) is torch.Tensor:
        made = torch.Tensor._make_subclass(nn.Parameter, tensor, requires_grad)  # nn.Parameter's own path, less a frame
        if original.__dict__:
            made.__dict__.update(original.__dict__)
        return made
    kind = original.cls_to_become if is_lazy(original) else kind
    # A tensor already of the class (a DTensor: a wrapper subclass, never re-wrapped; torch 2.7 refuses it) is
    # marked a parameter as nn.Parameter marks one.
    made = (nn.Parameter(tensor, requires_grad=requires_grad) if kind is nn.Parameter or type(tensor) is kind
            else torch.Tensor._make_subclass(kind, tensor, requires_grad))
    if original.__dict__:
        made.__dict__.update(original.__dict__)
    return made


def buffer_like(original: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a buffer of ``original``'s class, with its Python attributes (transformers marks buffers
    ``persistent`` and ``_is_buffer``).

    ``load_state_dict`` copies into a model's own buffer, so a buffer of a
    ``__torch_function__`` subclass stays that class, with the attributes
    set on it. A buffer a load allocates anew (its model was built on meta)
    is made so too: a view of the new memory as that class
    (``Tensor.as_subclass``, which runs no constructor of the subclass).
    """
    kind = original.cls_to_become if is_lazy(original) else type(original)
    made = tensor if type(tensor) is kind else tensor.as_subclass(kind)
    if original.__dict__:
        made.__dict__.update(original.__dict__)
    return made


def _to_meta_buffer(module: nn.Module, name: str, buffer: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    stack = _depth_flags()
    if not stack or buffer is None:
        return None
    if not stack[-1] or is_lazy(buffer) or buffer.device.type == "meta":
        _built_buffers().append((module, name))  # kept real: filled later from meta values, maybe
        return None
    return buffer.to("meta")


def _built_buffers() -> list[tuple[nn.Module, str]]:
    """Buffers registered real in this thread's outermost :func:`meta_init` so far."""
    return _thread_state("built_buffers", list)


def _unfilled() -> dict[int, torch.Tensor]:
    """Real tensors an in-place op was to fill from values on meta (which have none), by id."""
    return _thread_state("unfilled", dict)


def _put_unfilled_buffers_on_meta() -> None:
    """A buffer the constructor filled from values computed on meta holds nothing; on meta, a load recomputes it.

    The usual case: a buffer computed on ``self.weight.device`` (meta here) and
    copied into a real buffer (timm's Swin V2 relative position tables). On
    meta, the load initializes it with its module's ``reset_parameters()``
    like any buffer built on meta, before the checkpoint's values are read.
    """
    unfilled, built = _unfilled(), _built_buffers()
    try:
        for module, name in built:
            buffer = module._buffers.get(name)
            if buffer is not None and id(buffer) in unfilled and unfilled[id(buffer)] is buffer:
                module._buffers[name] = buffer.to("meta")
    finally:  # even where a move raises: the thread's next block must not hold (or move) this one's modules
        unfilled.clear()
        built.clear()


def _install_hooks() -> None:
    _hook_handles[:] = [
        module_hooks.register_module_parameter_registration_hook(_to_meta_parameter),
        module_hooks.register_module_buffer_registration_hook(_to_meta_buffer),
        _OrthogonalOnMeta(),
    ]


def _remove_hooks() -> None:
    for handle in _hook_handles:
        handle.remove()
    _hook_handles.clear()


class _OrthogonalOnMeta:
    """torch's ``orthogonal()`` on a weight on meta, made as eager makes it, shapes only.

    Registering it computes a ``base`` buffer from the weight's values (an
    orthogonality check, a QR completion): on meta the check asks for values
    and the completion has no meta kernel, whose ``NotImplementedError`` torch
    takes for "no right inverse", leaving ``base`` ``None``, so a load then
    called the checkpoint's ``base`` unexpected. Here ``base`` is made on meta
    with eager's shape and layout, for the load to fill from the checkpoint as
    it fills ``original``, and ``original`` gets eager's value (minus the
    identity); without the trivialization, ``original`` gets the layout of the
    QR factors eager construction keeps there.
    Installed while a :func:`meta_init` block is open, acting only in its
    threads and only on a weight on meta.
    """

    def __init__(self) -> None:
        from torch.nn.utils import parametrizations

        self._owner = parametrizations._Orthogonal
        self._eager = self._owner.__dict__["right_inverse"]
        eager = self._eager

        @torch.no_grad()
        def right_inverse(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
            if not (_depth_flags() and isinstance(weight, torch.Tensor) and weight.is_meta
                    and weight.shape == module.shape):
                return eager(module, weight)
            if "base" not in module._buffers:  # use_trivialization=False
                if module.orthogonal_map != type(module.orthogonal_map).householder:
                    return eager(module, weight)  # torch's own NotImplementedError: no inverse, eagerly too
                # geqrf's result (no meta kernel), laid out as the CPU lays it out: column-major
                transposed = weight.size(-2) < weight.size(-1)
                shape = weight.mT.shape if transposed else weight.shape
                factors = torch.empty(*shape[:-2], shape[-1], shape[-2], dtype=weight.dtype, device="meta").mT
                return factors.mT if transposed else factors
            side = max(weight.size(-2), weight.size(-1))
            # column-major, as the QR that makes it eagerly lays it out (an orthogonal weight, cloned, is the
            # one exception: whether it is needs its values)
            module.base = torch.empty(*weight.shape[:-2], side, side, dtype=weight.dtype, device="meta").mT
            negative_identity = torch.zeros_like(weight)
            negative_identity.diagonal(dim1=-2, dim2=-1).fill_(-1.0)  # eager's value, though on meta it is none
            return negative_identity

        self._owner.right_inverse = right_inverse

    def remove(self) -> None:
        self._owner.right_inverse = self._eager


# The last context to leave, in any thread, takes the hooks away: none linger process-wide.
_HOOKS = SharedHooks(_install_hooks, _remove_hooks)


class _SkipInPlaceOnMeta(TorchFunctionMode):
    """Make in-place ops on meta tensors (``normal_``, ``uniform_``...) free, and ops mixing meta and real work.

    In-place ops on meta compute nothing anyway, but the first one imports
    torch's reference kernels and dynamo, which costs seconds per process.
    An op that fails because it mixes meta and real tensors runs again on
    meta; one that was to fill a real tensor from meta values leaves it
    marked as unfilled instead.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # torch.nn.init functions pass their tensor by keyword.
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        in_place = name.endswith("_") and not name.endswith("__") and isinstance(target, torch.Tensor)
        if in_place and target.is_meta:
            if name in _METADATA_IN_PLACE:  # what the tensor is, not what it holds: it takes effect
                return func(*args, **kwargs)
            if name == "share_memory_":  # meta has no memory to share: the load shares the memory it allocates
                _ask_shared_memory(target)
            return target
        if name in MOVES and isinstance(target, torch.Tensor) and target.is_meta:
            return stay_on_meta(name, target, args[1:], kwargs)
        try:
            return func(*args, **kwargs)
        except RuntimeError as error:  # the common path pays nothing for what follows
            if not _mixes_meta_and_real(args, kwargs):
                if any(sign in str(error) for sign in _VALUE_ASKED):
                    raise MetaInitError(
                        f"building a model under meta_init: {name or 'an op'}() asks for the value of a tensor on "
                        "meta, which has none (a constructor that checks or computes from its weights' values, as "
                        "torch's orthogonal parametrization does); build that module outside meta_init, or the "
                        "model on the CPU, and load into it") from error
                if isinstance(error, NotImplementedError) and _holds_meta(args, kwargs):
                    raise NoMetaKernelError(
                        f"building a model under meta_init: {name or 'an op'}() has no kernel for tensors on meta "
                        f"(torch: {str(error).splitlines()[0][:160]}); build that module outside meta_init, or the "
                        "model on the CPU, and load into it") from error
                raise
        if in_place:
            _unfilled()[id(target)] = target  # a real tensor given meta values: see _put_unfilled_buffers_on_meta
            return target
        # A constructor running its layers on a real input to size what follows (a hybrid ViT's backbone
        # on zeros) meets meta weights; most kernels then answer on meta, but torch's Python
        # decompositions (group_norm) refuse mixed devices. On meta, every op answers.
        return func(*(on_meta(value) for value in args), **{key: on_meta(value) for key, value in kwargs.items()})


# In-place ops that change a tensor's attributes, shape or strides, not its values: they run on meta (at no
# cost: no kernel computes anything), so a constructor's requires_grad_(False) freezes what it froze.
_METADATA_IN_PLACE = frozenset({
    "requires_grad_", "resize_", "resize_as_", "as_strided_", "transpose_", "t_", "squeeze_", "unsqueeze_",
    "swapdims_", "swapaxes_", "detach_", "rename_",
})
# Moves off meta (a constructor ending in self.to(device), .cuda(), .cpu()): a meta tensor stays on meta, with
# the dtype and memory format asked for; where it then lives is the load's device=.
MOVES = frozenset({"to", "cuda", "cpu"})
# id -> a weak reference (a WeakSet would compare tensors with ==, which tensors answer elementwise).
_shared_memory_asked: dict[int, "weakref.ref[torch.Tensor]"] = {}


def _ask_shared_memory(tensor: torch.Tensor) -> None:
    key = id(tensor)
    _shared_memory_asked[key] = weakref.ref(tensor, lambda _: _shared_memory_asked.pop(key, None))


def shared_memory_asked(tensor: torch.Tensor) -> bool:
    """Whether a constructor under :func:`meta_init` called ``share_memory_()`` on this meta tensor."""
    if not _shared_memory_asked:  # asked of almost no tensor: a load asks of each
        return False
    ref = _shared_memory_asked.get(id(tensor))
    return ref is not None and ref() is tensor


def stay_on_meta(name: str, tensor: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """A constructor's move of a meta tensor (``name`` in :data:`MOVES`): it stays on meta, in the dtype and
    memory format asked for."""
    if name != "to":
        return tensor
    _, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return tensor.to(device="meta", dtype=dtype or tensor.dtype, memory_format=memory_format or torch.preserve_format)


# What torch says when an op needs a meta tensor's value: .item(), bool(), .tolist(), a copy out of it.
_VALUE_ASKED = ("cannot be called on meta tensors", "Cannot copy out of meta tensor")


class NoMetaKernelError(MetaInitError, NotImplementedError):
    """An op with no kernel for meta tensors, met under :func:`meta_init`: a :class:`MetaInitError` naming it,
    and still the ``NotImplementedError`` torch's own code may catch (a parametrization without an inverse)."""


def _holds_meta(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(value, torch.Tensor) and value.is_meta for value in (*args, *kwargs.values()))


def _mixes_meta_and_real(args: tuple, kwargs: dict) -> bool:
    """Whether an op was given tensors both on meta and not."""
    found = 0  # bit 1: a meta tensor, bit 2: a real one
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            found |= 1 if value.is_meta else 2
        elif type(value) in (list, tuple):
            for item in value:
                if isinstance(item, torch.Tensor):
                    found |= 1 if item.is_meta else 2
    return found == 3


def on_meta(value: object) -> object:
    """``value`` with its tensors (in lists and tuples too) on meta."""
    if isinstance(value, torch.Tensor):
        return value if value.is_meta else value.to("meta")
    if type(value) in (list, tuple):
        return type(value)(on_meta(item) for item in value)
    return value


@contextmanager
def meta_init(include_buffers: bool = False) -> Iterator[None]:
    """Create the parameters of every module built inside on ``meta``.

    Args:
        include_buffers: put buffers on ``meta`` too. Off by default because
            non-persistent buffers (never saved in checkpoints) would then
            have to be recomputed by an init.

    Parameters are allocated on CPU by the module's constructor and moved to
    ``meta`` as they are registered, so a constructor that fills a large
    tensor (``torch.randn``) still pays for that fill once; ``nn.Linear`` and
    friends allocate without touching memory and cost nothing. Nesting is
    allowed (the innermost ``include_buffers`` wins) and the effect is local
    to the calling thread.

    A real buffer that the constructor fills in place from values computed
    on meta (a table computed on ``self.weight.device``) would hold garbage;
    it is put on meta instead, for the load to recompute with its module's
    ``reset_parameters()``, as for buffers built on meta.

    Python's cyclic garbage collector is paused while the outermost block
    runs (in every thread: it is process-wide), as :func:`deferred_init` and
    a load pause it: building keeps nearly all it makes, so the collector's
    passes would find nothing. Cycles made inside are collected after it.
    """
    _HOOKS.acquire()
    stack = _depth_flags()
    stack.append(include_buffers)
    # (25,000 small layers built in 4.4 s, not 6.4, with the collector paused)
    pauses_collector = gc.isenabled()  # not where an outer block (or the caller) paused it
    if pauses_collector:
        gc.disable()
    try:
        with _SkipInPlaceOnMeta():
            yield
    finally:
        try:
            stack.pop()
            if not stack:
                _put_unfilled_buffers_on_meta()
        finally:  # whatever that raises, neither the hooks nor a paused collector outlive the block
            _HOOKS.release()
            if pauses_collector:
                gc.enable()


def is_meta(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "meta"
