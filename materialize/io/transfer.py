"""The device seam: how bytes reach a destination the reader cannot fill directly.

A :class:`Staging` owns a ring of host buffers ("slots") and starts copies
from a slot into a destination view, returning a handle to wait on before
the slot is refilled. The pipeline that drives it (``engine``) knows nothing
of devices, so the CPU implementation here, which copies on a worker thread,
exercises on any machine the exact logic the CUDA implementation runs:
ring wrap-around, tensors larger than a slot, dtype casts and errors
mid-stream.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import ContextManager, Optional, Protocol

import torch

# A 64 MiB ring: pinning host memory is slow (0.37 ms per MiB on an H100 host:
# 94 ms for 256 MiB, as long as copying 5 GB to the GPU), and small slots keep
# the copies flowing: 1.9 GB from the page cache took 0.078 s through
# 8 x 8 MiB, 0.126 s through 8 x 32 MiB and 0.160 s through 8 x 128 MiB.
DEFAULT_SLOT_BYTES = 8 * 1024 * 1024
DEFAULT_SLOTS = 8  # enough for every reader thread to fill one slot while others copy out
MIN_SLOT_BYTES = 1024 * 1024


class Completion(Protocol):
    def wait(self) -> None: ...


class Staging(ABC):
    """A ring of host slots and an asynchronous slot-to-destination copy."""

    def __init__(self, slots: list[torch.Tensor]) -> None:
        assert slots and all(s.dtype == torch.uint8 and s.dim() == 1 for s in slots)
        self.slots = slots
        self.slot_bytes = min(s.numel() for s in slots)

    @abstractmethod
    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> Completion:
        """Start ``dest.copy_(src)`` (casting if dtypes differ); ``src`` is a slot view."""

    def copy_all(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Completion:
        """Start the copies out of one slot fill, ``(dest, src)`` each; done when all of them are.

        If starting one fails, the copies already started are waited on before the error is raised: a caller
        that frees destinations or reuses the slot on an error must find nothing still writing.
        """
        started: list[Completion] = []
        try:
            for dest, src in pairs:
                started.append(self.copy(dest, src))
        except BaseException as exc:
            wait_all(started, raise_errors=False)
            _raise_started(len(started), exc)
        return _AllDone(started)

    def begin(self) -> None:
        """Called once before the first copy."""

    def finish(self) -> None:
        """Called once after the last copy has been waited on."""

    def close(self) -> None:
        """Release the slots and any worker."""


def wait_all(completions: list[Completion], *, raise_errors: bool = True) -> None:
    """Wait for every completion, even after one has failed (a slot is free only when nothing still reads it);
    then raise the first error, unless the caller is already raising one of its own."""
    first_error: Optional[BaseException] = None
    for completion in completions:
        try:
            completion.wait()
        except BaseException as exc:
            first_error = first_error or exc
    if first_error is not None and raise_errors:
        raise first_error


class CopyStartError(Exception):
    """Starting the copy of pair ``index`` of a slot fill failed with ``cause``; the copies started before it
    have all completed."""

    def __init__(self, index: int, cause: Exception) -> None:
        super().__init__(f"copy {index} of a slot fill could not start: {cause}")
        self.index, self.cause = index, cause


def _raise_started(index: int, error: BaseException) -> None:
    """An error starting copy ``index`` of a fill, as a :class:`CopyStartError`; an interrupt as it is."""
    if isinstance(error, Exception):
        raise CopyStartError(index, error) from error
    raise error


class _AllDone:
    def __init__(self, completions: list[Completion]) -> None:
        self._completions = completions

    def wait(self) -> None:
        wait_all(self._completions)


class _FutureCompletion:
    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()


class ThreadStaging(Staging):
    """CPU staging: plain buffers, copies on one worker thread, overlapping reads."""

    def __init__(self, slot_bytes: int = 8 * 1024 * 1024, num_slots: int = 3) -> None:
        super().__init__([torch.empty(slot_bytes, dtype=torch.uint8) for _ in range(num_slots)])
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="materialize-copy")

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> Completion:
        return _FutureCompletion(self._worker.submit(dest.copy_, src))

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self.slots = []


class CudaStaging(Staging):
    """Pinned slots; host-to-device copies on a side stream, one event per slot fill."""

    def __init__(self, device: torch.device, slot_bytes: int = DEFAULT_SLOT_BYTES, num_slots: int = DEFAULT_SLOTS) -> None:
        super().__init__([torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(num_slots)])
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def begin(self) -> None:
        # Destinations were allocated, and maybe initialized, on the current stream.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> Completion:
        return self.copy_all([(dest, src)])

    def copy_all(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Completion:
        # One event for a whole fill: a slot of small tensors paid an event, a stream switch and a
        # record per tensor, several times the cost of starting the copy itself.
        event = torch.cuda.Event()
        index = 0
        try:
            with torch.cuda.stream(self.stream):
                for index, (dest, src) in enumerate(pairs):
                    if dest.dtype == src.dtype:
                        dest.copy_(src, non_blocking=True)
                    else:
                        # A CPU-to-GPU copy_ that also casts converts on the CPU, on this
                        # (the main) thread, into pageable memory, then copies at pageable
                        # speed; moving the slot's bytes as they are and casting on the GPU
                        # avoids both. The temporary belongs to this stream, so the
                        # caching allocator reuses it only after the cast has run.
                        raw = torch.empty(src.shape, dtype=src.dtype, device=dest.device)
                        raw.copy_(src, non_blocking=True)
                        dest.copy_(raw)
        except BaseException as exc:
            # Copies queued before an error (out of memory for a cast's temporary, Ctrl-C) are waited for,
            # so nothing writes a destination that the error path then frees, nor reads the slot after it
            # is released.
            event.record(self.stream)
            event.synchronize()
            _raise_started(index, exc)
        event.record(self.stream)
        # Event.wait() orders streams; the ring needs the host to block, hence synchronize().
        return _EventCompletion(event)

    def finish(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.stream.synchronize()

    def close(self) -> None:
        self.slots = []


class _EventCompletion:
    def __init__(self, event: "torch.cuda.Event") -> None:
        self._event = event

    def wait(self) -> None:
        self._event.synchronize()


def staging_for(device: torch.device, staging_bytes: Optional[int] = None) -> Staging:
    """The staging a destination device needs: the one device-specific choice.

    ``staging_bytes`` is the whole ring's size (host memory, pinned on CUDA);
    the default is ``DEFAULT_SLOTS x DEFAULT_SLOT_BYTES`` (64 MiB).
    """
    slot_bytes = DEFAULT_SLOT_BYTES if staging_bytes is None else max(MIN_SLOT_BYTES, staging_bytes // DEFAULT_SLOTS)
    if device.type == "cuda":
        return CudaStaging(device, slot_bytes=slot_bytes)
    return ThreadStaging(slot_bytes=slot_bytes)


class _CudaCounters:
    """The CUDA caching allocator's counters of one device (see :class:`materialize.io.peak.PeakMemory`)."""

    def __init__(self) -> None:
        # Reading a device's counters before CUDA is initialized gives zeros (and resetting them fails): a fresh
        # process asked for cuda:1 has touched no CUDA yet.
        torch.cuda.init()

    def allocated(self, device: torch.device) -> int:
        return torch.cuda.memory_allocated(device)

    def peak(self, device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device)


def device_memory_counters() -> _CudaCounters:
    """The allocator counters of the GPUs, read by the peak-memory measurement."""
    return _CudaCounters()


def on_callers_streams(devices: "set[torch.device]") -> Callable[[torch.device], ContextManager[object]]:
    """A context that puts copies made on other threads (reader threads) on the calling thread's current
    stream of their device: a thread's current stream is its own, the default one, so a caller working
    under ``torch.cuda.stream(s)`` would otherwise find copies it does not wait for. Taken on the calling
    thread."""
    streams = {device: torch.cuda.current_stream(device) for device in devices if device.type == "cuda"}
    return lambda device: torch.cuda.stream(streams[device]) if device in streams else nullcontext()


def resolve_device(device: "str | torch.device") -> torch.device:
    """Validate a device up front, so a load never fails after allocating."""
    from ..errors import DeviceError

    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"invalid device {device!r}: {exc}") from None
    if target.type == "cpu":
        return torch.device("cpu")
    if target.type != "cuda":
        raise DeviceError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {device!r} requested but CUDA is not available (no GPU visible, or a CPU-only torch)")
    index = torch.cuda.current_device() if target.index is None else target.index
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {device!r} does not exist: {torch.cuda.device_count()} GPU(s) visible")
    return torch.device("cuda", index)
