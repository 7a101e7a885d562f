"""Checkpoint tensors saved in another layout than the model's: transposed or interleaved experts.

``python -m bench.strided`` writes 1 GB of bf16 expert stacks (8 tensors of
``[32, 1024, 2048]``; ``--scale`` multiplies the count) once under
``data/bench/strided/``, then loads them into a model that wants them
transposed (Qwen3-VL-MoE's ``Transpose``), deinterleaved (Inkling's
``Interleave(dim=1)``) or as saved, each run a fresh process, page cache
warm, the methods taking turns, median of ``--runs`` after a warm-up (none
with ``--no-warm-up``, for a quick check; ``--in-process`` runs them all in
the bench's own process instead, for a quick check too: nothing here
measures memory, and the times are then not the bench's). The
peer is what a conversion does after loading: every tensor read, then
rearranged by torch (``transpose(...).contiguous()``, a reshape-transpose-
reshape for an interleave), as transformers' ops do. Each result is checked
against samples of the expected tensors. Writes ``bench/results/bench-strided.md``
and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.turns import after, take_turns, write_table

RESULTS = Path(__file__).parent / "results"
SHAPE = (32, 1024, 2048)
SAMPLE_STEP = 9973  # every this many elements of each tensor are compared
METHODS = {
    "ours, same layout (no rearranging)": "ours-direct",
    "ours, transposed experts": "ours-transposed",
    "safetensors load_file + transpose().contiguous()": "peer-transposed",
    "ours, interleaved experts": "ours-interleaved",
    "safetensors load_file + interleave by reshapes": "peer-interleaved",
}


def _names(count: int) -> list[str]:
    return [f"experts.{i}" for i in range(count)]


def _interleaved(tensor: torch.Tensor) -> torch.Tensor:
    """transformers' ``Interleave(dim=1)``: pairs along dim 1 gathered into two halves."""
    shape = list(tensor.shape)
    shape[1:2] = [shape[1] // 2, 2]
    return tensor.reshape(shape).transpose(1, 2).reshape(tensor.shape)


def _rearranged(tensor: torch.Tensor, how: str) -> torch.Tensor:
    if how == "transposed":
        return tensor.transpose(1, 2).contiguous()
    if how == "interleaved":
        return _interleaved(tensor).contiguous()
    return tensor


def ensure(folder: Path, count: int, shape: tuple[int, ...] = SHAPE) -> Path:
    """The experts file and samples of every expected layout, written once."""
    from safetensors.torch import load_file, save_file

    path = folder / "experts.safetensors"
    samples = folder / "samples.pt"
    if path.exists() and samples.exists():
        cached = torch.load(samples, weights_only=True)
        if cached.get("shape") == list(shape) and len(cached.get("direct", ())) == count:
            return path
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    save_file({name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name in _names(count)}, path)
    saved = load_file(path)
    expected = {how: {name: _rearranged(saved[name], how).flatten()[::_step(shape)].clone() for name in saved}
                for how in ("direct", "transposed", "interleaved")}
    torch.save({"shape": list(shape), **expected}, samples)
    return path


def _step(shape: tuple[int, ...]) -> int:
    return min(SAMPLE_STEP, max(1, int(torch.tensor(shape).prod()) // 101))


def _model(how: str, count: int, saved: tuple[int, ...]) -> torch.nn.Module:
    shape = (saved[0], saved[2], saved[1]) if how == "transposed" else saved
    model = torch.nn.Module()
    for index in range(count):
        model.register_parameter(f"experts_{index}", torch.nn.Parameter(
            torch.empty(shape, dtype=torch.bfloat16, device="meta"), requires_grad=False))
    return model


def one(method: str, path: Path, count: int, shape: tuple[int, ...]) -> dict:
    """One timed load in this process: the tensors as the model wants them."""
    import materialize as mz
    from materialize.checkpoint.targets import Deinterleave, Rearranged, Transposed

    who, how = method.split("-")
    started = time.perf_counter()
    if who == "ours":
        model = _model(how, count, shape)
        rename = {
            "direct": lambda name: name.replace(".", "_"),
            "transposed": lambda name: Transposed(name.replace(".", "_"), 1, 2),
            "interleaved": lambda name: Rearranged(name.replace(".", "_"), Deinterleave(dim=1)),
        }[how]
        mz.load(model, path, key_map=rename)
        tensors = {name: getattr(model, name.replace(".", "_")) for name in _names(count)}
    else:
        from safetensors.torch import load_file

        tensors = {name: _rearranged(tensor, how) for name, tensor in load_file(path).items()}
    seconds = time.perf_counter() - started
    expected = torch.load(path.parent / "samples.pt", weights_only=True)[how]
    verified = all(torch.equal(tensors[name].flatten()[::_step(shape)], expected[name]) for name in expected)
    return {"load_s": seconds, "verified": verified}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/bench/strided")
    parser.add_argument("--scale", type=int, default=1, help="multiplies the number of expert stacks (8 of 128 MB)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-warm-up", action="store_true",
                        help="no discarded first run of each method (for a quick check)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--shape", default=",".join(map(str, SHAPE)), help="of each expert stack: experts,rows,cols")
    parser.add_argument("--in-process", action="store_true",
                        help="every run in this process, not a fresh one each (for a quick check: the runs share "
                             "imports and caches, their times are not the bench's)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    count = 8 * args.scale
    shape = tuple(int(size) for size in args.shape.split(","))
    path = ensure(Path(args.data), count, shape)
    if args.one:
        print(json.dumps(one(args.one, path, count, shape)))
        return

    def run(method: str) -> dict:
        if args.in_process:
            return one(method, path, count, shape)
        done = subprocess.run([sys.executable, "-m", "bench.strided", "--data", args.data, "--scale", str(args.scale),
                               "--shape", args.shape, "--one", method], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent.parent)
        return json.loads(done.stdout.strip().splitlines()[-1])

    results = take_turns(METHODS, run, args.runs, warm_up=not args.no_warm_up)
    same_layout = next(iter(METHODS))
    write_table(Path(args.out), "bench-strided",
                f"{path.stat().st_size / 1e9:.2f} GB of bf16 expert stacks ({count} x {list(shape)}); median of "
                f"{args.runs} runs {after(args.no_warm_up)}, methods taking turns, "
                f"{'every run in one process' if args.in_process else 'each run a fresh process'}, page cache warm.",
                results, lambda label: same_layout, "x same layout", {"nbytes": path.stat().st_size})

if __name__ == "__main__":
    main()
