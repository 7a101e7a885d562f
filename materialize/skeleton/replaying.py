"""Replaying a recorded construction (:mod:`materialize.skeleton.deferred`) into real tensors.

Given the tensors to make (a qualified name and where its values go), only
the steps they need run, in recorded order: the ops that make or write
them and what those read, and every draw before the last one they need
from the same generator (into scratch where its tensor is loaded, so the
later draws come out as eagerly). The draws after that are skipped.

Each target is written once: a tensor that eager construction allocated
empty and then filled is filled in the target itself; one computed
otherwise (``randn``, arithmetic, a cast with ``.half()`` after
construction) is copied into its target after the last step writing it,
and the temporaries of a step are freed after their last use: the peak is
the targets plus the temporaries of the tensors being made at a time.

Random generators: a replay on the CPU starts each generator from the
state it had when the recording first used it, so the values equal eager
construction's under the same seed; the caller's own generators are left
as they are. On another device the draws come from that device's
generator seeded with the recorded seed: equal to what eager construction
on that device would draw from a generator so seeded, not to the CPU's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional, Union

import torch

from ..errors import ReplayError
from .program import GeneratorRef, Program, Ref, SetGenerator, Step, TargetDevice

Sink = Callable[[torch.Tensor], None]  # takes a tensor's final values (a view valid only during the call)
Target = Union[torch.Tensor, Sink]


def replay(program: Program, targets: dict[str, Target], device: torch.device) -> None:
    """Give each target (by qualified name) the values eager construction gives that tensor.

    A target is an allocated tensor of the tensor's shape (any dtype: the
    values are cast as ``copy_`` casts), or a callable taking the values
    (a DTensor's shard copies its box).
    """
    if not targets:  # a load that found every tensor in the checkpoint: the program's steps are not even walked
        return
    wanted: dict[int, list[tuple[Target, Ref, str]]] = {}
    for name, target in targets.items():
        ref = program.bindings.get(name)
        if ref is None or ref.sid in program.unrecorded:
            raise ReplayError(f"tensor {name!r}: its values were never recorded (it was made before deferred_init "
                              "began, or outside torch's dispatcher); load it from the checkpoint")
        if isinstance(target, torch.Tensor) and tuple(target.shape) != ref.size:
            raise ReplayError(f"tensor {name!r}: recorded as {list(ref.size)}, now {list(target.shape)}: a shape "
                              "changed after construction cannot be replayed")
        wanted.setdefault(ref.sid, []).append((target, ref, name))
    _replay(program, wanted, device)


def values_of(program: Program, ref: Ref) -> torch.Tensor:
    """The values eager construction gives the tensor ``ref`` views, by the steps recorded so far, on the CPU:
    what a constructor asks of a tensor on meta (``.item()``, ``.tolist()``) while it is being recorded."""
    if ref.sid in program.unrecorded:
        raise ReplayError("its values were never recorded (it was made before deferred_init began)")
    values = torch.empty_strided(ref.size, ref.stride, dtype=ref.dtype)  # its layout: some kernels round by it
    _replay(program, {ref.sid: [(values, ref, "the tensor asked for")]}, torch.device("cpu"))
    return values


def _reads_unrecorded(program: Program, included: Any) -> bool:
    steps = program.steps
    return any(sid in program.unrecorded for index in included if isinstance(steps[index], Step)
               for sid in steps[index].reads)


def _replay(program: Program, wanted: dict[int, list[tuple[Target, Ref, str]]], device: torch.device) -> None:
    steps = program.steps
    included = _included_steps(steps, set(wanted))
    if _reads_unrecorded(program, included):
        # Named: only the tensors that need such a value (asked one by one, on this error's path alone).
        names = sorted(name for sid, pairs in wanted.items() for _, _, name in pairs
                       if _reads_unrecorded(program, _included_steps(steps, {sid})))
        shown = names[0] if len(names) == 1 else f"{names[:3]}{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
        raise ReplayError(f"{shown} {'is' if len(names) == 1 else 'are'} made from a tensor whose values were never "
                          "recorded (made on meta before deferred_init began)")
    bound = _bound_targets(program, wanted, device)
    last_use: dict[int, int] = {}
    last_write: dict[int, int] = {}
    for index in included:
        step = steps[index]
        if isinstance(step, Step):
            for sid in step.reads | step.writes:
                last_use[sid] = index
            for sid in step.writes:
                last_write[sid] = index
    generators = _generators(program, device)
    real: dict[int, torch.Tensor] = dict(program.constants)
    with torch.no_grad():
        for sid, pairs in wanted.items():  # never written while recording: a constant from before, as it is
            if sid not in last_write:
                _deliver(real, sid, pairs)
        for index in included:
            step = steps[index]
            if isinstance(step, SetGenerator):
                _set(generators[step.generator], step, device)
                continue
            made_bound = [sid for _, sid in step.made if sid in bound]
            if made_bound:
                real[made_bound[0]] = bound[made_bound[0]]  # an empty allocation: the target stands in
            else:
                _run(step, real, generators, device, wanted, program.made_as)
            for sid in step.writes:
                if last_write.get(sid) == index and sid in wanted and sid not in bound:
                    _deliver(real, sid, wanted[sid])
            for sid in step.reads | step.writes:
                if last_use.get(sid) == index:
                    real.pop(sid, None)


def _run(step: Step, real: dict[int, torch.Tensor], generators: dict[int, torch.Generator], device: torch.device,
         wanted: dict, made_as: dict[int, Ref]) -> None:
    def resolve(value: Any) -> Any:
        if isinstance(value, Ref):
            return _view(real, value)
        if isinstance(value, GeneratorRef):
            return generators[value.index]
        if isinstance(value, TargetDevice):
            return device
        if type(value) in (list, tuple):
            return type(value)(resolve(item) for item in value)
        return value

    def names() -> list[str]:
        return sorted(name for sid in step.writes for _, _, name in wanted.get(sid, ()))

    try:
        with _global_generator_as(generators.get(0) if step.whole_call else None):
            args, kwargs = resolve(step.args), {key: resolve(value) for key, value in step.kwargs.items()}
            out = step.run(*args, **kwargs) if not step.grad else _run_needing_grad(step.run, args, kwargs)
    except Exception as error:  # noqa: BLE001 - any kernel's failure, named with the step
        raise ReplayError(f"replaying {step.where}'s {step.name}"
                          + (f" for tensor {names()[0]!r}" if names() else "")
                          + f" on {device}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for position, sid in step.made:
        tensor = outs[position]
        recorded = made_as.get(sid)
        if recorded is not None and (tensor.stride() != recorded.stride or tensor.storage_offset() != recorded.offset
                                     or tensor.shape != recorded.size or tensor.dtype != recorded.dtype):
            tensor = _laid_as_recorded(tensor, recorded, step, device, names())
        real[sid] = tensor


def _laid_as_recorded(tensor: torch.Tensor, recorded: Ref, step: Step, device: torch.device,
                      names: list[str]) -> torch.Tensor:
    """An output laid out otherwise than the recording saw it on meta (a kernel of another device lays it out its
    own way: linalg.svd's Vh is row-major on CUDA, column-major on the CPU): copied into the recorded layout,
    which every later view of it was recorded against. One of another shape or dtype depends on values the
    recording did not have: refused."""
    if tensor.shape != recorded.size or tensor.dtype != recorded.dtype:
        raise ReplayError(f"replaying {step.where}'s {step.name}" + (f" for tensor {names[0]!r}" if names else "")
                          + f" on {device}: it made a {tensor.dtype} tensor of shape {list(tensor.shape)} where the "
                          f"recording had {recorded.dtype} {list(recorded.size)} (a result shaped by values); build "
                          "that module outside deferred_init and load into it")
    extent = 1 + sum((n - 1) * s for n, s in zip(recorded.size, recorded.stride)) if all(recorded.size) else 0
    laid = torch.empty(recorded.offset + extent, dtype=tensor.dtype, device=tensor.device)
    laid = laid.as_strided(recorded.size, recorded.stride, recorded.offset)
    try:
        laid.copy_(tensor)
    except RuntimeError as error:  # a recorded layout repeating elements (a stride of 0) takes no copy
        raise ReplayError(f"replaying {step.where}'s {step.name}" + (f" for tensor {names[0]!r}" if names else "")
                          + f" on {device}: its result is laid out as {list(tensor.stride())}, recorded as "
                          f"{list(recorded.stride)}, which cannot hold it; materialize on the CPU") from error
    return laid


def _run_needing_grad(run: Callable, args: tuple, kwargs: dict) -> Any:
    """``run`` as eager construction ran it where a gradient may be needed (its inputs requiring one, grad
    enabled): some composites then compute more (``linalg.svdvals`` computes U and V too), which changes the
    last bits of what they return. The results come back detached."""
    def needing(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            return value.detach().requires_grad_()
        if type(value) in (list, tuple):
            return type(value)(needing(item) for item in value)
        return value

    with torch.enable_grad():
        out = run(*needing(args), **{key: needing(value) for key, value in kwargs.items()})
    if isinstance(out, torch.Tensor):
        return out.detach()
    return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in out)  # the replay reads by position


@contextlib.contextmanager
def _global_generator_as(generator: Optional[torch.Generator]) -> Iterator[None]:
    """A whole ``torch.nn.init`` call draws from the global generator where eager construction's did: for its
    length, that generator holds the replay's state, which takes back what was drawn; the caller's state is
    put back after."""
    if generator is None:
        yield
        return
    device = generator.device
    own = torch.default_generator if device.type == "cpu" else torch.cuda.default_generators[device.index or 0]
    saved = own.get_state()
    own.set_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(own.get_state())
        own.set_state(saved)


def _view(real: dict[int, torch.Tensor], ref: Ref) -> torch.Tensor:
    base = real[ref.sid]
    if base.dtype == ref.dtype:
        view = base.as_strided(ref.size, ref.stride, ref.offset)
    else:  # a view of another dtype (x.view(torch.int32)): the same bytes read as that dtype
        view = torch.empty(0, dtype=ref.dtype, device=base.device).set_(base.untyped_storage(), ref.offset, ref.size,
                                                                         ref.stride)
    # A lazily conjugated or negated view (a.mH) is read so, whatever bits the storage's tensor carries.
    if view.is_conj() != ref.conj:
        view = view.conj()
    if view.is_neg() != ref.neg:
        view = torch._neg_view(view)
    return view


def _deliver(real: dict[int, torch.Tensor], sid: int, pairs: list) -> None:
    for target, ref, _ in pairs:
        values = _view(real, ref)
        if isinstance(target, torch.Tensor):
            target.copy_(values)
        else:
            target(values)


def _bound_targets(program: Program, wanted: dict, device: torch.device) -> dict[int, torch.Tensor]:
    """Targets that can be the storage itself: allocated empty while recording, one tensor over the whole of
    it, of the recorded dtype and strides, on the replay's device."""
    bound = {}
    for sid, pairs in wanted.items():
        made = program.made_as.get(sid)
        if sid not in program.made_empty or made is None or len(pairs) != 1:
            continue
        target, ref, _ = pairs[0]
        if (isinstance(target, torch.Tensor) and ref == made and target.dtype == made.dtype and target.device == device
                and tuple(target.stride()) == made.stride and target.storage_offset() == 0):
            bound[sid] = target
    return bound


def _included_steps(steps: list, wanted: set[int]) -> list[int]:
    """The steps that make the wanted tensors' values, and the draws that keep each generator where eager
    construction had it for the wanted draws after them."""
    for_values = _closure(steps, wanted, lambda index, step: False)
    last_draw: dict[int, int] = {}
    for index in for_values:
        step = steps[index]
        if isinstance(step, Step):
            for generator in step.draws_from:
                last_draw[generator] = max(last_draw.get(generator, -1), index)

    def keeps_the_stream(index: int, step: Any) -> bool:
        if isinstance(step, SetGenerator):
            return index < last_draw.get(step.generator, -1)
        return any(index < last_draw.get(generator, -1) for generator in step.draws_from)

    return _closure(steps, wanted, keeps_the_stream)


def _closure(steps: list, wanted: set[int], always: Callable[[int, Any], bool]) -> list[int]:
    """Walking back from the end: a step is kept if ``always`` says so or it writes a tensor needed later;
    what a kept step reads and writes is needed before it."""
    needed = set(wanted)
    chosen = []
    for index in range(len(steps) - 1, -1, -1):
        step = steps[index]
        if always(index, step) or (isinstance(step, Step) and step.writes & needed):
            chosen.append(index)
            if isinstance(step, Step):
                needed |= step.reads | step.writes
    chosen.reverse()
    return chosen


def _generators(program: Program, device: torch.device) -> dict[int, torch.Generator]:
    made = {}
    for index, state in program.start_states.items():
        generator = torch.Generator(device=device)
        if device.type == "cpu":
            generator.set_state(state)
        else:
            generator.manual_seed(program.start_seeds[index])
        made[index] = generator
    return made


def _set(generator: torch.Generator, step: SetGenerator, device: torch.device) -> None:
    if step.seed is not None:
        generator.manual_seed(step.seed)
    elif device.type == "cpu":
        generator.set_state(step.state)
    else:
        raise ReplayError(f"the recording set a generator to a saved CPU state (torch.set_rng_state), which a "
                          f"generator on {device} cannot take; materialize on the CPU")
