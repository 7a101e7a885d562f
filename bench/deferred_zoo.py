"""The recording against eager construction over the model zoo: ``python -m bench.deferred_zoo``.

Every model of the zoo's deferred cases (``zoo/``: the transformers classes at their tiny configs, timm's
families, torchvision's builders), or a sample of them (``--sample N``, drawn with ``--seed``), built both
ways in one process: eager construction and ``mz.deferred_init`` (the recording alone), each under the same
seed, in turns, best of ``--runs``, CPU time of this process. Before any timing, one meta computation is made
so that torch's one-time import of its Python meta kernels (``torch._dynamo`` and its decompositions, about
a second, paid once per process by any construction on meta: ``torch.device("meta")``, accelerate's
``init_empty_weights``, ``meta_init``, a recording) is not charged to the first model recorded; the bench
measures it apart and reports it.

Writes ``bench/results/bench-deferred-zoo.md`` and ``.json``: the ratio of the sums (all the zoo's
construction time, recorded against eager), the median and the 90th percentile of per-model ratios, and the
slowest models.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def meta_import_seconds() -> float:
    """What this process's first meta computation costs (torch imports its Python meta kernels)."""
    started = time.process_time()
    torch.ones(3, device="meta").cos()
    return time.process_time() - started


def _best(build, runs: int, record: bool) -> float:
    import materialize as mz

    best = float("inf")
    for _ in range(runs):
        torch.manual_seed(0)
        started = time.process_time()
        model = mz.deferred_init(build) if record else build()
        best = min(best, time.process_time() - started)
        del model
    return best


def measure(cases: list[str], runs: int) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from zoo.outcomes import Skipped
    from zoo.vision import import_libraries

    import_libraries()
    from zoo import hf, vision

    rows = []
    for case in cases:
        library, _, model = case.split("/", 2)
        try:
            build = hf.builder(model) if library == "hf" else vision.factory(library, model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _best(build, 1, False)  # its modules imported, its eager construction known to work
                eager, recorded = _best(build, runs, False), _best(build, runs, True)
        except Skipped:
            continue
        except Exception as error:  # noqa: BLE001 - a model the zoo reports on; here it is only left out
            rows.append({"case": case, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"})
            continue
        rows.append({"case": case, "eager_s": eager, "recorded_s": recorded})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=0, help="this many models (0: every deferred case)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=50, help="models per child process")
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.child is not None:
        meta = meta_import_seconds()
        print(json.dumps({"meta_import_s": meta, "rows": measure(args.child, args.runs)}))
        return
    sys.path.insert(0, str(ROOT))
    from zoo.cases import case_names

    cases = [c for c in case_names(("hf", "timm", "torchvision")) if c.split("/")[1] == "deferred"]  # the models it builds
    if args.sample:
        cases = sorted(random.Random(args.seed).sample(cases, min(args.sample, len(cases))))
    rows, imports = [], []
    for start in range(0, len(cases), args.chunk):
        chunk = cases[start:start + args.chunk]
        done = subprocess.run([sys.executable, "-m", "bench.deferred_zoo", "--runs", str(args.runs), "--child", *chunk],
                              capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            print(f"chunk {start}: the child failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        imports.append(result["meta_import_s"])
        rows += result["rows"]
        print(f"{len(rows)}/{len(cases)} models", file=sys.stderr, flush=True)
    write(args, rows, imports)


def write(args: argparse.Namespace, rows: list[dict], imports: list[float]) -> None:
    timed = [r for r in rows if "eager_s" in r]
    eager, recorded = sum(r["eager_s"] for r in timed), sum(r["recorded_s"] for r in timed)
    ratios = sorted(r["recorded_s"] / r["eager_s"] for r in timed if r["eager_s"] > 0)
    slowest = sorted(timed, key=lambda r: r["recorded_s"] / max(r["eager_s"], 1e-9), reverse=True)[:10]
    summary = {
        "models": len(timed), "left_out": [r for r in rows if "error" in r], "eager_s": eager, "recorded_s": recorded,
        "ratio_of_sums": recorded / eager, "median_ratio": statistics.median(ratios),
        "p90_ratio": ratios[int(0.9 * (len(ratios) - 1))], "meta_import_s": statistics.median(imports),
        "threads": torch.get_num_threads(), "runs": args.runs, "sample": args.sample, "seed": args.seed, "rows": timed,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-deferred-zoo.json").write_text(json.dumps(summary, indent=1))
    lines = [
        f"Recording (`mz.deferred_init`) against eager construction over {len(timed)} models of the zoo's deferred "
        f"cases{f' (a sample, seed {args.seed})' if args.sample else ''}, CPU seconds, best of {args.runs}, "
        f"{torch.get_num_threads()} threads. torch's one-time import of its meta kernels, "
        f"{summary['meta_import_s']:.2f} s a process, is paid before the timings (see the module docstring).",
        "",
        "| | eager s | recorded s | recorded / eager |",
        "| --- | ---: | ---: | ---: |",
        f"| all models, summed | {eager:.2f} | {recorded:.2f} | {recorded / eager:.2f} |",
        f"| per model, median | | | {summary['median_ratio']:.2f} |",
        f"| per model, 90th percentile | | | {summary['p90_ratio']:.2f} |",
        "",
        "Slowest to record against their eager construction:",
        "",
        "| model | eager ms | recorded ms | ratio |",
        "| --- | ---: | ---: | ---: |",
        *[f"| {r['case']} | {r['eager_s'] * 1e3:.1f} | {r['recorded_s'] * 1e3:.1f} | {r['recorded_s'] / r['eager_s']:.2f} |"
          for r in slowest],
    ]
    (args.out / "bench-deferred-zoo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
