"""Peak memory during a load: anonymous host memory, and each GPU's allocator counters.

Host memory is sampled from ``RssAnon`` (Linux) so pages of the checkpoint
held in the page cache or mapped from it do not count: only memory the
process itself allocated does.

Device memory is the growth over what was allocated when the load began, on
every GPU the load writes to, read from the caching allocator's counters
(:func:`materialize.io.transfer.device_memory_counters`). The caller's own peak
statistics are never reset: where the load's peak passes the peak the
process had already reached, the allocator's peak is the load's, exactly
(always so in a fresh process); otherwise the load's peak is sampled with the
host memory, a lower bound that can miss a spike shorter than a sample.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Optional, Protocol

import torch

SAMPLE_SECONDS = 0.002


def anon_rss_bytes() -> Optional[int]:
    """Current anonymous resident memory of this process, or None off Linux."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class DeviceCounters(Protocol):
    """A device allocator's counters, read without changing them."""

    def allocated(self, device: torch.device) -> int: ...

    def peak(self, device: torch.device) -> int: ...


class PeakMemory:
    """Context manager sampling peak anonymous host memory, and the device memory a load adds on each GPU."""

    def __init__(self, devices: Iterable[torch.device] = (), counters: Optional[DeviceCounters] = None) -> None:
        self.devices = list(dict.fromkeys(d for d in devices if d.type == "cuda"))
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
        while not self._stop.wait(SAMPLE_SECONDS):
            self._observe()

    def _observe(self) -> None:
        current = anon_rss_bytes()
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
