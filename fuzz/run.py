"""Run every fuzz target in ``tests/fuzz_targets.py`` for a time budget.

    python -m fuzz.run --seconds 120          # the budget is split evenly across targets
    python -m fuzz.run --replay fuzz/crashes/safetensors_structured-0123abcd4567.bin

Hypothesis generates the inputs (no atheris, no native fuzzer). Unlike a
test, the run does not stop at the first failure: it records it, keeps the
smallest input seen for each distinct failure (the exception type and the
place it was raised), and goes on until the target's share of the time is
spent. Each kept input is written to ``fuzz/crashes/<case>-<hash>.bin``; it is
the whole input file, so it can become a case in tests/test_bad_inputs.py or
an ``@example`` as it is.

Failures that match ``fuzz_targets.KNOWN_BUGS`` (bugs pinned by xfail tests
in tests/test_fuzz_short.py) are tagged as known. Exit status 1 when anything
failed; with ``--ignore-known``, only when something new failed.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, given, settings

ROOT = Path(__file__).resolve().parents[1]
CRASH_DIR = Path(__file__).resolve().parent / "crashes"
# The targets live beside the tests that also run them; pytest imports them
# as the top-level module ``fuzz_targets`` (tests/ has no __init__.py), so
# the runner imports them the same way.
sys.path.insert(0, str(ROOT / "tests"))

import fuzz_targets  # noqa: E402


class _TimeUp(Exception):
    """Raised from inside the test body once the target's time is spent.

    Hypothesis has no public "stop now" call. Raising from the body makes
    hypothesis treat the example as failing; with only the generate phase
    enabled it does not shrink, and re-raises the exception to the caller,
    where it is caught (if it replays the example first, that raises _TimeUp
    again: the clock is still past the deadline). Real failures never reach
    hypothesis: they are caught in the body and recorded, so _TimeUp is the
    only exception hypothesis ever sees and no time goes to shrinking.
    """


@dataclass
class Outcome:
    examples: int = 0
    failures: int = 0
    known: int = 0  # failures that are one of fuzz_targets.KNOWN_BUGS
    # _signature(exception) -> (the smallest input that raised it, the exception)
    distinct: dict[tuple[str, str], tuple[bytes, BaseException]] = field(default_factory=dict)


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


def fuzz_case(case: fuzz_targets.FuzzCase, seconds: float) -> Outcome:
    outcome = Outcome()
    deadline = time.monotonic() + seconds

    @settings(
        max_examples=10**9,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
    )
    @given(case.inputs)
    def run(data: bytes) -> None:
        if time.monotonic() >= deadline:
            raise _TimeUp
        outcome.examples += 1
        try:
            case.target(data)
        except Exception as exc:  # every exception that is not a MaterializeError is a finding
            outcome.failures += 1
            outcome.known += fuzz_targets.known_bug(exc) is not None
            key = _signature(exc)
            if key not in outcome.distinct or len(data) < len(outcome.distinct[key][0]):
                outcome.distinct[key] = (data, exc)

    # A run also ends when hypothesis believes the strategy is exhausted;
    # start over (new random seed) until the time is spent.
    while time.monotonic() < deadline:
        try:
            run()
        except _TimeUp:
            break
    return outcome


def save_crash(case_name: str, data: bytes) -> Path:
    CRASH_DIR.mkdir(parents=True, exist_ok=True)
    path = CRASH_DIR / f"{case_name}-{hashlib.sha1(data).hexdigest()[:12]}.bin"
    path.write_bytes(data)
    return path


def replay(paths: list[str]) -> int:
    """Run saved inputs again through the target their file name names."""
    status = 0
    for name in paths:
        path = Path(name)
        case_name = path.name.rsplit("-", 1)[0]
        target = fuzz_targets.TARGETS.get(case_name)
        if target is None:
            print(f"{path}: no target named {case_name!r}", file=sys.stderr)
            status = 1
            continue
        try:
            target(path.read_bytes())
        except Exception:
            print(f"{path}: FAILS")
            traceback.print_exc()
            status = 1
        else:
            print(f"{path}: passes")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.run", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="total time budget, split across targets")
    parser.add_argument("--target", action="append", choices=[case.name for case in fuzz_targets.CASES],
                        help="fuzz only this case (repeatable)")
    parser.add_argument("--replay", nargs="+", metavar="FILE", help="re-run saved inputs instead of fuzzing")
    parser.add_argument("--ignore-known", action="store_true",
                        help="exit 0 when every failure is one of fuzz_targets.KNOWN_BUGS (pinned by xfail tests)")
    args = parser.parse_args(argv)
    if args.replay:
        return replay(args.replay)

    # zipfile warns about the duplicate record names some torch inputs hold; noise here.
    warnings.simplefilter("ignore")
    cases = [case for case in fuzz_targets.CASES if not args.target or case.name in args.target]
    share = args.seconds / len(cases)
    failures = new_failures = 0
    for case in cases:
        outcome = fuzz_case(case, share)
        failures += outcome.failures
        new_failures += outcome.failures - outcome.known
        print(f"{case.name}: {outcome.examples} examples, {outcome.failures} failures "
              f"({outcome.known} of known bugs; {len(outcome.distinct)} distinct)", flush=True)
        for data, exc in outcome.distinct.values():
            path = save_crash(case.name, data)
            message = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
            bug = fuzz_targets.known_bug(exc)
            tag = f"known bug, pinned by {bug.test}" if bug else "NEW"
            print(f"  FAIL {case.target.__name__}: {type(exc).__name__} at {_signature(exc)[1]}: {message}", flush=True)
            print(f"       [{tag}] input ({len(data)} bytes): {path.relative_to(ROOT)}", flush=True)
    return 1 if (new_failures if args.ignore_known else failures) else 0


if __name__ == "__main__":
    sys.exit(main())
