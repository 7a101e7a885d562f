"""Moving tensor bytes from checkpoint files into allocated destinations.

Three paths, chosen per tensor:

* direct: a CPU destination of the file's dtype is filled by ``preadv`` into
  its own memory, in chunks spread over reader threads (no staging, no copy);
* staged: anything else (a cast, a GPU destination) goes through the ring of
  a :class:`~materialize.transfer.Staging`, one slot-sized chunk at a time,
  so a cast never makes a full-size temporary;
* strided: a non-contiguous view saved in a torch file is read as its span
  and copied; the only path whose temporary is one tensor's size.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from .checkpoint import TensorInfo
from .fileio import FileSet, byte_view
from .transfer import Completion, Staging

DIRECT_CHUNK_BYTES = 16 * 1024 * 1024
ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class Job:
    """Fill ``dest`` (contiguous, allocated) with the tensor ``info`` describes."""

    dest: torch.Tensor
    info: TensorInfo


def default_reader_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class _Progress:
    def __init__(self, total: int, callback: Optional[ProgressFn]) -> None:
        self.total = total
        self.done = 0
        self._callback = callback
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if self._callback is not None:
                self._callback(self.done, self.total)


def stream(
    jobs: Iterable[Job],
    files: FileSet,
    *,
    staging_factory: Callable[[], Staging],
    progress: Optional[ProgressFn] = None,
    reader_threads: Optional[int] = None,
) -> int:
    """Run every job; returns the number of bytes read from the files."""
    direct, staged, strided = [], [], []
    for job in jobs:
        if job.info.numel == 0:
            continue
        if not job.info.contiguous:
            strided.append(job)
        elif job.dest.device.type == "cpu" and job.dest.dtype == job.info.dtype:
            direct.append(job)
        else:
            staged.append(job)
    tracker = _Progress(sum(j.info.read_nbytes for j in direct + staged + strided), progress)
    for path in {j.info.path for j in direct + staged + strided}:
        files.advise_sequential(path)
    if direct:
        _run_direct(direct, files, tracker, reader_threads or default_reader_threads())
    if staged:
        staging = staging_factory()
        try:
            run_staged(staged, files, staging, tracker.add)
        finally:
            staging.close()
    for job in strided:
        _run_strided(job, files)
        tracker.add(job.info.read_nbytes)
    return tracker.done


def _run_direct(jobs: list[Job], files: FileSet, tracker: _Progress, threads: int) -> None:
    def read_chunk(job: Job, start: int, stop: int) -> None:
        files.read_into(job.info.path, job.info.offset + start, byte_view(job.dest)[start:stop], tensor=job.info.name)
        tracker.add(stop - start)

    # Files in order, large reads: the page cache and storage both prefer it.
    jobs = sorted(jobs, key=lambda j: (str(j.info.path), j.info.offset))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="materialize-read") as pool:
        futures = [
            pool.submit(read_chunk, job, start, min(start + DIRECT_CHUNK_BYTES, job.info.nbytes))
            for job in jobs
            for start in range(0, job.info.nbytes, DIRECT_CHUNK_BYTES)
        ]
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()


def run_staged(jobs: list[Job], files: FileSet, staging: Staging, on_bytes: Callable[[int], None]) -> None:
    """Read each job chunk by chunk into the ring, copying slots out asynchronously.

    A slot is refilled only after the copy out of it has completed. Whatever
    happens, every started copy is waited on before returning, so no copy
    still reads a slot that is released or reused.
    """
    pending: list[Optional[Completion]] = [None] * len(staging.slots)
    turn = 0
    staging.begin()
    try:
        for job in jobs:
            info = job.info
            itemsize = info.dtype.itemsize
            per_slot = max(1, staging.slot_bytes // itemsize)
            dest = job.dest.view(-1)
            for first in range(0, info.numel, per_slot):
                last = min(info.numel, first + per_slot)
                index = turn % len(staging.slots)
                turn += 1
                if pending[index] is not None:
                    pending[index].wait()
                    pending[index] = None
                slot = staging.slots[index][: (last - first) * itemsize]
                files.read_into(info.path, info.offset + first * itemsize, byte_view(slot), tensor=info.name)
                pending[index] = staging.copy(dest[first:last], slot.view(info.dtype))
                on_bytes((last - first) * itemsize)
    except BaseException:
        _drain(pending, raise_errors=False)
        raise
    _drain(pending, raise_errors=True)
    staging.finish()


def _drain(pending: list[Optional[Completion]], *, raise_errors: bool) -> None:
    first_error: Optional[BaseException] = None
    for index, completion in enumerate(pending):
        if completion is None:
            continue
        try:
            completion.wait()
        except BaseException as exc:  # keep draining: every slot must be released
            first_error = first_error or exc
        pending[index] = None
    if raise_errors and first_error is not None:
        raise first_error


def _run_strided(job: Job, files: FileSet) -> None:
    info = job.info
    assert info.stride is not None and info.span_nbytes is not None
    span = torch.empty(info.span_nbytes, dtype=torch.uint8)
    files.read_into(info.path, info.offset, byte_view(span), tensor=info.name)
    view = torch.as_strided(span.view(info.dtype), info.shape, info.stride)
    job.dest.copy_(view)
