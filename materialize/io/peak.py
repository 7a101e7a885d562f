"""Peak memory during a load: anonymous host memory, and each GPU's allocator counters.

Host memory is sampled from ``RssAnon`` (Linux) so pages of the checkpoint
held in the page cache or mapped from it do not count: only memory the
process itself allocated does. A load samples it every
:data:`LOAD_SAMPLE_SECONDS` and at its steps (:meth:`PeakMemory.observe`), not
every :data:`SAMPLE_SECONDS` as a measurement does: each sample takes the
interpreter from the load's own thread, and on a machine of few cores, busy
or virtual, each such switch cost the load up to milliseconds (sampled every
2 ms, a load of 25,000 small tensors spent a quarter more time allocating
them). A spike shorter than a sample, between two steps, can be missed.

Device memory is the growth over what was allocated when the load began, on
every GPU the load writes to, read from the caching allocator's counters
(:func:`materialize.io.transfer.device_memory_counters`). The caller's own peak
statistics are never reset: where the load's peak passes the peak the
process had already reached, the allocator's peak is the load's, exactly
(always so in a fresh process); otherwise the load's peak is sampled with the
host memory, a lower bound that can miss a spike shorter than a sample.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Optional, Protocol

import torch

SAMPLE_SECONDS = 0.002  # a measurement's (tests, benches)
LOAD_SAMPLE_SECONDS = 0.05  # a load's own, for its report
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def anon_rss_bytes(statm: Optional[int] = None) -> Optional[int]:
    """Current anonymous resident memory of this process, or None off Linux.

    Read from ``/proc/self/statm`` (``statm``: a descriptor of it, kept open by a sampler): its resident
    pages less its shared ones (file and shmem pages) are ``RssAnon`` of ``/proc/self/status``, which
    took fourteen times as long to read (36 us against 2.6 here).
    """
    try:
        if statm is not None:
            fields = os.pread(statm, 128, 0).split()
        else:
            with open("/proc/self/statm", "rb") as handle:
                fields = handle.read().split()
        return (int(fields[1]) - int(fields[2])) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        pass
    return None


class DeviceCounters(Protocol):
    """A device allocator's counters, read without changing them."""

    def allocated(self, device: torch.device) -> int: ...

    def peak(self, device: torch.device) -> int: ...


class PeakMemory:
    """Context manager sampling peak anonymous host memory, and the device memory a load adds on each GPU."""

    def __init__(self, devices: Iterable[torch.device] = (), counters: Optional[DeviceCounters] = None,
                 sample_seconds: float = SAMPLE_SECONDS) -> None:
        self.devices = list(dict.fromkeys(d for d in devices if d.type == "cuda"))
        self._sample_seconds = sample_seconds
        self._counters = counters
        self.start_host: Optional[int] = None
        self.peak_host: Optional[int] = None
        self.peak_by_device: dict[str, int] = {}
        self._start_device: dict[torch.device, int] = {}
        self._peak_before: dict[torch.device, int] = {}
        self._sampled: dict[torch.device, int] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        try:
            statm: Optional[int] = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            statm = None
        try:
            while not self._stop.wait(self._sample_seconds):
                self._observe(statm)
        finally:
            if statm is not None:
                os.close(statm)

    def observe(self) -> None:
        """Sample now, as the sampling thread does (a load calls it at its steps)."""
        self._observe()

    def _observe(self, statm: Optional[int] = None) -> None:
        current = anon_rss_bytes(statm)
        if current is not None and (self.peak_host is None or current > self.peak_host):
            self.peak_host = current
        for device in self._sampled:
            self._sampled[device] = max(self._sampled[device], self._counters.allocated(device))

    def __enter__(self) -> "PeakMemory":
        if self.devices and self._counters is None:
            from .transfer import device_memory_counters

            self._counters = device_memory_counters()
        for device in self.devices:
            self._start_device[device] = self._counters.allocated(device)
            self._peak_before[device] = self._counters.peak(device)
            if self._peak_before[device] > self._start_device[device]:  # a load peak below it would not show
                self._sampled[device] = self._start_device[device]
        self.start_host = anon_rss_bytes()
        self.peak_host = self.start_host
        if self.start_host is not None or self._sampled:
            self._thread = threading.Thread(target=self._sample, name="materialize-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._observe()
        for device in self.devices:
            peak = self._counters.peak(device)
            top = peak if peak > self._peak_before[device] else self._sampled.get(device, peak)
            self.peak_by_device[str(device)] = max(0, top - self._start_device[device])

    @property
    def peak_device(self) -> Optional[int]:
        """The largest growth on any one device; None where no GPU was measured."""
        return max(self.peak_by_device.values(), default=None)

    @property
    def host_growth(self) -> Optional[int]:
        if self.peak_host is None or self.start_host is None:
            return None
        return self.peak_host - self.start_host
