"""One rank of a sharded load, run by test_sharded.py as its own process (gloo, CPU).

Usage: python sharded_worker.py SCENARIO CHECKPOINT STORE RANK WORLD OUT

Writes what this rank saw to OUT as JSON; the test compares ranks and values.
Leaves with ``os._exit`` once everything is written: the gloo process group's
teardown at interpreter exit aborts now and then on its own (seen without any
load), and that is not what is being tested.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import materialize as mz
from conftest import reference_model, tiny_skeleton


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 12)  # Shard(0) under ColwiseParallel
        self.down = nn.Linear(12, 10)  # Shard(1) under RowwiseParallel: strided reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def reference_mlp() -> MLP:
    torch.manual_seed(1)
    return MLP()


def fsdp(checkpoint: str, mesh) -> dict:
    """FSDP2 over the project's decoder (tied embeddings, rotary buffers): sharded on meta, loaded, trained a step."""
    model = tiny_skeleton(tie=True)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = mz.load(model, checkpoint, check=True)
    source = reference_model(tie=True)
    tokens = torch.arange(11)[None] % 96
    result = _compare(model, source)
    with torch.no_grad():
        result["forward_equal"] = torch.allclose(model(tokens), source(tokens), atol=1e-6)
    model(tokens).float().pow(2).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    result["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    result["trained_finite"] = all(bool(p.full_tensor().isfinite().all()) for p in model.parameters())
    return {**result, "bytes_read": report.bytes_read, "model_bytes": report.model_bytes}


def fsdp_wrapped(checkpoint: str, mesh) -> dict:
    """As torchtitan builds: on meta, blocks wrapped for activation checkpointing, sharded, then loaded; a step."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_skeleton(tie=True)
    for index, layer in enumerate(model.model.layers):
        model.model.layers[index] = checkpoint_wrapper(layer)
        fully_shard(model.model.layers[index], mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = mz.load(model, checkpoint)
    source = reference_model(tie=True)
    expected = source.state_dict()
    tokens = torch.arange(11)[None] % 96
    equal = {name: torch.equal(param.full_tensor(), expected[name.replace("._checkpoint_wrapped_module", "")])
             for name, param in model.named_parameters()}
    with torch.no_grad():
        forward_equal = torch.allclose(model(tokens), source(tokens), atol=1e-6)
    model(tokens).float().pow(2).mean().backward()
    return {"equal": equal, "forward_equal": forward_equal, "loaded": report.loaded, "bytes_read": report.bytes_read,
            "grads": all(p.grad is not None for p in model.parameters())}


def tensor_parallel(checkpoint: str, mesh) -> dict:
    """Column- and row-wise parallel linears, cast on the way."""
    with torch.device("meta"):
        model = MLP()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    report = mz.load(model, checkpoint, dtype="fp64", check=True)
    source = reference_mlp().double()
    result = _compare(model, source)
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.no_grad():
        result["forward_equal"] = torch.allclose(model(x), source(x))
    return {**result, "bytes_read": report.bytes_read, "model_bytes": report.model_bytes}


def fsdp_mixed(checkpoint: str, mesh) -> dict:
    """FSDP2 with a bf16 mixed-precision policy over fp32 parameters, from a bf16 checkpoint."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    with torch.device("meta"):
        model = MLP()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.up, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    mz.load(model, checkpoint, check=True)
    source = reference_mlp().to(torch.bfloat16).float()  # the values the bf16 file holds
    result = _compare(model, source)
    result["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    model(torch.randn(3, 16)).float().pow(2).mean().backward()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    result["stepped"] = all(str(p.dtype) == "torch.float32" and p.grad is not None for p in model.parameters())
    return result


def stacked(checkpoint: str, mesh) -> dict:
    """Tensors assembled from several checkpoint tensors (experts stacked, parts concatenated), sharded by rows."""
    from safetensors.torch import load_file

    from materialize.planning.stacking import StackSlot

    model = nn.Module()
    with torch.device("meta"):
        model.gate_up = nn.Parameter(torch.empty(3, 6, 4))  # 3 experts of gate and up: rank 0 holds two, rank 1 one
        model.fused = nn.Parameter(torch.empty(8, 4))  # parts of 5 and 3 rows: the rank boundary (row 4) cuts the first
    fully_shard(model, mesh=mesh)

    def to_slot(name: str) -> StackSlot:
        kind, number, which = name.split(".")
        if kind == "experts":
            return StackSlot("gate_up", int(number), ("gate", "up").index(which))
        return StackSlot("fused", 0, int(number), new_dim=False)

    report = mz.load(model, checkpoint, key_map=to_slot, check=True)
    saved = load_file(checkpoint)
    expected = {
        "gate_up": torch.stack([torch.cat([saved[f"experts.{e}.gate"], saved[f"experts.{e}.up"]]) for e in range(3)]),
        "fused": torch.cat([saved["fused.0.part"], saved["fused.1.part"]]),
    }
    equal = {name: torch.equal(getattr(model, name).full_tensor(), value) for name, value in expected.items()}
    return {"equal": equal, "bytes_read": report.bytes_read,
            "local_rows": {name: getattr(model, name).to_local().shape[0] for name in expected}}


def save_fsdp(folder: str, mesh) -> dict:
    """A DCP checkpoint as FSDP2 training writes one: each rank its rows of every tensor, beside other state."""
    import torch.distributed.checkpoint as dcp

    model = reference_model(tie=True)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save({"model": model.state_dict(), "step": 7, "optim": {"lr": torch.tensor(0.5)}}, checkpoint_id=folder)
    return {"saved": True}


def save_tp(folder: str, mesh) -> dict:
    """A DCP checkpoint of a tensor-parallel model: row-wise layers saved in chunks of columns."""
    import torch.distributed.checkpoint as dcp

    model = reference_mlp()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    dcp.save(model.state_dict(), checkpoint_id=folder)
    return {"saved": True}


def partial(checkpoint: str, mesh) -> dict:
    with torch.device("meta"):
        model = MLP()
    model.up.weight = nn.Parameter(DTensor.from_local(torch.empty(12, 16, device="meta"), mesh, [Partial()],
                                                      run_check=False))
    model.down.weight = nn.Parameter(DTensor.from_local(torch.empty(10, 12, device="meta"), mesh, [Partial()],
                                                        run_check=False))
    before = model.up.weight
    try:
        mz.load(model, checkpoint)
    except mz.MaterializeError as error:
        return {"error": type(error).__name__, "message": str(error), "left_as_was": model.up.weight is before}
    return {"error": None}


def fsdp_own_head(checkpoint: str, mesh) -> dict:
    """The decoder ties its head to its embedding; the checkpoint holds a head of its own."""
    model = tiny_skeleton(tie=True)
    fully_shard(model, mesh=mesh)
    before = dict(model.named_parameters())
    try:
        mz.load(model, checkpoint)
    except mz.MaterializeError as error:
        left = all(param is before[name] and param.to_local().is_meta for name, param in model.named_parameters())
        return {"error": type(error).__name__, "message": str(error), "left_as_was": left}
    return {"error": None}


def fsdp_replayed(checkpoint: str, mesh) -> dict:
    """Recorded by deferred_init, sharded on meta, loaded from a checkpoint without the head: the head replayed."""
    from bench.models.transformer import DecoderLM
    from conftest import TINY

    torch.manual_seed(0)
    model = mz.deferred_init(DecoderLM, **TINY, tie_embeddings=False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = mz.load(model, checkpoint, strict=False)
    result = _compare(model, reference_model(tie=False))
    head = model.lm_head.weight
    result["head_local_rows"] = list(head.to_local().shape)
    return {**result, "replayed": report.replayed, "bytes_read": report.bytes_read}


def tp_materialized(checkpoint: str, mesh) -> dict:
    """Recorded, made tensor parallel on meta, then materialized with no checkpoint at all."""
    torch.manual_seed(1)  # as reference_mlp
    model = mz.deferred_init(MLP)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    mz.materialize(model)
    result = _compare(model, reference_mlp())
    result["local_shapes"] = {name: list(p.to_local().shape) for name, p in model.named_parameters()}
    return result


def _compare(model: nn.Module, source: nn.Module) -> dict:
    expected = source.state_dict()
    placements, equal = {}, {}
    for name, param in model.named_parameters():
        placements[name] = [repr(p) for p in param.placements] if isinstance(param, DTensor) else None
        equal[name] = torch.equal(param.full_tensor(), expected[name].to(param.dtype))
    return {"placements": placements, "equal": equal}


def main() -> None:
    scenario, checkpoint, store, rank, world, out = sys.argv[1:7]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world))
    try:
        mesh = init_device_mesh("cpu", (int(world),))
        result = {"fsdp": fsdp, "fsdp_mixed": fsdp_mixed, "tp": tensor_parallel, "stacked": stacked, "partial": partial,
                  "fsdp_own_head": fsdp_own_head, "save_fsdp": save_fsdp, "save_tp": save_tp,
                  "fsdp_wrapped": fsdp_wrapped, "fsdp_replayed": fsdp_replayed,
                  "tp_materialized": tp_materialized}[scenario](checkpoint, mesh)
    except BaseException:
        result = {"crash": traceback.format_exc()}
    with open(out, "w") as handle:
        json.dump(result, handle)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
