"""Run the zoo: every case in a worker process, results appended to ``data/zoo/results.jsonl``.

    python -m zoo.run                       # every case not yet in the results file, one worker
    python -m zoo.run --workers 2 --case-seconds 300
    python -m zoo.run --only 'hf/deferred/*' --limit 50
    python -m zoo.run --rerun-failed        # run again what did not pass
    python -m zoo.run --report              # only write docs/zoo.md and tests/zoo_failed.txt from the results

Workers are long-lived (transformers, timm and torchvision are imported once per worker) and replaced
after ``--cases-per-worker`` cases, so what one case leaves behind does not pile up. A case still running
after ``--case-seconds`` is recorded as ``timeout`` and its worker killed; a worker that dies (a segfault,
the address-space cap of ``--memory-mb`` reached in native code, the OOM killer) records ``crashed``.
Either way a fresh worker takes the next case. The results file is appended to after every case, so an
interrupted run loses nothing: a rerun skips every case it holds (``--rerun`` runs them again). Cases run
in the order of a stable hash of their names, so a partial run covers every library and oracle alike.
At the end the report is written (:mod:`zoo.report`).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback
import zlib
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "data" / "zoo" / "results.jsonl"
FAILING = ("refused", "different", "error", "timeout", "crashed")
KEPT_DIFFERENCES = 40


def outcome(case: str, scratch: Path) -> dict[str, Any]:
    """Run one case here and say how it ended (never raises)."""
    import materialize as mz
    from zoo.cases import run_case
    from zoo.outcomes import Different, Skipped, one_line

    folder = Path(tempfile.mkdtemp(dir=scratch))
    start = time.monotonic()
    result: dict[str, Any] = {"case": case}
    try:
        result.update(status="equal", notes=run_case(case, folder))
    except Skipped as skip:
        result.update(status="skipped", detail=str(skip))
    except Different as different:
        result.update(status="different", detail=different.differences[0],
                      differences=different.differences[:KEPT_DIFFERENCES], count=len(different.differences))
    except mz.MaterializeError as error:
        result.update(status="refused", detail=one_line(error))
    except BaseException as error:  # materialize broke (or the harness: the traceback says which)
        frames = traceback.extract_tb(error.__traceback__)[-3:]
        where = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames)
        result.update(status="error", detail=one_line(error), where=where)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result["seconds"] = round(time.monotonic() - start, 2)
    return result


def _worker(conn: Connection, scratch: str, memory_mb: int) -> None:
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                      HF_HUB_DISABLE_PROGRESS_BARS="1")
    if memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    import torch

    torch.set_num_threads(1)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars, one per case, in the run's log
    except ImportError:
        pass
    try:
        from zoo.vision import import_libraries

        import_libraries()  # before transformers, which imports torchvision wherever it can
    except ImportError:
        pass
    while True:
        case = conn.recv()
        if case is None:
            return
        conn.send(outcome(case, Path(scratch)))


class Worker:
    def __init__(self, context, scratch: Path, memory_mb: int) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, str(scratch), memory_mb), daemon=True)
        self.process.start()
        child.close()
        self.case: Optional[str] = None
        self.started = 0.0
        self.done = 0

    def give(self, case: str) -> None:
        self.case, self.started = case, time.monotonic()
        self.conn.send(case)

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(5)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()


class OneCase:
    """Cases one at a time in a worker process (what tests/test_zoo.py runs): imports as ``make zoo`` does
    them, whatever the calling process imported first, and a case past ``case_seconds`` is a timeout."""

    def __init__(self, scratch: Path, case_seconds: float, memory_mb: int = 0) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.scratch, self.case_seconds, self.memory_mb = scratch, case_seconds, memory_mb
        self.worker = Worker(self.context, scratch, memory_mb)

    def run(self, case: str) -> dict[str, Any]:
        self.worker.give(case)
        if not self.worker.conn.poll(self.case_seconds):
            result = {"case": case, "status": "timeout", "detail": f"still running after {self.case_seconds:g} s"}
        else:
            try:
                return self.worker.conn.recv()
            except (EOFError, OSError):
                result = {"case": case, "status": "crashed",
                          "detail": f"the worker died (exit code {self.worker.process.exitcode})"}
        self.worker.kill()
        self.worker = Worker(self.context, self.scratch, self.memory_mb)
        return result

    def close(self) -> None:
        self.worker.stop()


def load_results(path: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """The last result of each case."""
    results: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                results[record["case"]] = record
    return results


def order(cases: list[str]) -> list[str]:
    return sorted(cases, key=lambda c: (zlib.crc32(c.encode()), c))


def run(cases: list[str], *, workers: int, case_seconds: float, cases_per_worker: int, memory_mb: int,
        results_path: Path = RESULTS, progress=print) -> None:
    results_path.parent.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    pending = list(cases)
    with tempfile.TemporaryDirectory(prefix="zoo-") as scratch, results_path.open("a") as out:
        pool = [Worker(context, Path(scratch), memory_mb) for _ in range(min(workers, len(pending)))]
        finished = 0

        def record(result: dict[str, Any]) -> None:
            nonlocal finished
            finished += 1
            out.write(json.dumps(result) + "\n")
            out.flush()
            progress(f"[{finished}/{len(cases)}] {result['case']}: {result['status']} ({result['seconds']} s)"
                     + (f" {result['detail'][:160]}" if result.get("detail") else ""))

        for worker in pool:
            if pending:
                worker.give(pending.pop(0))
        while any(w.case for w in pool):
            busy = [w for w in pool if w.case]
            now = time.monotonic()
            timeout = max(0.0, min(w.started + case_seconds - now for w in busy))
            ready = wait([w.conn for w in busy], timeout=timeout)
            for index, worker in enumerate(list(pool)):
                if not worker.case:
                    continue
                replace = False
                if worker.conn in ready:
                    try:
                        result = worker.conn.recv()
                    except (EOFError, OSError):
                        worker.kill()
                        result = {"case": worker.case, "status": "crashed",
                                  "detail": f"the worker died (exit code {worker.process.exitcode})"}
                        replace = True
                elif time.monotonic() - worker.started > case_seconds:
                    worker.kill()
                    result = {"case": worker.case, "status": "timeout",
                              "detail": f"still running after {case_seconds:g} s"}
                    replace = True
                else:
                    continue
                result.setdefault("seconds", round(time.monotonic() - worker.started, 2))
                record(result)
                worker.case = None
                worker.done += 1
                if not replace and worker.done >= cases_per_worker:
                    worker.stop()
                    replace = True
                if replace:
                    worker = pool[index] = Worker(context, Path(scratch), memory_mb)
                if pending:
                    worker.give(pending.pop(0))
        for worker in pool:
            worker.stop()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--case-seconds", type=float, default=300)
    parser.add_argument("--cases-per-worker", type=int, default=100)
    parser.add_argument("--memory-mb", type=int, default=12288, help="address-space cap of each worker (0: none)")
    parser.add_argument("--only", action="append", help="glob over case names (repeatable)")
    parser.add_argument("--limit", type=int, help="run at most this many cases")
    parser.add_argument("--rerun", action="store_true", help="run cases the results file already holds")
    parser.add_argument("--rerun-failed", action="store_true", help="run again the cases whose last result failed")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--report", action="store_true", help="only write the report from the results")
    parser.add_argument("--no-report", action="store_true")
    args = parser.parse_args(argv)

    if not args.report:
        sys.path.insert(0, str(ROOT))
        from zoo.cases import case_names
        from zoo.vision import import_libraries

        import_libraries()
        cases = case_names()
        if args.only:
            cases = [c for c in cases if any(fnmatch.fnmatchcase(c, pattern) for pattern in args.only)]
        done = load_results(args.results)
        if args.rerun_failed:
            cases = [c for c in cases if c not in done or done[c]["status"] in FAILING]
        elif not args.rerun:
            cases = [c for c in cases if c not in done]
        cases = order(cases)[:args.limit]
        print(f"{len(cases)} cases to run ({len(done)} results already in {args.results})", flush=True)
        run(cases, workers=args.workers, case_seconds=args.case_seconds, cases_per_worker=args.cases_per_worker,
            memory_mb=args.memory_mb, results_path=args.results, progress=lambda s: print(s, flush=True))
    if not args.no_report:
        from zoo.report import write_report

        write_report(load_results(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
