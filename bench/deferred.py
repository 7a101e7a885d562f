"""Deferred init against eager construction: time and peak memory of making a model from scratch.

``python -m bench.deferred`` builds the bench configs' model (``configs/bench-llama-1b.toml``, about 1 B
parameters, and ``configs/bench-many-small.toml``, 18,000 small tensors) in fp32 on the CPU three ways,
each run a fresh process, the methods taking turns, median of ``--runs`` after a warm-up:

* eager construction under ``torch.manual_seed(0)`` (the oracle);
* ``mz.deferred_init`` then ``mz.materialize`` (recording and replay, timed together and apart);
* ``mz.meta_init`` then ``to_empty`` and every module's ``reset_parameters()``: torch's own recipe, here
  for time. It gives eager's values only where a model's whole init is ``reset_parameters()`` run in
  construction order, as for this bench's decoder; custom init, buffers drawn between layers, a seed in a
  constructor (``tests/test_deferred.py``'s models) come out otherwise.

Each child first makes one meta computation, untimed, for every method alike: a process's first one imports
torch's Python meta kernels (about a second; ``bench.deferred_zoo`` says more), a cost of building on meta at
all, reported apart. A result is verified when a checksum of every tensor equals eager construction's. Writes
``bench/results/bench-deferred-<config>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch
from torch import nn

from bench.turns import take_turns, write_table

RESULTS = Path(__file__).parent / "results"
CONFIGS = ("configs/bench-llama-1b.toml", "configs/bench-many-small.toml")
METHODS = {
    "eager construction": "eager",
    "deferred_init + materialize": "replayed",
    "meta_init + to_empty + reset_parameters": "to_empty",
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def _checksum(model: nn.Module) -> int:
    crc = 0
    for name, tensor in sorted({**dict(model.named_parameters()), **dict(model.named_buffers())}.items()):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        crc = zlib.crc32(memoryview(flat.numpy()), zlib.crc32(name.encode(), crc))
    return crc


def child(method: str, config: str) -> dict:
    import materialize as mz
    from materialize.skeleton.spec import resolve_factory

    factory, args = resolve_factory(config)
    # torch imports its Python meta kernels (torch._dynamo, the decompositions) at a process's first meta
    # computation: about a second, once, whatever builds on meta. Paid here by every method alike, and reported.
    started = time.perf_counter()
    torch.ones(3, device="meta").cos()
    meta_import_s = time.perf_counter() - started
    before = _rss_bytes()
    torch.manual_seed(0)
    started = time.perf_counter()
    recorded_s = None
    if method == "eager":
        model = factory(**args)
    elif method == "replayed":
        model = mz.deferred_init(factory, **args)
        recorded_s = time.perf_counter() - started
        mz.materialize(model)
    else:
        with mz.meta_init(include_buffers=True):
            model = factory(**args)
        model.to_empty(device="cpu")
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model_bytes = sum(t.numel() * t.element_size() for t in {**dict(model.named_parameters()), **dict(model.named_buffers())}.values())
    return {"load_s": seconds, "recorded_s": recorded_s, "rss_growth": peak - before, "model_bytes": model_bytes,
            "checksum": _checksum(model), "meta_import_s": meta_import_s}


def run(method: str, config: str, expected: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "bench.deferred", "--child", method, "--config", config],
                          capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "checksum" not in expected and method == "eager":
        expected["checksum"] = result["checksum"]
    result["verified"] = result["checksum"] == expected.get("checksum")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--config", action="append", help="a configs/ TOML (default: both bench configs)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.config[0])))
        return
    for config in args.config or CONFIGS:
        expected: dict = {}
        run("eager", config, expected)  # the oracle's checksum first
        results = take_turns(METHODS, lambda method: run(method, config, expected), args.runs)
        name = f"bench-deferred-{Path(config).stem.removeprefix('bench-')}"
        rows = results["deferred_init + materialize"]
        recorded = sorted(row["recorded_s"] for row in rows)[len(rows) // 2]
        eager = sorted(row["load_s"] for row in results["eager construction"])[len(rows) // 2]
        meta_import = sorted(row["meta_import_s"] for row in rows)[len(rows) // 2]
        model_bytes = rows[0]["model_bytes"]
        intro = (f"Making `{config}` from scratch in fp32 on the CPU (model {model_bytes / 1e9:.2f} GB), "
                 f"{torch.get_num_threads()} threads; median of {args.runs} runs in fresh processes, methods in turns. "
                 f"Recording alone: {recorded:.3f} s ({recorded / eager:.2f}x eager construction). Before the timer, "
                 f"each process makes one meta computation, which imports torch's meta kernels: {meta_import:.2f} s, "
                 "once a process, for any construction on meta. Verified: every tensor's checksum equals eager "
                 "construction's.")
        write_table(args.out, name, intro, results, lambda label: "eager construction", "vs eager",
                    {"config": config, "model_bytes": model_bytes, "recorded_s": recorded, "meta_import_s": meta_import})


if __name__ == "__main__":
    main()
