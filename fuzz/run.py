"""Run every fuzz target in ``tests/fuzz_targets.py`` for a time budget, each input under a time and a memory limit.

    python -m fuzz.run --seconds 120          # the budget is split evenly across targets
    python -m fuzz.run --seconds 60 --target torch_pickle_ops --input-seconds 5 --memory-mb 2048
    python -m fuzz.run --replay fuzz/crashes/safetensors_structured-0123abcd4567.bin
    python -m fuzz.run --seconds 3600 --target cx_torch_pickle --target cx_safetensors   # complexity only

Hypothesis generates the inputs (no atheris, no native fuzzer). Unlike a
test, the run does not stop at the first failure: it records it, keeps the
smallest input seen for each distinct failure (the exception type and the
place it was raised), and goes on until the target's share of the time is
spent. Each kept input is written to ``fuzz/crashes/<case>-<hash>.bin``; it is
the whole input file, so it can become a case in tests/test_bad_inputs.py or
an ``@example`` as it is.

Limits. Each target is fuzzed in a child process (multiprocessing, spawn),
whose address space is capped with ``RLIMIT_AS`` (``--memory-mb``, default
3072): an input that makes a load allocate without bound gets a
``MemoryError`` (recorded like any other exception that is not a
``MaterializeError``) instead of the kernel's OOM killer. Before each input
the child writes it to ``fuzz/crashes/.current-<case>.bin`` and stamps its
start and its size in shared memory; the parent watches. An input still
running after its time limit (``--input-seconds``, default 10, plus a part
in proportion to its size: see below) is a hang: the parent has the child dump its
Python stack (faulthandler, SIGUSR1), kills it, keeps the input as
``<case>-hang-<hash>.bin`` (the stack beside it, ``.traceback.txt``) and
starts a new child for the rest of the target's time. A child that dies
(killed by a signal: a segfault, an abort, the OOM killer) leaves its input
as ``<case>-died-<hash>.bin``. An input that fits under the cap but makes
resident memory rise more than its memory limit (``--input-memory-mb``,
default 1024, plus its part in proportion to the size; the peak is measured per input through /proc/self/clear_refs) is counted, and the
first few are kept as ``<case>-memory-<hash>.bin``: a load that takes
gigabytes for a small file and then succeeds (or fails cleanly) is found
too, though nothing raised. Hangs,
deaths and memory use are failures, never known bugs. ``--replay`` runs saved
inputs under the same limits, one child each.

Limits in proportion to the input. Both per-input limits grow with the
input's size, so that a large input a linear reader gets through is never
a finding and one whose cost grows faster than its size is::

    seconds    = --input-seconds   + --input-seconds-per-mb    * size_MB   (default 10 + 4 per MB)
    memory MiB = --input-memory-mb + --input-memory-mb-per-mb  * size_MB   (default 1024 + 64 per MB)

(size_MB: the input's bytes / 2**20). The child stamps each input's size
in shared memory beside its start time, and the parent works out that
input's deadline from both; the child compares its peak with that input's
memory limit. The constants are set for a slow, shared two-core machine.
A caller that runs beside other work may count the time limit in the child's
CPU time instead (``Limits(cpu_time=True)``; an input that only waits is
then a hang past four times its limit): the test suite's quick check does.
The linear readers take 0.1 to 2 s per MB there (an index or a pickle of
plain keys at the low end; at the high end a safetensors header of 100,000
one-byte tensors, listed, inspected and loaded, and a DCP tensor of 20,000
chunks in order, each chunk's embedded zip parsed at every open: the one
closest to its limit), and hold a few MB of Python objects per MB read. A
quadratic reader takes minutes at a few MB (a hash-flooded dict of 200,000
keys is 2*10^10 probes; a zip of 150,000 records, one name twice, counted
name by name, as many comparisons) and is stopped at 10 s + 4 s per MB.
The small inputs of the other targets gain nothing from the per-MB part.
The ``cx_*`` targets (``fuzz_targets.COMPLEXITY_CASES``) make inputs
expensive rather than malformed, up to a few MB each (a zip of many
records, 17 MB); each case's ``seeds``, its known expensive inputs, run
first, once per run: a child killed on one is replaced by one that starts
at the next.

An error the interpreter only prints, which no ``except`` sees (raised in a
finaliser, or printed by C code: ``sys.unraisablehook`` and
``sys.excepthook`` in the child), is recorded as a failure of the input
that printed it, its type marked ", printed"; ``--replay`` fails on one too.

Failures that match ``fuzz_targets.KNOWN_BUGS`` (bugs pinned by xfail tests
in tests/test_fuzz_short.py) are tagged as known. Exit status 1 when anything
failed; with ``--ignore-known``, only when something new failed.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import importlib
import multiprocessing
import os
import pickle
import resource
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed

ROOT = Path(__file__).resolve().parents[1]
CRASH_DIR = Path(__file__).resolve().parent / "crashes"
# The targets live beside the tests that also run them; pytest imports them
# as the top-level module ``fuzz_targets`` (tests/ has no __init__.py), so
# the runner imports them the same way (when it needs them: a child that
# runs a test's own probe target does without torch).
sys.path.insert(0, str(ROOT / "tests"))

DEFAULT_INPUT_SECONDS = 10.0
DEFAULT_MEMORY_MB = 3072
DEFAULT_INPUT_MEMORY_MB = 1024
DEFAULT_INPUT_SECONDS_PER_MB = 4.0  # see "Limits in proportion to the input" above
DEFAULT_INPUT_MEMORY_MB_PER_MB = 64
_KEPT_OVER_MEMORY = 5  # inputs kept per case for going over input_memory_mb (all are counted)
_POLL = 0.05  # how often the parent looks at its child
_STACK_DUMP_WAIT = 1.0  # how long a hung child gets to write its stack before it is killed
_MIN_RESTART_SECONDS = 1.0  # less time than this left for a target: no new child
_SPAWN = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or torch state inherited


def _fuzz_targets() -> Any:
    import fuzz_targets

    return fuzz_targets


WAIT_FACTOR = 4  # Limits.cpu_time: an input's wall-clock time may run to this many times its limit


def _past_its_limit(pid: int, shared: "_Shared", limits: Limits) -> Optional[str]:
    """None while the child's current input is within its time limit; else the words that say which time ran
    out ("" for wall-clock time, the default limit)."""
    limit = limits.seconds_for(shared.size.value)
    waited = time.monotonic() - shared.started.value
    if not limits.cpu_time:
        return "" if waited > limit else None
    if waited > WAIT_FACTOR * limit:
        return f" of wall-clock time ({WAIT_FACTOR} times its CPU time limit)"
    spent = _cpu_seconds(pid)
    if spent is not None and spent - shared.started_cpu.value > limit:
        return " of CPU time"
    return None


def _cpu_seconds(pid: int) -> Optional[float]:
    """A process's CPU time (user and system, every thread) as its own ``time.process_time()`` counts it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _TimeUp(Exception):
    """Raised from inside the test body once the target's time (or example count) is spent.

    Hypothesis has no public "stop now" call. Raising from the body makes
    hypothesis treat the example as failing; with only the generate phase
    enabled it does not shrink, and re-raises the exception to the caller,
    where it is caught (if it replays the example first, that raises _TimeUp
    again: the clock is still past the deadline). Real failures never reach
    hypothesis: they are caught in the body and recorded, so _TimeUp is the
    only exception hypothesis ever sees and no time goes to shrinking.
    """


@dataclass(frozen=True)
class Limits:
    input_seconds: float = DEFAULT_INPUT_SECONDS  # wall-clock time one input may run
    memory_mb: int = DEFAULT_MEMORY_MB  # the child's address space (RLIMIT_AS); 0: no limit
    input_memory_mb: int = DEFAULT_INPUT_MEMORY_MB  # resident memory one input may add at its peak; 0: not measured
    input_seconds_per_mb: float = DEFAULT_INPUT_SECONDS_PER_MB  # added to input_seconds per MB of the input
    input_memory_mb_per_mb: float = DEFAULT_INPUT_MEMORY_MB_PER_MB  # added to input_memory_mb per MB of the input
    # The time limit in the child's CPU time instead of wall-clock time (an input that waits is still a hang once
    # WAIT_FACTOR times its limit has passed): for checks run beside other work on shared cores, where a linear
    # reader's wall-clock time stretches with the load while its CPU time does not (tests/test_fuzz_short.py).
    cpu_time: bool = False

    def seconds_for(self, size: int) -> float:
        """The wall-clock time an input of ``size`` bytes may run."""
        return self.input_seconds + self.input_seconds_per_mb * size / 2**20

    def memory_bytes_for(self, size: int) -> int:
        """How far an input of ``size`` bytes may raise resident memory at its peak; 0: not measured."""
        if not self.input_memory_mb:
            return 0
        return int((self.input_memory_mb + self.input_memory_mb_per_mb * size / 2**20) * 2**20)


@dataclass
class Finding:
    """One distinct failure: the smallest input seen to raise it, and what it raised."""

    data: bytes
    type_name: str
    place: str
    message: str
    known_test: Optional[str]  # the xfail test of fuzz_targets.KNOWN_BUGS that pins it, if it is one


@dataclass
class Stop:
    """An input the parent had to stop: it ran past the time limit (a hang) or its child died."""

    kind: str  # "hang", "died", or "memory" (an input that went over input_memory_mb, and ran on)
    data: Optional[bytes]  # None: the child died between inputs
    detail: str
    path: Optional[Path] = None
    stack_path: Optional[Path] = None


@dataclass
class Outcome:
    examples: int = 0
    failures: int = 0
    known: int = 0  # failures that are one of fuzz_targets.KNOWN_BUGS
    # _signature(exception) -> the smallest input that raised it
    distinct: dict[tuple[str, str], Finding] = field(default_factory=dict)
    hangs: list[Stop] = field(default_factory=list)
    deaths: list[Stop] = field(default_factory=list)
    over_memory: int = 0  # inputs whose peak resident memory grew past input_memory_mb
    memory: list[Stop] = field(default_factory=list)  # the first _KEPT_OVER_MEMORY of them
    errors: list[str] = field(default_factory=list)  # a child that failed outside any input (the runner's fault)
    children: int = 0
    seeds_tried: int = 0  # the case's seed inputs handed to a child so far

    @property
    def new_failures(self) -> int:
        return self.failures - self.known + len(self.hangs) + len(self.deaths) + self.over_memory + len(self.errors)

    @property
    def all_failures(self) -> int:
        return self.failures + len(self.hangs) + len(self.deaths) + self.over_memory + len(self.errors)


def _signature(exc: BaseException) -> tuple[str, str]:
    """The exception type, the library line it escaped from and the line that raised it.

    The library line tells apart bugs that fail the same way deep in the
    standard library (zipfile, json) from different call sites.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__, "?"
    package = str(ROOT / "materialize")
    ours = [f for f in frames if f.filename.startswith(package)]
    places = [f"{Path(f.filename).name}:{f.lineno}" for f in (ours[-1:] + [frames[-1]])]
    return type(exc).__name__, " -> ".join(dict.fromkeys(places))


class _Printed:
    """Errors the interpreter prints and goes on from, which no ``except`` sees: one raised in a finaliser
    (``sys.unraisablehook``), or printed by C code with ``PyErr_Print`` (``sys.excepthook``; CPython 3.11 so
    reported a bytearray freed while the C unpickler still held a view of it). Each is a finding."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def install(self) -> None:
        sys.unraisablehook = self._unraisable
        sys.excepthook = self._printed

    def _unraisable(self, unraisable: Any) -> None:
        self.errors.append(unraisable.exc_value if unraisable.exc_value is not None else unraisable.exc_type())

    def _printed(self, kind: type, value: BaseException, tb: Any) -> None:
        self.errors.append(value)

    def take(self) -> list[BaseException]:
        errors, self.errors = self.errors, []
        return errors


def _first_line(exc: BaseException) -> str:
    """What a finding says of its exception: the first line of its message, at most 160 characters."""
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else ""


def _printed_signature(exc: BaseException) -> tuple[str, str]:
    kind, place = _signature(exc)
    return f"{kind}, printed", place


def find_case(ref: str) -> Any:
    """A case of ``fuzz_targets.CASES`` by name, or ``module:attribute`` (a test's own case, with name, target, inputs)."""
    if ":" in ref:
        module, attribute = ref.split(":", 1)
        return getattr(importlib.import_module(module), attribute)
    for case in _fuzz_targets().CASES:
        if case.name == ref:
            return case
    raise KeyError(f"no fuzz case named {ref!r}")


def _known_test(exc: BaseException) -> Optional[str]:
    if "fuzz_targets" not in sys.modules:  # a probe target's child: no known bugs to match
        return None
    bug = sys.modules["fuzz_targets"].known_bug(exc)
    return bug.test if bug is not None else None


# ---------------------------------------------------------------- the child


class _Shared:
    """What the child tells the parent through shared memory: when its current input started, and its counts."""

    def __init__(self) -> None:
        self.started = _SPAWN.RawValue("d", 0.0)  # time.monotonic() at the current input's start; 0: between inputs
        self.started_cpu = _SPAWN.RawValue("d", 0.0)  # the child's time.process_time() then, stamped before started
        self.size = _SPAWN.RawValue("q", 0)  # the current input's bytes, stamped before started: its deadline depends on it
        self.examples = _SPAWN.RawValue("q", 0)
        self.failures = _SPAWN.RawValue("q", 0)
        self.known = _SPAWN.RawValue("q", 0)
        self.grown = _SPAWN.RawValue("q", 0)  # replay: how far the input raised resident memory
        self.next_seed = _SPAWN.RawValue("q", 0)  # the case's seed input to try next (see fuzz_case)


def _status(*fields: str) -> list[int]:
    """Fields of /proc/self/status, in bytes (0 where there is none)."""
    found = dict.fromkeys(fields, 0)
    try:
        with open("/proc/self/status") as status:
            for line in status:
                name = line.split(":", 1)[0]
                if name in found:
                    found[name] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return list(found.values())


def _vm_bytes() -> int:
    return _status("VmSize")[0]


def _reset_peak() -> Optional[int]:
    """Reset the resident-memory high-water mark (Linux 4.0+); the resident memory now, or None where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return None
    return _status("VmRSS")[0]


def _peak_growth(before: Optional[int]) -> int:
    """How far resident memory rose above ``before`` at its peak since _reset_peak."""
    return 0 if before is None else max(0, _status("VmHWM")[0] - before)


def _apply_limits(memory_mb: int) -> None:
    """In the child: cap the address space, no core files, Ctrl-C left to the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    if memory_mb:
        limit = memory_mb * 2**20
        if _vm_bytes() >= limit:
            raise SystemExit(f"--memory-mb {memory_mb} is below what the child already maps "
                             f"({_vm_bytes() // 2**20} MiB after its imports); give it more")
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _open_stack_file(path: Path) -> Any:
    """faulthandler writes the child's Python stack here on a fatal signal, and when the parent sends SIGUSR1."""
    handle = open(path, "w")
    faulthandler.enable(handle)
    faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True)
    return handle


def _worker(ref: str, deadline: float, max_examples: Optional[int], seed: Optional[int], first_seed: int,
            limits: Limits, current: str, stack: str, shared: _Shared, conn: Any) -> None:
    case = find_case(ref)  # its imports (torch) before the limit, which is for the inputs
    _apply_limits(limits.memory_mb)
    stack_file = _open_stack_file(Path(stack))  # noqa: F841 (kept open for faulthandler)
    warnings.simplefilter("ignore")  # zipfile's duplicate names, torch's pickle protocol: noise here
    current_path = Path(current)
    best: dict[tuple[str, str], int] = {}  # signature -> size of the input last sent for it
    printed = _Printed()
    printed.install()

    def more() -> bool:
        return time.monotonic() < deadline and (max_examples is None or shared.examples.value < max_examples)

    def one(data: bytes) -> None:
        current_path.write_bytes(data)  # first the input, then the stamp: a stamped input is always on disk
        resident = _reset_peak() if limits.input_memory_mb else None
        shared.size.value = len(data)
        shared.started_cpu.value = time.process_time()
        shared.started.value = time.monotonic()
        shared.examples.value += 1
        reports = []
        printed.take()  # anything printed between inputs is no input's
        try:
            case.target(data)
        except Exception as exc:  # every exception that is not a MaterializeError is a finding
            shared.failures.value += 1
            known = _known_test(exc)
            shared.known.value += known is not None
            key = _signature(exc)
            if key not in best or len(data) < best[key]:
                best[key] = len(data)
                reports.append(("fail", key, data, type(exc).__name__, key[1], _first_line(exc), known))
        finally:
            shared.started.value = 0.0
        for exc in printed.take():
            shared.failures.value += 1
            key = _printed_signature(exc)
            if key not in best or len(data) < best[key]:
                best[key] = len(data)
                reports.append(("fail", key, data, key[0], key[1], _first_line(exc), None))
        grown = _peak_growth(resident)
        if limits.input_memory_mb and grown > limits.memory_bytes_for(len(data)):
            reports.append(("memory", data, grown))
        for report in reports:  # sent outside the timed span: a hang can never be cut mid-message
            conn.send(report)

    @settings(
        max_examples=max_examples or 10**9,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
    )
    @given(case.inputs)
    def run(data: bytes) -> None:
        if not more():
            raise _TimeUp
        one(data)

    attempt = 0
    try:
        # The case's known inputs first, each once per fuzz_case: the index of the next is kept in shared
        # memory before one runs, so that the child that replaces one killed on a seed goes on past it.
        seeds = getattr(case, "seeds", ())
        for index in range(first_seed, len(seeds)):
            if not more():
                break
            shared.next_seed.value = index + 1
            one(seeds[index]())
        # A run also ends when hypothesis believes the strategy is exhausted;
        # start over (new seed) until the time or the examples are spent.
        while more():
            runner = run if seed is None else hypothesis_seed(seed + attempt)(run)
            attempt += 1
            try:
                runner()
            except _TimeUp:
                break
    except BaseException:  # the strategy or the runner itself failed, outside any input
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(3)
    conn.send(("done",))


def _replay_worker(ref: str, path: str, limits: Limits, stack: str, shared: _Shared) -> None:
    case = find_case(ref)
    _apply_limits(limits.memory_mb)
    stack_file = _open_stack_file(Path(stack))  # noqa: F841
    warnings.simplefilter("ignore")
    data = Path(path).read_bytes()
    resident = _reset_peak()
    shared.size.value = len(data)
    shared.started_cpu.value = time.process_time()
    shared.started.value = time.monotonic()
    printed = _Printed()
    printed.install()
    try:
        case.target(data)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    errors = printed.take()
    if errors:
        for exc in errors:
            print(f"{_printed_signature(exc)[0]}: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    shared.grown.value = _peak_growth(resident)
    os._exit(0)


# ---------------------------------------------------------------- the parent


def _save(directory: Path, stem: str, data: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}-{hashlib.sha1(data).hexdigest()[:12]}.bin"
    path.write_bytes(data)
    return path


def _stack_text(stack: Path) -> str:
    try:
        return stack.read_text(errors="replace").strip()
    except OSError:
        return ""


def _describe_exit(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the kernel's OOM killer, or a kill from outside)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exited with status {code}"


def _kill(process: Any, *, stack: Optional[Path] = None) -> None:
    """Kill the child; with ``stack``, first have it write its Python stack there (faulthandler, on SIGUSR1)."""
    if stack is not None and process.is_alive():
        before = stack.stat().st_size if stack.exists() else 0
        try:
            os.kill(process.pid, signal.SIGUSR1)
        except OSError:
            pass
        waited_until = time.monotonic() + _STACK_DUMP_WAIT  # the dump takes milliseconds; the child goes on hanging
        while time.monotonic() < waited_until and process.is_alive():
            size = stack.stat().st_size if stack.exists() else 0
            if size > before:
                time.sleep(_POLL)  # let it finish writing
                if (stack.stat().st_size if stack.exists() else 0) == size:
                    break
            else:
                time.sleep(_POLL / 5)
    if process.is_alive():
        process.kill()
    process.join()


def fuzz_case(
    ref: str, seconds: float, *, limits: Limits = Limits(), directory: Path = CRASH_DIR,
    max_examples: Optional[int] = None, seed: Optional[int] = None, restart: bool = True,
) -> Outcome:
    """Fuzz one case in child processes, each input under ``limits``; hangs and deaths saved in ``directory`` at once.

    The case's ``seeds`` (known inputs, each a function making one), if it
    has any, are tried first, each once, before hypothesis draws any.
    ``ref`` is a name of ``fuzz_targets.CASES`` or ``module:attribute``. With
    ``max_examples``, stop after that many inputs; with ``seed``, the inputs
    are the same on every run (each new child takes the next seed). Without
    ``restart``, the first hang or death ends the case.
    """
    case = find_case(ref)
    directory.mkdir(parents=True, exist_ok=True)
    current = directory / f".current-{case.name}.bin"
    stack = directory / f".stack-{case.name}.txt"
    deadline = time.monotonic() + seconds
    outcome = Outcome()
    while time.monotonic() < deadline - (_MIN_RESTART_SECONDS if outcome.children else 0):
        if max_examples is not None and outcome.examples >= max_examples:
            break
        left = None if max_examples is None else max_examples - outcome.examples
        stopped = _run_child(case, ref, deadline, left, None if seed is None else seed + 1000 * outcome.children,
                             limits, current, stack, directory, outcome)
        if stopped is None or outcome.errors or not restart:
            break
    return outcome


def _run_child(case: Any, ref: str, deadline: float, max_examples: Optional[int], seed: Optional[int],
               limits: Limits, current: Path, stack: Path, directory: Path, outcome: Outcome) -> Optional[Stop]:
    """One child, watched until it finishes; returns the hang or death that ended it early, if one did."""
    shared = _Shared()
    shared.next_seed.value = outcome.seeds_tried
    receive, send = _SPAWN.Pipe(duplex=False)
    current.unlink(missing_ok=True)
    process = _SPAWN.Process(
        target=_worker, name=f"fuzz-{case.name}", daemon=True,
        args=(ref, deadline, max_examples, seed, outcome.seeds_tried, limits, str(current), str(stack), shared, send),
    )
    process.start()
    send.close()  # the child holds the only writing end: its death is an EOF here
    outcome.children += 1
    done = False
    stopped: Optional[Stop] = None
    pipe_open = True

    def drain(wait: float) -> None:
        nonlocal done, pipe_open
        while pipe_open and receive.poll(wait):
            wait = 0
            try:
                message = receive.recv()
            except (EOFError, OSError, pickle.UnpicklingError):
                pipe_open = False
                return
            if message[0] == "fail":
                _, key, data, type_name, place, text, known = message
                if key not in outcome.distinct or len(data) < len(outcome.distinct[key].data):
                    outcome.distinct[key] = Finding(data, type_name, place, text, known)
            elif message[0] == "memory":
                _, data, grown = message
                outcome.over_memory += 1
                if len(outcome.memory) < _KEPT_OVER_MEMORY:
                    stop = Stop("memory", data, f"resident memory rose {grown / 2**20:.0f} MiB during this input "
                                                f"(more than {limits.memory_bytes_for(len(data)) / 2**20:.0f} MiB, "
                                                f"the limit of its {len(data) / 2**20:.2f} MB), and it went on")
                    stop.path = _save(directory, f"{case.name}-memory", data)
                    outcome.memory.append(stop)
            elif message[0] == "error":
                outcome.errors.append(message[1])
            elif message[0] == "done":
                done = True

    try:
        while True:
            drain(_POLL)
            if not pipe_open:
                time.sleep(_POLL)
            if done:
                process.join(30)
                break
            if not process.is_alive():
                drain(0)
                if done or outcome.errors:
                    break
                if not shared.started.value and not shared.examples.value:
                    outcome.errors.append(f"the child {_describe_exit(process.exitcode)} before its first input")
                    break
                data = current.read_bytes() if shared.started.value and current.exists() else None
                stopped = Stop("died", data, _describe_exit(process.exitcode))
                break
            started = shared.started.value
            past = _past_its_limit(process.pid, shared, limits) if started else None
            if past is not None:
                size = shared.size.value
                data = current.read_bytes() if current.exists() else b""
                _kill(process, stack=stack)
                stopped = Stop("hang", data, f"still running after {limits.seconds_for(size):.1f} s{past} "
                                             f"(the limit of its {size / 2**20:.2f} MB), killed")
                break
            if not started and time.monotonic() > deadline + limits.seconds_for(shared.size.value) + 60:
                # Between inputs and far past its time: the strategy or the runner is stuck, not a target.
                _kill(process, stack=stack)
                outcome.errors.append(f"the child stopped making progress outside any input:\n{_stack_text(stack)}")
                break
    finally:
        if process.is_alive():
            _kill(process)
        receive.close()
    outcome.examples += shared.examples.value
    outcome.seeds_tried = max(outcome.seeds_tried, shared.next_seed.value)
    outcome.failures += shared.failures.value
    outcome.known += shared.known.value
    if stopped is not None:
        if stopped.data is not None:
            stopped.path = _save(directory, f"{case.name}-{stopped.kind}", stopped.data)
            text = _stack_text(stack)
            if text:
                stopped.stack_path = stopped.path.with_suffix(".traceback.txt")
                stopped.stack_path.write_text(text + "\n")
        (outcome.hangs if stopped.kind == "hang" else outcome.deaths).append(stopped)
    return stopped


def save_crash(case_name: str, data: bytes, directory: Path = CRASH_DIR) -> Path:
    return _save(directory, case_name, data)


def describe(case: Any, outcome: Outcome, directory: Path = CRASH_DIR) -> list[str]:
    """The report of one case: its counts, then each distinct failure, hang and death with its saved input."""
    def shown(path: Path) -> str:
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)

    lines = [f"{case.name}: {outcome.examples} examples, {outcome.failures} failures "
             f"({outcome.known} of known bugs; {len(outcome.distinct)} distinct), "
             f"{len(outcome.hangs)} hangs, {len(outcome.deaths)} deaths, {outcome.over_memory} over the memory budget"]
    for finding in outcome.distinct.values():
        path = save_crash(case.name, finding.data, directory)
        tag = f"known bug, pinned by {finding.known_test}" if finding.known_test else "NEW"
        lines.append(f"  FAIL {case.target.__name__}: {finding.type_name} at {finding.place}: {finding.message}")
        lines.append(f"       [{tag}] input ({len(finding.data)} bytes): {shown(path)}")
    for stop in outcome.hangs + outcome.deaths + outcome.memory:
        label = {"hang": "HANG", "died": "DIED", "memory": "MEMORY"}[stop.kind]
        if stop.path is None:
            lines.append(f"  {label} {case.target.__name__}: {stop.detail}, between inputs (no input to keep)")
            continue
        lines.append(f"  {label} {case.target.__name__}: {stop.detail}")
        lines.append(f"       [NEW] input ({len(stop.data or b'')} bytes): {shown(stop.path)}")
        if stop.stack_path is not None:
            lines.append(f"       its Python stack: {shown(stop.stack_path)}")
    if outcome.over_memory > len(outcome.memory):
        lines.append(f"  MEMORY: {outcome.over_memory - len(outcome.memory)} more inputs over the budget (not kept)")
    for error in outcome.errors:
        lines.append(f"  ERROR outside any input (a runner or strategy fault, not the target's):")
        lines.extend("       " + line for line in error.strip().splitlines()[-12:])
    return lines


def _case_of(path: Path) -> str:
    """``<case>-<hash>.bin``, ``<case>-hang-<hash>.bin``, ``<case>-died-<hash>.bin`` -> ``<case>`` (names hold no '-')."""
    return path.name.split("-", 1)[0]


def replay(paths: list[str], *, limits: Limits = Limits(), cases: Optional[Mapping[str, str]] = None) -> int:
    """Run saved inputs again, each in a child under ``limits``, through the target their file name names.

    ``cases`` maps case names to ``module:attribute`` references (for cases
    outside ``fuzz_targets.CASES``, as the runner's own tests use).
    """
    status = 0
    for name in paths:
        path = Path(name)
        case_name = _case_of(path)
        ref = (cases or {}).get(case_name, case_name)
        try:
            find_case(ref)
        except KeyError:
            print(f"{path}: no target named {case_name!r}", file=sys.stderr)
            status = 1
            continue
        verdict = _replay_one(ref, path, limits)
        print(f"{path}: {verdict}", flush=True)
        status |= verdict != "passes"
    return status


def _replay_one(ref: str, path: Path, limits: Limits) -> str:
    shared = _Shared()
    CRASH_DIR.mkdir(parents=True, exist_ok=True)
    stack = CRASH_DIR / f".stack-replay-{os.getpid()}.txt"
    process = _SPAWN.Process(target=_replay_worker, args=(ref, str(path), limits, str(stack), shared), daemon=True)
    process.start()
    try:
        while process.is_alive():
            process.join(_POLL)
            started = shared.started.value
            size = shared.size.value
            past = _past_its_limit(process.pid, shared, limits) if started and process.is_alive() else None
            if past is not None:
                _kill(process, stack=stack)
                text = _stack_text(stack)
                return (f"HANGS (still running after {limits.seconds_for(size):.1f} s{past}, the limit of its "
                        f"{size / 2**20:.2f} MB; killed)" + (f"; its stack:\n{text}" if text else ""))
        if process.exitcode == 0:
            grown = shared.grown.value
            size = shared.size.value
            if limits.input_memory_mb and grown > limits.memory_bytes_for(size):
                return (f"USES TOO MUCH MEMORY (resident memory rose {grown / 2**20:.0f} MiB, more than "
                        f"{limits.memory_bytes_for(size) / 2**20:.0f} MiB, the limit of its {size / 2**20:.2f} MB)")
            return "passes"
        if process.exitcode == 1:
            return "FAILS (traceback above)"
        text = _stack_text(stack)
        return f"DIES ({_describe_exit(process.exitcode)})" + (f"; its stack:\n{text}" if text else "")
    finally:
        if process.is_alive():
            _kill(process)
        stack.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    fuzz_targets = _fuzz_targets()
    parser = argparse.ArgumentParser(prog="python -m fuzz.run", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="total time budget, split across targets")
    parser.add_argument("--target", action="append", choices=[case.name for case in fuzz_targets.CASES],
                        help="fuzz only this case (repeatable)")
    parser.add_argument("--input-seconds", type=float, default=DEFAULT_INPUT_SECONDS,
                        help="wall-clock limit of one input; past it the input is kept as a hang (default %(default)s)")
    parser.add_argument("--memory-mb", type=int, default=DEFAULT_MEMORY_MB,
                        help="address-space limit (RLIMIT_AS) of the process running the inputs, MiB; 0: none "
                             "(default %(default)s)")
    parser.add_argument("--input-memory-mb", type=int, default=DEFAULT_INPUT_MEMORY_MB,
                        help="resident memory one input may add at its peak; an input past it is kept as a memory "
                             "failure (it runs on); 0: not measured (default %(default)s)")
    parser.add_argument("--input-seconds-per-mb", type=float, default=DEFAULT_INPUT_SECONDS_PER_MB,
                        help="seconds added to --input-seconds per MB of the input (default %(default)s)")
    parser.add_argument("--input-memory-mb-per-mb", type=float, default=DEFAULT_INPUT_MEMORY_MB_PER_MB,
                        help="MiB added to --input-memory-mb per MB of the input (default %(default)s)")
    parser.add_argument("--replay", nargs="+", metavar="FILE", help="re-run saved inputs (under the same limits) instead of fuzzing")
    parser.add_argument("--ignore-known", action="store_true",
                        help="exit 0 when every failure is one of fuzz_targets.KNOWN_BUGS (pinned by xfail tests)")
    args = parser.parse_args(argv)
    limits = Limits(input_seconds=args.input_seconds, memory_mb=args.memory_mb, input_memory_mb=args.input_memory_mb,
                    input_seconds_per_mb=args.input_seconds_per_mb, input_memory_mb_per_mb=args.input_memory_mb_per_mb)
    if args.replay:
        return replay(args.replay, limits=limits)

    cases = [case for case in fuzz_targets.CASES if not args.target or case.name in args.target]
    share = args.seconds / len(cases)
    failures = new_failures = 0
    for case in cases:
        outcome = fuzz_case(case.name, share, limits=limits)
        failures += outcome.all_failures
        new_failures += outcome.new_failures
        for line in describe(case, outcome):
            print(line, flush=True)
    return 1 if (new_failures if args.ignore_known else failures) else 0


if __name__ == "__main__":
    sys.exit(main())
