"""Peak device memory: the load's own growth on every device it writes to, the caller's statistics untouched.

The allocator's counters are faked (the CUDA ones are read through one seam, ``device_memory_counters``),
so the rules run here; tests/test_cuda.py checks the real counters on a GPU.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from materialize.io.peak import PeakMemory

GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)


class FakeCounters:
    """An allocator's counters, as a test sets them; no reset exists, so none can be called."""

    def __init__(self, allocated: dict, peak: dict) -> None:
        self.now, self.top = dict(allocated), dict(peak)

    def allocate(self, device: torch.device, nbytes: int) -> None:
        self.now[device] += nbytes
        self.top[device] = max(self.top[device], self.now[device])

    def allocated(self, device: torch.device) -> int:
        return self.now[device]

    def peak(self, device: torch.device) -> int:
        return self.top[device]


def test_a_fresh_process_reports_the_allocators_peak_exactly():
    counters = FakeCounters({GPU0: 0}, {GPU0: 0})

    with PeakMemory([torch.device("cpu"), GPU0], counters) as memory:
        counters.allocate(GPU0, 700)
        counters.allocate(GPU0, -200)  # a temporary freed: the peak stays

    assert memory.peak_device == 700 and memory.peak_by_device == {"cuda:0": 700}


def test_memory_held_before_the_load_is_not_counted_and_the_callers_peak_is_not_reset():
    counters = FakeCounters({GPU0: 1000}, {GPU0: 1500})  # a training script's earlier peak

    with PeakMemory([GPU0], counters) as memory:
        counters.allocate(GPU0, 800)  # past the earlier peak: the allocator's own is the load's
        counters.allocate(GPU0, -300)

    assert memory.peak_device == 800
    assert counters.peak(GPU0) == 1800  # the caller's statistics go on from where they were


def test_a_load_that_stays_below_the_callers_earlier_peak_is_sampled():
    counters = FakeCounters({GPU0: 1000}, {GPU0: 5000})

    with PeakMemory([GPU0], counters) as memory:
        counters.allocate(GPU0, 300)
        memory._observe()  # what the sampling thread does every few milliseconds
        counters.allocate(GPU0, -100)

    assert memory.peak_device == 300  # the allocator's peak (5000) was the caller's, not the load's


def test_every_device_the_load_writes_to_is_measured():
    counters = FakeCounters({GPU0: 0, GPU1: 100}, {GPU0: 0, GPU1: 100})

    with PeakMemory([GPU0, GPU1, GPU0], counters) as memory:
        counters.allocate(GPU0, 400)
        counters.allocate(GPU1, 900)

    assert memory.peak_by_device == {"cuda:0": 400, "cuda:1": 900} and memory.peak_device == 900


def test_a_cpu_load_measures_no_device():
    with PeakMemory([torch.device("cpu")]) as memory:
        pass

    assert memory.peak_device is None and memory.peak_by_device == {}


def _rss_anon_from_status() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_anonymous_memory_read_from_statm_is_what_status_calls_rssanon():
    from materialize.io.peak import anon_rss_bytes

    before, statm, after = _rss_anon_from_status(), anon_rss_bytes(), _rss_anon_from_status()

    assert min(before, after) - 2**20 <= statm <= max(before, after) + 2**20  # (the interpreter's own churn)


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_a_load_step_observed_counts_memory_no_sample_saw():
    with PeakMemory([torch.device("cpu")], sample_seconds=3600) as memory:  # the thread never samples
        # A mapping of its own, written: new resident memory whatever this process freed before (a bytes object
        # of 64 MB may be carved from heap memory an earlier test freed and left resident, and add nothing).
        held = mmap.mmap(-1, 64 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        held.write(b"\x01" * len(held))
        memory.observe()  # what a load does once everything is allocated, and once everything is read
        held.close()

    assert memory.host_growth >= 60 * 2**20
