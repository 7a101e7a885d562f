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
import re
import sys
import textwrap
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import materialize as mz
from bench.models.parallel import torchtitan_2d
from bench.models.transformer import DecoderLM
from conftest import TINY, general_way_only, reference_model, tiny_skeleton


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
    return {**result, "bytes_read": report.bytes_read, "model_bytes": report.model_bytes,
            "rank_share": report.rank_share, "text": str(report)}


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

    from materialize.checkpoint.targets import StackSlot

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


def short_way(checkpoint: str, mesh) -> dict:
    """Each DTensor parameter as the allocation loop's short way makes it (materialize.loading._allocated_shard)
    and as the general way does (_materialize_entry), FSDP2's rows and tensor parallel's columns alike: the
    same objects' kinds, layouts, memory and values, a parameter's own attributes and requires_grad kept."""
    from materialize import loading

    def built(kind: str) -> nn.Module:
        if kind == "fsdp":
            model = tiny_skeleton(tie=True)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            with torch.device("meta"):
                model = MLP()
            parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        first, second = list(model.parameters())[:2]
        first.no_decay = True  # a script's mark on its parameter: a load keeps it
        second.requires_grad_(False)
        return model

    def facts(model: nn.Module) -> dict:
        seen = {}
        for name, param in model.named_parameters():
            local = param._local_tensor
            seen[name] = [type(param).__name__, isinstance(param, nn.Parameter), param.requires_grad,
                          sorted((k, repr(v)) for k, v in vars(param).items() if k != "_local_tensor"),
                          repr(param._spec), list(local.shape), list(local.stride()), local.storage_offset(),
                          local.untyped_storage().nbytes(), str(local.dtype), str(local.device),
                          local.requires_grad, local.grad_fn is None, param.grad_fn is None]
        return seen

    result: dict = {}
    for kind, path in (("fsdp", checkpoint), ("tp", str(Path(checkpoint).with_name("mlp.safetensors")))):
        taken: list[int] = []
        shard_way = loading._allocated_shard
        loading._allocated_shard = lambda *args: taken.append(1) or shard_way(*args)
        try:
            short = built(kind)
            short_report = mz.load(short, path)
        finally:
            loading._allocated_shard = shard_way
        allocated = loading._allocated
        loading._allocated = general_way_only
        try:
            general = built(kind)
            general_report = mz.load(general, path)
        finally:
            loading._allocated = allocated
        short_facts, general_facts = facts(short), facts(general)
        result[kind] = {
            "short_way_taken": len(taken), "parameters": len(short_facts),
            "facts_differ": [name for name in short_facts if short_facts[name] != general_facts.get(name)],
            "values_equal": all(torch.equal(a._local_tensor, b._local_tensor)
                                for a, b in zip(short.parameters(), general.parameters())),
            "own_memory": len({p._local_tensor.untyped_storage().data_ptr() for p in short.parameters()})
                          == len(short_facts),
            "reports_equal": (short_report.loaded, short_report.bytes_read, short_report.tied)
                             == (general_report.loaded, general_report.bytes_read, general_report.tied),
            "marked": getattr(next(short.parameters()), "no_decay", None) is True,
        }
    return result


def _torchtitan_reference(mesh, full: dict[str, torch.Tensor]) -> nn.Module:
    """torchtitan's own path: sharded on meta, ``to_empty``, computed buffers made again, ``set_model_state_dict``
    from the full state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from bench.models.transformer import Rotary

    with torch.device("meta"):
        model = torchtitan_2d(_decoder(), mesh)
    model.to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, Rotary):
            module.reset_parameters()
    set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True))  # it swaps the values
    return model


def _decoder() -> nn.Module:
    from bench.models.transformer import DecoderLM
    from conftest import TINY

    return DecoderLM(**TINY, tie_embeddings=False)


class _Collectives:
    """Counts the collectives called while it is entered (a load must call none on an untied model): those of
    ``torch.distributed`` and the c10d ops DTensor's own communication dispatches."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "scatter", "reduce_scatter_tensor",
             "all_to_all_single", "send", "recv", "barrier")

    def __enter__(self) -> "_Collectives":
        from torch.utils._python_dispatch import TorchDispatchMode

        calls: list[str] = []
        self.calls = calls

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("c10d", "_c10d_functional"):
                    calls.append(str(func))
                return func(*args, **(kwargs or {}))

        self.saved = {name: getattr(dist, name) for name in self.NAMES}
        for name, function in self.saved.items():
            def counted(*args, _name=name, _function=function, **kwargs):
                calls.append(_name)
                return _function(*args, **kwargs)
            setattr(dist, name, counted)
        self.mode = Ops()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
        for name, function in self.saved.items():
            setattr(dist, name, function)


def _locals_equal(model: nn.Module, reference: nn.Module) -> dict:
    """Per tensor: the same placements and DTensor spec (mesh, shape, stride, dtype), the same local shard bit
    for bit and in the same strides, the same dtype, requires_grad and parameter marks, a leaf of no autograd
    history, as torch's own path made it."""
    expected = dict(reference.named_parameters())
    result = {}
    for name, param in model.named_parameters():
        other = expected[name]
        result[name] = (type(param) is type(other) and list(param.placements) == list(other.placements)
                        and param._spec == other._spec and param.stride() == other.stride()
                        and param.dtype == other.dtype and param.requires_grad == other.requires_grad
                        and isinstance(param, nn.Parameter) and getattr(param, "_is_param", False)
                        and param.is_leaf and param.grad_fn is None
                        and param.to_local().stride() == other.to_local().stride()
                        and torch.equal(param.to_local(), other.to_local()))
    return result


def _train(model: nn.Module, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.arange(24).view(2, 12) % 96
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def tp_fsdp(folder: str, _mesh) -> dict:
    """torchtitan's 2-D layout on 4 ranks, loaded from safetensors, a torch file and a DCP save, against
    torchtitan's own path; then trained a few steps beside it."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    folder_path = os.path.join(folder, "")
    full = load_file(folder_path + "model.safetensors")
    reference = _torchtitan_reference(mesh, full)
    dcp.save(reference.state_dict(), checkpoint_id=folder_path + "dcp")
    dist.barrier()

    result: dict = {"placements": {n: [repr(p) for p in param.placements] for n, param in reference.named_parameters()}}
    loaded = {}
    for kind, path in (("safetensors", "model.safetensors"), ("torch", "model.pt"), ("dcp", "dcp")):
        model = torchtitan_2d(tiny_skeleton(tie=False), mesh)
        with _Collectives() as collectives:
            report = mz.load(model, folder_path + path, check=True)
        result[kind] = {"equal": _locals_equal(model, reference), "collectives": collectives.calls,
                        "bytes_read": report.bytes_read, "loaded": len(report.loaded),
                        "whole_equal": all(torch.equal(p.full_tensor(), full[n]) for n, p in model.named_parameters())}
        loaded[kind] = model

    with _Collectives() as probe:  # the counter sees DTensor's own communication
        loaded["safetensors"].lm_head.weight.full_tensor()
    result["probe"] = probe.calls

    # torchtitan's DCP path is the same model again.
    by_dcp = torchtitan_2d(tiny_skeleton(tie=False), mesh)
    by_dcp.to_empty(device="cpu")
    state = by_dcp.state_dict()
    dcp.load(state, checkpoint_id=folder_path + "dcp")
    result["dcp_load_equal"] = _locals_equal(by_dcp, reference)

    shares = {}
    for name, param in reference.named_parameters():
        local = param.to_local()
        shares[name] = {"local_bytes": local.numel() * local.element_size(), "shape": list(param.shape),
                        "local_shape": list(local.shape)}
    result["shares"] = shares

    model = loaded["safetensors"]
    result["losses"], result["reference_losses"] = _train(model), _train(reference)
    result["trained_equal"] = _locals_equal(model, reference)
    return result


class OddMLP(nn.Module):
    """Tensor parallel divides its sizes (DTensor's forward needs it to); FSDP2's shards of them are uneven.
    Torch 2.7 refuses uneven FSDP2 over tensor parallel (``fully_shard`` raises): there ``even`` sizes."""

    def __init__(self, even: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(16, 8 if even else 10)
        self.down = nn.Linear(8 if even else 10, 6 if even else 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class UnevenTP(nn.Module):
    """Tensor parallel over 13 rows: DTensor's placements and FSDP2's cut disagree on which rows a rank holds."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 13)
        self.down = nn.Linear(13, 10)


def _fsdp2_cut(whole: torch.Tensor, placements, mesh_shape, coordinate) -> torch.Tensor:
    """What FSDP2 over model parallelism holds on a rank: the model-parallel part (``Shard`` placements, left to
    right), then FSDP2's own chunk of that (the ``_StridedShard`` placement, on its mesh dimension)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    def chunk(tensor: torch.Tensor, mesh_dim: int, dim: int) -> torch.Tensor:
        chunks = list(torch.chunk(tensor, mesh_shape[mesh_dim], dim=dim))
        chunks += [tensor.narrow(dim, 0, 0)] * (mesh_shape[mesh_dim] - len(chunks))
        return chunks[coordinate[mesh_dim]]

    for mesh_dim, placement in enumerate(placements):
        if not placement.is_replicate() and not isinstance(placement, _StridedShard):
            whole = chunk(whole, mesh_dim, placement.dim)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            whole = chunk(whole, mesh_dim, placement.dim)
    return whole


def _train_beside_eager(model: nn.Module, eager: nn.Module, values: dict) -> dict:
    """Two SGD steps of the sharded model and of ``eager`` holding ``values``: the losses, and whether the
    trained tensors agree. Torch 2.7's HSDP averages gradients with an all-reduce gloo cannot run: there
    ``trains`` is False (the lock's torch must train)."""
    eager.load_state_dict(values)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    losses = []
    for net in (eager, model):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            loss = net(x).pow(2).mean()
            try:
                loss.backward()
            except RuntimeError as error:
                if "ReduceOp.AVG with Gloo" not in str(error):
                    raise
                return {"trains": False}
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return {"trains": True, "losses": losses,
            "trained_close": {n: torch.allclose(p.full_tensor(), eager.state_dict()[n], atol=1e-6)
                              for n, p in model.named_parameters()}}


def _hsdp_tp(model: nn.Module, mesh) -> nn.Module:
    """Tensor parallel on ``tp``, then HSDP (replicated over ``dp_replicate``, sharded over ``dp_shard``)."""
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    return model


# Placements that give a rank several boxes: runs of rows, runs of columns, over three mesh dimensions.
HAND_MADE = {  # sizes the split divides: torch 2.7 splits no other
    "w": ((12, 6), "SS0/3 S0 R"),  # rows in two runs
    "v": ((7, 12), "S0 SS1/2 R"),  # columns in two runs: strided reads
    "tied": ((16, 4), "SS0/2 R R"),
    "gate_up": ((3, 8, 4), "SS1/2 R S0"),  # each expert's gate (3 rows) and up (5 rows) cut, a run crossing both
    "fused": ((8, 4), "R SS0/2 R"),  # a run crossing the boundary of the parts (5 and 3 rows)
}


def _placements(text: str) -> list:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    made = []
    for word in text.split():
        if word == "R":
            made.append(Replicate())
        elif word.startswith("SS"):
            dim, split = word[2:].split("/")
            made.append(_StridedShard(int(dim), split_factor=int(split)))
        else:
            made.append(Shard(int(word[1:])))
    return made


def strided_zoo(checkpoint: str, _mesh) -> dict:
    """On 8 ranks (2x2x2): HSDP over tensor parallel on uneven sizes against torchtitan's path, trained a step;
    the same layout recorded and materialized; hand-made placements giving a rank several boxes, with a tie, a
    stacked and a fused tensor, against torch's own distribution of the whole tensors."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from materialize.checkpoint.targets import StackSlot

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    folder = os.path.join(checkpoint, "")
    result: dict = {}

    # HSDP + TP, uneven. torchtitan's path (set_model_state_dict, distribute_tensor) asserts on uneven strided
    # shards, so the local oracle is torch's own split (no communication), and training is compared with eager.
    even = False
    try:
        with torch.device("meta"):
            model = _hsdp_tp(OddMLP(), mesh)
    except NotImplementedError:  # this torch's FSDP2 shards tensor-parallel tensors evenly only
        even = True
        with torch.device("meta"):
            model = _hsdp_tp(OddMLP(even=True), mesh)
    result["even_only"] = even
    path = folder + ("even.safetensors" if even else "odd.safetensors")
    full = load_file(path)
    with _Collectives() as collectives:
        report = mz.load(model, path, check=True)
    local_equal = {n: torch.equal(p.to_local(), distribute_tensor(full[n], mesh, p.placements, src_data_rank=None).to_local())
                   for n, p in model.named_parameters()}
    result["odd"] = {
        "placements": {n: [repr(p) for p in param.placements] for n, param in model.named_parameters()},
        "local_shapes": {n: list(param.to_local().shape) for n, param in model.named_parameters()},
        "collectives": collectives.calls, "bytes_read": report.bytes_read, "local_equal": local_equal,
    }
    hsdp_model, hsdp_values = model, full  # trained last: see the end

    # The same layout over a recorded model, materialized without a checkpoint: eager construction's values.
    torch.manual_seed(5)
    eager = OddMLP(even)
    torch.manual_seed(5)
    recorded = _hsdp_tp(mz.deferred_init(OddMLP, even), mesh)
    mz.materialize(recorded)
    result["odd_materialized"] = {n: torch.equal(p.full_tensor(), eager.state_dict()[n])
                                  for n, p in recorded.named_parameters()}

    # Tensor parallel over a size it does not divide, under HSDP: refused, every such tensor named; the remedy
    # the error gives (load, then shard) works, and FSDP2 cuts the loaded values its way.
    if even:
        result["uneven"] = None  # such a layout cannot be made with this torch
    else:
        with torch.device("meta"):
            uneven = _hsdp_tp(UnevenTP(), mesh)
        before = dict(uneven.named_parameters())
        try:
            mz.load(uneven, folder + "uneven.safetensors")
            result["uneven"] = {"error": None}
        except mz.MaterializeError as error:
            result["uneven"] = {"error": type(error).__name__, "message": str(error), "left_as_was": all(
                p is before[n] and p.to_local().is_meta for n, p in uneven.named_parameters())}
        with torch.device("meta"):
            first_loaded = UnevenTP()
        mz.load(first_loaded, folder + "uneven.safetensors")
        first_loaded = _hsdp_tp(first_loaded, mesh)
        values = load_file(folder + "uneven.safetensors")
        coordinate = mesh.get_coordinate()
        result["uneven"]["loaded_then_sharded"] = {
            name: torch.equal(param.to_local(), _fsdp2_cut(values[name], param.placements, mesh.shape, coordinate))
            for name, param in first_loaded.named_parameters()}

    # Hand-made placements, compared with torch's own split of the whole tensors (full_tensor() fails on some).
    saved = load_file(folder + "zoo.safetensors")
    whole = {
        "w": saved["w"], "v": saved["v"], "tied": saved["a"],
        "gate_up": torch.stack([torch.cat([saved[f"experts.{e}.gate"], saved[f"experts.{e}.up"]]) for e in range(3)]),
        "fused": torch.cat([saved["fused.0.part"], saved["fused.1.part"]]),
    }
    zoo = nn.Module()
    for name, (shape, text) in HAND_MADE.items():
        placements = _placements(text)
        local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
        setattr(zoo, name, nn.Parameter(DTensor.from_local(torch.empty(local_shape, device="meta"), mesh, placements,
                                                            run_check=False, shape=torch.Size(shape),
                                                            stride=torch.empty(shape, device="meta").stride())))
    zoo.a, zoo.b = nn.Module(), nn.Module()
    zoo.a.weight = zoo.b.weight = zoo.tied
    del zoo.tied

    def to_slot(name: str):
        parts = name.split(".")
        if parts[0] == "experts":
            return StackSlot("gate_up", int(parts[1]), ("gate", "up").index(parts[2]))
        if parts[0] == "fused":
            return StackSlot("fused", 0, int(parts[1]), new_dim=False)
        return {"a": "a.weight", "b": "b.weight"}.get(name, name)

    report = mz.load(zoo, folder + "zoo.safetensors", key_map=to_slot, check=True)

    # A DTensor whose local shard is not what its placements say (made by hand, or by a torch that shards
    # otherwise) is refused, not read into the wrong rows.
    odd_one = nn.Module()
    odd_one.w = nn.Parameter(DTensor.from_local(torch.empty(5, 6, device="meta"), mesh, _placements("S0 R R"),
                                                run_check=False, shape=torch.Size((12, 6)), stride=(6, 1)))
    try:
        mz.load(odd_one, folder + "zoo.safetensors", strict=False)
        result["mismatched_local"] = None
    except mz.MaterializeError as error:
        result["mismatched_local"] = str(error)
    params = {"w": zoo.w, "v": zoo.v, "tied": zoo.a.weight, "gate_up": zoo.gate_up, "fused": zoo.fused}
    result["zoo"] = {
        "boxes": {name: len(mz.integrations.sharded.shard_spec(param, name).boxes) for name, param in params.items()},
        "local_equal": {name: torch.equal(param.to_local(),
                                          distribute_tensor(whole[name], mesh, param.placements, src_data_rank=None).to_local())
                        for name, param in params.items()},
        "tied": zoo.a.weight is zoo.b.weight, "bytes_read": report.bytes_read,
    }
    result["odd"].update(_train_beside_eager(hsdp_model, OddMLP(even), hsdp_values))
    return result


def _compare(model: nn.Module, source: nn.Module) -> dict:
    expected = source.state_dict()
    placements, equal = {}, {}
    for name, param in model.named_parameters():
        placements[name] = [repr(p) for p in param.placements] if isinstance(param, DTensor) else None
        equal[name] = torch.equal(param.full_tensor(), expected[name].to(param.dtype))
    return {"placements": placements, "equal": equal}


def recipe_blocks() -> tuple[str, str]:
    """docs/library.md's FSDP2 resume recipe: the block that saves and the block that resumes, as written."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "library.md").read_text()
    blocks = [textwrap.dedent(code) for _, code in re.findall(r"^( *)```python\n(.*?)^\1```", page, flags=re.S | re.M)]
    [save] = [code for code in blocks if "dcp.save(" in code]
    [resume] = [code for code in blocks if "set_optimizer_state_dict(" in code]
    return save, resume


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    model(tokens).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def resume_recipe(folder: str, mesh) -> dict:
    """The recipe run as written: a model trained two AdamW steps under FSDP2, saved by its first block, resumed
    by its second in the same ranks; the resumed optimizer's state against the saved one, shard for shard."""
    save, resume = recipe_blocks()
    os.chdir(folder)
    torch.manual_seed(0)
    model = DecoderLM(**TINY)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens = torch.arange(2 * 11).reshape(2, 11) % TINY["vocab_size"]
    for _ in range(2):
        _train_step(model, optimizer, tokens)
    exec(compile(save, "docs/library.md: the save", "exec"), {"model": model, "optimizer": optimizer})
    given = {"MyModel": DecoderLM, "cfg": dict(TINY)}
    exec(compile(resume, "docs/library.md: the resume", "exec"), given)
    resumed, resumed_optimizer = given["model"], given["optimizer"]

    saved, got = optimizer.state_dict(), resumed_optimizer.state_dict()
    state_equal = saved["state"].keys() == got["state"].keys() and all(
        saved["state"][k].keys() == got["state"][k].keys()
        and all(torch.equal(_local(v), _local(got["state"][k][name])) for name, v in saved["state"][k].items())
        for k in saved["state"])
    result = {"state_equal": state_equal, "param_groups_equal": saved["param_groups"] == got["param_groups"],
              "state_names": sorted({name for entry in got["state"].values() for name in entry}),
              "steps": sorted({float(entry["step"]) for entry in got["state"].values()}),
              "lr": [group["lr"] for group in got["param_groups"]],
              "params_equal": all(torch.equal(_local(a), _local(b)) for a, b in zip(model.parameters(), resumed.parameters())),
              "sharded": all(isinstance(p, DTensor) for p in resumed.parameters())}
    _train_step(model, optimizer, tokens)  # the state dicts above hold the live tensors: read before this
    _train_step(resumed, resumed_optimizer, tokens)
    result["stepped_equal"] = all(torch.equal(_local(a), _local(b)) for a, b in zip(model.parameters(), resumed.parameters()))
    return result


def finish_rank(run, out: str) -> None:
    """Run this rank's scenario, write its result (or its traceback) to ``out``, meet the other ranks, and leave
    without gloo's teardown at exit, which aborts now and then on its own."""
    try:
        result = run()
    except BaseException:
        result = {"crash": traceback.format_exc()}
    with open(out, "w") as handle:
        json.dump(result, handle)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    scenario, checkpoint, store, rank, world, out = sys.argv[1:7]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world))

    def run() -> dict:
        mesh = init_device_mesh("cpu", (int(world),))
        return {"fsdp": fsdp, "fsdp_mixed": fsdp_mixed, "tp": tensor_parallel, "stacked": stacked, "partial": partial,
                "fsdp_own_head": fsdp_own_head, "save_fsdp": save_fsdp, "save_tp": save_tp,
                "fsdp_wrapped": fsdp_wrapped, "fsdp_replayed": fsdp_replayed,
                "tp_materialized": tp_materialized, "tp_fsdp": tp_fsdp,
                "strided_zoo": strided_zoo, "resume_recipe": resume_recipe,
                "short_way": short_way}[scenario](checkpoint, mesh)

    finish_rank(run, out)


if __name__ == "__main__":
    main()
