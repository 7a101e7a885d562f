"""One rank of a load shared by a process group (``group=``), run by test_group_loads.py as its own process.

Usage: python group_worker.py SCENARIO FOLDER STORE RANK WORLD OUT

FOLDER holds what the test wrote: ``model.safetensors``, ``model.pt`` and ``dcp/`` of the tiny decoder
(untied), and ``mlp.safetensors``. Each scenario loads with a group and without one, against torch's own
paths, and writes per-rank findings (equalities, bytes from storage and from the other ranks) to OUT.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import materialize as mz
from bench.models.parallel import torchtitan_2d
from conftest import reference_model, tiny_skeleton
from sharded_worker import MLP, _Collectives, _hsdp_tp, _locals_equal, _torchtitan_reference, _train, finish_rank, reference_mlp

KINDS = (("safetensors", "model.safetensors"), ("torch", "model.pt"), ("dcp", "dcp"))
# A budget this small cuts the tiny model into many chunks and rounds, its larger tensors into pieces: the paths
# a large checkpoint takes with the default budget.
SMALL = 16 * 1024


def _same_as_eager(model: nn.Module, eager: nn.Module) -> dict:
    """Per tensor, as eager construction + load_state_dict made it: class, values, dtype, strides, requires_grad."""
    theirs = dict(eager.named_parameters()) | dict(eager.named_buffers())
    result = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        other = theirs[name]
        result[name] = (type(tensor) is type(other) and tensor.dtype == other.dtype and tensor.stride() == other.stride()
                        and tensor.requires_grad == other.requires_grad and tensor.device == other.device
                        and torch.equal(tensor, other))
    return result


def replicated(folder: str, world: int) -> dict:
    """A plain model on every rank (as DDP and inference replicas hold it), from each format, on a gloo group made
    for it (the hint a group without a CPU backend gets), against eager + load_state_dict; three steps."""
    group = dist.new_group(backend="gloo")
    result = {}
    for kind, path in KINDS:
        eager = reference_model()
        eager.load_state_dict(reference_model().state_dict())
        model = tiny_skeleton()
        with _Collectives() as alone:
            alone_report = mz.load(tiny_skeleton(), os.path.join(folder, path))
        report = mz.load(model, os.path.join(folder, path), group=group, check=True, staging_bytes=SMALL)
        result[kind] = {"same": _same_as_eager(model, eager), "bytes_read": report.bytes_read,
                        "received": report.bytes_received, "alone_read": alone_report.bytes_read,
                        "alone_received": alone_report.bytes_received, "alone_collectives": alone.calls,
                        "loaded": len(report.loaded)}
    tied = tiny_skeleton(tie=True)  # a tie, and a checkpoint holding both its names: settled over the group too
    tied_report = mz.load(tied, os.path.join(folder, "tied.safetensors"), group=group, staging_bytes=SMALL)
    tied_eager = reference_model(tie=True)
    result["tied"] = {"same": _same_as_eager(tied, tied_eager), "tied": tied.lm_head.weight is tied.model.embed_tokens.weight,
                      "bytes_read": tied_report.bytes_read}
    tokens = torch.arange(24).view(2, 12) % 96
    result["losses"] = [_steps(model, tokens), _steps(eager, tokens)]
    return result


def _steps(model: nn.Module, tokens: torch.Tensor, steps: int = 3) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(tokens).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def hsdp(folder: str, world: int) -> dict:
    """HSDP 2x2 (replicated over ``rep``, sharded over ``shard``): each shard's rows read once for both replicas."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))

    def sharded() -> nn.Module:
        model = tiny_skeleton()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    result = {"replica": mesh.get_coordinate()[0]}
    for kind, path in KINDS:
        alone, shared = sharded(), sharded()
        alone_report = mz.load(alone, os.path.join(folder, path))
        report = mz.load(shared, os.path.join(folder, path), group=dist.group.WORLD, staging_bytes=SMALL)
        source = reference_model().state_dict()
        result[kind] = {"locals_equal": _locals_equal(shared, alone), "bytes_read": report.bytes_read,
                        "received": report.bytes_received, "alone_read": alone_report.bytes_read,
                        "whole_equal": all(torch.equal(p.full_tensor(), source[n]) for n, p in shared.named_parameters())}
        if kind == "safetensors":
            result["losses"] = [_train(shared), _train(alone)]
    return result


def tp_fsdp(folder: str, world: int) -> dict:
    """torchtitan's 2-D layout (TP 2 x FSDP 2) against its own set_model_state_dict path: the row-wise tensors'
    spans, the norms every TP rank holds, each read once; three steps beside the reference."""
    from safetensors.torch import load_file

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = load_file(os.path.join(folder, "model.safetensors"))
    reference = _torchtitan_reference(mesh, full)
    result = {}
    for kind, path in KINDS:
        model = torchtitan_2d(tiny_skeleton(), mesh)
        alone_report = mz.load(torchtitan_2d(tiny_skeleton(), mesh), os.path.join(folder, path))
        report = mz.load(model, os.path.join(folder, path), group=dist.group.WORLD, check=True, staging_bytes=SMALL)
        result[kind] = {"equal": _locals_equal(model, reference), "bytes_read": report.bytes_read,
                        "received": report.bytes_received, "alone_read": alone_report.bytes_read}
        if kind == "safetensors":
            first = model
    result["losses"] = [_train(first), _train(reference)]  # after every comparison with the reference
    return result


def mesh3d(folder: str, world: int) -> dict:
    """On 8 ranks, a 2x2x2 mesh: tensor parallel, then HSDP over it, from one read of every byte."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    path = os.path.join(folder, "mlp.safetensors")
    with torch.device("meta"):
        alone, shared = _hsdp_tp(MLP(), mesh), _hsdp_tp(MLP(), mesh)
    alone_report = mz.load(alone, path)
    report = mz.load(shared, path, group=dist.group.WORLD, staging_bytes=SMALL)
    source = reference_mlp().state_dict()
    result = {"locals_equal": _locals_equal(shared, alone), "bytes_read": report.bytes_read,
              "received": report.bytes_received, "alone_read": alone_report.bytes_read,
              "whole_equal": all(torch.equal(p.full_tensor(), source[n]) for n, p in shared.named_parameters())}
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    losses = []
    for net in (shared, alone):  # three steps each: the same losses and the same tensors after, bit for bit
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(3):
            loss = net(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    result["losses"] = losses
    result["trained_equal"] = _locals_equal(shared, alone)
    return result


def failure(folder: str, world: int) -> dict:
    """The checkpoint cut short under the group's feet (opened, then truncated): the rank reading its end fails,
    and every rank raises the same one-line error, its model left as it was."""
    path = os.path.join(folder, "model.safetensors")
    model = tiny_skeleton()
    with mz.open_checkpoint(path) as ckpt:
        dist.barrier()
        if dist.get_rank() == 0:
            os.truncate(path, os.path.getsize(path) - 4096)
        dist.barrier()
        try:
            mz.load(model, ckpt, group=dist.group.WORLD, staging_bytes=SMALL)
        except mz.MaterializeError as error:
            return {"error": type(error).__name__, "message": str(error), "path": error.path, "tensor": error.tensor,
                    "left_on_meta": all(p.is_meta for p in model.parameters())}
    return {"error": None}


def absent(folder: str, world: int) -> dict:
    """The last rank never calls the load: the others fail after the group's timeout (5 s here), one line."""
    from datetime import timedelta

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=5))
    if dist.get_rank() == world - 1:
        return {"called": False}
    model = tiny_skeleton()
    try:
        mz.load(model, os.path.join(folder, "model.safetensors"), group=group)
    except mz.MaterializeError as error:
        return {"called": True, "error": type(error).__name__, "message": str(error),
                "left_on_meta": all(p.is_meta for p in model.parameters())}
    return {"called": True, "error": None}


def big_linear() -> nn.Linear:
    torch.manual_seed(3)
    return nn.Linear(1024, 1024)  # 4 MB: far more than the head a remote open reads


def remote(base: str, world: int) -> dict:
    """URLs on tests/range_server.py (127.0.0.1): ``alone/`` loaded without a group, ``shared/`` with one (the
    same file at two paths, so that the server's log tells the loads apart)."""
    result = {}
    for name, group in (("alone", None), ("shared", dist.group.WORLD)):
        with mz.meta_init():
            model = nn.Linear(1024, 1024)
        report = mz.load(model, f"{base}/{name}/model.safetensors", group=group, staging_bytes=1024 * 1024)
        result[name] = {"same": _same_as_eager(model, big_linear()), "bytes_read": report.bytes_read,
                        "received": report.bytes_received}
    return result


SCENARIOS = {"absent": absent, "remote": remote, "replicated": replicated, "hsdp": hsdp, "tp_fsdp": tp_fsdp, "mesh3d": mesh3d, "failure": failure}


def main() -> None:
    scenarios, folder, store, rank, world, out = sys.argv[1:7]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world))
    finish_rank(lambda: {name: SCENARIOS[name](folder, int(world)) for name in scenarios.split(",")}, out)


if __name__ == "__main__":
    main()
