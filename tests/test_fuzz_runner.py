"""The fuzz runner's limits (fuzz/run.py): a hang, a death and a blow-up are recorded failures, and the run goes on.

Tiny probe targets stand in for the readers: one sleeps, one kills its own
process (as the kernel's OOM killer would), one allocates past the memory
limit, one touches more memory than one input may; and, for the limits that
grow with the input, ones that spend time or memory in proportion to their
input's size (which must pass) or to its square (which must be caught). Each
runs in a child process of its own, as every fuzz target does.
"""

from __future__ import annotations

import ctypes
import dataclasses
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
    seeds: tuple[Callable[[], bytes], ...] = ()


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
    if data == b"finalizer":  # raised where no caller can catch it: the interpreter prints it and goes on
        _RaisesWhenFreed()
    if data == b"print":  # printed by C code (PyErr_Print), as CPython's C unpickler once reported a freed buffer
        ctypes.pythonapi.PyRun_SimpleString(b"raise SystemError('printed, never raised')")


class _RaisesWhenFreed:
    def __del__(self) -> None:
        raise ValueError("raised in a finaliser")


MB = 2**20
SECONDS_PER_MB = 1.0  # of the proportional limits below; the linear probes spend a third of it
MIB_PER_MB = 16


def _mb(data: bytes) -> float:
    return len(data) / MB


def _touch(nbytes: int) -> None:
    hog = bytearray(nbytes)
    hog[::4096] = b"x" * len(range(0, nbytes, 4096))


def sleeps_linearly(data: bytes) -> None:
    time.sleep(SECONDS_PER_MB / 3 * _mb(data))


def sleeps_quadratically(data: bytes) -> None:  # 9 s for 3 MB, where the limit is 3.5 s
    time.sleep(SECONDS_PER_MB * _mb(data) ** 2)


def touches_linearly(data: bytes) -> None:  # 36 MiB for 3 MB: past the fixed 32 MiB, well under the 80 MiB limit
    _touch(int(MIB_PER_MB * 3 / 4 * _mb(data) * MB))


def touches_quadratically(data: bytes) -> None:  # 144 MiB for 3 MB, where the limit is 80 MiB
    _touch(int(MIB_PER_MB * _mb(data) ** 2 * MB))


def spins_quadratically(data: bytes) -> None:  # 9 s of CPU for 3 MB, where the limit is 3.5 s
    end = time.process_time() + SECONDS_PER_MB * _mb(data) ** 2
    while time.process_time() < end:
        pass


def seeded(data: bytes) -> None:
    if data == b"seed-hang":
        while True:
            time.sleep(60)


_SIZES = st.sampled_from([b"", b"x" * 1024, b"x" * (3 * MB)])

# The children import this module to find them: `test_fuzz_runner:HANG`.
HANG = Probe("probe_hang", probe, st.just(b"hang"))
DIE = Probe("probe_die", probe, st.just(b"die"))
ALLOC = Probe("probe_alloc", probe, st.just(b"alloc"))
HOG_ONCE = Probe("probe_hog", probe, st.sampled_from([b"fine", b"hog"]))
PRINTED = Probe("probe_printed", probe, st.sampled_from([b"fine", b"finalizer", b"print"]))
SLEEP_LINEAR = Probe("probe_sleeplinear", sleeps_linearly, _SIZES)
SLEEP_SQUARE = Probe("probe_sleepsquare", sleeps_quadratically, _SIZES)
SPIN_SQUARE = Probe("probe_spinsquare", spins_quadratically, _SIZES)
TOUCH_LINEAR = Probe("probe_touchlinear", touches_linearly, _SIZES)
TOUCH_SQUARE = Probe("probe_touchsquare", touches_quadratically, _SIZES)
SEEDED = Probe("probe_seeded", seeded, st.just(b"drawn"),
               seeds=(lambda: b"seed-0", lambda: b"seed-hang", lambda: b"seed-2"))
PROBES = {probe.name: f"{__name__}:{attr}"
          for probe, attr in ((HANG, "HANG"), (DIE, "DIE"), (ALLOC, "ALLOC"), (HOG_ONCE, "HOG_ONCE"), (PRINTED, "PRINTED"),
                              (SLEEP_LINEAR, "SLEEP_LINEAR"), (SLEEP_SQUARE, "SLEEP_SQUARE"), (SPIN_SQUARE, "SPIN_SQUARE"),
                              (TOUCH_LINEAR, "TOUCH_LINEAR"), (TOUCH_SQUARE, "TOUCH_SQUARE"), (SEEDED, "SEEDED"))}

LIMITS = fuzz_run.Limits(input_seconds=0.5, memory_mb=1024, input_memory_mb=128)
# Touching 256 MiB costs page faults, which beside make test's other worker ran past 0.5 s of wall-clock time
# (called a hang): the probes that hog memory are timed by CPU time (a waiting input still hangs, at 4x).
HOG_LIMITS = dataclasses.replace(LIMITS, cpu_time=True)
# 0.5 s + 1 s per MB, 32 MiB + 16 MiB per MB: 3.5 s and 80 MiB for 3 MB.
PROPORTIONAL = fuzz_run.Limits(input_seconds=0.5, memory_mb=1024, input_memory_mb=32,
                               input_seconds_per_mb=SECONDS_PER_MB, input_memory_mb_per_mb=MIB_PER_MB)


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
    outcome = fuzz_run.fuzz_case(PROBES["probe_hog"], 120, limits=HOG_LIMITS, directory=tmp_path, max_examples=20,
                                 seed=0)

    assert outcome.examples == 20 and outcome.children == 1 and outcome.failures == 0
    assert 0 < outcome.over_memory < 20 and outcome.new_failures == outcome.over_memory
    kept = outcome.memory[0]
    assert kept.path.name.startswith("probe_hog-memory-") and kept.path.read_bytes() == b"hog"
    assert "rose 256 MiB" in kept.detail or "rose 257 MiB" in kept.detail


def test_errors_the_interpreter_only_prints_are_failures_of_the_input_that_printed_them(tmp_path):
    outcome = fuzz_run.fuzz_case(PROBES["probe_printed"], 120, limits=LIMITS, directory=tmp_path, max_examples=30,
                                 seed=0)

    assert outcome.examples == 30 and outcome.children == 1 and not outcome.errors
    by_type = {finding.type_name: finding for finding in outcome.distinct.values()}
    assert set(by_type) == {"ValueError, printed", "SystemError, printed"}
    assert by_type["ValueError, printed"].data == b"finalizer" and "finaliser" in by_type["ValueError, printed"].message
    assert by_type["SystemError, printed"].data == b"print"
    assert by_type["SystemError, printed"].message == "printed, never raised"
    assert 2 <= outcome.failures < 30  # each such input, never the fine ones


def test_replay_fails_an_input_that_prints_an_error(tmp_path, capsys):
    saved = tmp_path / "probe_printed-0.bin"
    saved.write_bytes(b"finalizer")
    fine = tmp_path / "probe_printed-1.bin"
    fine.write_bytes(b"fine")

    status = fuzz_run.replay([str(saved), str(fine)], limits=LIMITS, cases=PROBES)

    out = capsys.readouterr().out
    assert status == 1
    assert f"{saved}: FAILS" in out and f"{fine}: passes" in out


def test_replay_runs_each_saved_input_under_the_same_limits(tmp_path, capsys):
    saved = {}
    for name, data in (("probe_hang-hang-0", b"hang"), ("probe_die-died-0", b"die"), ("probe_alloc-0", b"alloc"),
                       ("probe_hog-memory-0", b"hog"), ("probe_hang-1", b"fine")):
        saved[name] = tmp_path / f"{name}.bin"
        saved[name].write_bytes(data)

    status = fuzz_run.replay([str(path) for path in saved.values()], limits=HOG_LIMITS, cases=PROBES)

    out = capsys.readouterr().out
    assert status == 1
    verdicts = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in out.splitlines() if line.startswith(str(tmp_path))}
    assert verdicts[str(saved["probe_hang-hang-0"])].startswith("HANGS")
    assert verdicts[str(saved["probe_die-died-0"])].startswith("DIES (killed by SIGKILL")
    assert verdicts[str(saved["probe_alloc-0"])].startswith("FAILS")  # a MemoryError, under the limit
    assert verdicts[str(saved["probe_hog-memory-0"])].startswith("USES TOO MUCH MEMORY")
    assert verdicts[str(saved["probe_hang-1"])] == "passes"


def test_the_limits_grow_with_the_input_by_the_documented_rule():
    limits = fuzz_run.Limits(input_seconds=10, input_memory_mb=1024, input_seconds_per_mb=4, input_memory_mb_per_mb=64)

    assert limits.seconds_for(0) == 10 and limits.seconds_for(3 * MB) == 22
    assert limits.memory_bytes_for(0) == 1024 * MB and limits.memory_bytes_for(3 * MB) == (1024 + 192) * MB
    assert fuzz_run.Limits(input_memory_mb=0).memory_bytes_for(3 * MB) == 0  # not measured stays not measured


def test_time_in_proportion_to_the_input_passes_and_time_in_its_square_is_a_hang(tmp_path):
    linear = fuzz_run.fuzz_case(PROBES["probe_sleeplinear"], 120, limits=PROPORTIONAL, directory=tmp_path,
                                max_examples=8, seed=0)
    square = fuzz_run.fuzz_case(PROBES["probe_sleepsquare"], 120, limits=PROPORTIONAL, directory=tmp_path,
                                max_examples=8, seed=0)

    # The linear probe takes 1 s over 3 MB, twice the fixed part of the limit: only the proportional part lets it by.
    assert linear.examples == 8 and linear.all_failures == 0, linear
    assert square.hangs and not square.deaths and not square.errors and square.failures == 0
    hang = square.hangs[0]
    assert len(hang.data) == 3 * MB and "3.5 s (the limit of its 3.00 MB)" in hang.detail


def test_under_cpu_time_limits_waiting_counts_only_past_its_wall_clock_cap_and_spinning_past_the_limit_is_a_hang(
        tmp_path, capsys):
    by_cpu = dataclasses.replace(PROPORTIONAL, cpu_time=True)
    waits = tmp_path / "probe_sleepsquare-0.bin"
    waits.write_bytes(b"x" * (2 * MB))  # 4 s asleep: past its 2.5 s limit, within four times it

    assert fuzz_run.replay([str(waits)], limits=by_cpu, cases=PROBES) == 0, capsys.readouterr().out
    assert fuzz_run.replay([str(waits)], limits=PROPORTIONAL, cases=PROBES) == 1  # wall-clock limits: a hang
    spins = fuzz_run.fuzz_case(PROBES["probe_spinsquare"], 120, limits=by_cpu, directory=tmp_path, max_examples=8,
                               seed=0, restart=False)

    assert spins.hangs and not spins.deaths and not spins.errors and spins.failures == 0, spins
    assert len(spins.hangs[0].data) == 3 * MB and "3.5 s of CPU time (the limit of its 3.00 MB)" in spins.hangs[0].detail


def test_memory_in_proportion_to_the_input_passes_and_memory_in_its_square_is_kept(tmp_path):
    linear = fuzz_run.fuzz_case(PROBES["probe_touchlinear"], 120, limits=PROPORTIONAL, directory=tmp_path,
                                max_examples=8, seed=0)
    square = fuzz_run.fuzz_case(PROBES["probe_touchsquare"], 120, limits=PROPORTIONAL, directory=tmp_path,
                                max_examples=8, seed=0)

    assert linear.examples == 8 and linear.all_failures == 0, linear
    assert square.examples == 8 and square.over_memory and not square.hangs and square.failures == 0
    kept = square.memory[0]
    assert len(kept.data) == 3 * MB and "more than 80 MiB, the limit of its 3.00 MB" in kept.detail


def test_a_case_s_seeds_run_first_once_each_and_a_hung_one_is_not_tried_again(tmp_path):
    outcome = fuzz_run.fuzz_case(PROBES["probe_seeded"], 120, limits=LIMITS, directory=tmp_path, max_examples=5,
                                 seed=0)

    assert outcome.seeds_tried == 3 and outcome.children == 2
    assert [hang.data for hang in outcome.hangs] == [b"seed-hang"]
    # Both children counted: seed-0 and the hung seed in the first, seed-2 and two drawn inputs in the second.
    assert outcome.examples == 5


def test_replay_gives_each_input_the_limits_of_its_size(tmp_path, capsys):
    saved = {}
    for name, probe_name in (("square", "probe_sleepsquare"), ("linear", "probe_sleeplinear"),
                             ("touch", "probe_touchsquare")):
        saved[name] = tmp_path / f"{probe_name}-0.bin"
        saved[name].write_bytes(b"x" * (3 * MB))

    status = fuzz_run.replay([str(path) for path in saved.values()], limits=PROPORTIONAL, cases=PROBES)

    out = capsys.readouterr().out
    assert status == 1
    verdicts = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in out.splitlines() if line.startswith(str(tmp_path))}
    assert verdicts[str(saved["square"])].startswith("HANGS (still running after 3.5 s")
    assert verdicts[str(saved["linear"])] == "passes"
    assert verdicts[str(saved["touch"])].startswith("USES TOO MUCH MEMORY")
