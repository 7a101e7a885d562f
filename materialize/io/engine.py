"""Moving tensor bytes from checkpoint files into allocated destinations.

Three paths, chosen per tensor:

* direct: a CPU destination of the file's dtype is filled by ``preadv`` into
  its own memory, in chunks spread over reader threads (no staging, no copy),
  each chunk's pages faulted in by one call just before (:func:`prefault`);
* cast: a CPU destination of another dtype is filled chunk by chunk, each
  reader thread reading into its own small reused buffer and casting from it
  into the destination, so a cast never makes a full-size temporary;
* staged: a GPU destination goes through the ring of a
  :class:`~materialize.io.transfer.Staging`, one slot-sized chunk at a time;
* strided: a non-contiguous view (saved so in a torch file, or a transposed
  checkpoint tensor) is read in blocks along its outermost dimension, each
  copied into place; the temporary is one block. Whole rows in another
  order (an interleave) are read straight into their places instead
  (:mod:`materialize.io.scatter`).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from ..checkpoint import TensorInfo
from ..checkpoint.base import contiguous_strides, view_of
from ..checkpoint.pieces import Job, Stacked, piece_destination
from ..dtypes import RangeCheck, check_cast_range
from ..errors import AllocationError, CastOverflowError, CheckpointError
from ..options import ProgressFn
from ..sources.fileio import MAX_IOVECS, FileSet, Part, byte_view, memory_at
from .hostmem import prefault
from .kernelthreads import set_this_threads_kernel_threads
from ..sources.remotepath import is_remote
from .scatter import RowScatter, row_scatter
from .transfer import Completion, CopyStartError, Staging, on_callers_streams, wait_all

DIRECT_CHUNK_BYTES = 16 * 1024 * 1024
CAST_CHUNK_BYTES = 2 * 1024 * 1024  # per reader thread: stays in cache between read and cast
CAST_ALONE_BYTES = 64 * 1024  # a piece this large is cast straight into place; smaller ones together (_cast_segment)
TASK_BYTES = 16 * 1024 * 1024  # work handed to a reader thread at once (see _run_in_tasks)
STRIDED_BLOCK_BYTES = 8 * 1024 * 1024  # the temporary of a strided read (see _run_strided)
SLOT_ALIGNMENT = 64  # where a piece starts in a buffer or slot: any dtype can view it, and copies stay aligned
GAP_BYTES = 4096  # bytes between two pieces that one read passes over rather than making two (see _file_runs)
PREFAULT_MIN_BYTES = 256 * 1024  # smaller: the faults taken inside the read cost less than the call sparing them


MIN_READER_THREADS = 4  # reads in flight a cold file wants, even on a machine of fewer cores
MAX_READER_THREADS = 8


def default_reader_threads() -> int:
    """One reader thread per core, within [4, 8].

    More threads than cores: a cold read keeps a request in flight per
    thread, and on a 2-core machine two were too few (``make bench`` cold
    rows, one safetensors: 1.31 s with 2 threads, 1.09 s with 4; 6 were no
    better than 4). Warm copies (2 or 4 threads) and casts (2 to 8) timed the same.
    """
    return max(MIN_READER_THREADS, min(MAX_READER_THREADS, os.cpu_count() or 1))


def default_cast_threads() -> int:
    """One thread per core, at most 8: a cast is work for the cores, so threads beyond them only contend.

    (``make bench``, many small tensors on 2 cores: 18,000 casts took 1.56 s
    on 2 threads and 1.88 s on 4.)
    """
    return max(1, min(MAX_READER_THREADS, os.cpu_count() or 1))


class _Progress:
    def __init__(self, total: int, callback: Optional[ProgressFn]) -> None:
        self.total = total
        self.done = 0
        self._callback = callback
        self._lock = threading.Lock()
        if callback is not None and total:
            callback(0, total)  # reading starts now: a rate shown from here on is the read's own

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if self._callback is not None:
                self._callback(self.done, self.total)


def stream(
    jobs: Iterable[Job],
    files: FileSet,
    *,
    staging_factory: Callable[[torch.device], Staging],
    progress: Optional[ProgressFn] = None,
    reader_threads: Optional[int] = None,
    allow_overflow: bool = False,
) -> int:
    """Run every job; returns the number of bytes read from the files.

    Unless ``allow_overflow``, a cast that would turn finite values into inf
    (fp32 to fp16 above 65504, say) raises :class:`CastOverflowError`.
    ``files`` are read as given: :func:`materialize.sources.fileio.reading` makes them direct reads.
    """
    checked = None if allow_overflow else check_cast_range
    direct, cast, staged, strided = [], [], [], []
    for job in pieces_of_stacks(jobs):
        info, dest = job.info, job.dest
        if info.numel == 0:
            continue
        if info.stride is not None:  # only a strided source may be a dense layout read as one run
            job = flattened_if_same_dense_layout(job)
            info, dest = job.info, job.dest
        if info.stride is not None or not dest.is_contiguous():
            strided.append(job)  # a box of the destination (a tensor-parallel chunk) is filled as a strided view is
        elif not dest.is_cpu:
            staged.append(job)
        elif dest.dtype == info.dtype:
            direct.append(job)
        else:
            cast.append(job)
    everything = direct + cast + staged + strided
    tracker = _Progress(sum(j.info.read_nbytes for j in everything), progress)
    # No POSIX_FADV_SEQUENTIAL: with reader threads sharing a descriptor it made
    # cold loads 1.7x slower here (the doubled read-ahead window of one shared
    # read-ahead state, thrashed by interleaved chunks); the default window is
    # what a cold read of all cores wants (bench: cold rows).
    threads = reader_threads or _threads_for(everything)
    if direct:
        _run_direct(direct, files, tracker, threads)
    if cast:
        _run_cpu_cast(cast, files, tracker, reader_threads or _threads_for(cast, default_cast_threads()), checked)
    for device in dict.fromkeys(job.dest.device for job in staged):
        staging = staging_factory(device)
        try:
            on_device = [job for job in staged if job.dest.device == device]
            run_staged(on_device, files, staging, tracker.add, reader_threads=threads, check_range=checked)
        finally:
            staging.close()
    if strided:
        _run_strided(strided, files, tracker, threads, checked)
    return tracker.done


def _threads_for(jobs: list[Job], local: Optional[int] = None) -> int:
    """Reader threads for ``jobs``: per core for local files; for a remote source, as many as the requests it
    keeps in flight (each thread waits on its GET, the cores are not what bounds it)."""
    local = local or default_reader_threads()
    remote = next((job.info.path for job in jobs if is_remote(job.info.path)), None)
    return max(local, remote.connections) if remote is not None else local


def flattened_if_same_dense_layout(job: Job) -> Job:
    """A job whose destination has the strides of its dense strided source (a column-major tensor into a
    column-major one) as the contiguous copy it is: both lay out their elements in the same order."""
    info, dest = job.info, job.dest
    if not info.dense_strided or tuple(dest.shape) != info.shape or tuple(dest.stride()) != info.stride:
        return job
    flat = view_of(info, (info.numel,), info.offset, storage=info.storage)
    return Job(dest.as_strided((info.numel,), (1,)), flat)


def pieces_of_stacks(jobs: Iterable[Job]) -> Iterator[Job]:
    """Each job whose source is assembled from several checkpoint tensors, as one job per piece, in place."""
    for job in jobs:
        if not isinstance(job.info, Stacked):
            yield job
            continue
        for piece in job.info.pieces:
            yield Job(piece_destination(job.dest, piece), piece.info)


def _run_direct(jobs: list[Job], files: FileSet, tracker: _Progress, threads: int) -> None:
    # Tensors next to each other both in the file and in memory (carved in the files' order from a load's arena,
    # materialize.io.arena) are read as one view: a view, and a step of the read's loop, per tensor is what a
    # load of a hundred thousand small ones spent here. Not where bytes are counted per tensor (check mode).
    merge = not files.counts_by_tensor
    across_slack = merge and files.reads_between

    def read_run(run: list[Span]) -> None:
        # One pass over the run (a reader thread's Python work per small tensor is what a load of many waits
        # on): each destination's address once, the bytes passed over between pieces. Small pieces are
        # faulted in together only where they fill the span between them (an arena's): elsewhere their
        # neighbours in the heap may be free memory (a skeleton built under meta_init freed a CPU tensor for
        # each), and one call over such a span made a 100,000-tensor load hold 15% more memory for no time gained.
        parts, total, merged = _direct_parts(run, merge, across_slack)
        first, start, _ = run[0]
        try:
            files.read_run(first.info.path, first.info.offset + start, parts)
        except CheckpointError:
            if not merged or is_remote(first.info.path):  # a remote run's error names its first tensor either way
                raise
            # A short or failing file: read again a view per tensor, for the error to name the tensor it is in.
            files.read_run(first.info.path, first.info.offset + start, _direct_parts(run, False)[0])
            raise
        tracker.add(total)

    _run_in_tasks(read_run, _pieces(jobs, DIRECT_CHUNK_BYTES), threads, run_bytes=TASK_BYTES)


def _direct_parts(run: list[Span], merge: bool, across_slack: bool = False) -> tuple[list[Part], int, bool]:
    """The views (and bytes passed over) a run is read into, its bytes, and whether any view holds several
    tensors (``merge``: where they lie next to each other in the file and in memory; ``across_slack``: or as
    far apart in both as a job's slack, the bytes before it that are no tensor's); faults the small pieces in."""
    parts: list[Part] = []
    end = None
    total = small = 0
    low, high = -1, 0
    merged = False
    held_address = held_nbytes = 0  # the view being gathered
    held_name = ""
    for job, start, stop in run:
        address = job.dest.data_ptr() + start
        nbytes = stop - start
        if nbytes >= PREFAULT_MIN_BYTES:
            prefault(address, nbytes)
        else:
            small += nbytes
            low = address if low < 0 or address < low else low
            high = address + nbytes if address + nbytes > high else high
        total += nbytes
        info = job.info
        at = info.offset + start
        # Next in the file and in memory; or as far after in both as the job's slack, the bytes before it that
        # are no tensor's (a torch zip's local header is read into them instead of a sink: one view for both)
        if merge and end is not None and (at == end or across_slack and start == 0 and at - end == job.slack > 0) \
                and address - (held_address + held_nbytes) == at - end:
            held_nbytes += at - end + nbytes
            merged = True
        else:
            if held_nbytes:
                parts.append((memory_at(held_address, held_nbytes), held_name))
            if end is not None and at > end:
                parts.append((at - end, info.name))  # a short file here is this tensor's to report
            held_address, held_nbytes, held_name = address, nbytes, info.name
        end = info.offset + stop
    parts.append((memory_at(held_address, held_nbytes), held_name))
    if small and high - low <= small + small // 8 + len(run) * SLOT_ALIGNMENT:
        prefault(low, high - low)
    return parts, total, merged


def _run_cpu_cast(jobs: list[Job], files: FileSet, tracker: _Progress, threads: int, check_range: Optional[RangeCheck]) -> None:
    local = threading.local()

    def cast_run(run: list[Span]) -> None:
        if not hasattr(local, "buffer"):
            local.buffer = torch.empty(CAST_CHUNK_BYTES + MAX_IOVECS * SLOT_ALIGNMENT, dtype=torch.uint8)
            local.view = byte_view(local.buffer)
        segments = _cast_segments(run)
        views = [local.view[at: at + stop - start] for segment in segments for (_, start, stop), at in segment.pieces]
        first, start, _ = run[0]
        files.read_run(first.info.path, first.info.offset + start, _with_gaps(run, views))
        for segment in segments:
            _cast_segment(segment, local, check_range)
        tracker.add(sum(stop - start for _, start, stop in run))

    _run_in_tasks(cast_run, _pieces(jobs, CAST_CHUNK_BYTES), threads, run_bytes=CAST_CHUNK_BYTES)


@dataclass
class _CastSegment:
    """Pieces of one run that follow each other with the same cast: packed together in the buffer, cast at once."""

    source: torch.dtype
    target: torch.dtype
    start: int  # byte position in the buffer
    pieces: list[tuple[Span, int]]  # each with its byte position in the buffer
    end: int = 0


def _cast_segments(run: list[Span]) -> list[_CastSegment]:
    segments: list[_CastSegment] = []
    used = 0
    for piece in run:
        job, start, stop = piece
        segment = segments[-1] if segments else None
        alone = stop - start >= CAST_ALONE_BYTES
        if (segment is None or segment.source != job.info.dtype or segment.target != job.dest.dtype or alone
                or segment.pieces[-1][0][2] - segment.pieces[-1][0][1] >= CAST_ALONE_BYTES):
            used = -(-used // SLOT_ALIGNMENT) * SLOT_ALIGNMENT  # each segment viewable as its dtype
            segment = _CastSegment(job.info.dtype, job.dest.dtype, used, [])
            segments.append(segment)
        segment.pieces.append((piece, used))
        used += stop - start
        segment.end = used
    return segments


def _cast_segment(segment: _CastSegment, local: threading.local, check_range: Optional[RangeCheck]) -> None:
    """Cast a segment's values into their destinations.

    One piece (a chunk of a large tensor) is cast straight into its place.
    Many small tensors are cast by one call into a reused buffer of the
    target dtype, then each copied into place by ``memmove``: a torch call
    per tensor costs about 10 us, more than casting a small tensor does, and
    18,000 of them made casts of small tensors take 1.5x a same-dtype load.
    """
    values = local.buffer[segment.start: segment.end].view(segment.source)
    if check_range is not None:
        _check_segment(segment, values, check_range)
    if len(segment.pieces) == 1:
        (job, start, stop), _ = segment.pieces[0]
        itemsize = job.info.itemsize
        first, last = start // itemsize, stop // itemsize
        dest_itemsize = job.dest.element_size()
        if (last - first) * dest_itemsize >= PREFAULT_MIN_BYTES:
            prefault(job.dest.data_ptr() + first * dest_itemsize, (last - first) * dest_itemsize)
        job.dest.view(-1)[first:last].copy_(values)
        return
    cast = getattr(local, "cast", None)
    if cast is None or cast.numel() < values.numel() * segment.target.itemsize:
        local.cast = cast = None  # the old one freed before a larger one is taken
        local.cast = cast = torch.empty(values.numel() * segment.target.itemsize, dtype=torch.uint8)
    cast[: values.numel() * segment.target.itemsize].view(segment.target).copy_(values)
    source_itemsize, target_itemsize, base = segment.source.itemsize, segment.target.itemsize, cast.data_ptr()
    for (job, start, stop), at in segment.pieces:
        ctypes.memmove(job.dest.data_ptr() + start // source_itemsize * target_itemsize,
                       base + (at - segment.start) // source_itemsize * target_itemsize,
                       (stop - start) // source_itemsize * target_itemsize)


def _check_segment(segment: _CastSegment, values: torch.Tensor, check_range: RangeCheck) -> None:
    """The range check, once for the segment; where it fails, again per piece, to name the tensor at fault."""
    first_job = segment.pieces[0][0][0]
    try:
        check_range(values, segment.target, first_job.info)
    except CastOverflowError:
        if len(segment.pieces) == 1:
            raise
        for (job, start, stop), at in segment.pieces:
            check_range(values[(at - segment.start) // segment.source.itemsize:
                               (at - segment.start + stop - start) // segment.source.itemsize], segment.target, job.info)
        raise


Span = tuple[Job, int, int]  # a job's source bytes [start, stop), whole elements


def _pieces(jobs: list[Job], chunk_bytes: int) -> list[Span]:
    """Every job cut into pieces of at most ``chunk_bytes`` (one element at least), files in order."""
    pieces = []
    # Files in order, large reads: the page cache and storage both prefer it.
    for job in sorted(jobs, key=lambda j: (str(j.info.path), j.info.offset)):
        nbytes = job.info.nbytes
        if nbytes <= chunk_bytes:
            pieces.append((job, 0, nbytes))
            continue
        step = max(1, chunk_bytes // job.info.itemsize) * job.info.itemsize
        pieces += [(job, start, min(start + step, nbytes)) for start in range(0, nbytes, step)]
    return pieces


def _file_runs(pieces: list[Span], run_bytes: int) -> Iterator[list[Span]]:
    """Pieces grouped into runs that follow each other in one file, each run within ``run_bytes`` (or one piece).

    Pieces at most :data:`GAP_BYTES` apart still make one run: a torch zip
    puts a record header between every two tensors, and a few bytes read
    for nothing cost less than a system call per tensor.
    """
    run: list[Span] = []
    run_size = 0
    for piece in pieces:
        job, start, stop = piece
        if run:
            last_job, _, last_stop = run[-1]
            gap = job.info.offset + start - (last_job.info.offset + last_stop)
            same_file = job.info.path is last_job.info.path or job.info.path == last_job.info.path
            follows = same_file and 0 <= gap <= GAP_BYTES
            if not follows or run_size + stop - start > run_bytes or len(run) == MAX_IOVECS:
                yield run
                run, run_size = [], 0
        run.append(piece)
        run_size += stop - start
    if run:
        yield run


def _with_gaps(run: list[Span], views: list[memoryview]) -> list[Part]:
    """The parts of one read of ``run`` into ``views``, the bytes between pieces passed over."""
    parts: list[Part] = []
    end = None
    for (job, start, stop), view in zip(run, views):
        at = job.info.offset + start
        if end is not None and at > end:
            parts.append((at - end, job.info.name))  # a short file here is this tensor's to report
        parts.append((view, job.info.name))
        end = job.info.offset + stop
    return parts


def _single_threaded_kernels() -> None:
    # Our reader threads already use every core; torch's intra-op threads on
    # top of them oversubscribe the cores and made casts 2-3x slower when
    # measured. torch.set_num_threads cannot say so: it also stores the count
    # process-wide, where every thread that has not run a parallel kernel yet
    # (the caller's own, often) starts from it. The OpenMP setting is this
    # thread's alone; torch's first read (get_num_threads) comes first, as it
    # would otherwise overwrite it from the process-wide count.
    torch.get_num_threads()
    set_this_threads_kernel_threads(1)


def _run_in_tasks(work: Callable[[list[Span]], None], pieces: list[Span], threads: int, *, run_bytes: int) -> None:
    """``work(run)`` for every run of ``pieces`` (see :func:`_file_runs`), over the reader threads.

    Pieces are handed to threads in tasks of about :data:`TASK_BYTES`, and
    read a run at a time: a checkpoint of tens of thousands of small tensors
    (experts, norms, biases) would otherwise pay a future, two thread
    hand-offs and a system call per tensor, more than reading it costs.
    """
    def run_task(task: list[Span]) -> None:
        for run in _file_runs(task, run_bytes):
            work(run)

    tasks: list[tuple] = []
    task: list[Span] = []
    task_bytes = 0
    for piece in pieces:
        task.append(piece)
        task_bytes += piece[2] - piece[1]
        if task_bytes >= TASK_BYTES:
            tasks.append((task,))
            task, task_bytes = [], 0
    if task:
        tasks.append((task,))
    _run_parallel(run_task, tasks, threads)


def _run_parallel(function: Callable[..., None], tasks: list[tuple], threads: int) -> None:
    """Run every task on a pool; the first error cancels what has not started and is raised."""
    with ThreadPoolExecutor(
        max_workers=threads, thread_name_prefix="materialize-read", initializer=_single_threaded_kernels
    ) as pool:
        futures = [pool.submit(function, *task) for task in tasks]
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()


Fill = list[tuple[Span, int]]  # the pieces one slot holds, each with its byte position in the slot


def _fills(jobs: list[Job], slot_bytes: int) -> Iterator[Fill]:
    """Every job cut into slot-sized pieces, and small pieces packed several to a slot."""
    fill: Fill = []
    used = 0
    for piece in _pieces(jobs, slot_bytes):
        at = -(-used // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
        if fill and (at + piece[2] - piece[1] > slot_bytes or len(fill) == MAX_IOVECS):
            yield fill
            fill, at = [], 0
        fill.append((piece, at))
        used = at + piece[2] - piece[1]
    if fill:
        yield fill


def run_staged(
    jobs: list[Job],
    files: FileSet,
    staging: Staging,
    on_bytes: Callable[[int], None],
    *,
    reader_threads: int = 1,
    check_range: Optional[RangeCheck] = None,
) -> None:
    """Read slot fills into the ring on reader threads, copying each out asynchronously.

    Slot ``i % n`` holds fill ``i``: one piece of a large tensor, or many small
    tensors (one read for those that follow each other in the file, then a
    copy each). A slot is refilled only after every copy out of it has
    completed; copies are started in fill order as soon as their reads
    finish. Whatever happens, every read and every started copy is waited
    on before returning, so nothing still touches a slot that is released or
    reused.
    """
    slots = staging.slots
    copies: list[list[Completion]] = [[] for _ in slots]
    reads: deque[tuple[Future, Fill, int]] = deque()

    def read(fill: Fill, index: int) -> None:
        slot = slots[index]
        positions = iter(at for _, at in fill)
        for run in _file_runs([piece for piece, _ in fill], staging.slot_bytes):
            views = []
            for job, start, stop in run:
                at = next(positions)
                views.append(byte_view(slot[at: at + stop - start]))
            first, start, _ = run[0]
            files.read_run(first.info.path, first.info.offset + start, _with_gaps(run, views))
        if check_range is not None:
            for (job, start, stop), at in fill:
                if job.dest.dtype != job.info.dtype:
                    check_range(slot[at: at + stop - start].view(job.info.dtype), job.dest.dtype, job.info)

    def start_copies() -> None:
        future, fill, index = reads.popleft()
        future.result()
        pairs = []
        for (job, start, stop), at in fill:
            source = slots[index][at: at + stop - start].view(job.info.dtype)
            pairs.append((job.dest.view(-1)[start // job.info.itemsize: stop // job.info.itemsize], source))
        try:
            copies[index].append(staging.copy_all(pairs))
        except CopyStartError as failed:  # the copies before it have landed
            (job, _, _), _ = fill[failed.index]
            if isinstance(failed.cause, torch.OutOfMemoryError):  # a cast's temporary on the device
                raise AllocationError(f"out of memory on {job.dest.device} for the temporary of a cast while "
                                      "copying it in", path=job.info.path, tensor=job.info.name) from None
            raise failed.cause
        on_bytes(sum(stop - start for (_, start, stop), _ in fill))

    pool = ThreadPoolExecutor(max_workers=reader_threads, thread_name_prefix="materialize-stage")
    staging.begin()
    try:
        for turn, fill in enumerate(_fills(jobs, staging.slot_bytes)):
            index = turn % len(slots)
            if len(reads) == len(slots):  # the oldest read still owns this slot
                start_copies()
            _drain(copies[index], raise_errors=True)
            reads.append((pool.submit(read, fill, index), fill, index))
            while reads and reads[0][0].done():
                start_copies()
        while reads:
            start_copies()
    except BaseException:
        for future, *_ in reads:
            future.cancel()
        pool.shutdown(wait=True)
        _drain([done for pending in copies for done in pending], raise_errors=False)
        raise
    pool.shutdown(wait=True)
    _drain([done for pending in copies for done in pending], raise_errors=True)
    staging.finish()


def _drain(pending: list[Completion], *, raise_errors: bool) -> None:
    """Wait for every completion in ``pending`` and empty it; the first error is raised after all are waited on."""
    try:
        wait_all(pending, raise_errors=raise_errors)
    finally:
        pending.clear()


@dataclass(frozen=True)
class _StridedLayout:
    shape: tuple[int, ...]  # the view's (see TensorInfo.view_shape)
    strides: tuple[int, ...]  # of the file's elements, in elements
    outer: int  # the dimension blocks are cut along: the largest stride
    step: int  # its stride, in elements
    inner_span: int  # elements one index of it spans in the file
    per_block: int  # indexes of it per block


def strided_layout(info: TensorInfo) -> _StridedLayout:
    shape = info.view_shape or info.shape  # a rearranged tensor: the destination is filled under the view's shape
    strides = info.stride if info.stride is not None else contiguous_strides(shape)  # a box of the destination
    outer = max((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: strides[d], default=0)
    step = strides[outer] if shape else 1
    inner_span = sum((size - 1) * stride for d, (size, stride) in enumerate(zip(shape, strides)) if d != outer) + 1
    per_block = shape[outer] if step == 0 or not shape else max(1, STRIDED_BLOCK_BYTES // (step * info.itemsize))
    return _StridedLayout(shape, strides, outer, step, inner_span, per_block)


def _run_strided(jobs: list[Job], files: FileSet, tracker: _Progress, threads: int,
                 check_range: Optional[RangeCheck]) -> None:
    """Strided views of the file's bytes, read in blocks along their outermost dimension and copied into place.

    The outermost dimension (largest stride) cuts a view into slabs that
    are each one run of the file: a transposed expert stack is read an expert
    at a time, a transposed matrix a few of its source rows at a time. Blocks
    of every view are spread over the reader threads, each reading into its
    own reused temporary of one block (up to :data:`STRIDED_BLOCK_BYTES`).
    """
    local = threading.local()
    callers_stream = on_callers_streams({job.dest.device for job in jobs})

    def read_block(job: Job, layout: _StridedLayout, first: int, last: int) -> None:
        info = job.info
        nbytes = ((last - first - 1) * layout.step + layout.inner_span) * info.itemsize
        if getattr(local, "buffer", None) is None or local.buffer.numel() < nbytes:
            local.buffer = None  # the old one freed before the new one is taken
            local.buffer = torch.empty(nbytes, dtype=torch.uint8)
        raw = local.buffer[:nbytes]
        files.read_into(info.path, info.offset + first * layout.step * info.itemsize, byte_view(raw), tensor=info.name)
        block = list(layout.shape)
        block[layout.outer] = last - first
        view = torch.as_strided(raw.view(info.dtype), block, layout.strides)
        if check_range is not None and job.dest.dtype != info.dtype:
            check_range(view, job.dest.dtype, info)
        target = job.dest.view(layout.shape).narrow(layout.outer, first, last - first)
        if target.device.type == "cpu":
            span = (sum((size - 1) * step for size, step in zip(target.shape, target.stride())) + 1) * target.element_size()
            if span >= PREFAULT_MIN_BYTES:
                prefault(target.data_ptr(), span)  # one call, not a fault per page inside the copy
        with callers_stream(target.device):  # synchronous from pageable memory: the block is free after it
            _copy_block(target, view)
        count = layout.shape[layout.outer]
        tracker.add(info.read_nbytes * last // count - info.read_nbytes * first // count)

    def read_rows(job: Job, scatter: RowScatter, first: int, last: int) -> None:
        rows = scatter.rows[first:last]
        low, high = int(rows[:, 0].min()), int(rows[:, 0].max()) + scatter.row_bytes
        if high - low <= 2 * (last - first) * scatter.row_bytes:  # rows close together: fault them in at once
            prefault(low, high - low)
        info = job.info
        files.read_scattered(info.path, info.offset + first * scatter.row_bytes, rows, scatter.row_bytes, tensor=info.name)
        tracker.add((last - first) * scatter.row_bytes)

    tasks: list[tuple[Callable[..., None], tuple]] = []
    for job in jobs:
        scatter = row_scatter(job.info, job.dest) if files.scatters else None
        if scatter is not None:
            count, step = scatter.rows.shape[0], max(1, STRIDED_BLOCK_BYTES // scatter.row_bytes)
            tasks += [(read_rows, (job, scatter, first, min(first + step, count))) for first in range(0, count, step)]
            continue
        layout = strided_layout(job.info)
        count = layout.shape[layout.outer]
        tasks += [(read_block, (job, layout, first, min(first + layout.per_block, count)))
                  for first in range(0, count, layout.per_block)]
    _run_parallel(lambda work, arguments: work(*arguments), tasks, threads)


def _copy_block(dest: torch.Tensor, view: torch.Tensor) -> None:
    # A batch of transposed matrices is copied a matrix at a time: torch's
    # tiled 2-D transpose is 3-4x faster than its strided copy of the batch.
    if view.dim() < 3 or view.stride(-1) == 1:
        dest.copy_(view)
        return
    for index in itertools.product(*map(range, view.shape[:-2])):
        dest[index].copy_(view[index])
