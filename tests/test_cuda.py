"""The CUDA path: staged through pinned memory; host memory bounded by the ring, not the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import materialize as mz
from materialize.io.transfer import DEFAULT_SLOT_BYTES, DEFAULT_SLOTS

from conftest import reference_model, saved_state, tiny_skeleton, write_safetensors, write_torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROBE = Path(__file__).with_name("memory_probe.py")


@pytest.mark.parametrize("writer", [write_safetensors, write_torch], ids=["safetensors", "torch"])
@pytest.mark.parametrize("dtype", [None, torch.float16], ids=["keep", "fp16"])
def test_load_to_cuda_matches_the_source(writer, dtype, tmp_path, tokens):
    source = reference_model(tie=True, dtype=torch.bfloat16)
    state = saved_state(source)
    path = writer(state, tmp_path / ("m.safetensors" if writer is write_safetensors else "m.pt"))
    model = tiny_skeleton(tie=True)

    report = mz.load(model, path, device="cuda", dtype=dtype)

    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(t.device.type == "cuda" for t in list(model.parameters()) + list(model.buffers()))
    for name, value in state.items():
        want = value.to(dtype) if dtype is not None else value
        assert torch.equal(model.state_dict()[name].cpu(), want), name
    assert report.peak_device_bytes is not None and report.peak_device_bytes > 0


def test_a_model_built_on_the_gpu_is_filled_there_in_place_by_default(tmp_path):
    source = reference_model()
    path = write_safetensors(saved_state(source), tmp_path / "m.safetensors")
    model = reference_model(seed=1).cuda()
    before = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}

    mz.load(model, path)  # no device: where the model is

    assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == before
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), value), name


@pytest.mark.parametrize("dtype", [None, "fp32"], ids=["keep", "fp32"])
def test_direct_io_to_cuda_matches_the_source(dtype, tmp_path):
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(1000 + 37 * i, dtype=torch.bfloat16) for i in range(5)}
    state["tied"] = state["w0"]
    path = write_torch(state, tmp_path / "m.pt")

    tensors, _ = mz.load_tensors(path, device="cuda", dtype=dtype, direct_io=True, staging_bytes=8 * 1024 * 1024)

    for name, value in state.items():
        want = value.float() if dtype else value
        assert tensors[name].device.type == "cuda"
        assert torch.equal(tensors[name].cpu(), want), name


def test_cuda_load_host_memory_is_bounded_by_the_staging_ring(tmp_path):
    path = tmp_path / "m.safetensors"
    subprocess.run([sys.executable, str(PROBE), "write", str(path)], check=True)

    done = subprocess.run([sys.executable, str(PROBE), "ours", str(path), "auto", "cuda"], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)

    assert result["growth"] <= DEFAULT_SLOT_BYTES * DEFAULT_SLOTS + 128 * 1024 * 1024, result


def test_unavailable_cuda_index_is_a_device_error(tmp_path):
    path = write_safetensors({"w": torch.ones(2)}, tmp_path / "m.safetensors")

    with pytest.raises(mz.DeviceError, match="does not exist"):
        mz.load_tensors(path, device=f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize("dtype", [None, "fp32"], ids=["keep", "fp32"])
def test_stacked_experts_load_to_cuda_into_their_blocks(dtype, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=99, num_local_experts=4, num_experts_per_tok=2)
    source = transformers.MixtralForCausalLM(config).to(torch.bfloat16)
    source.save_pretrained(tmp_path / "moe")

    model, _ = mz.load_model(tmp_path / "moe", device="cuda", dtype=dtype)

    want = source.model.layers[0].mlp.experts
    got = model.model.layers[0].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        value = getattr(got, name)
        assert value.device.type == "cuda"
        expected = getattr(want, name).detach()
        assert torch.equal(value.cpu(), expected.float() if dtype else expected), name


@pytest.mark.parametrize("dtype", [None, torch.float32], ids=["keep", "fp32"])
@pytest.mark.parametrize("differ", [False, True], ids=["copies", "own-head"])
def test_a_tie_saved_as_two_tensors_is_compared_on_the_gpu_as_loaded(dtype, differ, tmp_path, monkeypatch):
    monkeypatch.setattr("materialize.planning.ties.COMPARE_BLOCK_BYTES", 1024)
    state = saved_state(reference_model(tie=True, dtype=torch.bfloat16))
    head = state["model.embed_tokens.weight"].clone()
    if differ:
        head[-1] += 1
    state["lm_head.weight"] = head
    path = write_safetensors(state, tmp_path / "two.safetensors")
    model = tiny_skeleton(tie=True)

    report = mz.load(model, path, device="cuda", dtype=dtype)

    assert (model.lm_head.weight is model.model.embed_tokens.weight) != differ
    assert model.lm_head.weight.device.type == "cuda"
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        want = state[name].to(dtype) if dtype is not None else state[name]
        assert torch.equal(model.state_dict()[name].cpu(), want), name
    assert (report.untied if differ else report.tied) == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert report.bytes_read == sum(t.nbytes for t in state.values())


def test_a_plan_for_a_gpu_without_room_is_an_error_and_a_device_map_within_its_free_memory_fits(tmp_path, monkeypatch):
    from materialize.io import capacity

    path = write_safetensors(saved_state(reference_model()), tmp_path / "m.safetensors")  # about 100 KB
    free = 32 * 1024
    monkeypatch.setattr(capacity, "available_device_bytes", lambda device: free)  # as if the GPU were nearly full

    crowded = mz.plan(tiny_skeleton(), path, device="cuda")
    with pytest.raises(mz.AllocationError) as caught:
        mz.check_memory(crowded)
    budget = {0: free, "cpu": 2**30}
    spread = mz.plan(tiny_skeleton(), path, device_map="auto", max_memory=budget)
    mz.check_memory(spread)  # the way out the error gives, within what the GPU has free: fits
    report = mz.load(tiny_skeleton(), path, device_map="auto", max_memory=budget)

    assert "device_map='auto' (CLI: --device-map auto)" in str(caught.value)
    assert all(memory["fits"] is not False for memory in spread.fits.values())
    assert report.bytes_by_device == spread.bytes_by_device


def test_a_recorded_lazy_module_is_materialized_on_the_gpu_still_lazy():
    # .to(device) of an uninitialized parameter gives a plain tensor of shape (0,): it must stay lazy there.
    from torch import nn

    model = mz.deferred_init(lambda: nn.Sequential(nn.LazyLinear(3), nn.Linear(3, 2)))
    mz.materialize(model, device="cuda")

    assert isinstance(model[0].weight, nn.parameter.UninitializedParameter)
    assert model[0].weight.device.type == "cuda" and model[1].weight.device.type == "cuda"
    out = model(torch.randn(2, 5, device="cuda"))  # the first forward shapes it, on the GPU
    assert out.shape == (2, 2) and model[0].weight.shape == (3, 5)
