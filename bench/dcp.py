"""A torch.distributed.checkpoint (DCP) training save loaded into a model, against torch's own DCP loader.

``python -m bench.dcp`` saves the benchmark model (configs/bench-llama-1b.toml,
1.9 GB of bf16) once with ``dcp.save`` under ``data/bench/<config>/dcp``, as a
single-process training save writes it (the model's state nested under
``model``, beside an optimizer entry). Then, each run a fresh process, page
cache warm, the methods taking turns, median of ``--runs`` after a warm-up
(none with ``--no-warm-up``, for a quick check):

- ours: ``mz.load`` into the skeleton built on meta;
- torch DCP: the skeleton on meta, ``to_empty``, then ``dcp.load`` into its
  state dict (what torch's documentation and training frameworks do);
- each again into an fp32 model (a bf16 -> fp32 cast).

Load seconds (the call, skeleton included), peak RSS growth, and every
result verified against the sampled checksums of the benchmark fixture.
Writes ``bench/results/bench-dcp.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from bench.fixtures import crc, ensure
from bench.turns import after, take_turns, write_table

RESULTS = Path(__file__).parent / "results"
METHODS = {
    "ours, same dtype": "ours",
    "torch DCP: to_empty + dcp.load, same dtype": "torch",
    "ours, bf16 -> fp32": "ours-cast",
    "torch DCP: to_empty + dcp.load, bf16 -> fp32": "torch-cast",
}


def ensure_dcp(config: str, root: Path) -> tuple[Path, dict]:
    """The DCP folder of the benchmark checkpoint (written once), and the fixture's expected checksums."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    paths = ensure(config, root)
    expected = json.loads(paths["expected"].read_text())
    folder = paths["single"].parent / "dcp"
    if (folder / ".metadata").exists():
        return folder, expected
    partial = folder.with_name("dcp.partial")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a single-process save warns that no process group exists
        dcp.save({"model": load_file(paths["single"]), "optim": {"step": 1000, "lr": torch.tensor(3e-4)}},
                 checkpoint_id=str(partial))
    partial.rename(folder)
    return folder, expected


def _skeleton(args: dict) -> torch.nn.Module:
    import materialize as mz
    from bench.models.transformer import DecoderLM

    with mz.meta_init():
        return DecoderLM(**args)


def one(method: str, folder: Path, expected: dict) -> dict:
    """One timed load in this process."""
    import materialize as mz

    cast = method.endswith("-cast")
    dtype = torch.float32 if cast else torch.bfloat16
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    model = _skeleton(expected["model_args"])
    if method.startswith("ours"):
        mz.load(model, folder, dtype=dtype)
    else:
        import torch.distributed.checkpoint as dcp

        model.to(dtype).to_empty(device="cpu")  # dcp.load copies into the tensors it is given, in their dtype
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=str(folder))
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tensors = dict(model.named_parameters())
    wanted = expected["float32" if cast else "same"]
    verified = all(crc(tensors[name].detach()) == value for name, value in wanted.items())
    return {"load_s": seconds, "rss_growth": peak - before, "verified": verified}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench-llama-1b.toml")
    parser.add_argument("--data", default="data/bench")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-warm-up", action="store_true",
                        help="no discarded first run of each method (for a quick check)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    folder, expected = ensure_dcp(args.config, Path(args.data))
    if args.one:
        print(json.dumps(one(args.one, folder, expected)))
        return

    def run(method: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "bench.dcp", "--config", args.config, "--data", args.data,
                               "--one", method], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent.parent)
        return json.loads(done.stdout.strip().splitlines()[-1])

    results = take_turns(METHODS, run, args.runs, warm_up=not args.no_warm_up)
    ours: dict[bool, str] = {}  # the first row of each group (same dtype, cast) is ours
    for label in METHODS:
        ours.setdefault("fp32" in label, label)
    write_table(Path(args.out), "bench-dcp",
                f"{expected['nbytes'] / 1e9:.2f} GB of bf16 weights saved with dcp.save ({Path(args.config).stem}); "
                f"median of {args.runs} runs {after(args.no_warm_up)}, methods taking turns, each run a fresh process, "
                "page cache warm. Load s includes building the skeleton on meta.",
                results, lambda label: ours["fp32" in label], "x ours (same group)", {"nbytes": expected["nbytes"]})

if __name__ == "__main__":
    main()
