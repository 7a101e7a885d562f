"""``make bench-remote``: the bench checkpoint streamed from HTTP and S3 into CPU tensors, against a local load.

The 1.9 GB checkpoint of ``make bench`` (one safetensors file) is loaded as
plain tensors into CPU memory: by ``materialize.load_tensors`` from the local
file, from nginx on loopback (``http://``) and from a loopback S3 server
(``s3://``, moto's, see ``bench/s3_server.py``); and by Run:ai's Model
Streamer (the one vLLM and SGLang use for ``s3://``) from the same S3 object
and from the local file; and the bar for ``http://``, plain ranged GETs into
one buffer (``bench.remote_methods.http_limit``). Every load is a fresh
process, the page cache warm for every source (the file's, and the S3
server's stored copy); a discarded warm-up each, then ``--runs`` rounds
taking the methods in turn, median kept. Per load: wall seconds of the load
(after imports), the process's CPU seconds over it (``getrusage``: user +
sys, every thread), the server's CPU seconds apart (read from ``/proc``),
and peak RSS growth over the RSS after imports (``VmHWM`` after resetting
it), against the model's bytes. Sampled tensors are checked against the
checksums the fixture recorded. Results: ``bench/results/remote.json`` and
``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from . import nginx, s3_server
from .fixtures import ensure

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parent.parent
CHILD_TIMEOUT_SECONDS = 600
BUCKET = "bench"


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    source: str  # where the bytes come from: local, http or s3
    loader: str  # ours, runai, or limit (the bar: plain ranged GETs into one buffer)
    env: dict[str, str] = field(default_factory=dict)


METHODS = [
    Method("local", "ours, local file", "local", "ours"),
    Method("http", "ours, http (nginx)", "http", "ours"),
    Method("http-limit", "limit: http.client readinto, 4 connections, 16 MiB parts prefaulted", "http", "limit"),
    Method("s3", "ours, s3 (moto)", "s3", "ours"),
    Method("runai-s3", "Run:ai streamer, s3 (moto)", "s3", "runai"),
    Method("runai-s3-limited", "Run:ai streamer, s3 (moto), RUNAI_STREAMER_MEMORY_LIMIT=1 GiB", "s3", "runai",
           {"RUNAI_STREAMER_MEMORY_LIMIT": str(2**30)}),
    Method("runai-local", "Run:ai streamer, local file", "local", "runai"),
]

# The project's goals for streaming, against the table's rows.
HTTP_OVER_LOCAL = 1.3
OVER_RUNAI = 3.0
CPU_S_PER_GB = 1.2
MEMORY_OVER_MODEL = 1.05


@dataclass
class Sources:
    """Each source's address for one file, and the environment its children need."""

    local: str
    http: Optional[str] = None
    s3: Optional[str] = None
    s3_env: dict[str, str] = field(default_factory=dict)
    server_pids: dict[str, int] = field(default_factory=dict)

    def of(self, method: Method) -> Optional[str]:
        return getattr(self, method.source)

    def server_cpu_seconds(self, method: Method) -> float:
        pid = self.server_pids.get(method.source)
        return 0.0 if pid is None else nginx.tree_cpu_seconds(pid)


def run_once(method: Method, sources: Sources, expected: Path) -> dict:
    source = sources.of(method)
    if source is None:
        return {"error": f"no {method.source} server"}
    env = {**os.environ, **method.env, **(sources.s3_env if method.source == "s3" else {})}
    server_before, started = sources.server_cpu_seconds(method), time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "bench.remote_methods", method.loader, source, str(expected)],
                              capture_output=True, text=True, cwd=ROOT, env=env, timeout=CHILD_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_SECONDS} s"}
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1], "wall_s": wall}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    result["server_cpu_s"] = sources.server_cpu_seconds(method) - server_before
    return result


def warm(path: Path) -> None:
    """Read the file once, so the local loads and nginx find it in the page cache."""
    with open(path, "rb") as handle:
        while handle.read(64 * 2**20):
            pass


def summarize(runs: list[dict]) -> dict:
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": errors[0]}
    fields = ("load_s", "cpu_s", "rss_growth", "held_growth", "wall_s", "server_cpu_s")
    summary = {k: statistics.median(r[k] for r in runs) for k in fields}
    summary["runs"] = [r["load_s"] for r in runs]
    summary["load_min_s"], summary["load_max_s"] = min(summary["runs"]), max(summary["runs"])
    summary["verified"] = all(r["verified"] for r in runs)
    summary["tensors"] = runs[0]["tensors"]
    return summary


def goals(report: dict) -> list[dict]:
    """Each goal of the streaming loader, its measured value, and whether it is met (None: not measured).

    A ratio of two methods is the ratio of their medians; beside it, the
    range of the ratios round by round (the two loads of a round ran seconds
    apart, so a machine whose speed drifts moves both).
    """
    rows, gb = report["results"], report["nbytes"] / 1e9

    def row(name: str) -> Optional[dict]:
        found = rows.get(name)
        return None if found is None or "error" in found else found

    def compare(slower: str, faster: str) -> tuple[Optional[float], Optional[list[float]]]:
        a, b = row(slower), row(faster)
        if a is None or b is None:
            return None, None
        return a["load_s"] / b["load_s"], [x / y for x, y in zip(a["runs"], b["runs"])]

    def per_gb(name: str, key: str, scale: float) -> tuple[Optional[float], None]:
        found = row(name)
        return (None if found is None else found[key] / scale), None

    checks = [
        (f"http load at most {HTTP_OVER_LOCAL}x the local load", compare("http", "local"),
         lambda v: v <= HTTP_OVER_LOCAL, "x local"),
        (f"s3 at least {OVER_RUNAI:.0f}x faster than Run:ai's streamer from the same server",
         compare("runai-s3", "s3"), lambda v: v >= OVER_RUNAI, "x faster"),
    ]
    for name in ("http", "s3"):
        checks.append((f"{name}: at most {CPU_S_PER_GB} CPU s per GB", per_gb(name, "cpu_s", gb),
                       lambda v: v <= CPU_S_PER_GB, "CPU s/GB"))
        checks.append((f"{name}: peak host memory growth at most {MEMORY_OVER_MODEL}x the model",
                       per_gb(name, "rss_growth", report["nbytes"]), lambda v: v <= MEMORY_OVER_MODEL, "x model"))
    return [{"goal": goal, "value": value, "per_round": rounds, "unit": unit,
             "met": None if value is None else bool(test(value))}
            for goal, (value, rounds), test, unit in checks]


def markdown(report: dict) -> str:
    m, gb = report["machine"], report["nbytes"] / 1e9
    local = report["results"].get("local", {})
    lines = [
        f"{gb:.2f} GB of bf16 weights ({report['config']}, one safetensors file, {report.get('tensors', '?')} tensors) "
        f"loaded as plain tensors into CPU memory; {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GiB, Linux "
        f"{m['kernel']}, torch {m['torch']}; servers on loopback: {report['servers']['http']}, "
        f"{report['servers']['s3']}. Median of {report['rounds']} rounds after a warm-up, methods taking turns, "
        f"each load a fresh process, page cache warm. CPU: the loading process's user + sys over the load "
        f"(servers not counted there; server CPU s: the server's processes over the child's whole life). "
        f"Peak RSS growth: over the RSS after imports.",
        "",
        "| method | load s | min-max s | x local | GB/s | CPU s | CPU s/GB | server CPU s | peak RSS growth GB "
        "| x model | verified |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for method in METHODS:
        result = report["results"].get(method.name)
        if result is None:
            continue
        if "error" in result:
            lines.append(f"| {method.label} | error: {result['error'][:100]} | | | | | | | | | |")
            continue
        ratio = f"{result['load_s'] / local['load_s']:.2f}" if "load_s" in local else "-"
        lines.append(
            f"| {method.label} | {result['load_s']:.3f} | {result['load_min_s']:.3f}-{result['load_max_s']:.3f} | "
            f"{ratio} | {gb / result['load_s']:.2f} | {result['cpu_s']:.2f} | {result['cpu_s'] / gb:.2f} | "
            f"{_server_cpu(method, result)} | "
            f"{result['rss_growth'] / 1e9:.2f} | {result['rss_growth'] / report['nbytes']:.2f} | "
            f"{'yes' if result['verified'] else 'NO'} |"
        )
    lines += ["", "| goal | measured | met |", "| --- | ---: | --- |"]
    for goal in report["goals"]:
        measured = "not measured" if goal["value"] is None else f"{goal['value']:.2f} {goal['unit']}"
        if goal.get("per_round"):
            measured += f" (rounds: {min(goal['per_round']):.2f}-{max(goal['per_round']):.2f})"
        met = {None: "-", True: "met", False: "**not met**"}[goal["met"]]
        lines.append(f"| {goal['goal']} | {measured} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench-llama-1b.toml")
    parser.add_argument("--data", default="data/bench")
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds, every method once each")
    parser.add_argument("--only", help="comma-separated methods: " + ",".join(m.name for m in METHODS))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    from .run import machine  # imports torch: not before the arguments are known good

    wanted = set(args.only.split(",")) if args.only else {m.name for m in METHODS}
    unknown = wanted - {m.name for m in METHODS}
    if unknown:
        parser.error(f"unknown methods: {', '.join(sorted(unknown))}")
    methods = [m for m in METHODS if m.name in wanted]
    paths = ensure(args.config, Path(args.data))
    file, expected = paths["single"], paths["expected"]
    nbytes = json.loads(expected.read_text())["nbytes"]
    report: dict = {"machine": machine(), "config": args.config, "rounds": args.runs, "nbytes": nbytes,
                    "servers": {"http": nginx.nginx_version(), "s3": f"moto {_version('moto')} (bench/s3_server.py)"},
                    "runai_model_streamer": _version("runai-model-streamer"), "results": {}}
    sources = Sources(local=str(file.resolve()))
    needs = {m.source for m in methods}
    warm(file)
    with (nginx.serve(file.parent) if "http" in needs else nullcontext()) as http, \
            (s3_server.serve({file.name: file}, bucket=BUCKET) if "s3" in needs else nullcontext()) as s3:
        if http is not None:
            sources.http, sources.server_pids["http"] = f"{http.url}/{file.name}", http.pid
        if s3 is not None:
            sources.s3, sources.s3_env, sources.server_pids["s3"] = f"s3://{BUCKET}/{file.name}", s3.env, s3.pid
        runs: dict[str, list[dict]] = {m.name: [] for m in methods}
        for method in methods:
            warmup = run_once(method, sources, expected)
            print(f"warm-up {method.name:<18} {_short(warmup, nbytes)}", flush=True)
        for round_ in range(args.runs):
            for method in methods:
                runs[method.name].append(run_once(method, sources, expected))
                print(f"round {round_ + 1} {method.name:<18} {_short(runs[method.name][-1], nbytes)}", flush=True)
    report["results"] = {name: summarize(results) for name, results in runs.items()}
    report["tensors"] = next((r["tensors"] for r in report["results"].values() if "tensors" in r), None)
    report["goals"] = goals(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "remote.json").write_text(json.dumps(report, indent=2))
    (out / "remote.md").write_text(markdown(report))
    print()
    print(markdown(report))


def _server_cpu(method: Method, result: dict) -> str:
    """The server's CPU seconds over the load (the whole child's life: start-up included); none for a local file."""
    return "-" if method.source == "local" else f"{result['server_cpu_s']:.2f}"


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def _short(result: dict, nbytes: int) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    return (f"load {result['load_s']:.3f} s  CPU {result['cpu_s']:.2f} s  peak +{result['rss_growth'] / 1e9:.2f} GB "
            f"({result['rss_growth'] / nbytes:.2f}x)  verified={result['verified']}")


if __name__ == "__main__":
    main()
