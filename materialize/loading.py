"""Allocate once, initialize what the checkpoint lacks, stream in the rest: :func:`load`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
import weakref
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from .io.capacity import expected_peak_host_bytes
from .checkpoint import Checkpoint, CheckpointLike, TensorInfo, opened
from .sources.fileio import FileSet
from .sources import RemoteOptions
from .sources.remotepath import is_remote
from .integrations.devicemap import DeviceMapLike, Placement, compute_device_map
from .dtypes import dtype_name, parse_dtype
from .checkpoint.pieces import Job
from .checkpoint.setstates import refuse_setstate_values_elsewhere, setstates_again
from .errors import AllocationError, CheckpointError, InitError, MaterializeError, SanitizerError, summarize_names
from .planning.extrastate import extra_state_reads, hand_over
from .planning.loadruns import VALUES_BUDGET, load_code_reads, run_load_code
from .io.executor import Reads, reads
from .io.replay import ReplayInit
from .io.checkedinit import CheckedInit, own_init
from .skeleton.deferred import program_of
from .gcpause import gc_paused
from .integrations.hub import looks_like_repo_id
from .integrations.hf import forget_ties, hf_dtype_rule, hf_init, hf_key_map, hf_tolerated, is_hf_model, mark_loaded
from .io.arena import HostArena
from .io.hostmem import admit_host_copies, empty_destination, with_whole_load
from .planning.keymap import KeyMapLike
from .planning.loadhooks import run_post_hooks
from .io.peak import LOAD_SAMPLE_SECONDS, PeakMemory
from .checkpoint.base import contiguous_strides
from .skeleton.meta import buffer_like, fresh_parameter_like, is_lazy, parameter_like, shared_memory_asked
from .skeleton.modtree import modules_of, one_walk
from .skeleton.plainattrs import remake_views, replaced_storages
from .planning.plan import Entry, InitFn, Plan, initializer_of, make_plan, raise_for_mismatch
from .options import DtypeRule, IgnoreUnexpected, PlanOptions, ProgressFn, ReadOptions, Tolerated, unexpected_to_ignore
from .progress import ProgressLike, counted, report_phase, takes_progress
from .text import shown_url
from .report import Report
from .sanitizer import audit, is_poisoned, nonfinite, poison
from .integrations.sharded import held_local, is_dtensor, local_of
from .planning.ties import TieSettling, Undo, compared_before_allocating
from .io.transfer import resolve_device
from .sizes import format_bytes

DeviceLike = Union[str, torch.device]
DtypeLike = Union[str, torch.dtype, None]

logger = logging.getLogger(__name__)


def announce_opening(progress: Optional[ProgressFn], checkpoint: CheckpointLike) -> None:
    """Tell ``progress`` that a path is being opened (an open :class:`Checkpoint` is already)."""
    if not isinstance(checkpoint, Checkpoint):
        report_phase(progress, f"opening {shown_name(checkpoint)}")


def shown_name(source: Union[str, os.PathLike]) -> str:
    """A source as a progress step names it: a hub id whole, a path by its last part (a folder's, a file's), a
    URL's as :func:`~materialize.text.shown_url` shows it (no secret of its query)."""
    text = shown_url(os.fspath(source))
    return text if looks_like_repo_id(text) else (Path(text).name or text)


def _model_defaults(
    model: nn.Module, options: PlanOptions
) -> tuple[PlanOptions, Optional[DtypeRule], Optional[Tolerated]]:
    """transformers models bring their own key renames and init (unless the caller gave others), fp32 lists,
    and the missing and unexpected names they declare expected; the unexpected names the caller ignores
    join those."""
    program = program_of(model)
    if program is not None and options.init is None:  # recorded by deferred_init: made as eager construction made it
        options = dataclasses.replace(options, init=ReplayInit(program))
    if not is_hf_model(model):
        asked = Tolerated(unexpected=options.ignore_unexpected) if options.ignore_unexpected is not None else None
        return options, None, asked
    options = dataclasses.replace(
        options,
        key_map=options.key_map if options.key_map is not None else hf_key_map(model),
        init=options.init if options.init is not None else CheckedInit(model, hf_init(model)),
    )
    return options, hf_dtype_rule(model), hf_tolerated(model).also_unexpected(options.ignore_unexpected)


@gc_paused
@takes_progress
def load(
    model: nn.Module,
    checkpoint: CheckpointLike,
    *,
    device: Optional[DeviceLike] = None,
    dtype: DtypeLike = None,
    strict: bool = True,
    key_map: KeyMapLike = None,
    init: Optional[InitFn] = None,
    trust_pickle: bool = False,
    state_dict_key: Optional[str] = None,
    mmap: bool = False,
    staging_bytes: Optional[int] = None,
    device_map: Optional[DeviceMapLike] = None,
    max_memory: Optional[Mapping[Union[int, str], Union[int, str]]] = None,
    allow_overflow: bool = False,
    check: bool = False,
    check_finite: bool = False,
    progress: ProgressLike = None,
    direct_io: bool = False,
    ignore_mismatched_sizes: bool = False,
    ignore_unexpected: IgnoreUnexpected = False,
    remote: Optional[RemoteOptions] = None,
    group: Any = None,
) -> Report:
    """Materialize ``model`` on ``device`` from ``checkpoint``, each tensor allocated once.

    Args:
        model: a module whose tensors may be on ``meta`` (built under
            :func:`meta_init` or ``torch.device("meta")``) or real.
        checkpoint: a path (file, shard index, folder) or an open :class:`Checkpoint`.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. By default, where the
            model's real parameters are (a model built on a GPU is filled
            there, in place), else ``"cpu"`` (a model on meta, whose real
            buffers are on the CPU); a model recorded by ``deferred_init`` and
            then moved (``model.cuda()``) goes where it was moved. DTensor tensors (a
            model sharded on meta by FSDP2 or tensor parallel) go to their
            mesh's device instead, each rank reading only its own shard
            (see :mod:`materialize.integrations.sharded`).
        dtype: cast floating tensors to this dtype; ``None`` keeps each
            tensor's checkpoint dtype where the model's is on meta (a real
            tensor keeps its own floating dtype, as ``load_state_dict``
            does, and a DTensor the dtype it was sharded with), and
            initialized tensors follow the dtype of the loaded ones.
        strict: missing or unexpected tensors are an error. With
            ``strict=False`` unexpected tensors are skipped and missing ones
            initialized by their module's ``reset_parameters()`` (or ``init``).
        key_map: renames checkpoint names to model names (:class:`KeyMap`,
            ``{regex: replacement}`` or a callable). Without one, a
            ``module.`` or ``_orig_mod.`` prefix on every checkpoint name is
            stripped when the model has none.
        init: ``fn(module)`` used instead of ``reset_parameters()``.
        ignore_mismatched_sizes: a checkpoint tensor of another shape than
            the model's (fine-tuning with a new head: a classifier for 10
            classes, a checkpoint's for 1000) is left out and the model's
            initialized instead, as ``from_pretrained`` does with the same
            option; listed in ``report.reinitialized``. Otherwise it is a
            :class:`ShapeMismatchError`.
        ignore_unexpected: leave checkpoint tensors the model does not have
            unread, listed in ``report.ignored`` instead of
            ``report.unexpected``, while a strict load still requires every
            tensor of the model: ``True`` for all of them (a pipeline stage,
            which holds part of the model, loading the whole model's
            checkpoint), or regular expressions searched in checkpoint names
            for some (as transformers' ``_keys_to_ignore_on_load_unexpected``).
        trust_pickle: see :func:`open_checkpoint`.
        state_dict_key: the entry of a training checkpoint that holds the
            model's state, where it holds several (see :func:`open_checkpoint`).
        mmap: on CPU, make loaded tensors copy-on-write views of the files
            instead of copies (zero-copy: the load reads only headers, pages
            are read on first use, and only pages written to cost memory).
            Tensors that need a cast, and strided views, are still copied.
            The files must not change while the model lives.
        staging_bytes: host memory for staging copies to a GPU (pinned),
            default 64 MiB; the bound on host memory of a CUDA load.
        device_map: spread the model over devices instead of ``device``: a
            dict of module name to GPU index, ``"cpu"`` or ``"disk"``, or
            ``"auto"``/``"balanced"``/``"balanced_low_0"``/``"sequential"``,
            computed by accelerate within ``max_memory``. Each tensor is
            allocated directly on its device; ``"disk"`` tensors stay mapped
            from the checkpoint. With more than one device the model is
            dispatched with accelerate's hooks, so its forward runs as is.
        allow_overflow: a cast to a narrower float type (fp32 to fp16, say)
            that would turn finite values into inf is an error naming the
            tensor, unless this is set.
        check: sanitizer mode (see :mod:`materialize.sanitizer`): poison
            fresh memory, count every byte written, and prove after the load
            that each tensor was written exactly once, as planned.
        check_finite: list tensors holding NaN or Inf in ``report.nonfinite``.
        progress: ``True`` for a bar on stderr (:class:`~materialize.progress.Progress`),
            or ``fn(bytes_done, bytes_total)``, called from reader threads; one
            with a ``phase(text)`` method is also told each step before the
            reads (see :mod:`materialize.progress`).
        direct_io: read the files with ``O_DIRECT``, around the page cache:
            for cold checkpoints on fast storage, and to leave the page cache
            alone. A checkpoint already in the page cache is read from
            storage again, so it is off by default. Ignored for tensors
            that stay mapped (``mmap``, disk offload), and for a URL.
        remote: how a URL checkpoint (``s3://``, ``gs://``, ``az://``, ``https://``) is read: connections,
            timeouts, retries, unsigned access (:class:`~materialize.RemoteOptions`; docs/remote.md). Its bytes go straight into
            the tensors as a local file's do; ``mmap`` and disk offload, which map local files, are refused.
        group: a ``torch.distributed`` process group whose ranks load the same checkpoint together (every rank
            of it calls ``load`` with the same group): each byte any of them needs is read from storage by one
            rank and reaches the others over the group (gloo, or a group with a CPU backend), in chunks within
            ``staging_bytes`` per rank. For replicas (DDP, HSDP's replicate dimension) and tensor-parallel
            layouts, whose ranks need the same bytes. ``report.bytes_read`` is then what this rank read from
            storage, ``report.bytes_received`` what it got from the others (:mod:`materialize.io.groupread`;
            docs/distributed.md). Without one, each rank reads what it needs and nothing is communicated.

    Tied parameters stay one tensor. Real buffers absent from the checkpoint
    move to ``device`` unchanged. If the load fails, every tensor the model
    had before is put back (the same objects) and those the load allocated
    are freed; values already written into a real model's own tensors, filled
    in place, stay written, and the error names those tensors.
    """
    walk = one_walk(model)  # the device lookup and planning walk the model once; no model code runs in between
    with walk:
        options = PlanOptions(
            device=resolve_device(device if device is not None else chosen_device(model, device_map)),
            dtype=parse_dtype(dtype),
            strict=strict, key_map=key_map, init=init, ignore_mismatched_sizes=ignore_mismatched_sizes,
            ignore_unexpected=unexpected_to_ignore(ignore_unexpected), device_map=device_map, max_memory=max_memory,
        )
    read = ReadOptions(mmap=mmap, staging_bytes=staging_bytes, allow_overflow=allow_overflow, check=check,
                       check_finite=check_finite, progress=progress, direct_io=direct_io, group=group)
    announce_opening(progress, checkpoint)
    with opened(checkpoint, trust_pickle, state_dict_key, remote) as ckpt:
        report_phase(progress, f"planning {counted(len(ckpt), 'tensor')}")
        with walk:
            the_plan, options, placement = planned(model, ckpt, options)
        report_phase(progress, f"loading {counted(len(the_plan.of('load')), 'tensor')}")
        if ckpt.module is not None and model is not ckpt.module:
            refuse_setstate_values_elsewhere(ckpt.module, ckpt.path)  # values only the pickled module's code makes
        report = execute(the_plan, ckpt, read,  # a module's own init, checked for what it leaves unwritten
                         init=options.init if options.init is not None else CheckedInit(model, own_init))
        if model is ckpt.module:  # its own __setstate__ that changed its tensors as torch.load gives them, again
            setstates_again(model, ckpt.path)
    if is_hf_model(model):
        mark_loaded(model, report.loaded)
        if report.untied:
            forget_ties(model, report.untied)
    refresh_flat_weights_of(the_plan)
    run_post_hooks(the_plan.post_hooked, report.missing, report.unexpected)
    if the_plan.strict_after_hooks:  # what the hooks left unforgiven fails the load, as in load_state_dict
        the_plan.missing, the_plan.unexpected, the_plan.mismatched = report.missing, report.unexpected, []
        raise_for_mismatch(the_plan, report.checkpoint, True, [])
    if placement is not None and placement.needs_dispatch:
        from accelerate import dispatch_model

        dispatch_model(model, device_map=placement.for_accelerate())
    return report


def refresh_flat_weights(model: nn.Module) -> None:
    """RNNs keep a list of their weight tensors (``_flat_weights``, which cuDNN's ``flatten_parameters`` reads);
    torch refreshes it wherever it replaces them (``_apply``), and so do a load and ``materialize``."""
    for module in modules_of(model):  # torch's walk costs a generator per level, a model of experts many
        if isinstance(module, nn.RNNBase):
            _refresh_flat_weights_of_rnn(module)


def refresh_flat_weights_of(plan: Plan) -> None:
    """:func:`refresh_flat_weights` for the RNNs whose tensors a load replaced: those owning one of its entries."""
    for module in plan.rnn_modules:
        _refresh_flat_weights_of_rnn(module)


def _refresh_flat_weights_of_rnn(module: nn.RNNBase) -> None:
    """torch's ``_init_flat_weights``, but a weight under a one-tensor parametrization (``spectral_norm``,
    ``orthogonal``) is listed as its ``original``, the very tensor eager construction's list holds (registering
    the parametrization moves the weight there): ``getattr`` would compute the parametrization instead, and in
    training mode ``spectral_norm``'s power iteration would move its ``_u``/``_v`` past the file's."""
    parametrizations = module.__dict__.get("_modules", {}).get("parametrizations")
    weights = []
    for name in module._flat_weights_names:
        held = parametrizations[name] if parametrizations is not None and name in parametrizations else None
        if held is not None and hasattr(held, "original"):
            weights.append(held.original)
        else:  # weight_norm's two originals: eager's list keeps a tensor no longer in the model (docs/limits.md)
            weights.append(getattr(module, name) if hasattr(module, name) else None)
    module._flat_weights = weights
    module._flat_weight_refs = [weakref.ref(weight) if weight is not None else None for weight in weights]
    module.flatten_parameters()


def chosen_device(model: nn.Module, device_map: Optional[DeviceMapLike] = None) -> torch.device:
    """:func:`default_device`, said (INFO) where no ``device_map`` places the tensors instead: a load or a plan
    given no ``device`` puts the model there."""
    device = default_device(model)
    if device_map is None:
        program = program_of(model)
        moved = program is not None and program.device is not None
        logger.info("no device given: the model goes to %s, %s", device,
                    "where it was moved after its recorded construction" if moved
                    else "where its real tensors are (the CPU for a model wholly on meta)")
    return device


def default_device(model: nn.Module) -> torch.device:
    """Where a load puts a model without ``device=``: where a recorded model was moved after construction
    (``model.cuda()`` on a :func:`~materialize.skeleton.deferred.deferred_init` model), else
    :func:`model_device`."""
    program = program_of(model)
    if program is not None and program.device is not None:
        return program.device
    return model_device(model)


def model_device(model: nn.Module) -> torch.device:
    """The one device the model's real parameters are on (its real buffers', if no parameter is real), else the CPU."""
    parameter_devices: set[torch.device] = set()
    buffer_devices: set[torch.device] = set()
    # One pass for both (torch's own walk costs a generator per level): each module's registries are read
    # while it is at hand; on a model of experts, a second pass over its modules costs half a microsecond a tensor.
    for module in modules_of(model):
        for tensor in module._parameters.values():
            if tensor is not None and not tensor.is_meta:
                parameter_devices.add(tensor.device)
        if module._buffers:
            for tensor in module._buffers.values():
                if tensor is not None and not tensor.is_meta:
                    buffer_devices.add(tensor.device)
    devices = parameter_devices or buffer_devices
    if len(devices) == 1:
        return devices.pop()
    return torch.device("cpu")


def local_views(ckpt: Checkpoint, maps: bool, what: str) -> FileSet:
    """``ckpt``'s files, refused with a one-line error where ``maps`` asks views of a checkpoint read over the
    network (``mmap`` and disk offload map local files; a URL has none to map)."""
    if maps and is_remote(ckpt.path):
        raise CheckpointError(f"is read over the network, and {what} maps local files: leave it out (the tensors "
                              "are read into memory), or download the checkpoint first", path=ckpt.path)
    return ckpt.files


def planned(model: nn.Module, ckpt: Checkpoint, options: PlanOptions) -> tuple[Plan, PlanOptions, Optional[Placement]]:
    """The plan of a load under ``options`` with the model's own defaults applied (a transformers model's key
    map and init), those options, and where a device map places each tensor."""
    asked_key_map = options.key_map
    options, dtype_rule, tolerated = _model_defaults(model, options)
    placement = _placement_for(model, ckpt, options)
    the_plan = make_plan(model, ckpt, options, placement=placement, dtype_rule=dtype_rule, tolerated=tolerated,
                         fetch=_value_reader(ckpt))
    _log_choices(the_plan, options, asked_key_map)
    return the_plan, options, placement


def _log_choices(the_plan: Plan, options: PlanOptions, asked_key_map: KeyMapLike) -> None:
    """Say (INFO) what the plan chose that no option asked for: the checkpoint's dtype for a model built on meta,
    a rename of the checkpoint's names, where a device map puts the tensors."""
    if options.dtype is None and logger.isEnabledFor(logging.INFO):
        kept: Counter[tuple[torch.dtype, torch.dtype]] = Counter()
        for entry in the_plan.entries:
            if entry.action == "load" and entry.original.is_meta and entry.dtype != entry.original.dtype \
                    and entry.dtype.is_floating_point:
                kept[entry.original.dtype, entry.dtype] += 1
        if kept:
            logger.info("%s: the model's tensors on meta take the checkpoint's dtype: %s; dtype= (CLI --dtype) "
                        "casts them", the_plan.path, ", ".join(
                            f"{count} tensor(s) in {dtype_name(theirs)} where the model has {dtype_name(own)}"
                            for (own, theirs), count in kept.items()))
    if asked_key_map is None and the_plan.key_map:
        logger.info("%s: checkpoint names renamed to the model's, no key_map given: %s", the_plan.path,
                    the_plan.key_map)
    if options.device_map is not None:
        logger.info("%s: device_map %s puts %s", the_plan.path,
                    options.device_map if isinstance(options.device_map, str) else "(given)",
                    ", ".join(f"{format_bytes(n)} on {where}" for where, n in the_plan.bytes_by_device.items()))


def _value_reader(ckpt: Checkpoint) -> Callable[[TensorInfo], Optional[torch.Tensor]]:
    """Reads of the few checkpoint values a model's own load code needs while planning (a saved version
    number), onto the CPU, as ``load_state_dict`` hands them to it; ``None`` past :data:`VALUES_BUDGET` in all."""
    left = [VALUES_BUDGET]

    def fetch(info: TensorInfo) -> Optional[torch.Tensor]:
        if type(info) is not TensorInfo or info.nbytes > left[0]:  # a stacked or rearranged source: not a saved value
            return None
        left[0] -= info.nbytes
        value = torch.empty(info.shape, dtype=info.dtype)
        with reads(ckpt.files, ReadOptions()) as reader:
            reader.read([Job(value, info)])
        return value

    return fetch


def _placement_for(model: nn.Module, ckpt: Checkpoint, options: PlanOptions) -> Optional[Placement]:
    """Where each tensor goes under ``options.device_map``; None without one."""
    if options.device_map is None:
        return None
    # Sized as the tensors will be: the cast, or the checkpoint's own dtype (not the skeleton's).
    sizing = options.dtype or dominant_float_dtype(ckpt)
    return Placement(compute_device_map(model, options.device_map, max_memory=options.max_memory, dtype=sizing))


def dominant_float_dtype(ckpt: Checkpoint) -> Optional[torch.dtype]:
    weights: Counter[str] = Counter()
    for info in ckpt.values():
        if info.dtype.is_floating_point:
            weights[info.dtype_name] += info.nbytes
    return getattr(torch, weights.most_common(1)[0][0]) if weights else None


def execute(
    the_plan: Plan,
    ckpt: Checkpoint,
    read_options: ReadOptions = ReadOptions(),
    *,
    init: Optional[InitFn] = None,
) -> Report:
    """Carry out a plan made by :func:`make_plan` against ``ckpt``, reading as ``read_options`` says
    (through :mod:`materialize.io.executor`, as every read does)."""
    wants_views = (read_options.mmap and the_plan.device.type == "cpu") or any(e.on_disk for e in the_plan.entries)
    files = local_views(ckpt, wants_views, "mmap" if read_options.mmap else "a device map's disk offload")
    with reads(files, read_options, maps=wants_views) as reader:
        return _execute(the_plan, ckpt, reader, init)


def _execute(the_plan: Plan, ckpt: Checkpoint, reader: Reads, init: Optional[InitFn]) -> Report:
    read_options = reader.options
    mmap, staging_bytes, allow_overflow = read_options.mmap, read_options.staging_bytes, read_options.allow_overflow
    check = read_options.check
    started = time.perf_counter()
    admit_host_copies(expected_peak_host_bytes(the_plan, mmap=mmap, staging_bytes=staging_bytes), ckpt.path,
                      placeable=True)
    undo: Undo = []
    mapped: list[str] = []

    devices_written = {the_plan.device, *(entry.device for entry in the_plan.entries)}  # a device map's, a mesh's
    in_place: list[str] = []  # the model's own tensors, once the reads into them have begun
    replayed: list[str] = []  # initialized by replaying a module's recorded construction
    grad_mode = torch.is_grad_enabled()  # the caller's, in which load_state_dict would run the model's load code
    with PeakMemory(devices_written, sample_seconds=LOAD_SAMPLE_SECONDS) as memory, torch.no_grad():
        try:
            compared_in_file = compared_before_allocating(the_plan, mmap)
            arena = HostArena()
            plain = not (check or reader.maps)  # no sanitizer, no file views: a parameter may take the short way
            host = the_plan.device if the_plan.device.type == "cpu" else None
            # In the files' order: tensors read by one run then lie one after another in the arena, faulted in
            # together (materialize.io.engine._run_direct)
            order = [entry for index, entry in sorted(enumerate(the_plan.entries), key=_file_order)
                     if index not in compared_in_file]
            general = functools.partial(_materialize_entry, undo=undo, reader=reader, mmap=mmap, mapped=mapped,
                                        check=check, arena=arena)
            wants_grad: list[nn.Parameter] = []  # the short way's parameters, given requires_grad once read
            jobs = _allocated(order, undo, arena, host, general, wants_grad) if plain else \
                [job for entry in order for job in general(entry)]
            extra_jobs, extra_states = extra_state_reads(the_plan)
            fed_jobs, fed_values = load_code_reads(the_plan)
            if isinstance(init, ReplayInit):
                init.fill(the_plan)
            elif isinstance(init, CheckedInit):  # the model's init; what it leaves unwritten made or refused
                replayed = init.fill(the_plan)
            else:
                for _, module in the_plan.init_modules:
                    if init is not None:
                        init(module)
                    else:
                        initializer_of(module, computed_only=True)()  # planning made sure the module has one
            in_place = [entry.name for entry in the_plan.entries
                        if entry.action == "load" and not entry.original.is_meta and entry.held() is entry.original]
            memory.observe()  # everything allocated, nothing read
            reader.read(jobs + extra_jobs + fed_jobs, progress=read_options.progress)
            for parameter in wants_grad:
                parameter.requires_grad_()
            memory.observe()  # everything read
            ties = TieSettling(the_plan, compared_in_file, reader.read, undo, allow_overflow=allow_overflow,
                               allocate=lambda entry: _materialize_entry(entry, undo, None, False, [], check))
            retied, untied = ties.settle()
            if the_plan.load_code_runs:
                with torch.set_grad_enabled(grad_mode):
                    run_load_code(the_plan, fed_values, ckpt.format)
                _refuse_unfilled(the_plan)
            compared = {index for check in the_plan.tie_checks for index in check}  # reported by the settling
            held = [entry.held() for entry in the_plan.entries]  # no pair made per tensor: a load frees each it made
            if reader.counted is not None:
                problems = audit(the_plan, zip(the_plan.entries, held), reader.counted, set(mapped))
                if problems:
                    raise SanitizerError(f"check failed for {len(problems)} tensor(s): " + "; ".join(problems), path=ckpt.path)
            hand_over(the_plan, extra_states)  # last: a module's state is no tensor the undo can put back
        except BaseException as error:
            _undo(undo)
            _tell_what_stays_overwritten(error, in_place)
            if isinstance(error, AllocationError) and error.tensor is not None:
                with_whole_load(error, *_needs_where(the_plan, error.tensor, mmap, staging_bytes), placeable=True)
            raise
    if the_plan.plain_on_meta:  # views of parameters kept as plain attributes: over the tensors now held
        remake_views(the_plan.plain_on_meta, replaced_storages(
            (entry.original, tensor) for entry, tensor in zip(the_plan.entries, held)),
            program=init.program if isinstance(init, ReplayInit) else None, device=the_plan.device)
    names_by_action: dict[str, list[str]] = {"load": [], "init": [], "keep": [], "code": []}
    for entry in the_plan.entries:  # one pass, not one per action
        names_by_action[entry.action].append(entry.names[0])  # entry.name, less its property call
    report = make_report(
        ckpt, the_plan.device, [held_local(tensor) for tensor in held], reader.bytes_read, started, memory,
        bytes_received=reader.bytes_received, rank_share=bool(the_plan.shard_specs),
        loaded=names_by_action["load"],
        initialized=names_by_action["init"],
        replayed=list(names_by_action["init"]) if isinstance(init, ReplayInit) else replayed,
        kept=names_by_action["keep"],
        missing=list(the_plan.missing),
        unexpected=list(the_plan.unexpected),
        ignored=list(the_plan.ignored),
        reinitialized=list(the_plan.reinitialized),
        not_from_checkpoint=the_plan.not_from_checkpoint,
        fed_to_load_code=list(the_plan.fed_to_load_code),
        filled_by_load_code=names_by_action["code"],
        key_map=the_plan.key_map,
        tied=[list(entry.names) for index, entry in enumerate(the_plan.entries)
              if len(entry.names) > 1 and index not in compared] + retied,
        untied=untied,
        mapped=mapped,
        bytes_by_device=the_plan.bytes_by_device,
        nonfinite=(nonfinite((entry.name, local_of(tensor)) for entry, tensor in zip(the_plan.entries, held))
                   if read_options.check_finite else []),
    )
    if report.bytes_read > report.model_bytes:  # said, not left to puzzle over (a sharded rank's most of all)
        report.read_beyond_model = _read_beyond_model(the_plan, report, grouped=read_options.group is not None)
    return report


def _read_beyond_model(plan: Plan, report: Report, grouped: bool) -> list[str]:
    """Why a load read more bytes than the model holds, in words with the bytes each reason accounts for
    (``Report.read_beyond_model``): asked only where it did, so a load pays no pass over its tensors for it."""
    mapped, retied = set(report.mapped), {name for names in report.tied for name in names}
    copies = {index for check in plan.tie_checks for index in check[1:]}
    rows = compared = narrowed = 0
    for index, entry in enumerate(plan.entries):
        source = entry.source
        if source is None or entry.action not in ("load", "code") or entry.on_disk or entry.name in mapped:
            continue
        if index in copies and entry.name in retied:  # read, found equal to the first, and dropped for it
            compared += source.read_nbytes
            continue
        rows += max(0, source.read_nbytes - source.nbytes)  # a strided box's span: its rows whole
        if source.itemsize > entry.dtype.itemsize:
            narrowed += source.numel * (source.itemsize - entry.dtype.itemsize)
    sharded = report.rank_share
    reasons = [f"{words} ({format_bytes(nbytes)})" for words, nbytes in (
        ("whole rows read around the columns this rank's shards take" if sharded else
         "the spans of strided views read whole", rows),
        ("a tied tensor's other copies read to compare with the first", compared),
        ("casts to a narrower dtype", narrowed)) if nbytes]
    if grouped:
        reasons.append("reads for the group's other ranks")
    if plan.fed_to_load_code:
        reasons.append("values read for the model's load code")
    return reasons


def _refuse_unfilled(plan: Plan) -> None:
    """A tensor the load allocated for the model's own load code to make (poisoned until then) that the code
    left unwritten holds no value: an error naming it."""
    unfilled = [entry.name for entry in plan.of("code")
                if entry.held() is not entry.original and is_poisoned(local_of(entry.held()))]
    if unfilled:
        raise InitError(f"the model's own load code was to make {summarize_names(unfilled)} (it does not call them "
                        "missing) and left them unwritten: built on meta they hold no value; build the model on the "
                        "CPU, or pass a checkpoint that holds them", path=plan.path)


def _tell_what_stays_overwritten(error: BaseException, in_place: list[str]) -> None:
    """A failed load puts back every tensor it replaced, but not the values it wrote into the model's own
    tensors (a real model's, filled in place as load_state_dict fills them: a copy to roll back to would be
    a second model in memory). The error says which they are."""
    if not in_place:
        return
    note = (f"the model's own tensors filled in place may now hold part of the checkpoint's values "
            f"({len(in_place)}: {summarize_names(in_place, 4)}): load them again")
    if isinstance(error, MaterializeError):
        error.reason += f"; {note}"
    elif hasattr(error, "add_note"):  # Python 3.11+: shown under the traceback
        error.add_note(note)


def _needs_where(plan: Plan, name: str, mmap: bool, staging_bytes: Optional[int]) -> tuple[torch.device, int]:
    """The device of the tensor ``name`` and the bytes the whole load puts there (host: its copies and staging)."""
    device = next((entry.device for entry in plan.entries if name in entry.names), plan.device)
    if device.type == "cpu":
        return device, expected_peak_host_bytes(plan, mmap=mmap, staging_bytes=staging_bytes)
    return device, plan.bytes_by_device.get(str(device), 0)


def make_report(
    ckpt: Checkpoint, device: torch.device, final: list[torch.Tensor], bytes_read: int, started: float,
    memory: PeakMemory, **outcome: Any,
) -> Report:
    # Devices and dtypes gathered as objects, named once each: a name made per tensor costs a model of many.
    placed = {str(device) for device in {tensor.device for tensor in final if not tensor.is_meta}}
    return Report(
        checkpoint=os.fspath(ckpt.path),
        format=ckpt.format,
        state_dict_key=ckpt.state_dict_key,
        device=placed.pop() if len(placed) == 1 else str(device),  # a DTensor lives on its mesh's device
        dtypes={dtype_name(dtype): count for dtype, count in Counter(t.dtype for t in final).items()},
        bytes_read=bytes_read,
        model_bytes=_unique_bytes(final),
        seconds=time.perf_counter() - started,
        peak_host_bytes=memory.peak_host,
        host_growth_bytes=memory.host_growth,
        peak_device_bytes=memory.peak_device,
        peak_device_bytes_by_device=memory.peak_by_device,
        **outcome,
    )


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of memory the tensors hold, each storage counted once (views share theirs)."""
    storages = {}
    for tensor in tensors:
        if tensor.is_meta or is_lazy(tensor):
            continue
        storage = tensor.untyped_storage()
        storages.setdefault((storage.device, storage.data_ptr()), storage.nbytes())
    return sum(storages.values())


def _file_order(numbered: tuple[int, Entry]) -> tuple[int, int]:
    source = numbered[1].source
    return (id(source.path), source.offset) if source is not None else (0, numbered[0])


def _allocated(entries: list[Entry], undo: Undo, arena: HostArena, host: Optional[torch.device],
               general: Callable[[Entry], list[Job]], wants_grad: list[nn.Parameter]) -> list[Job]:
    """The read jobs of ``entries``, each allocated and registered: the usual tensor of a model built on meta
    (an ``nn.Parameter`` to load, no shard, contiguous, no shared memory asked) in one step of this loop, a
    DTensor parameter on meta by :func:`_allocated_shard`, any other by ``general`` (:func:`_materialize_entry`);
    the outcome is the same either way (``tests/test_arena.py`` compares them over the differential zoo,
    ``tests/test_sharded.py`` under FSDP2 and tensor parallel). A load of a hundred thousand small
    experts spends its time in per-tensor steps: the short way is written out in the loop, not called (25,000
    tensors allocated in 0.515 s instead of 0.53, alternating runs of each). ``host`` is the plan's device where it
    is the CPU: an entry placed there holds that very object, and ``is`` costs less than asking a device its
    type.

    A parameter of the short way is the tensor just allocated, its class made ``nn.Parameter``
    (what ``Tensor._make_subclass`` makes is a second tensor object over the same storage: 1 us and some
    300 bytes more a tensor, and a read job holding the first until the load ends). It is its own read job, so
    it asks no gradient while it is read (reader threads run with autograd on, and a cast writes through an
    in-place copy); those that ask one are appended to ``wants_grad``, for the caller to set once the reads are
    done."""
    jobs: list[Job] = []
    append, extend, new_job, grad_later = jobs.append, jobs.extend, tuple.__new__, wants_grad.append
    parameter, carve = nn.Parameter, arena.carved
    for entry in entries:
        original = entry.original
        shard = entry.shard
        if shard is not None:
            if entry.action != "load" or not original.is_meta:
                extend(general(entry))
            else:
                extend(_allocated_shard(entry, undo, arena, general))
            continue
        if type(original) is not parameter or entry.action != "load" or not original.is_meta:
            extend(general(entry))
            continue
        shape = entry.shape
        if original.stride() != _contiguous_strides_of(shape) or shared_memory_asked(original):
            extend(general(entry))
            continue
        source = entry.source
        dtype = entry.dtype
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        device = entry.device
        tensor, slack = None, 0
        if device is host or device.type == "cpu":  # the usual one: a small CPU tensor, carved
            # Placed after the tensor before it as the file places it, where its bytes are one run of a file
            in_file = type(source) is TensorInfo and source.stride is None
            try:
                tensor, slack = carve(shape, dtype, numel, nbytes, source.path if in_file else None, source.offset)
            except (MemoryError, OSError):  # mapping a new chunk failed: empty_destination tries again, and words the error
                pass
        if tensor is None:
            tensor = empty_destination(shape, dtype=dtype, device=device, name=entry.names[0], path=source.path,
                                       arena=arena)
        requires_grad = original.requires_grad and (dtype.is_floating_point or dtype.is_complex)
        # The fresh tensor becomes the parameter (see above): a class of the same layout, with the original's
        # attributes as parameter_like carries them over
        tensor.__class__ = parameter
        if original.__dict__:
            tensor.__dict__.update(original.__dict__)
        if requires_grad:
            grad_later(tensor)
        entry.put(tensor)
        undo.append(entry)  # Entry.hold's records, one for all its owners
        append(new_job(Job, (tensor, source, slack)))  # Job(tensor, source, slack), less the call of its __new__
    return jobs


def _allocated_shard(entry: Entry, undo: Undo, arena: HostArena, general: Callable[[Entry], list[Job]]) -> list[Job]:
    """The read job of a DTensor parameter on meta (FSDP2's, tensor parallel's) to be loaded, its shard on
    this rank allocated and the parameter registered: :func:`_materialize_entry`'s outcome, less its
    questions of a tensor that is real already, mapped or kept (a sharded mixture of experts has a hundred
    thousand such parameters). A shard not in host memory, or a buffer, takes the general way."""
    original, shard = entry.original, entry.shard
    device = entry.device
    if device.type != "cpu" or not isinstance(original, nn.Parameter) or shared_memory_asked(original):
        return general(entry)
    source, dtype, shape = entry.source, entry.dtype, shard.local_shape
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    in_file = type(source) is TensorInfo and source.stride is None  # a range of whole rows: one run of the file
    tensor, slack = None, 0
    try:
        tensor, slack = arena.carved(shape, dtype, numel, nbytes, source.path if in_file else None, source.offset)
    except (MemoryError, OSError):  # mapping a new chunk failed: empty_destination tries again, and words the error
        pass
    if tensor is None:
        tensor = empty_destination(shape, dtype=dtype, device=device, name=entry.names[0], path=source.path,
                                   arena=arena)
    made = fresh_parameter_like(original, shard.wrap(tensor),
                                original.requires_grad and (dtype.is_floating_point or dtype.is_complex))
    entry.put(made)
    undo.append(entry)  # each name held its original: the entry is the undo record
    return [Job(tensor, source, slack)]


def _materialize_entry(
    entry: Entry, undo: Undo, reader: Optional[Reads], mmap: bool, mapped: list[str], check: bool,
    arena: Optional[HostArena] = None,
) -> list[Job]:
    """Allocate one tensor (once, whatever its tie group; a small CPU one from ``arena``) and register it
    everywhere."""
    original = entry.original
    source = entry.source
    action = entry.action
    view = reader.view(source) if reader is not None and source is not None and entry.stays_in_file(mmap) else None
    if view is not None:
        tensor = view
        mapped.append(entry.name)
    elif action == "keep":
        tensor = original if is_lazy(original) else original.to(entry.device)
    elif _reusable(original, entry):
        tensor = original  # already real, right place and type: fill it in place
    else:
        tensor = empty_destination(
            entry.local_shape, dtype=entry.dtype, device=entry.device, name=entry.name,
            path=source.path if source is not None else None, stride=_asked_strides(original, entry), arena=arena,
        )
        if tensor.is_cpu and shared_memory_asked(original):
            tensor.share_memory_()  # empty yet: moving it costs no copy of values
    sharded = entry.shard is not None
    local = local_of(tensor) if sharded else tensor  # what this process fills: a DTensor's shard on this rank
    if (check and view is None and action != "keep") or (action == "code" and tensor is not original):
        poison(local)  # whatever is not written later is caught by the audit (the load code's, by _refuse_unfilled)
    wrapped = sharded and not is_dtensor(tensor)
    if wrapped:
        tensor = entry.shard.wrap(tensor)
    if tensor is not original:
        if isinstance(original, nn.Parameter):
            dtype = tensor.dtype
            make = fresh_parameter_like if wrapped else parameter_like  # a DTensor just made is this load's alone
            tensor = make(original, tensor, original.requires_grad and (dtype.is_floating_point or dtype.is_complex))
        else:
            tensor = buffer_like(original, tensor)
    entry.hold(tensor, undo)
    if action != "load" or view is not None:
        return []
    assert source is not None
    # Reader threads run with autograd on: a tensor that requires grad is filled through a detached alias.
    return [Job(local.detach() if local.requires_grad else local, source)]


def _asked_strides(original: torch.Tensor, entry: Entry) -> Optional[tuple[int, ...]]:
    """The strides a meta tensor asked for (a channels_last weight), where they lay its elements out densely;
    None for contiguous ones."""
    if entry.shard is not None or is_lazy(original) or original.shape != entry.local_shape:
        return None
    stride = original.stride()
    # Exactly: a 1x1 convolution's channels_last weight counts as contiguous, but its strides are not.
    return None if stride == _contiguous_strides_of(entry.local_shape) or not _dense(original) else stride


@functools.lru_cache(maxsize=4096)
def _contiguous_strides_of(shape: tuple[int, ...]) -> tuple[int, ...]:
    # A model of many tensors has few shapes: an expert's three, repeated thousands of times.
    return contiguous_strides(shape)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether a tensor's strides lay out its elements one after another in some dimension order (no gap, no overlap)."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _reusable(original: torch.Tensor, entry: Entry) -> bool:
    """Whether the model's own (real) tensor can be filled in place: kept, as load_state_dict keeps it, whatever
    its strides (a channels_last weight is filled as a box of a strided view is)."""
    if original.is_meta or is_lazy(original) or entry.split_from_tie:  # a name split off a tie needs memory of its own
        return False
    local = local_of(original)
    return (
        is_dtensor(original) == (entry.shard is not None)
        and local.device == entry.device
        and local.dtype == entry.dtype
        and tuple(local.shape) == entry.local_shape
        and (local.is_contiguous() or _dense(local))
    )


def _undo(undo: Undo) -> None:
    for record in reversed(undo):
        if type(record) is Entry:  # a fresh parameter's: each of its owners held the entry's original (a meta one)
            record.put(record.original)
            continue
        module, attr, is_parameter, previous = record
        (module._parameters if is_parameter else module._buffers)[attr] = previous
