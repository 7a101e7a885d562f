"""``python -m bench.http_clients``: which HTTP client the streaming loader reads tensor bytes with.

A file of random bytes (1 GiB by default) is served by nginx on loopback; each
candidate client reads it whole as ranged GETs of 16 MiB parts into one
preallocated ``torch.uint8`` buffer, as the loader fills a tensor: once on one
connection, once with 4 threads on 4 kept-alive connections. Each candidate
runs in a fresh interpreter, the candidates taking turns over interleaved
rounds (median kept). Per candidate: GB/s (wall), CPU seconds per GB (the
child's ``getrusage``, user + sys, over the download alone), the peak memory
it needs beyond the buffer, and what it leaves the rest of the process: the
rate of a pure-Python counting thread running beside the download against its
rate alone, and the download's own rate beside that busy thread. Every part
of the buffer is checked against the file's CRC32, so a broken read cannot
count. The buffer's pages are faulted in before the clock starts (the loader
faults each chunk in with ``MADV_POPULATE_WRITE`` before reading into it), so
the numbers are the client's alone.

Results: ``bench/results/http_clients.json`` and ``.md``. The file is written
to ``MATERIALIZE_BENCH_DIR`` (and kept there) or to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from . import nginx
from .http_candidates import CANDIDATES, MAKERS, MiB

RESULTS = Path(__file__).parent / "results"
FILE_NAME = "random.bin"
CHILD_TIMEOUT_SECONDS = 240


@contextmanager
def random_file(size: int, part: int) -> Iterator[tuple[Path, list[int]]]:
    """The served file and its parts' CRC32s: kept in MATERIALIZE_BENCH_DIR, else in a folder removed after."""
    kept = os.environ.get("MATERIALIZE_BENCH_DIR")
    with (tempfile.TemporaryDirectory(prefix="bench-http-") if kept is None else _folder(Path(kept))) as folder:
        path = Path(folder) / "http-clients" / FILE_NAME
        sums = path.with_suffix(".crc32.json")
        kept_sums = json.loads(sums.read_text()) if path.exists() and sums.exists() else None
        if kept_sums is not None and path.stat().st_size == size and kept_sums["part"] == part:
            crcs = kept_sums["crcs"]
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            crcs = []
            with open(path, "wb") as out:
                for start in range(0, size, part):
                    block = os.urandom(min(part, size - start))
                    crcs.append(zlib.crc32(block))
                    out.write(block)
            sums.write_text(json.dumps({"part": part, "crcs": crcs}))
        yield path, crcs


@contextmanager
def _folder(path: Path) -> Iterator[str]:
    path.mkdir(parents=True, exist_ok=True)
    yield str(path)


def run_child(job: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "bench.http_download"], input=json.dumps(job),
                          capture_output=True, text=True, cwd=Path(__file__).parent.parent,
                          timeout=CHILD_TIMEOUT_SECONDS)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


MODE_FIELDS = ("wall_s", "cpu_s", "gbps", "cpu_s_per_gb", "counter_ratio", "busy_gbps")


def summarize(runs: list[dict], threads: int) -> dict:
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": errors[0]}
    summary: dict = {"extra_peak_bytes": statistics.median(r["extra_peak_bytes"] for r in runs),
                     "counter_alone_per_s": statistics.median(r["counter_alone_per_s"] for r in runs)}
    for mode in ("threads_1", f"threads_{threads}"):
        rows = [r[mode] for r in runs]
        summary[mode] = {field: statistics.median(row[field] for row in rows) for field in MODE_FIELDS}
        summary[mode]["gbps_runs"] = [row["gbps"] for row in rows]
        summary[mode]["verified"] = all(row["verified"] for row in rows)
    return summary


def markdown(report: dict) -> str:
    threads, m = report["threads"], report["machine"]
    lines = [
        f"{report['size'] / 2**30:.0f} GiB of random bytes as {report['part'] // MiB} MiB ranged GETs into one "
        f"preallocated torch.uint8 buffer, from {report['server']} on loopback ({m['cpu']}, {m['cores']} cores, "
        f"Linux {m['kernel']}, Python {m['python']}); median of {report['rounds']} interleaved rounds, each "
        f"candidate a fresh process (slowest-fastest round in brackets). 1 thread: one connection; {threads} "
        f"threads: {threads} kept-alive connections. CPU: the client process's user + sys over the download. "
        f"Counter: a pure-Python counting thread's rate beside the download against its rate alone; beside it, "
        f"the download's own rate.",
        "",
        f"| client | GB/s 1 thread | GB/s {threads} threads | CPU s/GB 1 / {threads} | counter beside 1 / {threads} | "
        f"GB/s beside the counter 1 / {threads} | extra peak MB | verified | how bytes reach the buffer |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for candidate in CANDIDATES:
        result = report["results"].get(candidate.name)
        if result is None:
            continue
        if "error" in result:
            lines.append(f"| {candidate.label} | error: {result['error'][:80]} | | | | | | | |")
            continue
        one, many = result["threads_1"], result[f"threads_{threads}"]
        lines.append(
            f"| {candidate.label} | {_spread(one)} | {_spread(many)} | {one['cpu_s_per_gb']:.2f} / "
            f"{many['cpu_s_per_gb']:.2f} | {one['counter_ratio']:.2f} / {many['counter_ratio']:.2f} | "
            f"{one['busy_gbps']:.3f} / {many['busy_gbps']:.3f} | {result['extra_peak_bytes'] / 1e6:.0f} | "
            f"{'yes' if one['verified'] and many['verified'] else 'NO'} | {candidate.writes} |"
        )
    return "\n".join(lines) + "\n"


def _spread(mode: dict) -> str:
    """The median GB/s, the slowest and fastest round beside it."""
    return f"{mode['gbps']:.2f} ({min(mode['gbps_runs']):.2f}-{max(mode['gbps_runs']):.2f})"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="the file's size in MiB")
    parser.add_argument("--part-mb", type=int, default=16, help="each ranged GET's size in MiB")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds, every method once each")
    parser.add_argument("--only", help="comma-separated candidates: " + ",".join(c.name for c in CANDIDATES))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    from .run import machine  # imports torch: not before the arguments are known good

    wanted = args.only.split(",") if args.only else [c.name for c in CANDIDATES]
    unknown = set(wanted) - set(MAKERS)
    if unknown:
        parser.error(f"unknown candidates: {', '.join(sorted(unknown))}")
    size, part = args.size_mb * MiB, args.part_mb * MiB
    report: dict = {"machine": machine(), "server": nginx.nginx_version(), "size": size, "part": part,
                    "threads": args.threads, "rounds": args.runs, "results": {}}
    runs: dict[str, list[dict]] = {name: [] for name in wanted}
    with random_file(size, part) as (path, crcs), nginx.serve(path.parent) as server:
        job = {"base": server.url, "path": "/" + path.name, "size": size, "part": part, "crcs": crcs,
               "threads": args.threads}
        for round_ in range(args.runs):
            for name in wanted:
                started = time.perf_counter()
                runs[name].append(run_child({**job, "candidate": name}))
                print(f"round {round_ + 1} {name:<18} {time.perf_counter() - started:5.1f} s  "
                      f"{_short(runs[name][-1], args.threads)}", flush=True)
    report["results"] = {name: summarize(runs[name], args.threads) for name in wanted}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "http_clients.json").write_text(json.dumps(report, indent=2))
    (out / "http_clients.md").write_text(markdown(report))
    print()
    print(markdown(report))


def _short(result: dict, threads: int) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    one, many = result["threads_1"], result[f"threads_{threads}"]
    return (f"{one['gbps']:.2f} / {many['gbps']:.2f} GB/s  {one['cpu_s_per_gb']:.2f} / {many['cpu_s_per_gb']:.2f} "
            f"CPU s/GB  counter {one['counter_ratio']:.2f} / {many['counter_ratio']:.2f}  "
            f"verified {one['verified'] and many['verified']}")


if __name__ == "__main__":
    main()
