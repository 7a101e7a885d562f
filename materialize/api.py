"""From a source (a path, a Hugging Face folder, a hub id) to a plan, a loaded model, or plain tensors."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Union

import torch
from torch import nn

from .io.capacity import fit_report, staging_host_bytes, verdict
from .checkpoint import Checkpoint, CheckpointLike, TensorInfo, opened
from .integrations.devicemap import DeviceMapLike
from .dtypes import dtype_name, parse_dtype
from .checkpoint.pieces import Job
from .io.executor import reads
from .errors import AllocationError, ModelRequiredError, ModelSpecError, ReplayError, SanitizerError
from .gcpause import gc_paused
from .io.arena import HostArena
from .io.hostmem import admit_host_copies, admit_planned, empty_destination, with_whole_load
from .integrations.hub import resolve as resolve_source
from .planning.keymap import KeyMapLike
from .loading import (
    DeviceLike,
    DtypeLike,
    dominant_float_dtype,
    load,
    make_report,
    chosen_device,
    planned,
    refresh_flat_weights,
    announce_opening,
    local_views,
)
from .sources import RemoteOptions
from .sources.companions import companion_folder
from .sources.remotepath import RemotePath
from .io.peak import LOAD_SAMPLE_SECONDS, PeakMemory
from .planning.plan import InitFn, Plan, TensorsPlan
from .options import IgnoreUnexpected, PlanOptions, ProgressFn, ReadOptions, unexpected_to_ignore
from .progress import ProgressLike, counted, report_phase, takes_progress
from .report import Report
from .sanitizer import audit_plain, nonfinite, poison
from .skeleton.deferred import program_of
from .skeleton.hfbuild import HF_SPEC_PREFIX, build_hf, is_hf_folder, is_transformers_folder
from .skeleton.meta import buffer_like, is_lazy, parameter_like
from .skeleton.modtree import named_modules
from .skeleton.plainattrs import plain_meta_tensors, remake_views, replaced_storages
from .skeleton.spec import ModelSpec, build, build_recorded
from .integrations.sharded import is_dtensor, shard_spec
from .io.replay import allocated_together, replay, shard_box
from .io.transfer import resolve_device
from .io.shared import SharedSpan, shared_spans

logger = logging.getLogger(__name__)


@gc_paused
def plan(
    model: Union[nn.Module, ModelSpec, None],
    checkpoint: CheckpointLike,
    *,
    device: Optional[DeviceLike] = None,
    dtype: DtypeLike = None,
    strict: bool = True,
    key_map: KeyMapLike = None,
    init: Optional[InitFn] = None,
    model_args: Optional[Mapping[str, Any]] = None,
    revision: Optional[str] = None,
    trust_pickle: bool = False,
    state_dict_key: Optional[str] = None,
    device_map: Optional[DeviceMapLike] = None,
    max_memory: Optional[Mapping[Union[int, str], Union[int, str]]] = None,
    mmap: bool = False,
    staging_bytes: Optional[int] = None,
    ignore_mismatched_sizes: bool = False,
    ignore_unexpected: IgnoreUnexpected = False,
    stream: bool = False,
    remote: Optional[RemoteOptions] = None,
) -> Union[Plan, TensorsPlan]:
    """What :func:`load_model` would do, without reading any tensor data (but the few values a model's own load
    code asks for to decide what it does with names, a saved version number: 1 MiB at most).

    ``model`` is a module or anything :func:`load_model` accepts as one
    (a spec, ``"hf:ClassName"``, or ``None`` for a Hugging Face folder or a
    pickled module). Raises the same errors a load would (missing,
    unexpected and mismatched tensors; tensors that cannot be initialized).
    Where ``model`` is ``None`` and the source holds no model to build (a
    plain state dict), the plan is of the load :func:`load_model` then does,
    :func:`load_tensors`: a :class:`TensorsPlan`, whose ``to_dict()`` has the
    keys of a :class:`Plan`'s (``"into"``: ``"dict"``, not ``"model"``) and
    whose ``fits`` is the same verdict; the options about a model (``strict``,
    ``key_map``, ``init``, ``ignore_*``, ``max_memory``, ``device_map``) are a
    :class:`ModelRequiredError`, as there. ``device`` and ``state_dict_key`` (a training checkpoint's entry)
    are as in :func:`load`; ``stream`` and ``remote`` as in :func:`load_model`.

    ``plan.fits`` compares the memory each device will need (for ``"cpu"``,
    what the load adds to host memory, the figure the load itself checks) with
    what is available now, and gives the host's ``limit``, all the memory the
    process can ever have. ``read_bytes`` is what the load reads into memory;
    with ``mmap`` what stays mapped from the files is ``mapped_bytes`` instead.
    :func:`check_memory` does with it what the load does before it allocates: it
    raises the load's own :class:`AllocationError` where the host copies can
    never fit (and an ``AllocationError`` where a GPU has less free memory than
    the load puts there), and warns with the load's ``LowMemoryWarning`` where
    they fit the machine but not the memory available now.
    """
    with _opened_source(checkpoint, revision, trust_pickle, state_dict_key, stream=stream,
                        remote=remote) as (ckpt, folder):
        skeleton = _skeleton(model, model_args, folder, ckpt, dtype, record=not strict or ignore_mismatched_sizes)
        if skeleton is None:
            if device_map is not None:
                raise _no_model_to_place(ckpt)
            _refuse_model_options(ckpt, {"strict": strict, "key_map": key_map, "init": init, "max_memory": max_memory,
                                         "ignore_mismatched_sizes": ignore_mismatched_sizes,
                                         "ignore_unexpected": ignore_unexpected})
            return _tensors_plan(ckpt, device, dtype, mmap, staging_bytes)
        options = PlanOptions(
            device=resolve_device(device if device is not None else chosen_device(skeleton, device_map)),
            dtype=parse_dtype(dtype),
            strict=strict, key_map=key_map, init=init, ignore_mismatched_sizes=ignore_mismatched_sizes,
            ignore_unexpected=unexpected_to_ignore(ignore_unexpected), device_map=device_map, max_memory=max_memory,
        )
        the_plan, _, _ = planned(skeleton, ckpt, options)
    the_plan.mmap = mmap
    the_plan.fits = fit_report(the_plan, mmap=mmap, staging_bytes=staging_bytes)
    return the_plan


def check_memory(the_plan: Union[Plan, TensorsPlan]) -> None:
    """Do what the load of ``the_plan`` does about memory before it allocates, by ``the_plan.fits``: raise
    its :class:`AllocationError` where the host copies can never fit (or a GPU has less free memory than the
    load puts there), warn with its ``LowMemoryWarning`` where they fit the machine but not the memory
    available now. ``materialize plan`` calls it after printing the plan."""
    admit_planned(the_plan.fits, the_plan.path, placeable=isinstance(the_plan, Plan))


# The options that act on a model's tensors, their values when not given, and their words in the CLI and the
# library: a plain load of a state dict (no model) has nothing for them to act on.
MODEL_OPTIONS: dict[str, tuple[Any, str]] = {
    "strict": (True, "--no-strict (strict=False)"),
    "key_map": (None, "--strip-prefix, --add-prefix, --rename (key_map)"),
    "init": (None, "init"),
    "max_memory": (None, "--max-memory (max_memory)"),
    "ignore_mismatched_sizes": (False, "--ignore-mismatched-sizes (ignore_mismatched_sizes)"),
    "ignore_unexpected": (False, "--ignore-unexpected, --ignore-unexpected-matching (ignore_unexpected)"),
}


def _refuse_model_options(ckpt: Checkpoint, options: Mapping[str, Any]) -> None:
    """A plain load keeps every tensor under its own name and reads it whole: options that act on a model's
    tensors would be ignored there, and a load that quietly ignores what was asked is not the one asked for."""
    given = [words for option, (default, words) in MODEL_OPTIONS.items() if options.get(option, default) != default]
    if given:
        verb = "acts" if len(given) == 1 else "act"
        raise ModelRequiredError(
            f"{', '.join(given)} {verb} on a model's tensors, and without a model this checkpoint loads as a plain "
            "dict of its tensors: pass a model (CLI: --model SPEC), or leave them out", path=ckpt.path)


def _no_model_to_place(ckpt: Checkpoint) -> ModelRequiredError:
    return ModelRequiredError("a device map needs a model to place: pass one (CLI: --model SPEC)", path=ckpt.path)


def _loaded_dtype(info: TensorInfo, cast: Optional[torch.dtype]) -> torch.dtype:
    return cast if cast is not None and info.dtype.is_floating_point else info.dtype


class _PlainBytes(NamedTuple):
    total: int  # the tensors' memory on the device, mapped ones included
    copied: int  # of it, what is allocated and filled
    read: int  # the file bytes read to fill it
    mapped: int  # the file bytes left mapped


def _plain_bytes(ckpt: Checkpoint, groups: list[SharedSpan], cast: Optional[torch.dtype], maps: bool) -> _PlainBytes:
    """What :func:`load_tensors` puts on its device: each storage once; with ``maps``, what can stay a view of
    the file is not copied. One rule for the load and its plan, so that they agree."""
    grouped = {member.name for group in groups for member in group.members}
    total = copied = read = mapped = 0
    for info in [group.span for group in groups] + [info for name, info in ckpt.items() if name not in grouped]:
        wanted = _loaded_dtype(info, cast)
        size = info.numel * wanted.itemsize
        total += size
        if maps and wanted == info.dtype and info.mappable:
            mapped += info.nbytes
        else:
            copied += size
            read += info.read_nbytes if info.numel else 0  # an empty tensor is made, never read
    return _PlainBytes(total, copied, read, mapped)


def _host_bytes(target: torch.device, copied: int, staging_bytes: Optional[int]) -> int:
    """What :func:`load_tensors` adds to host memory: its copies, or the staging ring a GPU's pass through."""
    return copied if target.type == "cpu" else staging_host_bytes(staging_bytes)


def _tensors_plan(ckpt: Checkpoint, device: Optional[DeviceLike], dtype: DtypeLike, mmap: bool,
                  staging_bytes: Optional[int]) -> TensorsPlan:
    target = resolve_device(device if device is not None else "cpu")
    cast = parse_dtype(dtype)
    plain = _plain_bytes(ckpt, shared_spans(ckpt.values()), cast, mmap and target.type == "cpu")
    needs = {} if target.type == "cpu" else {str(target): plain.total}
    needs["cpu"] = _host_bytes(target, plain.copied, staging_bytes)
    return TensorsPlan(
        path=str(ckpt.path), device=target, tensors=len(ckpt), bytes_by_device={str(target): plain.total},
        read_bytes=plain.read, mapped_bytes=plain.mapped,
        dtypes=dict(Counter(dtype_name(_loaded_dtype(info, cast)) for info in ckpt.values())),
        state_dict_key=ckpt.state_dict_key, mmap=mmap, fits=verdict(needs),
    )


@gc_paused
@takes_progress
def load_tensors(
    checkpoint: CheckpointLike,
    *,
    device: Optional[DeviceLike] = "cpu",
    dtype: DtypeLike = None,
    trust_pickle: bool = False,
    state_dict_key: Optional[str] = None,
    mmap: bool = False,
    staging_bytes: Optional[int] = None,
    allow_overflow: bool = False,
    check_finite: bool = False,
    progress: ProgressLike = None,
    direct_io: bool = False,
    check: bool = False,
    remote: Optional[RemoteOptions] = None,
    group: Any = None,
) -> tuple[dict[str, torch.Tensor], Report]:
    """Materialize every tensor of a checkpoint as a plain dict on ``device``.

    ``mmap=True`` (CPU): tensors are copy-on-write views of the files,
    ``direct_io=True`` reads around the page cache, ``state_dict_key``
    picks a training checkpoint's entry, ``progress`` shows the load, ``remote`` reads a URL, and ``group``
    shares the reads among the ranks of a process group, as in :func:`load`.
    ``check=True``: every tensor read is poisoned when allocated, and after the reads each must hold no poison
    and have received exactly its bytes from the file, or the load is a :class:`SanitizerError` naming them
    (see :mod:`materialize.sanitizer`; views of the files, with ``mmap``, are the files' own bytes).
    """
    target = resolve_device(device if device is not None else "cpu")
    cast = parse_dtype(dtype)
    read_options = ReadOptions(mmap=mmap, staging_bytes=staging_bytes, allow_overflow=allow_overflow,
                               check=check, check_finite=check_finite, progress=progress, direct_io=direct_io,
                               group=group)
    maps = mmap and target.type == "cpu"
    started = time.perf_counter()
    announce_opening(progress, checkpoint)
    with opened(checkpoint, trust_pickle, state_dict_key, remote) as ckpt, \
            PeakMemory([target], sample_seconds=LOAD_SAMPLE_SECONDS) as memory, \
            reads(local_views(ckpt, maps, "mmap"), read_options, maps=maps) as reader:
        report_phase(progress, f"loading {counted(len(ckpt), 'tensor')}")
        made: dict[str, torch.Tensor] = {}
        jobs = []
        mapped: list[str] = []
        arena = HostArena()  # the small tensors (docs: README, "Where a load differs")

        def materialize(info: TensorInfo) -> torch.Tensor:
            wanted = _loaded_dtype(info, cast)
            view = reader.view(info) if wanted == info.dtype else None
            if view is not None:
                mapped.append(info.name)
                return view
            # Saved strides that lay the elements out densely (a transposed or column-major save) are kept, as
            # torch.load keeps them: the file's bytes are then the tensor's memory, read straight in.
            tensor = empty_destination(info.shape, dtype=wanted, device=target, name=info.name, path=info.path,
                                       stride=info.stride if info.dense_strided else None, arena=arena)
            if check:
                poison(tensor)  # whatever the reads leave unwritten is caught by the audit
            jobs.append(Job(tensor, info))
            return tensor

        groups = list(shared_spans(ckpt.values()))
        plain = _plain_bytes(ckpt, groups, cast, maps)
        admit_host_copies(_host_bytes(target, plain.copied, staging_bytes), ckpt.path)
        try:
            for group in groups:
                before = len(mapped)
                base = materialize(group.span)
                if len(mapped) > before:
                    mapped[before:] = [member.name for member in group.members]
                made.update((member.name, group.view(base, member)) for member in group.members)
            for name, info in ckpt.items():
                if name not in made:
                    made[name] = materialize(info)
        except AllocationError as error:
            if error.tensor is not None:
                with_whole_load(error, target, plain.copied)
            raise
        tensors = {name: made[name] for name in ckpt}
        memory.observe()  # everything allocated, nothing read
        reader.read(jobs, progress=progress)
        memory.observe()  # everything read
        if check:
            problems = audit_plain(jobs, reader.counted)
            if problems:
                raise SanitizerError(f"check failed for {len(problems)} tensor(s): " + "; ".join(problems),
                                     path=ckpt.path)
    report = make_report(
        ckpt, target, list(tensors.values()), reader.bytes_read, started, memory, loaded=list(tensors), mapped=mapped,
        bytes_received=reader.bytes_received,
        bytes_by_device={str(target): plain.total},
        nonfinite=nonfinite(tensors.items()) if check_finite else [],
    )
    return tensors, report


@gc_paused
@takes_progress
def load_model(
    source: CheckpointLike,
    *,
    model: Union[nn.Module, ModelSpec, None] = None,
    model_args: Optional[Mapping[str, Any]] = None,
    revision: Optional[str] = None,
    trust_pickle: bool = False,
    state_dict_key: Optional[str] = None,
    stream: bool = False,
    remote: Optional[RemoteOptions] = None,
    **load_options: Any,
) -> tuple[Union[nn.Module, dict[str, torch.Tensor]], Report]:
    """Build the skeleton and load it in one call (what the CLI runs).

    ``source`` is a checkpoint path, a Hugging Face folder, a hub repo id
    (``org/name``, at ``revision``), or a URL (``s3://bucket/prefix/``, ``https://host/model.safetensors``:
    read by ranged GETs straight into the tensors, as ``remote`` says; see docs/remote.md). With ``stream``
    a hub repo's weights are read the same way from the hub, not downloaded; its JSON files (config,
    index) are fetched to the cache as a download fetches them. ``model`` is a module, a spec for
    :func:`build` (called with ``model_args``), ``"hf:ClassName"`` (a
    transformers class built from the source's ``config.json``), or ``None``:
    then a folder with a ``config.json`` builds its transformers model, a
    pickled module in the checkpoint is its own skeleton (needs
    ``trust_pickle``), and a plain state dict is materialized as a ``dict`` of
    tensors. ``state_dict_key`` picks a training checkpoint's entry (see
    :func:`open_checkpoint`). ``progress`` (see :func:`load`) is told of
    the download, the opening and the build too.
    """
    record = not load_options.get("strict", True) or load_options.get("ignore_mismatched_sizes", False)
    progress = load_options.get("progress")
    with _opened_source(source, revision, trust_pickle, state_dict_key, stream=stream, remote=remote,
                        progress=progress) as (ckpt, folder):
        skeleton = _skeleton(model, model_args, folder, ckpt, load_options.get("dtype"), record, progress)
        if skeleton is None:
            if load_options.get("device_map") is not None:
                raise _no_model_to_place(ckpt)
            _refuse_model_options(ckpt, load_options)
            for option in (*MODEL_OPTIONS, "device_map"):
                load_options.pop(option, None)
            return load_tensors(ckpt, **load_options)
        return skeleton, load(skeleton, ckpt, **load_options)


@contextmanager
def _opened_source(
    source: CheckpointLike,
    revision: Optional[str],
    trust_pickle: bool,
    state_dict_key: Optional[str] = None,
    *,
    stream: bool = False,
    remote: Optional[RemoteOptions] = None,
    progress: Optional[ProgressFn] = None,
) -> Iterator[tuple[Checkpoint, Optional[Path]]]:
    """Resolve a hub id and open the checkpoint; with it, the local folder of its config files (None: none),
    where :func:`_skeleton` finds the model the source calls for. ``progress`` is told of the opening."""
    announce_opening(progress, source)  # before a hub id's download, which is part of the opening
    if not isinstance(source, Checkpoint):
        source = resolve_source(source, revision=revision, stream=stream, remote=remote)
    folder = None if isinstance(source, Checkpoint) else local_folder(source)
    with opened(source, trust_pickle, state_dict_key) as ckpt:
        yield ckpt, folder


def local_folder(source: Union[Path, RemotePath]) -> Optional[Path]:
    """Where a source's config files are on local disk: the source itself, or a remote folder's companions (a
    remote file, like a local one, is no folder to build a model from)."""
    if isinstance(source, RemotePath):
        return companion_folder(source) if source.is_dir() else None
    return Path(source)


def _skeleton(
    model: Union[nn.Module, ModelSpec, None],
    model_args: Optional[Mapping[str, Any]],
    folder: Optional[Path],
    ckpt: Checkpoint,
    dtype: DtypeLike = None,
    record: bool = False,
    progress: Optional[ProgressFn] = None,
) -> Optional[nn.Module]:
    """The model the source calls for (None: none, its tensors load as a dict): ``model`` itself, built from a
    spec or ``folder``'s ``config.json``, or the checkpoint's pickled module.

    A transformers model is built in the dtype its floating tensors will
    load in (``dtype``, else the checkpoint's), as ``from_pretrained``
    builds it (see :func:`~materialize.skeleton.hfbuild.build_hf`). With
    ``record`` (a load that may initialize tensors: ``strict=False``,
    ``ignore_mismatched_sizes``), a spec is built by
    :func:`~materialize.skeleton.spec.build_recorded`, so what the checkpoint
    lacks is made as eager construction made it. ``progress`` is told of the build.
    """
    if isinstance(model, nn.Module):
        return model
    builds_hf = isinstance(model, str) and model.startswith(HF_SPEC_PREFIX)
    if builds_hf and (folder is None or not is_hf_folder(folder)):
        raise ModelSpecError(f"{model!r} needs a Hugging Face folder or hub id holding config.json as the source")
    if model is not None and not builds_hf:
        report_phase(progress, f"building {_spec_words(model)}")
        return (build_recorded if record else build)(model, **dict(model_args or {}))
    if builds_hf or (folder is not None and is_transformers_folder(folder)):
        class_name = (model[len(HF_SPEC_PREFIX):] or None) if builds_hf else None
        report_phase(progress, f"building {model if builds_hf else 'the model config.json names'}")
        asked = parse_dtype(dtype)
        built_in = asked or dominant_float_dtype(ckpt)
        skeleton = build_hf(folder, model_class=class_name, dtype=built_in, checkpoint=ckpt)
        logger.info("%s: building %s%s in %s%s", folder, type(skeleton).__name__,
                    "" if class_name else " (config.json's model)",
                    dtype_name(built_in) if built_in is not None else "its config's dtype",
                    "" if asked or built_in is None else " (the checkpoint's dtype)")
        return skeleton
    if model is None:
        if ckpt.module is not None:
            logger.info("%s: no model given: the checkpoint's pickled module (%s.%s) is the model", ckpt.path,
                        type(ckpt.module).__module__, type(ckpt.module).__qualname__)
        else:
            logger.info("%s: no model given, and none to build (no pickled module, no config.json naming a "
                        "transformers model): its tensors are loaded as a dict", ckpt.path)
    return ckpt.module


def _spec_words(model: ModelSpec) -> str:
    """A model spec as a progress step names it: as written, or a callable by its name."""
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    return getattr(model, "__qualname__", None) or type(model).__name__


@gc_paused
def materialize(model: nn.Module, *, device: Optional[DeviceLike] = None) -> nn.Module:
    """Make every tensor of a model :func:`~materialize.skeleton.deferred.deferred_init` recorded, on
    ``device`` (default: where ``model.cuda()`` / ``.to(device)`` moved it after construction, else the
    CPU), with the values eager construction gives it under the same seed: a model
    trained from scratch, no checkpoint.

    Each tensor is allocated once, in the dtype the model has now (``.half()`` after construction takes
    effect), with the strides eager construction gives it (tensors it made as views of one storage, as
    ``torch.triu_indices``' rows and columns, share one again); ties stay one tensor; parameters keep their
    class, attributes and ``requires_grad``. A DTensor (a model sharded on meta by FSDP2 or tensor
    parallel) gets this rank's box of the eager values, on its mesh's device. Tensors already real are moved
    to ``device`` as they are. Returns ``model``, filled in place.
    """
    program = program_of(model)
    if program is None:
        raise ReplayError("the model was not built by deferred_init: nothing was recorded to replay; build it with "
                          "mz.deferred_init(ModelClass, ...) or load a checkpoint into it")
    target = resolve_device(device if device is not None else (program.device or "cpu"))
    made: dict[int, torch.Tensor] = {}  # id of the model's tensor -> its replacement (ties: one)
    targets: dict[str, Any] = {}
    slots = []
    pending: list[tuple[str, torch.Tensor]] = []  # (name, tensor) of those allocated whole on the target
    modules = named_modules(model)
    for prefix, module in modules:
        for registry in ("_parameters", "_buffers"):
            for attr, tensor in getattr(module, registry).items():
                if tensor is None:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                slots.append((module, registry, attr, tensor))
                if id(tensor) in made:
                    continue
                if is_lazy(tensor):  # a lazy module's, shaped by its first forward: as uninitialized on target
                    made[id(tensor)] = tensor if tensor.device == target else type(tensor)(
                        requires_grad=tensor.requires_grad, device=target, dtype=tensor.dtype)
                    continue
                if not tensor.is_meta and not is_dtensor(tensor):
                    made[id(tensor)] = tensor.to(target)
                    continue
                spec = shard_spec(tensor, name)
                if spec is not None:
                    local = empty_destination(spec.local_shape, dtype=tensor.dtype, device=spec.device, name=name)
                    targets[name] = shard_box(local, spec)
                    made[id(tensor)] = spec.wrap(local)
                else:
                    pending.append((name, tensor))
    together = allocated_together(program, pending, target)  # tensors eager construction made in one storage
    for name, tensor in pending:
        made[id(tensor)] = targets[name] = together[name] if name in together else empty_destination(
            tuple(tensor.shape), dtype=tensor.dtype, device=target, name=name, stride=tuple(tensor.stride()))
    plain = plain_meta_tensors(modules)  # the walk above, not another
    replay(program, targets, target)
    registered: dict[tuple[str, int], torch.Tensor] = {}  # (registry, id of the model's tensor) -> what it holds now
    for module, registry, attr, tensor in slots:
        key = (registry, id(tensor))
        if key not in registered:
            value = made[id(tensor)]
            if value is not tensor and not is_lazy(value):  # keeps the model's class and attributes, as load_state_dict keeps its objects
                value = (parameter_like(tensor, value, tensor.requires_grad) if registry == "_parameters"
                         else buffer_like(tensor, value))
            registered[key] = value
        getattr(module, registry)[attr] = registered[key]
    if plain:  # views of parameters kept as plain attributes, and tensors such as a prompt's token ids
        remake_views(plain, replaced_storages((tensor, getattr(module, registry)[attr])
                                              for module, registry, attr, tensor in slots), program=program, device=target)
    refresh_flat_weights(model)
    return model
