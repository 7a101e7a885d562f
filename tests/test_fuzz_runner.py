"""The fuzz runner's limits (fuzz/run.py): a hang, a death and a blow-up are recorded failures, and the run goes on.

Tiny probe targets stand in for the readers: one sleeps, one kills its own
process (as the kernel's OOM killer would), one allocates past the memory
limit, one touches more memory than one input may. Each runs in a child
process of its own, as every fuzz target does.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the fuzz package, whichever way pytest was started
from fuzz import run as fuzz_run  # noqa: E402

HUGE = 2**31  # bytes: refused under the 1 GiB limit below, mapped lazily (never touched) without one
HOG = 2**28


@dataclass(frozen=True)
class Probe:
    name: str
    target: Callable[[bytes], None]
    inputs: st.SearchStrategy[bytes]


def probe(data: bytes) -> None:
    if data == b"hang":
        while True:
            time.sleep(60)
    if data == b"die":
        os.kill(os.getpid(), signal.SIGKILL)
    if data == b"alloc":
        bytearray(HUGE)
    if data == b"hog":  # 256 MiB, every page touched, then freed: no failure, only a peak
        hog = bytearray(HOG)
        hog[::4096] = b"x" * len(range(0, HOG, 4096))


# The children import this module to find them: `test_fuzz_runner:HANG`.
HANG = Probe("probe_hang", probe, st.just(b"hang"))
DIE = Probe("probe_die", probe, st.just(b"die"))
ALLOC = Probe("probe_alloc", probe, st.just(b"alloc"))
HOG_ONCE = Probe("probe_hog", probe, st.sampled_from([b"fine", b"hog"]))
PROBES = {probe.name: f"{__name__}:{attr}"
          for probe, attr in ((HANG, "HANG"), (DIE, "DIE"), (ALLOC, "ALLOC"), (HOG_ONCE, "HOG_ONCE"))}

LIMITS = fuzz_run.Limits(input_seconds=0.5, memory_mb=1024, input_memory_mb=128)


def test_an_input_past_the_time_limit_is_killed_kept_as_a_hang_and_the_run_goes_on_in_a_new_child(tmp_path):
    outcome = fuzz_run.fuzz_case(PROBES["probe_hang"], 120, limits=LIMITS, directory=tmp_path, max_examples=2, seed=0)

    assert outcome.examples == 2 and outcome.children == 2 and len(outcome.hangs) == 2
    hang = outcome.hangs[0]
    assert hang.path.name.startswith("probe_hang-hang-") and hang.path.read_bytes() == b"hang"
    assert "in probe" in hang.stack_path.read_text()  # where it hung, from faulthandler
    assert outcome.new_failures == 2 and not outcome.deaths and not outcome.errors


def test_a_child_killed_by_a_signal_keeps_its_input_as_died(tmp_path):
    outcome = fuzz_run.fuzz_case(PROBES["probe_die"], 120, limits=LIMITS, directory=tmp_path, max_examples=1, seed=0)

    assert len(outcome.deaths) == 1 and not outcome.hangs and not outcome.errors
    death = outcome.deaths[0]
    assert "SIGKILL" in death.detail
    assert death.path.name.startswith("probe_die-died-") and death.path.read_bytes() == b"die"


def test_an_allocation_past_the_memory_limit_is_a_memory_error_recorded_as_a_failure(tmp_path):
    outcome = fuzz_run.fuzz_case(PROBES["probe_alloc"], 120, limits=LIMITS, directory=tmp_path, max_examples=1, seed=0)

    assert outcome.failures == 1 and not outcome.hangs and not outcome.deaths and not outcome.errors
    (finding,) = outcome.distinct.values()
    assert finding.type_name == "MemoryError" and finding.data == b"alloc"


def test_an_input_whose_peak_memory_goes_past_the_per_input_budget_is_kept_and_the_run_goes_on(tmp_path):
    outcome = fuzz_run.fuzz_case(PROBES["probe_hog"], 120, limits=LIMITS, directory=tmp_path, max_examples=20, seed=0)

    assert outcome.examples == 20 and outcome.children == 1 and outcome.failures == 0
    assert 0 < outcome.over_memory < 20 and outcome.new_failures == outcome.over_memory
    kept = outcome.memory[0]
    assert kept.path.name.startswith("probe_hog-memory-") and kept.path.read_bytes() == b"hog"
    assert "rose 256 MiB" in kept.detail or "rose 257 MiB" in kept.detail


def test_replay_runs_each_saved_input_under_the_same_limits(tmp_path, capsys):
    saved = {}
    for name, data in (("probe_hang-hang-0", b"hang"), ("probe_die-died-0", b"die"), ("probe_alloc-0", b"alloc"),
                       ("probe_hog-memory-0", b"hog"), ("probe_hang-1", b"fine")):
        saved[name] = tmp_path / f"{name}.bin"
        saved[name].write_bytes(data)

    status = fuzz_run.replay([str(path) for path in saved.values()], limits=LIMITS, cases=PROBES)

    out = capsys.readouterr().out
    assert status == 1
    verdicts = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in out.splitlines() if line.startswith(str(tmp_path))}
    assert verdicts[str(saved["probe_hang-hang-0"])].startswith("HANGS")
    assert verdicts[str(saved["probe_die-died-0"])].startswith("DIES (killed by SIGKILL")
    assert verdicts[str(saved["probe_alloc-0"])].startswith("FAILS")  # a MemoryError, under the limit
    assert verdicts[str(saved["probe_hog-memory-0"])].startswith("USES TOO MUCH MEMORY")
    assert verdicts[str(saved["probe_hang-1"])] == "passes"
