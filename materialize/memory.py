"""Peak memory during a load: anonymous host memory, and the device's own counter.

Host memory is sampled from ``RssAnon`` (Linux) so pages of the checkpoint
held in the page cache or mapped from it do not count: only memory the
process itself allocated does.
"""

from __future__ import annotations

import threading
from typing import Optional

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


class PeakMemory:
    """Context manager sampling peak anonymous host memory on a background thread."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device
        self.start_host: Optional[int] = None
        self.peak_host: Optional[int] = None
        self.peak_device: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self._observe()

    def _observe(self) -> None:
        current = anon_rss_bytes()
        if current is not None and (self.peak_host is None or current > self.peak_host):
            self.peak_host = current

    def __enter__(self) -> "PeakMemory":
        self.start_host = anon_rss_bytes()
        self.peak_host = self.start_host
        if self.start_host is not None:
            self._thread = threading.Thread(target=self._sample, name="materialize-memory", daemon=True)
            self._thread.start()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._observe()
        if self.device is not None and self.device.type == "cuda":
            self.peak_device = torch.cuda.max_memory_allocated(self.device)

    @property
    def host_growth(self) -> Optional[int]:
        if self.peak_host is None or self.start_host is None:
            return None
        return self.peak_host - self.start_host
