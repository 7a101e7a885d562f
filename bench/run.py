"""``make bench``: every method on the same files, same machine, one run.

Each measurement is a fresh interpreter (``bench.methods``); the page cache
is warmed by a first, discarded run (none with ``--no-warm-up``, for a quick
check), then the median of ``--runs`` is kept, the methods of a group taking
turns run by run.
Cold rows evict the method's files from the page cache first
(``posix_fadvise(DONTNEED)``, no root needed). Writes a markdown table, a
JSON file and a PNG chart under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .fixtures import ensure
from .turns import after

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Case:
    label: str
    method: str
    form: str
    cold: bool = False
    group: str = "copy"

    @property
    def key(self) -> str:
        return f"{self.label}{' (cold)' if self.cold else ''}"


CASES = [
    Case("ours, sharded safetensors", "ours", "sharded"),
    Case("ours, one safetensors", "ours", "single"),
    Case("ours, torch zip", "ours", "torch"),
    Case("safetensors pread backend", "safetensors-pread", "single"),
    Case("naive: build on CPU + torch.load", "naive", "torch"),
    Case("limit: all cores, fresh memory", "limit", "single"),
    Case("limit: all cores, chunks prefaulted", "limit-prefault", "single"),
    Case("limit: one thread, large reads", "limit-1t", "single"),
    Case("ours --mmap", "ours-mmap", "sharded", group="zero-copy"),
    Case("transformers from_pretrained", "transformers", "sharded", group="zero-copy"),
    Case("accelerate load_checkpoint_and_dispatch", "accelerate", "sharded", group="zero-copy"),
    Case("torch meta + load(mmap) + assign", "torch-mmap", "torch", group="zero-copy"),
    Case("safetensors load_file + assign", "safetensors", "single", group="zero-copy"),
    Case("ours, bf16 -> fp32", "ours-cast", "sharded", group="cast"),
    Case("accelerate, bf16 -> fp32", "accelerate-cast", "sharded", group="cast"),
    Case("transformers, bf16 -> fp32", "transformers-cast", "sharded", group="cast"),
    Case("limit: fresh fp32 memory alone, all cores", "limit-fresh-fp32", "sharded", group="cast"),
    Case("ours, one safetensors", "ours", "single", cold=True, group="cold"),
    Case("ours, sharded safetensors", "ours", "sharded", cold=True, group="cold"),
    Case("safetensors pread backend", "safetensors-pread", "single", cold=True, group="cold"),
    Case("transformers from_pretrained", "transformers", "sharded", cold=True, group="cold"),
    Case("ours --mmap", "ours-mmap", "sharded", cold=True, group="cold"),
    Case("ours --direct-io, one safetensors", "ours-direct", "single", cold=True, group="cold"),
    Case("ours --direct-io, sharded safetensors", "ours-direct", "sharded", cold=True, group="cold"),
    Case("limit: all cores, fresh memory", "limit", "single", cold=True, group="cold"),
    Case("limit: all cores, fresh memory, sharded", "limit", "sharded", cold=True, group="cold"),
    Case("limit: one thread, large reads", "limit-1t", "single", cold=True, group="cold"),
    Case("limit: copy out of a mapping (read-ahead)", "limit-mapped", "single", cold=True, group="cold"),
    # To a GPU: only where one is present.
    Case("ours to cuda, sharded safetensors", "ours-cuda", "sharded", group="cuda"),
    Case("ours to cuda, one safetensors", "ours-cuda", "single", group="cuda"),
    Case("ours to cuda, torch zip", "ours-cuda", "torch", group="cuda"),
    Case("safetensors load_file(device=cuda) + assign", "safetensors-cuda", "single", group="cuda"),
    Case("torch.load(mmap, map_location=cuda) + assign", "torch-cuda", "torch", group="cuda"),
    Case("accelerate, device_map cuda", "accelerate-cuda", "sharded", group="cuda"),
    Case("transformers, device_map cuda", "transformers-cuda", "sharded", group="cuda"),
    Case("ours to cuda, bf16 -> fp32", "ours-cast-cuda", "sharded", group="cuda cast"),
    Case("accelerate to cuda, bf16 -> fp32", "accelerate-cast-cuda", "sharded", group="cuda cast"),
    Case("transformers to cuda, bf16 -> fp32", "transformers-cast-cuda", "sharded", group="cuda cast"),
    Case("ours to cuda, one safetensors", "ours-cuda", "single", cold=True, group="cuda cold"),
    Case("ours to cuda, sharded safetensors", "ours-cuda", "sharded", cold=True, group="cuda cold"),
    Case("ours to cuda --direct-io, one safetensors", "ours-direct-cuda", "single", cold=True, group="cuda cold"),
    Case("safetensors load_file(device=cuda) + assign", "safetensors-cuda", "single", cold=True, group="cuda cold"),
    Case("transformers, device_map cuda", "transformers-cuda", "sharded", cold=True, group="cuda cold"),
    Case("limit: one thread, large reads", "limit-1t", "single", cold=True, group="cuda cold"),
    Case("limit: all cores, fresh memory", "limit", "single", cold=True, group="cuda cold"),
    Case("limit: copy out of a mapping (read-ahead)", "limit-mapped", "single", cold=True, group="cuda cold"),
]


def available(case: Case) -> bool:
    method = case.method
    if method.endswith("-cuda") or case.group.startswith("cuda"):  # the cuda groups' raw reads too
        import torch

        if not torch.cuda.is_available():
            return False
    if method.startswith("transformers"):
        try:
            import transformers  # noqa: F401
        except ImportError:
            return False
    return True


def _files(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]


def evict(path: Path) -> None:
    for file in _files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def recache(paths: dict[str, Path]) -> None:
    """Evict every fixture file, then read it back once, so all are cached alike.

    How a file entered the page cache matters to zero-copy loads: pages cached
    by the writer's small writes are mapped 4 KiB at a time, pages brought in by
    read-ahead as large folios, and first touch of a mapping differs by 3x.
    """
    for key, path in paths.items():
        if key == "expected":
            continue
        evict(path)
        for file in _files(path):
            with open(file, "rb") as handle:
                while handle.read(64 * 1024 * 1024):
                    pass


def run_once(case: Case, fixture: Path, paths: dict[str, Path]) -> dict:
    if case.cold:
        evict(paths[case.form])
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "bench.methods", case.method, case.form, str(fixture)],
        capture_output=True, text=True, cwd=Path(__file__).parent.parent,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1], "wall_s": wall}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def startup_seconds(runs: int) -> float:
    """Interpreter plus ``import torch, materialize``: the part of wall time that is not loading."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, materialize"], check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def cuda_startup_seconds(runs: int) -> Optional[float]:
    """CUDA context creation in a fresh process: inside every cuda row's load, for every method alike."""
    import torch

    if not torch.cuda.is_available():
        return None
    script = ("import time, torch; started = time.perf_counter(); torch.empty(1, device='cuda'); "
              "torch.cuda.synchronize(); print(time.perf_counter() - started)")
    times = [float(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout)
             for _ in range(runs)]
    return statistics.median(times)


def measure_group(cases: list[Case], fixture: Path, paths: dict[str, Path], runs: int, *,
                  warm_up: bool = True) -> dict[str, dict]:
    """Every case of one group: a warm-up each (unless not ``warm_up``), then ``runs`` rounds taking each case in turn.

    Rounds, not one case's runs back to back: what a fresh process pays for
    its memory drifts with the machine (on a VM whose freed pages are handed
    back to the host, memory freed seconds ago is several times cheaper to
    touch than memory freed long ago), and taking turns spreads that drift
    over every method alike.
    """
    for case in cases if warm_up else ():
        run_once(case, fixture, paths)  # warm-up: page cache, import caches
    results: dict[str, list[dict]] = {case.key: [] for case in cases}
    for _ in range(runs):
        for case in cases:
            results[case.key].append(run_once(case, fixture, paths))
    return {case.key: {"case": case.__dict__, **summarize(results[case.key])} for case in cases}


def summarize(results: list[dict]) -> dict:
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    summary = {k: statistics.median(r[k] for r in results) for k in ("load_s", "build_s", "touch_s", "wall_s", "anon_growth", "rss_growth")}
    summary["verified"] = all(r["verified"] for r in results)
    summary["forward_ok"] = all(r["forward_ok"] for r in results)
    summary["runs"] = [r["load_s"] for r in results]
    summary["load_min_s"], summary["load_max_s"] = min(summary["runs"]), max(summary["runs"])
    return summary


def machine() -> dict:
    cpu = "unknown"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu, "gpu": gpu, "cores": os.cpu_count(), "memory_gb": round(memory / 2**30, 1), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench-llama-1b.toml")
    parser.add_argument("--data", default="data/bench")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-warm-up", action="store_true",
                        help="no discarded first run of each case (for a quick check)")
    parser.add_argument("--only", help="comma-separated method names to run")
    parser.add_argument("--groups", help="comma-separated groups to run (copy, zero-copy, cast, cold, cuda, cuda cast, cuda cold)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other rows of an earlier report in --out (a run split over several calls)")
    parser.add_argument("--out", default=str(RESULTS), help="folder for the .json, .md and .png results")
    args = parser.parse_args(argv)

    paths = ensure(args.config, Path(args.data))
    fixture = paths["expected"].parent
    expected = json.loads(paths["expected"].read_text())
    wanted = set(args.only.split(",")) if args.only else None
    groups = set(args.groups.split(",")) if args.groups else None
    cases = [c for c in CASES if available(c) and (wanted is None or c.method in wanted)
             and (groups is None or c.group in groups)]
    out = Path(args.out)
    stem = Path(args.config).stem
    earlier = out / f"{stem}.json"
    report = json.loads(earlier.read_text()) if args.merge and earlier.exists() else {"results": {}}
    rerun = {_row(c.group, c.key) for c in cases}
    report["results"] = {k: r for k, r in report["results"].items() if k not in rerun}
    recache(paths)
    report.update(machine=machine(), config=args.config, runs=args.runs, warm_up=not args.no_warm_up,
                  nbytes=expected["nbytes"], startup_s=startup_seconds(args.runs))
    if any(c.group.startswith("cuda") for c in cases):
        report["cuda_startup_s"] = cuda_startup_seconds(args.runs)
    for group in dict.fromkeys(case.group for case in cases):
        measured = measure_group([c for c in cases if c.group == group], fixture, paths, args.runs,
                                 warm_up=not args.no_warm_up)
        for key, result in measured.items():
            report["results"][_row(group, key)] = result
            print(f"{key:<48} {_short(result)}", flush=True)
        write_report(report, out, stem)  # after each group: a run cut short still leaves what it measured
    print()
    print(markdown(report))


def _row(group: str, key: str) -> str:
    """The report's key: a case's label, qualified by its group where the label alone repeats across groups."""
    groups = {c.group for c in CASES if c.key == key}
    return key if len(groups) == 1 or group == min(groups, key=len) else f"{key} [{group}]"


def write_report(report: dict, out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    order = {group: i for i, group in enumerate(dict.fromkeys(c.group for c in CASES))}
    report["results"] = dict(sorted(report["results"].items(), key=lambda kv: order.get(kv[1]["case"]["group"], len(order))))
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (out / f"{stem}.md").write_text(markdown(report))
    chart(report, out / f"{stem}.png")


def _short(result: dict) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    return f"load {result['load_s']:.3f} s  anon +{result['anon_growth'] / 1e9:.2f} GB  verified={result['verified']}"


def _baseline(report: dict, group: str) -> Optional[dict]:
    """The row each group's ratios are taken against: ours."""
    for result in report["results"].values():
        if result["case"]["group"] == group and result["case"]["method"].startswith("ours") and "error" not in result:
            return result
    return None


def markdown(report: dict) -> str:
    gb = report["nbytes"] / 1e9
    m = report["machine"]
    lines = [
        f"{gb:.2f} GB of bf16 weights ({report['config']}); {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GiB, "
        f"Linux {m['kernel']}, torch {m['torch']}{', ' + m['gpu'] if m.get('gpu') else ''}. "
        f"Median of {report.get('runs', 3)} runs {after(not report.get('warm_up', True))}, "
        "the methods of a group taking turns (fastest and slowest beside it); each run a fresh process. "
        f"Interpreter + import start-up, not counted in load: {report['startup_s']:.2f} s."
        + (f" CUDA context creation, counted in every cuda row's load: {report['cuda_startup_s']:.2f} s."
           if report.get("cuda_startup_s") else ""),
        "",
        "| group | method | load s | min-max s | x ours | GB/s | wall s | build s | touch s | anon growth GB | peak RSS growth GB | RSS x ours | verified | forward |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for result in report["results"].values():
        group, key = result["case"]["group"], _label(result)
        if "error" in result:
            lines.append(f"| {group} | {key} | error: {result['error'][:80]} | | | | | | | | | | | |")
            continue
        base = _baseline(report, group)
        ratio = result["load_s"] / base["load_s"] if base else float("nan")
        lines.append(
            f"| {group} | {key} | {result['load_s']:.3f} | {result.get('load_min_s', result['load_s']):.3f}-"
            f"{result.get('load_max_s', result['load_s']):.3f} | {ratio:.2f} | {gb / max(result['load_s'], 1e-9):.1f} | "
            f"{result['wall_s']:.2f} | {result['build_s']:.3f} | {result['touch_s']:.3f} | {result['anon_growth'] / 1e9:.2f} | "
            f"{result['rss_growth'] / 1e9:.2f} | {_memory_ratio(result, base)} | {'yes' if result['verified'] else 'NO'} | "
            f"{'yes' if result['forward_ok'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def _label(result: dict) -> str:
    return f"{result['case']['label']}{' (cold)' if result['case']['cold'] else ''}"


def _memory_ratio(result: dict, base: Optional[dict]) -> str:
    """Peak RSS growth against ours; none where ours grows by too little to divide by (zero-copy)."""
    if base is None or base["rss_growth"] < 50e6:
        return "-"
    return f"{result['rss_growth'] / base['rss_growth']:.2f}"


def chart(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    rows = [(k, r) for k, r in report["results"].items() if "error" not in r]
    colors = {"copy": "#4c72b0", "zero-copy": "#55a868", "cast": "#c44e52", "cold": "#8172b2", "cuda": "#937860",
              "cuda cast": "#8c613c", "cuda cold": "#da8bc3"}
    fig, ax = plt.subplots(figsize=(10, 0.38 * len(rows) + 1.5))
    labels = [f"[{r['case']['group']}] {_label(r)}" for _, r in rows]
    values = [r["load_s"] + r["touch_s"] for _, r in rows]
    bars = ax.barh(range(len(rows)), values, color=[colors[r["case"]["group"]] for _, r in rows])
    for bar, (key, result) in zip(bars, rows):
        weight = "bold" if result["case"]["method"].startswith("ours") else "normal"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {bar.get_width():.2f} s", va="center", fontsize=8, fontweight=weight)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")  # the naive load is 10x the rest: a linear axis would flatten everything else
    ax.set_xlabel("seconds to load, then touch every weight once (log scale, lower is better)")
    m = report["machine"]
    ax.set_title(f"Loading {report['nbytes'] / 1e9:.1f} GB of bf16 weights - {m['cores']} cores, {m['memory_gb']} GiB" + (f", {m['gpu']}" if m.get("gpu") else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
