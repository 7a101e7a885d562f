"""Deferred init: build a model on ``meta`` while recording how eager construction would make each tensor.

:func:`deferred_init` runs a constructor with every factory function on
``meta`` and records, as a program, each op that makes a tensor or writes
into one (``empty``, ``uniform_``, ``normal_``, a column zeroed through a
view, ``randn`` for a buffer, arithmetic mixing two tensors), in order,
with the random generator each draw came from. Nothing is computed and no
tensor memory is held: the program costs memory in proportion to its ops
(plus the values of tensors made from Python data, ``torch.tensor([..])``,
as small as the literals they came from).

Replaying the program (:mod:`materialize.io.replay`: by ``mz.load`` for the
tensors a checkpoint lacks, by ``mz.materialize`` for all) gives every tensor
the values eager construction gives it under the same seed, bit for bit on
the CPU: the draws of tensors that are loaded are still made (and thrown
away) where a later draw depends on them.

Why a function (``deferred_init(fn, *args)``, torchdistx's form) and not a
``meta_init(record=True)`` block: the program belongs to one model, the one
``fn`` returns, and a block could build several or none.

What the recording sees:

* ops at torch's dispatch level (a ``TorchDispatchMode``), so in-place
  writes through views, ``torch.no_grad`` blocks and explicit generators
  count as they run;
* ``torch.nn.init.trunc_normal_``, ``orthogonal_``, ``sparse_`` and
  ``dirac_`` whole: on ``meta`` they return before any op (torch's own
  shortcut), so they are recorded as calls and replayed as calls;
* a generator reseeded or set between two draws (``torch.manual_seed`` in a
  constructor): the change is recorded as a step;
* factory functions on ``meta`` without ``torch.device("meta")``, which
  libraries read as "skip the init" (transformers' ``init_weights`` does);
* a recorded tensor's ``.device``, ``.is_meta`` and ``.is_cpu``, as eager
  construction's (code branching on a weight being on meta takes eager's
  path); that device object passed on as ``device=`` means the replay's
  device, recorded on meta;
* results laid out as the CPU's kernels lay them out (torch's meta kernels
  guess CUDA's layout for some: ``linalg.svd``'s Vh), and the composites that
  pick their kernels by whether a gradient may be needed (``linalg.svdvals``)
  as whole calls: under a dispatch mode torch takes that for yes;
* a lazy module's uninitialized tensors, left as eagerly made (empty, on the
  CPU); a quantized module's weights have no meta form and are refused;
* every other way a tensor comes into being, at the dispatcher: a factory
  the function mode never sees (the legacy constructors ``torch.Tensor(n)``,
  ``torch.FloatTensor(n)``, ``t.new(n)``, ``torch.normal(0, std, size=)``) is
  put on meta too; one given a device by name (``device="cpu"``) makes a real
  tensor there, as eagerly; data
  made outside the dispatcher (``torch.Tensor([..])``, ``torch.from_numpy``,
  ``torch.frombuffer``) stays real as eagerly made, its values kept as they
  were before any op wrote them, and a draw into a real tensor gets
  eager construction's numbers by replaying its steps. A tensor the
  recording cannot name (a sparse one) is refused.

A constructor that asks a tensor's value (``.item()``, ``.tolist()``,
``if w.sum() > 0``) gets eager construction's, computed then on the CPU by
replaying the steps that made it. One that asks it of a meta tensor from
before the recording, or runs a kernel with no meta implementation, cannot
be recorded: :class:`~materialize.errors.MetaInitError` names the module
being built and the op.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..errors import MetaInitError, ReplayError
from ..gcpause import gc_paused
from .program import DEFAULT_GENERATOR, GeneratorRef, Program, Ref, SetGenerator, Step, TargetDevice
from .replaying import values_of
from .meta import MOVES, is_lazy, on_meta, stay_on_meta
from .modtree import named_modules

aten = torch.ops.aten

_EMPTY = {aten.empty.memory_format, aten.empty_strided.default}
# What turns data made outside the dispatcher into a tensor (torch.Tensor([..]), torch.from_numpy).
_LIFTS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_META = torch.device("meta")
# What a recorded tensor's .device says, this very object: passed on as device=, it means the replay's device.
_EAGER_DEVICE = torch.device("cpu")
_DEVICE_ATTRIBUTE = torch.Tensor.device
_IS_META = torch.Tensor.is_meta
_IS_CPU = torch.Tensor.is_cpu  # .is_cuda, .is_xpu, .get_device() answer on meta as on the CPU already
_FORMAT = torch.Tensor.__format__
# Composites that pick their kernels' arguments by whether a gradient may be needed, which under any dispatch mode
# (the recording's) torch takes for yes: linalg.svdvals computes U and V, eigvalsh the eigenvectors, eigvals goes
# through linalg.eig; their results then differ in the last bits. Recorded as whole calls, replayed as eager made
# them. (torch.norm, matrix_norm, cond and matrix_rank reach svdvals or eigvalsh inside.)
_GRAD_DECIDED = frozenset({
    torch.linalg.svdvals, torch.linalg.eigvalsh, torch.linalg.eigvals, torch.linalg.cond, torch.linalg.matrix_rank,
    torch.linalg.matrix_norm, torch.linalg.norm, torch.svd, torch.Tensor.svd, torch.norm, torch.Tensor.norm,
    torch.nuclear_norm})
# torch.nn.init's in-place functions, recorded as whole calls and replayed as calls: some return at once for a
# meta tensor (trunc_normal_, orthogonal_, sparse_, dirac_: torch's shortcut), and the rest would cost a meta
# kernel in Python and the fan-in arithmetic for nothing, the recording's bulk on a model of many small layers.
_WHOLE_STEPS = ("uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                "kaiming_normal_", "orthogonal_", "sparse_", "constant_", "ones_", "zeros_", "eye_", "dirac_")
_NO_DRAW = frozenset({"constant_", "ones_", "zeros_", "eye_", "dirac_"})
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_NOT_COMPUTED = object()


def _list_indices_as_tensors(index: Any, recorder: "_Recorder") -> Any:
    """``index`` with each list of ints in it (``weight[[1, 2, 3]]``, peft's TrainableTokens) a tensor made from
    it and kept as a constant of the recording: torch makes a list's index tensor in C++, on the indexed
    tensor's device, where the recording would never see its values. Lists of anything else (bools: a mask;
    nested lists, which torch may read as a tuple) are left to torch."""
    if isinstance(index, tuple):
        items = tuple(_list_indices_as_tensors(item, recorder) for item in index)
        return items if any(new is not old for new, old in zip(items, index)) else index
    if type(index) is list and index and all(type(item) is int for item in index):
        with _disable_current_modes():
            made = torch.tensor(index)
        recorder.adopt_constant(made)
        return made
    return index
_CONSTRUCTORS = _device_constructors() - _FROM_DATA
# What torch says when an op needs a meta tensor's value: .item(), bool(), .tolist(), a copy out of it.
_VALUE_ASKED = ("cannot be called on meta tensors", "Cannot copy out of meta tensor", "_local_scalar_dense")

_programs: "weakref.WeakKeyDictionary[nn.Module, Program]" = weakref.WeakKeyDictionary()
_recording = threading.local()


def program_of(module: nn.Module) -> Optional[Program]:
    """The program :func:`deferred_init` recorded for ``module``; None for a model built otherwise."""
    return _programs.get(module)


def deferred_init(fn: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """``fn(*args, **kwargs)`` built on ``meta``, its construction recorded, so that each tensor can be made
    later with the values eager construction gives it under the same seed (see docs/deferred.md).

    The model behaves as any model built on meta: shard it, cast it
    (``.half()`` and ``.to(dtype)`` take effect in the replay: values are
    made as recorded, then cast, as eager construction then ``.half()``
    gives them), move it (``model.cuda()``, ``.to(device)``: its tensors stay
    on meta and the device becomes the replay's default), and load it with
    :func:`materialize.load`, which replays what the checkpoint lacks, or
    make it whole with :func:`materialize.materialize`.
    """
    if getattr(_recording, "active", False):
        raise MetaInitError("deferred_init inside deferred_init: build the inner module as part of the outer one")
    module, program = _recorded(fn, args, kwargs)
    _programs[module] = program
    # model.cuda() / .to(device) / .cpu() on the whole model keep its tensors on meta and say where the replay
    # goes (torch would refuse to copy out of meta): an instance attribute, on the root module only.
    module._apply = types.MethodType(_applied_on_meta, module)
    return module


@gc_paused  # the recording keeps every step it makes: the collector's passes would find nothing
def _recorded(fn: Callable[..., nn.Module], args: tuple, kwargs: dict) -> tuple[nn.Module, Program]:
    program = Program()
    recorder = _Recorder(program)
    recorder.generator_index(None)
    _recording.active = True
    try:
        with _OnMeta(recorder), _whole_steps(recorder), _meta_kernels_laid_out_as_eager(), recorder:
            module = fn(*args, **kwargs)
    finally:
        _recording.active = False
    if not isinstance(module, nn.Module):
        raise MetaInitError(f"deferred_init: {getattr(fn, '__qualname__', fn)!r} returned {type(module).__name__}, "
                            "not an nn.Module")
    sids = recorder.sids
    uninitialized: dict[int, torch.Tensor] = {}
    for prefix, owner in named_modules(module, remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for registry in (owner._parameters, owner._buffers):
            for attr, tensor in list(registry.items()):
                if tensor is not None and is_lazy(tensor):  # no shape, no values: nothing to replay
                    registry[attr] = _uninitialized_as_eager(tensor, uninitialized)
                    continue
                sid = sids.get(tensor.untyped_storage()._cdata) if tensor is not None else None
                if sid is not None:
                    program.bindings[dot + attr] = Ref.of(sid, tensor)
        for attr, value in owner.__dict__.items():  # plain tensor attributes (a prompt's token ids): replayed too
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.parameter.UninitializedTensorMixin):
                sid = sids.get(value.untyped_storage()._cdata)
                if sid is not None:
                    program.bindings.setdefault(dot + attr, Ref.of(sid, value))
    return module, program


def _uninitialized_as_eager(tensor: torch.Tensor, made: dict[int, torch.Tensor]) -> torch.Tensor:
    """A lazy module's uninitialized parameter or buffer (``nn.LazyLinear``'s, shaped at its first forward) as
    eager construction leaves it: empty on the CPU, of its class, so that forward makes it there, with eager's
    init, as it would on a model built eagerly (left on meta, it would be made on meta). Ties stay one."""
    found = made.get(id(tensor))
    if found is None:
        with torch._C.DisableTorchFunction():  # the class refuses most reads in its own handler
            if not tensor.is_meta:
                return tensor
            found = torch.Tensor._make_subclass(type(tensor), torch.empty(0, dtype=tensor.dtype, device=_EAGER_DEVICE),
                                                tensor.requires_grad)
        found.__dict__.update(tensor.__dict__)
        made[id(tensor)] = found
    return found


_hint_lock = threading.Lock()
_hint_users: list = [0, None]  # recordings under way (any thread), torch's own device_hint while they are


@contextlib.contextmanager
def _meta_kernels_laid_out_as_eager() -> Iterator[None]:
    """torch's Python meta kernels lay out some results by the device they guess a meta tensor stands for, and
    guess CUDA (``device_hint``: linalg.svd's Vh and linalg.eig's vectors row-major, column-major on the CPU;
    the FFTs): told eager construction's device in a recording's thread, so a recorded tensor has eager's
    strides, and the ops after it read it in eager's memory order."""
    registrations = sys.modules["torch._meta_registrations"]  # imported by torch's own import
    with _hint_lock:
        if _hint_users[0] == 0:
            _hint_users[1] = original = registrations.device_hint

            def device_hint(tensor: Any) -> str:
                if (getattr(_recording, "active", False) and isinstance(tensor, torch.Tensor) and tensor.is_meta
                        and not isinstance(tensor, torch._subclasses.FakeTensor)):
                    return _EAGER_DEVICE.type
                return original(tensor)

            registrations.device_hint = device_hint
        _hint_users[0] += 1
    try:
        yield
    finally:
        with _hint_lock:
            _hint_users[0] -= 1
            if _hint_users[0] == 0:
                registrations.device_hint = _hint_users[1]


def _applied_on_meta(self: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
    program = _programs.get(self)
    if program is None:
        return type(self)._apply(self, fn, recurse)
    with _MovesStayOnMeta(program):
        return type(self)._apply(self, fn, recurse)


class _MovesStayOnMeta(TorchFunctionMode):
    """A move of a recorded model's meta tensor (``.cuda()``, ``.to(device, dtype)``, ``.cpu()``): the tensor
    stays on meta, in the dtype asked for, and the device asked for becomes the replay's default."""

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _move_of_meta(func, args)
        if name is not None:
            asked = _device_asked(name, args[1:], kwargs)
            if asked is not None and asked.type != "meta":
                self.program.device = asked
            return stay_on_meta(name, args[0], args[1:], kwargs)
        return func(*args, **kwargs)


def _move_of_meta(func: Any, args: tuple) -> Optional[str]:
    """The name of a move (``to``, ``cuda``, ``cpu``) called on a meta tensor; None for any other call."""
    name = getattr(func, "__name__", "")
    return name if name in MOVES and args and isinstance(args[0], torch.Tensor) and args[0].is_meta else None


def _device_asked(name: str, args: tuple, kwargs: dict) -> Optional[torch.device]:
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        index = args[0] if args else kwargs.get("device")
        if index is None:
            return torch.device("cuda")
        return torch.device(index) if not isinstance(index, int) else torch.device("cuda", index)
    device = torch._C._nn._parse_to(*args, **kwargs)[0]
    return torch.device(device) if device is not None else None


class _Recorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo-disabling frame by default: 30 us an op, half the
        # recording's time on a model of many small tensors. A recording never runs under torch.compile.
        return False

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program
        self.thread = threading.get_ident()
        self.sids: dict[int, int] = {}  # storage address -> sid
        # Every storage seen stays alive while recording, so no address is reused for another one (on meta
        # they hold no memory); the program itself keeps none of them.
        self.alive: list[torch.UntypedStorage] = []
        self.generators: dict[int, int] = {}  # id(generator) -> index
        self.generator_objects: list[torch.Generator] = [torch.default_generator]
        self.last_state: dict[int, bytes] = {}
        self.last_seed: dict[int, int] = {}
        self.drawn_for_real: set[int] = set()  # generators a real tensor drew from since their last check
        self.answers: dict[tuple, tuple] = {}  # see _on_meta_as_before
        self.values_asked: dict[Ref, torch.Tensor] = {}  # see _values; forgotten when their storage is written
        self.kept_constants: set[int] = set()  # see keep_constants_written
        self.device_asked = 0  # inside a factory function given a device by name: see _OnMeta
        self.meta_eagerly: set[int] = set()  # meta tensors from before the recording, and what ops made of them

    def _new_sid(self, tensor: torch.Tensor) -> int:
        if tensor.layout is not torch.strided:  # no storage to name (torch.sparse.FloatTensor(n)): refused, loud
            raise MetaInitError(f"deferred_init: {_module_being_built()} makes a {tensor.layout} tensor, which the "
                                "recording cannot hold; build that module outside deferred_init and load into it")
        sid = len(self.alive)
        # The storage itself, not only its tensor: code that gives a tensor other memory (`param.data = ...`,
        # peft's XLoRA) frees the first storage, and a tensor made next at its address took its sid.
        self.alive.append(tensor.untyped_storage())
        self.sids[tensor.untyped_storage()._cdata] = sid
        return sid

    def made_here(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is on meta only because the recording put it there (one from before is on meta
        eagerly too)."""
        with torch._C.DisableTorchFunction():  # a lazy module's parameter refuses these reads in its own handler
            if not tensor.is_meta:
                return False
            sid = self.sids.get(tensor.untyped_storage()._cdata)
        return sid is not None and sid not in self.meta_eagerly

    def made_of_meta_eagerly(self, reads: set, made: list) -> None:
        if self.meta_eagerly and not self.meta_eagerly.isdisjoint(reads):
            self.meta_eagerly.update(sid for _, sid in made)

    def whole_call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """A composite of :data:`_GRAD_DECIDED`: run as eager construction runs it (no mode: the kernels it picks
        are eager's), on meta where any of its tensors is, and recorded as one step making its results."""
        reads: set = set()
        generators: list = []
        with torch._C.DisableTorchFunction():
            t_args = self.template(args, reads, generators)
            t_kwargs = {key: self.template(value, reads, generators) for key, value in kwargs.items()}
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            meta = any(t.is_meta for t in tensors)
        with _disable_current_modes():
            out = (func(*on_meta(args), **{key: on_meta(value) for key, value in kwargs.items()}) if meta
                   else func(*args, **kwargs))
        outs = out if isinstance(out, tuple) else (out,)
        made = []
        for position, tensor in enumerate(outs):
            if isinstance(tensor, torch.Tensor):
                sid = self._new_sid(tensor)
                self.program.made_as[sid] = Ref.of(sid, tensor)
                made.append((position, sid))
        self.made_of_meta_eagerly(reads, made)
        self.program.steps.append(Step(func, t_args, t_kwargs, tuple(made), frozenset(reads),
                                       frozenset(sid for _, sid in made), None, _module_being_built(), grad=grad))
        return out

    def ref(self, tensor: torch.Tensor) -> Ref:
        sid = self.sids.get(tensor.untyped_storage()._cdata)
        if sid is None:  # made before the recording (or outside the dispatcher)
            sid = self._new_sid(tensor)
            if tensor.is_meta:
                self.program.unrecorded.add(sid)
                self.meta_eagerly.add(sid)
            else:
                self.program.constants[sid] = tensor
        return Ref.of(sid, tensor)

    def adopt_constant(self, tensor: torch.Tensor) -> None:
        """A tensor made from Python data (``torch.tensor``), on the CPU as eager construction makes it: its
        values are kept (as small as the literal) and remade on the replay's device."""
        sid = self._new_sid(tensor)
        self.program.made_as[sid] = Ref.of(sid, tensor)
        self.program.steps.append(Step(_remade, (tensor.detach().clone(), TargetDevice()), {}, ((0, sid),),
                                       frozenset(), frozenset({sid}), None, _module_being_built()))

    def generator_index(self, generator: Optional[torch.Generator]) -> int:
        generator = torch.default_generator if generator is None else generator
        index = self.generators.get(id(generator))
        if index is None:
            index = DEFAULT_GENERATOR if generator is torch.default_generator else len(self.generator_objects)
            if index != DEFAULT_GENERATOR:
                self.generator_objects.append(generator)
            self.generators[id(generator)] = index
            self.program.start_states[index] = state = generator.get_state()
            self.last_state[index] = _state_bytes(state)
            self.last_seed[index] = self.program.start_seeds[index] = generator.initial_seed()
        return index

    def before_draw(self, index: int) -> None:
        """A generator changed since its last draw without a recorded op (reseeded, set to a saved state): that
        is a step too. Draws on meta do not move a generator, so a seed as before and no real draw since mean
        the state is as before (torch.manual_seed to the same seed is seen where it is called: see
        _seeding_calls); else the state itself is compared."""
        generator = self.generator_objects[index]
        if generator.initial_seed() == self.last_seed[index] and index not in self.drawn_for_real:
            return
        state = generator.get_state()
        now = _state_bytes(state)
        self.drawn_for_real.discard(index)
        if now != self.last_state[index]:
            self.set_generator_step(index, generator, state, now)

    def set_generator_step(self, index: int, generator: torch.Generator, state: torch.Tensor, as_bytes: bytes) -> None:
        seed = generator.initial_seed()
        as_seed = generator.device.type == "cpu" and _state_bytes(torch.Generator().manual_seed(seed).get_state()) == as_bytes
        self.program.steps.append(SetGenerator(index, seed if as_seed else None, None if as_seed else state))
        self.last_state[index], self.last_seed[index] = as_bytes, seed

    def seeded(self) -> None:
        """The global generator reseeded or set by torch's own functions (torch.manual_seed, set_rng_state) in
        this thread: a step, even to the state it already had (meta draws never moved it, eager's did)."""
        if threading.get_ident() == self.thread:
            state = torch.default_generator.get_state()
            self.drawn_for_real.discard(DEFAULT_GENERATOR)
            self.set_generator_step(DEFAULT_GENERATOR, torch.default_generator, state, _state_bytes(state))

    def after_draw(self, index: int, on_real: bool) -> None:
        if on_real:  # a real tensor's draw moved the generator itself: compare its state at the next draw
            self.drawn_for_real.add(index)
            self.last_state[index] = _state_bytes(self.generator_objects[index].get_state())

    def _values(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a constructor asks of a tensor on meta (``.item()``, ``.tolist()``, a copy into a real one):
        the values eager construction gives it, computed now on the CPU by replaying the steps that made it
        (a stochastic-depth schedule from ``torch.linspace(...).tolist()``, torchvision's RegNet widths)."""
        ref = self.ref(tensor)
        known = self.values_asked.get(ref)
        if known is not None:
            return known
        try:
            with _disable_current_modes(), torch._C.DisableTorchFunction():  # the replay is not recorded
                values = values_of(self.program, ref)
        except ReplayError as error:
            raise MetaInitError(f"deferred_init: {_module_being_built()} asks for the value of a tensor on meta "
                                f"that {error.reason}; build that module outside deferred_init and load into it"
                                ) from error
        self.values_asked[ref] = values
        return values

    def _on_meta_as_before(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """An op making one tensor from tensors on meta only, answered as it was for the same shapes before.

        On meta an op's result is its shape, strides and dtype, which follow
        from its arguments' alone; many of torch's meta kernels are Python
        (a hundred microseconds an op, more than the CPU kernel on a small
        tensor), and a model repeats the same ops on the same shapes layer
        after layer (a rotary table, each block's norms).
        """
        key = _signature(func, args, kwargs)
        known = self.answers.get(key) if key is not None else None
        if known is not None:
            size, stride, dtype = known
            return torch.empty_strided(size, stride, dtype=dtype, device="meta")
        out = func(*args, **kwargs)
        if key is not None and isinstance(out, torch.Tensor) and out.is_meta and out.storage_offset() == 0:
            self.answers[key] = (tuple(out.shape), tuple(out.stride()), out.dtype)
        return out

    def template(self, value: Any, reads: set, generators: list) -> Any:
        """``value`` with tensors, generators and the meta device replaced by what the replay resolves."""
        kind = type(value)  # by type first: an op's arguments are mostly numbers, and isinstance costs
        if kind in _PLAIN:
            return value
        if kind is list or kind is tuple:
            if all(type(item) in _PLAIN for item in value):  # sizes, strides
                return value
            return kind(self.template(item, reads, generators) for item in value)
        if kind is torch.device:
            return TargetDevice() if value.type == "meta" else value
        if kind is torch.Generator:
            index = self.generator_index(value)
            generators.append(index)
            return GeneratorRef(index)
        if isinstance(value, torch.Tensor):
            ref = self.ref(value)
            reads.add(ref.sid)
            return ref
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # An op reached without the function mode's frame (nn.Parameter's detach) would have its bookkeeping's
        # reads of shapes and strides seen by that mode: 20 us an op.
        with torch._C.DisableTorchFunction():
            return self.record(func, args, kwargs or {})

    def record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func is aten._local_scalar_dense.default and args[0].is_meta:  # .item(), float(), bool(), a Python int
            return self._values(args[0]).item()
        if func in _LIFTS:  # torch.Tensor([..]), torch.from_numpy(a): a real tensor of data, kept as eagerly made
            out = func(*args, **kwargs)
            if not out.is_meta and out.untyped_storage()._cdata not in self.sids:
                self.adopt_constant(out)
            return out
        shape = _op_shape(func)
        written, fresh, draws = shape.written, shape.fresh, shape.draws
        if not written and not fresh:  # a view or detach: seen later as a view of its storage
            return func(*args, **kwargs)
        if shape.quantizes and (_device_type(kwargs) == "meta" or any(
                isinstance(value, torch.Tensor) and value.is_meta for value in (*args, *kwargs.values()))):
            raise _quantized_refusal(func)  # some run on meta, but as float tensors (quantize_per_tensor)
        if shape.factory and not self.device_asked and _device_type(kwargs) != "meta":
            # A factory the function mode does not see: the legacy constructors (torch.Tensor(n),
            # torch.FloatTensor(n), t.new(n)), torch.normal(mean, std, size=). Made real, it would cost its memory
            # and hold values drawn now from a generator whose meta draws never happened.
            kwargs = {**kwargs, "device": _META, "pin_memory": False}
        schema = func._schema
        replayed = _with_generator_argument(func) if draws and not shape.takes_generator else func
        reads: set = set()
        generators: list = []
        t_args = self.template(args, reads, generators)
        t_kwargs = {key: self.template(value, reads, generators) for key, value in kwargs.items()}
        generator = None
        if draws:
            generator = generators[0] if generators else self.generator_index(None)
            t_kwargs["generator"] = GeneratorRef(generator)
            self.before_draw(generator)
        writes = set()
        for position in written:
            value = args[position] if position < len(args) else kwargs.get(schema.arguments[position].name)
            if isinstance(value, torch.Tensor):
                writes.add(self.ref(value).sid)
        self.keep_constants_written(writes)
        try:
            if func is aten.empty.memory_format and _device_type(kwargs) == "meta":  # every parameter's first op
                out = torch.empty(*args, **kwargs)  # the binding's own path: a third of the op's generic call
            elif shape.skippable and all(isinstance(args[i], torch.Tensor) and args[i].is_meta for i in written):
                out = args[written[0]]  # writes values on meta, which has none: nothing to compute (as meta_init)
            elif func is aten._to_copy.default and args[0].is_meta and _device_type(kwargs) not in (None, "meta"):  # .cpu()
                out = func(self._values(args[0]), **kwargs)
            elif func is aten.copy_.default and not args[0].is_meta and args[1].is_meta:  # real.copy_(meta)
                out = func(args[0], self._values(args[1]), *args[2:], **kwargs)
            elif _mixes_meta_and_real((*args, *kwargs.values())):  # a constant met a meta tensor: answered on meta
                out = func(*on_meta(args), **{key: on_meta(value) for key, value in kwargs.items()})
            elif not written and shape.one_output:
                out = self._on_meta_as_before(func, args, kwargs)
            else:
                out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as error:
            computed = self._computed_from_values(func, args, kwargs, written, draws)
            if computed is not _NOT_COMPUTED:
                return computed
            if any(sign in str(error) for sign in _VALUE_ASKED) or func is aten._local_scalar_dense.default:
                raise MetaInitError(
                    f"deferred_init: {_module_being_built()} asks for the value of a tensor on meta ({func}), which "
                    "the recording does not have; build that module outside deferred_init and load into it"
                ) from error
            if kwargs.get("dtype") in _QUANTIZED_DTYPES:  # torch.empty(n, dtype=torch.qint8)
                raise _quantized_refusal(func) from error
            if _device_type(kwargs) == "meta" or any(isinstance(value, torch.Tensor) and value.is_meta
                                                     for value in (*args, *kwargs.values())):
                # A kernel without a meta implementation (a C++ extension's op): nothing can record it.
                raise MetaInitError(
                    f"deferred_init: {_module_being_built()} runs {func} on meta, which it cannot: "
                    f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}; build that module "
                    "outside deferred_init and load into it") from error
            raise
        outs = out if isinstance(out, (tuple, list)) else (out,)
        made = []
        for position in fresh:
            tensor = outs[position] if position < len(outs) else None
            if isinstance(tensor, torch.Tensor):
                sid = self._new_sid(tensor)
                self.program.made_as[sid] = Ref.of(sid, tensor)
                if func in _EMPTY:
                    self.program.made_empty.add(sid)
                made.append((position, sid))
                writes.add(sid)
        self.made_of_meta_eagerly(reads, made)
        drawn_real = draws and self.drawn_real(func, args, kwargs, written, outs, fresh)
        if draws:
            self.after_draw(generator, bool(drawn_real))
        self.program.steps.append(Step(replayed, t_args, t_kwargs, tuple(made), frozenset(reads), frozenset(writes),
                                       generator, _module_being_built()))
        self.forget_values(writes)
        for tensor in drawn_real or ():
            self.set_eager_values(tensor)
        return out

    def _computed_from_values(self, func: Any, args: tuple, kwargs: dict, written: tuple, draws: bool) -> Any:
        """An op meta cannot answer (no meta kernel: ``geqrf`` in torch's ``orthogonal()``, ``nonzero`` in peft's
        SHiRA; or one asking values: ``allclose``), run on the values eager construction gives its inputs, on
        the CPU, there and then; its tensors are kept as constants of the recording (remade on the replay's
        device), as a tensor made from Python data is. Only ops that write none of their inputs and draw nothing:
        ``_NOT_COMPUTED`` for the others, and where the values cannot be had."""
        if written or draws or func is aten._local_scalar_dense.default or kwargs.get("out") is not None:
            return _NOT_COMPUTED
        if not any(isinstance(value, torch.Tensor) and value.is_meta for value in (*args, *kwargs.values())):
            return _NOT_COMPUTED  # nothing of the recording's in it: the error is the op's own
        try:
            real_args = tuple(self._values(value) if isinstance(value, torch.Tensor) and value.is_meta else value
                              for value in args)
            real_kwargs = {key: self._values(value) if isinstance(value, torch.Tensor) and value.is_meta else value
                           for key, value in kwargs.items()}
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                out = func(*real_args, **real_kwargs)
        except Exception:  # noqa: BLE001 - then the op is refused as before, with the meta kernel's error
            return _NOT_COMPUTED
        for tensor in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in self.sids:
                self.adopt_constant(tensor)
        return out

    def forget_values(self, written: set) -> None:
        """Values asked of tensors before an op wrote them are not theirs any more (see _values)."""
        if self.values_asked:
            self.values_asked = {ref: values for ref, values in self.values_asked.items() if ref.sid not in written}

    @staticmethod
    def drawn_real(func: Any, args: tuple, kwargs: dict, written: tuple, outs: tuple, fresh: tuple) -> list:
        """The real tensors a draw filled (``constant.uniform_()``, ``torch.rand_like(constant)``)."""
        arguments = func._schema.arguments
        filled = [args[p] if p < len(args) else kwargs.get(arguments[p].name) for p in written]
        filled += [outs[p] for p in fresh if p < len(outs)]
        return [t for t in filled if isinstance(t, torch.Tensor) and not t.is_meta]

    def set_eager_values(self, tensor: torch.Tensor) -> None:
        """A real tensor drew from a generator in the state the recording left it, not eager construction's
        (the meta draws before it advanced nothing): its values are made again by replaying its steps."""
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
            tensor.copy_(self._values(tensor))

    def keep_constants_written(self, sids: set) -> None:
        """A real tensor from before the recording (or made unseen) that an op is about to write: the replay
        starts from its values as they are now, so those are kept, not the tensor itself, which the op and later
        ones change (and the replay must never write into a live tensor of the caller's)."""
        for sid in sids:
            constant = self.program.constants.get(sid)
            if constant is not None and sid not in self.kept_constants:
                with _disable_current_modes():
                    kept = torch.empty(0, dtype=torch.uint8, device=constant.device)
                    kept.set_(constant.untyped_storage().clone())
                    if kept.numel() % constant.element_size() == 0:  # else a view by bytes: see replaying._view
                        kept = kept.view(constant.dtype)
                self.program.constants[sid] = kept
                self.kept_constants.add(sid)


@dataclass(frozen=True)
class _OpShape:
    written: tuple[int, ...]  # positions of the arguments it writes
    fresh: tuple[int, ...]  # positions of the outputs that alias nothing
    draws: bool
    takes_generator: bool
    skippable: bool  # an in-place op on values whose one output is its first, written, argument
    one_output: bool  # returns one tensor
    factory: bool  # makes a tensor from no tensor, on the device it is given (torch.Tensor(n), torch.normal(size=))
    quantizes: bool  # makes or packs quantized tensors: see _quantized_refusal


# Ops that write what a tensor is (its shape, strides, storage), not its values: they run on meta too.
_METADATA_WRITES = frozenset({"resize_", "resize_as_", "as_strided_", "set_", "squeeze_", "unsqueeze_", "transpose_",
                              "t_", "swapdims_", "swapaxes_", "detach_", "requires_grad_", "rename_", "_coalesced_"})
_op_shapes: dict[Any, _OpShape] = {}
_PLAIN = frozenset({int, float, bool, type(None)})


# Ops whose schemas do not declare what they write: batch norm's kernels update the running statistics they are
# given in training (a forward run while building: the recording must see the update for the replay to make it).
_UNDECLARED_WRITES = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
    "aten::batch_norm_update_stats": (1, 2),
}


def _op_shape(func: Any) -> _OpShape:
    """What a recording needs of an op's schema, worked out once per op."""
    found = _op_shapes.get(func)
    if found is None:
        schema = func._schema
        written = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
        written = tuple(sorted({*written, *_UNDECLARED_WRITES.get(schema.name, ())}))
        fresh = tuple(i for i, r in enumerate(schema.returns) if r.alias_info is None)
        skippable = (written == (0,) and not fresh and len(schema.returns) == 1
                     and schema.arguments[0].name == "self" and func.overloadpacket.__name__ not in _METADATA_WRITES)
        one_output = len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"
        factory = (bool(fresh) and any(a.name == "device" for a in schema.arguments)
                   and not any("Tensor" in str(a.type) for a in schema.arguments))
        name = func.name()
        quantizes = func.namespace == "quantized" or name.startswith("aten::quantize_per") or "affine_quantized" in name
        found = _op_shapes[func] = _OpShape(written, fresh, torch.Tag.nondeterministic_seeded in func.tags,
                                            _takes_generator(func), skippable, one_output, factory, quantizes)
    return found


def _signature(func: Any, args: tuple, kwargs: dict) -> Optional[tuple]:
    """What an op's result on meta depends on: the op, its tensors' shapes, strides and dtypes, its other
    arguments; None where a tensor is not on meta or an argument cannot be a key."""
    parts: list = [func]
    for value in (*args, *kwargs.items()):
        if isinstance(value, torch.Tensor):
            if not value.is_meta:
                return None
            parts.append((tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype))
        elif isinstance(value, tuple) and len(value) == 2 and type(value[0]) is str:  # a keyword argument
            inner = value[1]
            if isinstance(inner, torch.Tensor):
                return None
            parts.append((value[0], inner if type(inner) in _PLAIN or type(inner) in (torch.dtype, torch.device,
                                                                                     torch.memory_format, torch.layout)
                          else _hashable(inner)))
        else:
            parts.append(value if type(value) in _PLAIN else _hashable(value))
    return tuple(parts) if all(part is not _UNHASHABLE for part in parts) else None


_UNHASHABLE = object()


def _hashable(value: Any) -> Any:
    if type(value) in (list, tuple):
        items = tuple(_hashable(item) if type(item) not in _PLAIN else item for item in value)
        return _UNHASHABLE if _UNHASHABLE in items else items
    if type(value) in (torch.dtype, torch.device, torch.memory_format, torch.layout):
        return value
    return _UNHASHABLE


def _state_bytes(state: torch.Tensor) -> bytes:
    """A generator's state to compare (bytes: no torch op, which a recording would see)."""
    with torch._C.DisableTorchFunction():
        return state.numpy().tobytes()


def _device_type(kwargs: dict) -> Optional[str]:
    """The type of the device an op was given (``"meta"``, ``"cpu"``...), None where it was given none."""
    device = kwargs.get("device")
    return torch.device(device).type if device is not None else None


def _remade(saved: torch.Tensor, device: torch.device) -> torch.Tensor:
    return saved.to(device, copy=True)


def _takes_generator(func: Any) -> bool:
    return any("Generator" in str(argument.type) for argument in func._schema.arguments)


def _with_generator_argument(func: Any) -> Any:
    """The overload of a random op that takes a generator (``randn.default`` -> ``randn.generator``): the
    replay draws from its own."""
    name = func._overloadname
    found = getattr(func.overloadpacket, "generator" if name == "default" else f"{name}_generator", None)
    if found is None or not _takes_generator(found):
        raise MetaInitError(f"deferred_init: {_module_being_built()} draws with {func}, which has no overload taking "
                            "a generator: its draws could not be replayed exactly")
    return found


def _mixes_meta_and_real(values: Any) -> bool:
    found = 0  # bit 1: a meta tensor; bit 2: a real one of one dimension or more (a 0-d one mixes with any device)
    for value in values:
        if isinstance(value, torch.Tensor):
            found |= 1 if value.is_meta else (2 if value.dim() else 0)
        elif type(value) in (list, tuple):
            found |= 3 if _mixes_meta_and_real(value) else 0
    return found == 3


_QUANTIZED_DTYPES = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def _quantized_refusal(func: Any) -> MetaInitError:
    """An op making or packing quantized tensors on meta (``_empty_affine_quantized``, ``quantize_per_tensor``,
    ``quantized::linear_prepack``): torch has no meta form of them (some answer on meta with a float tensor)."""
    return MetaInitError(
        f"deferred_init: {_quantized_module_being_built()} makes quantized tensors ({func}), which have no meta "
        "form: a quantized module holds its weights quantized and packed for its engine, not as tensors a replay "
        "makes; build it outside deferred_init, or record the float model and quantize it after materialize "
        "(torch.ao.quantization.convert)")


def _quantized_module_being_built() -> str:
    """The outermost quantized module being built, by the name torch exports it under
    (``torch.ao.nn.quantized.Linear``, not the ``LinearPackedParams`` inside it that makes the tensor)."""
    frame = sys._getframe(2)
    found = None
    while frame is not None:
        module = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
        if isinstance(module, nn.Module) and ".quantized" in type(module).__module__:
            found = type(module)
        frame = frame.f_back
    if found is None:
        return _module_being_built()
    parts = found.__module__.split(".")
    for end in range(1, len(parts) + 1):  # the shortest package exporting it
        if getattr(sys.modules.get(".".join(parts[:end])), found.__name__, None) is found:
            return f"{'.'.join(parts[:end])}.{found.__name__}"
    return f"{found.__module__}.{found.__qualname__}"


def _module_being_built() -> str:
    """The innermost module whose ``__init__`` is running (for messages)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), nn.Module):
            return type(frame.f_locals["self"]).__qualname__
        frame = frame.f_back
    return "the constructor"


class _OnMeta(TorchFunctionMode):
    """Factory functions make their tensors on meta unless given a device.

    Not ``torch.device("meta")``: libraries ask for the default device and
    skip their init on meta (transformers' ``init_weights`` does), and the
    init is what is recorded. ``torch.tensor(data)`` is made on the CPU, as
    eager construction makes it, and kept as a constant of the recording.
    """

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is _DEVICE_ATTRIBUTE or owner is _IS_META or owner is _IS_CPU:  # tensor.device, .is_meta, .is_cpu
            # A recorded tensor is where eager construction puts it: code that branches on a weight being on
            # meta (DETR's frozen batch norms copy their values only off meta; peft's DEFT initializes only
            # `if not self.weight.is_meta`) takes eager construction's path.
            if not self.recorder.made_here(args[0]):
                return func(*args, **kwargs)
            return _EAGER_DEVICE if owner is _DEVICE_ATTRIBUTE else owner is _IS_CPU
        if func is _FORMAT and self.recorder.made_here(args[0]) and args[0].dim() == 0:  # f"{loss:.3f}"
            return format(args[0].item(), *args[1:])  # eager's value (on meta, torch's own would raise)
        if func in _GRAD_DECIDED and kwargs.get("out") is None:
            return self.recorder.whole_call(func, args, kwargs)
        if func in _INDEXING and len(args) > 1:
            index = _list_indices_as_tensors(args[1], self.recorder)
            if index is not args[1]:
                return func(args[0], index, *args[2:], **kwargs)
        name = _move_of_meta(func, args)
        if name is not None:
            return stay_on_meta(name, args[0], args[1:], kwargs)  # where it lives is the load's device=
        device = kwargs.get("device")
        if device is _EAGER_DEVICE:  # device=weight.device: where the weight is, on meta, the replay's device
            if func in _FROM_DATA:  # data: as made on the default device, a constant
                kwargs = {key: value for key, value in kwargs.items() if key != "device"}
                device = None
            else:
                return func(*args, **{**kwargs, "device": "meta"})
        if device is None:
            if func in _FROM_DATA:
                with _disable_current_modes():
                    made = func(*args, **kwargs)
                self.recorder.adopt_constant(made)
                return made
            if func in _CONSTRUCTORS:
                kwargs = {**kwargs, "device": "meta"}
        elif torch.device(device).type != "meta":
            # Asked for by name (timm's RegNet sizes its stages with torch.arange(.., device="cpu") and
            # torch.unique, which has no meta kernel): made there, as eagerly; a draw into it is made again.
            self.recorder.device_asked += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.recorder.device_asked -= 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def _whole_steps(recorder: _Recorder) -> Iterator[None]:
    """The whole-call functions recorded wherever a loaded module holds them: ``torch.nn.init``'s own names,
    names imported from it (``from torch.nn.init import trunc_normal_``), and tables of them
    (transformers' ``initialization.TORCH_INIT_FUNCTIONS``, which its ``init.trunc_normal_`` calls); and
    torch's seeding functions, seen where they are called."""
    makers: dict[Callable, Callable[[Callable], Callable]] = {}  # an original -> what replaces it, or a wrapper of it
    for name in _WHOLE_STEPS:
        makers[getattr(nn.init, name)] = functools.partial(_recorded_call, recorder, draws=name not in _NO_DRAW)
    for original in (torch.random.manual_seed, torch.random.set_rng_state, torch.random.seed):
        makers[original] = functools.partial(_seeding_call, recorder)
    makers[torch.random.get_rng_state] = functools.partial(_state_refused, recorder)
    replacements: dict[int, Callable] = {}  # one replacement per function object found, wherever it is held
    patched = []
    for table, key, value, original in _holders(frozenset(makers)):
        if table.get(key) is value:
            if id(value) not in replacements:
                replacements[id(value)] = makers[original](value)
            patched.append((table, key, value))
    for table, key, value in patched:
        table[key] = replacements[id(value)]
    try:
        yield
    finally:
        for table, key, value in patched:
            table[key] = value


# Where loaded modules hold the whole-call functions: module name -> (its namespace, that namespace's length
# when scanned, the places found). A recording scans only the modules new or grown since the last one (with
# transformers, timm and torchvision loaded, a full scan was 40 ms, more than recording a small model), and
# none while nothing was imported since: a name bound to one of them at run time, in a module imported
# before, is then not seen (an import binds them; a lazy module's attribute comes with an import).
_scanned: dict[str, tuple[dict, int, list]] = {}
_scanned_for: list[frozenset] = []


_last_holders: list = [-1, []]  # len(sys.modules) at the last scan, and what it found


def _holders(originals: frozenset) -> list[tuple[dict, Any, Callable, Callable]]:
    """(table, key, the function it holds, the original that function is or wraps) for every place found."""
    if _scanned_for != [originals]:
        _scanned.clear()
        _scanned_for[:] = [originals]
        _last_holders[:] = [-1, []]
    if _last_holders[0] == len(sys.modules):  # nothing imported since: 2,600 modules walked were 2 ms a recording
        return _last_holders[1]
    found: list[tuple[dict, Any, Callable, Callable]] = []
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if type(namespace) is not dict:
            continue
        known = _scanned.get(name)
        # Rescanned when it grew, or a place found holds another function now (importing torch._dynamo wraps
        # torch.manual_seed in place: the wrapper calls the original directly, not through any namespace).
        if (known is None or known[0] is not namespace or known[1] != len(namespace)
                or any(table.get(key) is not value for table, key, value, _ in known[2])):
            known = _scanned[name] = (namespace, len(namespace), _scan(namespace, originals))
        found += known[2]
    _last_holders[:] = [len(sys.modules), found]
    return found


def _scan(namespace: dict, originals: frozenset) -> list[tuple[dict, Any, Callable, Callable]]:
    """The names (and entries of small tables) of ``namespace`` holding one of ``originals`` or a wrapper of
    one (``functools.wraps``' ``__wrapped__``)."""
    found = []
    for key, value in list(namespace.items()):
        if type(value) is types.FunctionType:
            original = _original_in(value, originals)
            if original is not None:
                found.append((namespace, key, value, original))
        elif type(value) is dict and len(value) < 256:
            for k, v in value.items():
                original = _original_in(v, originals) if type(v) is types.FunctionType else None
                if original is not None:
                    found.append((value, k, v, original))
    return found


def _original_in(function: Callable, originals: frozenset) -> Optional[Callable]:
    for _ in range(8):  # a chain of wrappers, never a cycle
        if function in originals:
            return function
        function = getattr(function, "__wrapped__", None)
        if function is None:
            return None
    return None


def _seeding_call(recorder: _Recorder, original: Callable) -> Callable:
    """torch.manual_seed, set_rng_state, seed: run, then recorded as a step (see _Recorder.seeded)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        recorder.seeded()
        return result

    call.__name__ = original.__name__
    return call


def _state_refused(recorder: _Recorder, original: Callable) -> Callable:
    """torch.get_rng_state (and torch.random.fork_rng, which calls it) in a constructor: the state it would
    give is the recording's, not eager construction's (draws on meta never moved the generator), and setting
    it back later would replay another stream. Refused, loud, rather than a model quietly not eager's."""
    def call(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == recorder.thread:
            raise MetaInitError(f"deferred_init: {_module_being_built()} saves the random generator's state "
                                "(torch.get_rng_state, torch.random.fork_rng), which a recording does not have as "
                                "eager construction has it; build that module outside deferred_init and load into it")
        return original(*args, **kwargs)

    call.__name__ = original.__name__
    return call


def _recorded_call(recorder: _Recorder, original: Callable, *, draws: bool) -> Callable:
    def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if threading.get_ident() != recorder.thread:  # another thread's init is not this recording's
            return original(tensor, *args, **kwargs)
        with torch._C.DisableTorchFunction():  # the bookkeeping's own tensor reads are no constructor's calls
            generator = recorded(tensor, args, kwargs)
            on_meta_now = tensor.is_meta
        if on_meta_now:
            return tensor
        with _disable_current_modes():  # a real tensor is filled now too, as eagerly, without recording its ops
            result = original(tensor, *args, **kwargs)
        if draws:
            recorder.after_draw(generator, True)
            recorder.set_eager_values(tensor)  # drawn from the generator as the recording left it: made again
        return result

    def recorded(tensor: torch.Tensor, args: tuple, kwargs: dict) -> Optional[int]:
        """The call as a step; the generator it draws from."""
        reads: set = set()
        generators: list = []
        target = recorder.template(tensor, reads, generators)
        t_args = recorder.template(args, reads, generators)
        t_kwargs = {key: recorder.template(value, reads, generators) for key, value in kwargs.items()}
        generator = None
        if draws:  # and from the global generator too: sparse_ draws its zeros with randperm, given one or not
            generator = generators[0] if generators else recorder.generator_index(None)
            recorder.before_draw(generator)
            if generator != DEFAULT_GENERATOR:
                recorder.before_draw(recorder.generator_index(None))
        recorder.keep_constants_written({target.sid})
        recorder.program.steps.append(Step(original, (target, *t_args), t_kwargs, (), frozenset(reads),
                                           frozenset({target.sid}), generator, _module_being_built(), whole_call=True))
        recorder.forget_values({target.sid})
        return generator

    call.__name__ = original.__name__
    return call
