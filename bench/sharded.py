"""An FSDP2 model sharded on meta over several ranks, loaded from the benchmark checkpoint.

``python -m bench.sharded`` runs ``--world`` processes (gloo on CPU; a file
store, no port) per load, each rank building the benchmark model
(configs/bench-llama-1b.toml, 1.9 GB of bf16) on meta and sharding every
layer with ``fully_shard``. Methods, each a fresh set of processes, page
cache warm, taking turns, median of ``--runs`` after a warm-up (none with
``--no-warm-up``, for a quick check):

- ours: ``mz.load`` on every rank (each reads its own rows);
- torch, rank 0 reads and broadcasts: ``to_empty``, rank 0 ``load_file``,
  then ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``
  (how FSDP2 recipes load a Hugging Face checkpoint);
- torch, every rank reads: ``to_empty``, every rank ``load_file``, then
  ``set_model_state_dict(full_state_dict=True)``.

With ``--layout 2d`` the model takes torchtitan's 2-D layout instead
(``bench/models/parallel.py``: tensor parallel over pairs of ranks, FSDP2
across them; column-wise weights placed ``_StridedShard``), on ``--world``
ranks (4: a 2x2 mesh), and the methods are:

- ours, from the safetensors file;
- ours, and torch DCP (``to_empty``, then ``dcp.load`` into the model's
  state dict: torchtitan's own resume path), from two DCP saves of the
  same weights: one a single process wrote (``bench/dcp.py``, one chunk per
  tensor), one the 2-D layout itself wrote (each rank its chunks, written
  once by the ranks before the runs: what torchtitan resumes from).

With ``--layout replicas`` every rank holds the whole model (DDP, inference
replicas), on ``--world`` ranks (4), and the methods are:

- ours, ``group=``: each byte read from storage by one rank, sent to the others;
- ours, every rank reads all of it;
- torch, rank 0 reads and broadcasts: ``to_empty``, rank 0 ``load_file``, then
  ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``;
- torch, every rank reads: ``to_empty``, ``load_file`` + ``load_state_dict`` (copying into the model's
  memory; ``assign=True`` would keep views of load_file's mapping, read only when used).

With ``--source s3`` the replicas read the same file from a loopback S3
server (moto's, ``bench/s3_server.py``), ours with a group and without
(torch's recipes read local files).

The 2-D layout's table has ``group=`` beside ours without it too.

Figures: the slowest rank's load seconds, the largest rank's peak RSS
growth, the bytes read from storage summed over the ranks, each result
verified (sampled tensors gathered and checksummed). Writes
``bench/results/bench-sharded.md`` (``bench-sharded-2d.md``,
``bench-sharded-replicas.md``) and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from contextlib import nullcontext
from typing import Optional

import torch

from bench import s3_server
from bench.fixtures import crc, ensure
from bench.turns import after, take_turns, write_table

RESULTS = Path(__file__).parent / "results"
METHODS = {
    "ours: every rank reads its own rows": "ours",
    "torch: rank 0 reads, set_model_state_dict broadcasts": "broadcast",
    "torch: every rank reads all, set_model_state_dict": "everyone",
}
METHODS_2D = {
    "ours: every rank reads its own part, safetensors": "ours-2d",
    "ours, group=: each byte read by one rank, safetensors": "group-2d",
    "ours: a one-process DCP save": "ours-2d-dcp",
    "torch DCP: to_empty + dcp.load, a one-process DCP save": "dcp-2d",
    "ours: a DCP save of the same 2-D layout": "ours-2d-dcp2d",
    "torch DCP: to_empty + dcp.load, a DCP save of the same 2-D layout": "dcp-2d-dcp2d",
}
METHODS_REPLICAS = {
    "ours, group=: each byte read by one rank, sent to the others": "group-replicas",
    "ours: every rank reads all": "ours-replicas",
    "torch: rank 0 reads, set_model_state_dict broadcasts": "broadcast-replicas",
    "torch: every rank to_empty, load_file + load_state_dict": "everyone-replicas",
}
SAVE_2D = "save-2d"  # not timed: the ranks write the DCP save of their own layout, once


def is_2d(method: str) -> bool:
    return method in METHODS_2D.values() or method == SAVE_2D


def dcp_2d_folder(single: Path, world: int) -> Path:
    return single.parent / f"dcp-2d-{world}"


def is_replicas(method: str) -> bool:
    return method in METHODS_REPLICAS.values()


def rank_main(method: str, path: Path, dcp_folder: Optional[Path], expected: dict, store: Path, rank: int, world: int,
              out: Path, url: Optional[str] = None) -> None:
    """One rank of one load by ``method``; ``dcp_folder`` is the one-process DCP save (2-D methods)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import materialize as mz
    from bench.models.transformer import DecoderLM

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    two_d = is_2d(method)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp")) if two_d else init_device_mesh("cpu", (world,))
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    with mz.meta_init():
        model = DecoderLM(**expected["model_args"]).to(torch.bfloat16)
    if two_d:
        from bench.models.parallel import torchtitan_2d

        torchtitan_2d(model, mesh)
    elif is_replicas(method):
        pass  # the whole model on every rank
    else:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    own_layout = dcp_2d_folder(path, world)
    file_bytes = path.stat().st_size
    # What each rank reads from storage: the report's, for ours; the whole file, for a rank that load_file's it;
    # unknown (None) for dcp.load.
    storage = (file_bytes if method in ("everyone", "everyone-replicas") or (rank == 0 and "broadcast" in method)
               else 0 if "broadcast" in method else None)
    source = url or path  # a URL: the same file from a loopback S3 server (--source s3)
    if method in ("ours", "ours-2d", "ours-replicas", SAVE_2D):
        storage = mz.load(model, source).bytes_read
    elif method in ("group-2d", "group-replicas"):
        storage = mz.load(model, source, group=dist.group.WORLD).bytes_read
    elif method == "everyone-replicas":
        from safetensors.torch import load_file

        # Copied into the model's own memory: with assign=True the tensors would stay views of load_file's
        # mapping, nothing read until used (what mmap=True gives), and nothing to compare with a load.
        model.to_empty(device="cpu")
        model.load_state_dict(load_file(path))
    elif method in ("ours-2d-dcp", "ours-2d-dcp2d"):
        mz.load(model, own_layout if method.endswith("dcp2d") else dcp_folder)
    elif method in ("dcp-2d", "dcp-2d-dcp2d"):
        import torch.distributed.checkpoint as dcp

        model.to_empty(device="cpu")
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(own_layout if method.endswith("dcp2d") else dcp_folder))
    else:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model.to_empty(device="cpu")
        broadcast = "broadcast" in method
        state = load_file(path) if rank == 0 or not broadcast else {}
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast))
        del state
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if method == SAVE_2D:
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict()}, checkpoint_id=str(own_layout.with_name(own_layout.name + ".partial")))
    params = dict(model.named_parameters())
    whole = (lambda t: t.full_tensor()) if not is_replicas(method) else (lambda t: t)
    verified = all(crc(whole(params[name])) == value for name, value in expected["same"].items())
    out.write_text(json.dumps({"load_s": seconds, "rss_growth": peak - before, "verified": verified,
                               "storage_bytes": storage}))
    dist.barrier()
    os._exit(0)  # gloo's teardown at exit aborts now and then on its own; the result is written


def one(method: str, path: Path, world: int, config: str, data: str, scratch: Path, url: Optional[str] = None,
        env: Optional[dict] = None) -> dict:
    """One load on ``world`` fresh processes: the slowest rank's time, the largest rank's memory."""
    scratch.mkdir(parents=True, exist_ok=True)
    store = scratch / "store"
    store.unlink(missing_ok=True)
    outs = [scratch / f"rank{rank}.json" for rank in range(world)]
    for out in outs:
        out.unlink(missing_ok=True)
    processes = [subprocess.Popen([sys.executable, "-m", "bench.sharded", "--config", config, "--data", data, "--rank",
                                   f"{method},{rank},{world},{store},{out}", *(["--url", url] if url else [])],
                                  cwd=Path(__file__).parent.parent, env={**os.environ, **(env or {})},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for rank, out in enumerate(outs)]
    errors = [process.communicate(timeout=900)[1] for process in processes]
    if not all(out.exists() for out in outs):
        raise RuntimeError(f"{method}: a rank wrote no result: {errors[0][-2000:]}")
    ranks = [json.loads(out.read_text()) for out in outs]
    return {"load_s": max(r["load_s"] for r in ranks), "rss_growth": max(r["rss_growth"] for r in ranks),
            "verified": all(r["verified"] for r in ranks),
            "storage_bytes": None if any(r["storage_bytes"] is None for r in ranks) else sum(r["storage_bytes"] for r in ranks)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench-llama-1b.toml")
    parser.add_argument("--data", default="data/bench")
    parser.add_argument("--world", type=int, default=None, help="ranks (default 2; 4 for --layout 2d)")
    parser.add_argument("--layout", choices=("fsdp", "2d", "replicas"), default="fsdp")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-warm-up", action="store_true",
                        help="no discarded first run of each method (for a quick check)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--source", choices=("file", "s3"), default="file",
                        help="replicas only: the file, or the same file from a loopback S3 server (bench/s3_server.py)")
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from bench.dcp import ensure_dcp

    paths = ensure(args.config, Path(args.data))
    expected = json.loads(paths["expected"].read_text())
    method = args.rank.split(",")[0] if args.rank else None
    two_d = is_2d(method) if method else args.layout == "2d"
    replicas = is_replicas(method) if method else args.layout == "replicas"
    dcp_folder = ensure_dcp(args.config, Path(args.data))[0] if two_d else None  # written once, for 2-D only
    if args.rank:
        _, rank, world, store, out = args.rank.split(",")
        rank_main(method, paths["single"], dcp_folder, expected, Path(store), int(rank), int(world), Path(out), args.url)
        return
    world = args.world or (4 if two_d or replicas else 2)
    methods = METHODS_2D if two_d else METHODS_REPLICAS if replicas else METHODS
    scratch = Path(args.data).resolve() / "sharded-runs"  # a file:// store wants an absolute path
    if two_d and not (dcp_2d_folder(paths["single"], world) / ".metadata").exists():
        folder = dcp_2d_folder(paths["single"], world)
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        one(SAVE_2D, paths["single"], world, args.config, args.data, scratch)  # each rank writes its own chunks
        partial.rename(folder)
    from_s3 = replicas and args.source == "s3"
    if from_s3:  # torch's recipes read local files: ours alone, with a group and without
        methods = {label: method for label, method in methods.items() if method in ("group-replicas", "ours-replicas")}
    with (s3_server.serve({paths["single"].name: paths["single"]}) if from_s3 else nullcontext()) as s3:
        url = f"s3://{s3.bucket}/{paths['single'].name}" if s3 is not None else None
        env = s3.env if s3 is not None else None
        results = take_turns(methods, lambda method: one(method, paths["single"], world, args.config, args.data,
                                                         scratch, url, env), args.runs,
                             warm_up=not args.no_warm_up)
    ours = next(iter(methods))
    layout = (f"torchtitan's 2-D layout on {world} ranks ({world // 2} FSDP2 x 2 tensor parallel, gloo, CPU); "
              "the DCP saves: one a single process wrote, one this layout's ranks wrote" if two_d
              else f"the whole model on each of {world} ranks (gloo, CPU)"
              + (", from a loopback S3 server (moto, bench/s3_server.py)" if from_s3 else "") if replicas
              else f"FSDP2 over {world} ranks (gloo, CPU)")
    name = "bench-sharded-2d" if two_d else f"bench-sharded-replicas{'-s3' if from_s3 else ''}" if replicas else "bench-sharded"
    write_table(Path(args.out), name,
                f"{expected['nbytes'] / 1e9:.2f} GB of bf16 weights ({Path(args.config).stem}, one safetensors file), "
                f"{layout}; median of {args.runs} runs {after(args.no_warm_up)}, methods "
                "taking turns, each run fresh processes, page cache warm. Load s: the slowest rank, sharding on meta "
                "included; RSS growth: the largest rank.",
                results, lambda label: ours, "x ours", {"nbytes": expected["nbytes"], "world": world})

if __name__ == "__main__":
    main()
