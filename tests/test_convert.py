"""convert: any checkpoint to safetensors, bounded memory, all or nothing at the destination."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import materialize as mz
from materialize import conversion as convert_module
from materialize.memory import PeakMemory

from conftest import write_safetensors, write_sharded, write_torch
from test_cli import run_cli
from test_hf import _save, _tiny


def torch_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(6, 4)
    return {
        "embed": base,
        "head": base,  # a tie: one storage, two names
        "rows": base[2:],
        "transposed": base.t(),  # non-contiguous
        "half": torch.randn(5, 3).bfloat16(),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }


def leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_a_torch_file_becomes_one_safetensors_file_with_the_same_values(tmp_path):
    state = torch_state()
    src = write_torch(state, tmp_path / "model.pt")
    dst = tmp_path / "model.safetensors"

    report = mz.convert(src, dst)

    written = load_file(str(dst))  # the format's own reader
    assert set(written) == set(state)
    for name, value in state.items():
        assert written[name].dtype == value.dtype and torch.equal(written[name], value.contiguous()), name
    with safe_open(str(dst), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    assert report.tensors == len(state) and report.files == [str(dst)]
    assert report.bytes_written == sum(v.numel() * v.element_size() for v in state.values())
    assert leftovers(tmp_path, {"model.pt", "model.safetensors"}) == []


def test_a_cast_converts_floating_tensors_only(tmp_path):
    state = torch_state()
    src = write_torch(state, tmp_path / "model.pt")

    mz.convert(src, tmp_path / "out.safetensors", dtype="bf16")

    written = load_file(str(tmp_path / "out.safetensors"))
    for name, value in state.items():
        want = value.bfloat16() if value.is_floating_point() else value
        assert written[name].dtype == want.dtype and torch.equal(written[name], want.contiguous()), name


def test_a_folder_output_is_sharded_with_an_index_past_the_shard_size(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "BATCH_BYTES", 1000)  # many batches per shard
    torch.manual_seed(1)
    state = {f"layer{i}.weight": torch.randn(40, 10) for i in range(7)}
    src = write_sharded(state, tmp_path / "src", shards=2)

    report = mz.convert(src, tmp_path / "out", shard_size=4000)

    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 4 and shards[0] == "model-00001-of-00004.safetensors"
    assert all((out / s).stat().st_size <= 4000 + 1000 for s in shards)  # data within the limit, plus a header
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in state.values())
    assert sorted(index["weight_map"]) == sorted(state)
    tensors, _ = mz.load_tensors(out)
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name
    assert report.files == [str(out / s) for s in shards]


def test_a_small_folder_output_is_one_model_safetensors(tmp_path):
    src = write_safetensors({"w": torch.ones(3)}, tmp_path / "m.safetensors")

    mz.convert(src, tmp_path / "out")

    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def test_a_hugging_face_bin_folder_becomes_a_safetensors_folder_that_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, inputs = _tiny("gpt2")
    src = _save(model, tmp_path / "bin", as_bin=True, dtype=torch.float32)

    report = mz.convert(src, tmp_path / "st", shard_size="60KB")

    assert "config.json" in report.copied
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "st").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, model.eval()(**inputs).logits)


def test_an_overflowing_cast_fails_naming_the_tensor_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "BATCH_BYTES", 16)  # the bad tensor comes after a batch was written
    src = write_safetensors({"fine": torch.ones(8), "huge": torch.full((4,), 1e6)}, tmp_path / "m.safetensors")

    for dst in (tmp_path / "out.safetensors", tmp_path / "out"):
        with pytest.raises(mz.CastOverflowError) as caught:
            mz.convert(src, dst, dtype="fp16", shard_size=16)
        assert "'huge'" in str(caught.value)
        assert leftovers(tmp_path, {"m.safetensors"}) == []


def test_an_existing_destination_is_refused_unless_overwrite(tmp_path):
    src = write_safetensors({"w": torch.arange(3.0)}, tmp_path / "m.safetensors")
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"precious")

    with pytest.raises(mz.OutputError) as caught:
        mz.convert(src, dst)
    assert str(dst) in str(caught.value) and dst.read_bytes() == b"precious"

    mz.convert(src, dst, overwrite=True)
    assert torch.equal(load_file(str(dst))["w"], torch.arange(3.0))


def test_memory_stays_near_one_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "BATCH_BYTES", 8 * 1024 * 1024)
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(24)}  # 96 MiB of 4 MiB tensors
    src = write_safetensors(state, tmp_path / "m.safetensors")
    del state

    with PeakMemory() as memory:
        mz.convert(src, tmp_path / "out.safetensors")

    assert memory.host_growth < 40 * 1024 * 1024, memory.host_growth  # 8 MiB batches, not 96 MiB


def test_cli_converts_and_reports_json(tmp_path):
    state = torch_state()
    src = write_torch(state, tmp_path / "model.pt")
    dst = tmp_path / "model.safetensors"

    result = run_cli("convert", src, dst, "--json")

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tensors"] == len(state) and report["destination"] == str(dst)
    assert set(load_file(str(dst))) == set(state)


def test_cli_convert_error_is_one_line_and_writes_nothing(tmp_path):
    src = write_safetensors({"huge": torch.full((4,), 1e6)}, tmp_path / "m.safetensors")

    result = run_cli("convert", src, tmp_path / "out.safetensors", "--dtype", "fp16")

    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and "'huge'" in lines[0]
    assert leftovers(tmp_path, {"m.safetensors"}) == []
