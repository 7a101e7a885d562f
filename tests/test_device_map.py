"""Device maps: each tensor allocated on its device, disk tensors left mapped in the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import materialize as mz

from conftest import DECODER_SPEC, TINY, reference_model, saved_state, tiny_skeleton, write_safetensors
import preforked

CLI = str(Path(sys.executable).parent / "materialize")
SPLIT = {"model.embed_tokens": "disk", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "disk"}


def test_cpu_and_disk_split_gives_the_same_forward_as_all_cpu(tmp_path, tokens):
    source = reference_model(dtype=torch.bfloat16)
    path = write_safetensors(saved_state(source), tmp_path / "m.safetensors")
    model = tiny_skeleton()

    report = mz.load(model, path, device_map=SPLIT)

    disk_names = [n for n in saved_state(source) if n.startswith(("model.embed_tokens", "model.layers.0.", "lm_head"))]
    assert sorted(report.mapped) == sorted(disk_names)
    assert set(report.bytes_by_device) == {"cpu", "disk"}
    with torch.no_grad():
        assert torch.equal(model(tokens), source(tokens))


def test_auto_device_map_offloads_what_does_not_fit_to_disk(tmp_path, tokens):
    source = reference_model()
    path = write_safetensors(saved_state(source), tmp_path / "m.safetensors")
    model = tiny_skeleton()
    budget = {"cpu": 20_000}  # far less than the model: the rest goes to disk

    plan = mz.plan(model, path, device_map="sequential", max_memory=budget)
    report = mz.load(model, path, device_map="sequential", max_memory=budget)

    assert plan.bytes_by_device.get("disk", 0) > 0
    assert report.bytes_by_device == plan.bytes_by_device
    with torch.no_grad():
        assert torch.equal(model(tokens), source(tokens))


def test_disk_tensors_cannot_be_cast(tmp_path):
    path = write_safetensors(saved_state(reference_model(dtype=torch.bfloat16)), tmp_path / "m.safetensors")

    with pytest.raises(mz.DeviceError, match="on disk .* cannot be cast"):
        mz.load(tiny_skeleton(), path, device_map={"": "disk"}, dtype="fp32")


def test_a_device_map_that_misses_a_module_names_the_tensor(tmp_path):
    path = write_safetensors(saved_state(reference_model()), tmp_path / "m.safetensors")

    with pytest.raises(mz.DeviceError, match="lm_head.weight"):
        mz.load(tiny_skeleton(), path, device_map={"model": "cpu"})


def test_cli_plan_shows_bytes_per_device_for_a_device_map(tmp_path):
    path = write_safetensors(saved_state(reference_model()), tmp_path / "m.safetensors")
    args = [f"--model-arg={k}={json.dumps(v)}" for k, v in TINY.items()]

    done = preforked.run(
        [CLI, "plan", str(path), "--model", DECODER_SPEC, *args,
         "--device-map", json.dumps({"model": "cpu", "lm_head": "disk"}), "--json"],
        capture_output=True, text=True,
    )

    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    lm_head = TINY["vocab_size"] * TINY["hidden_size"] * 4
    assert summary["bytes_by_device"]["disk"] == lm_head


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_and_cpu_split_is_dispatched_and_runs(tmp_path, tokens):
    source = reference_model()
    path = write_safetensors(saved_state(source), tmp_path / "m.safetensors")
    model = tiny_skeleton()

    mz.load(model, path, device_map={"model.embed_tokens": 0, "model.layers": 0, "model.norm": "cpu", "lm_head": "disk"})

    assert model.model.layers[0].mlp.up_proj.weight.device.type == "cuda"
    with torch.no_grad():
        assert torch.allclose(model(tokens.cuda()).cpu(), source(tokens), atol=1e-5)


def test_plan_reports_expected_peak_host_memory_and_whether_it_fits(tmp_path):
    state = saved_state(reference_model(dtype=torch.bfloat16))
    path = write_safetensors(state, tmp_path / "m.safetensors")
    loaded = sum(t.numel() * t.element_size() for t in state.values())

    copy = mz.plan(tiny_skeleton(), path).fits["cpu"]
    mapped = mz.plan(tiny_skeleton(), path, mmap=True).fits["cpu"]
    cast = mz.plan(tiny_skeleton(), path, mmap=True, dtype="fp32").fits["cpu"]

    assert copy["needed"] >= loaded and copy["fits"] is True
    assert mapped["needed"] < loaded
    assert cast["needed"] >= 2 * loaded  # a cast cannot stay mapped


def test_plan_says_when_a_model_does_not_fit(tmp_path):
    path = write_safetensors({"model.norm.weight": torch.ones(16384)}, tmp_path / "m.safetensors")  # the rest: init
    # About 3 TB in fp32 on meta: planning allocates nothing, so this costs nothing.
    huge = mz.build("bench.models.transformer:DecoderLM", vocab_size=32000, hidden_size=16384,
                    num_layers=256, num_heads=128, intermediate_size=65536)

    with pytest.warns(mz.MostlyInitializedWarning):
        memory = mz.plan(huge, path, strict=False).to_dict()["memory"]["cpu"]

    assert memory["needed"] > 10**12
    assert memory["fits"] is False
