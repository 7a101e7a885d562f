"""Model specs (callable, module:callable, TOML), build, load_model, and the checkpoint writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import materialize as mz
from materialize.fixtures import write_sharded_checkpoint
from materialize.models.transformer import DecoderLM

from conftest import TINY, reference_model, saved_state, write_safetensors, write_torch

FACTORY = "materialize.models.transformer:DecoderLM"


def _toml(tmp_path, args: dict) -> str:
    lines = ["[model]", f'factory = "{FACTORY}"', "", "[model.args]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in args.items()]
    path = tmp_path / "model.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("form", ["callable", "string", "toml"])
def test_build_makes_a_meta_skeleton_from_every_spec_form(form, tmp_path):
    spec = {"callable": DecoderLM, "string": FACTORY, "toml": _toml(tmp_path, TINY)}[form]
    kwargs = {} if form == "toml" else TINY

    model = mz.build(spec, **kwargs)

    assert isinstance(model, DecoderLM)
    assert model.model.embed_tokens.weight.shape == (TINY["vocab_size"], TINY["hidden_size"])
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.model.layers[0].self_attn.rotary.inv_freq.device.type == "cpu"


def test_keyword_arguments_override_the_config(tmp_path):
    model = mz.build(_toml(tmp_path, TINY), num_layers=1)

    assert len(model.model.layers) == 1


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon_here", "package.module:callable"),
        ("not_a_module_xyz:Thing", "cannot import"),
        ("materialize.models.transformer:Missing", "has no attribute"),
    ],
)
def test_bad_specs_raise_model_spec_error(spec, message):
    with pytest.raises(mz.ModelSpecError, match=message):
        mz.build(spec)


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[model\nfactory=")

    with pytest.raises(mz.ModelSpecError, match="broken.toml"):
        mz.build(str(path))


def test_load_model_builds_and_loads_in_one_call(tmp_path):
    state = saved_state(reference_model())
    path = write_safetensors(state, tmp_path / "m.safetensors")

    model, report = mz.load_model(path, model=FACTORY, model_args=TINY, dtype="bf16")

    assert torch.equal(model.model.norm.weight, state["model.norm.weight"].bfloat16())
    assert report.dtypes["bfloat16"] == len(state)


def test_load_model_without_a_model_returns_the_tensors(tmp_path):
    state = {"a": torch.randn(3, 2), "b": torch.arange(5)}
    path = write_torch(state, tmp_path / "m.pt")

    tensors, report = mz.load_model(path)

    assert set(tensors) == {"a", "b"} and torch.equal(tensors["a"], state["a"])
    assert report.loaded == ["a", "b"]


def test_writer_produces_a_loadable_sharded_checkpoint(tmp_path):
    out = write_sharded_checkpoint(FACTORY, tmp_path / "ckpt", dtype="bf16", shard_size=20_000, model_args=dict(TINY, tie_embeddings=True))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    written = {}
    for shard in shards:
        written.update(load_file(str(out / shard)))

    model, report = mz.load_model(out, model=FACTORY, model_args=dict(TINY, tie_embeddings=True))

    assert len(shards) > 1
    assert "lm_head.weight" not in written  # tied: saved once
    assert not any("inv_freq" in name for name in written)
    for name, value in written.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(model.get_parameter(name), value), name
    assert report.tied == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert not list(tmp_path.glob(".ckpt.*"))  # no staging folder left behind


def test_the_demo_writer_rebuilds_only_when_its_config_changes(tmp_path, capsys):
    from materialize.fixtures import main

    config = _toml(tmp_path, TINY)
    out = tmp_path / "demo"

    main([config, str(out)])
    main([config, str(out)])
    Path(config).write_text(Path(config).read_text().replace('"num_layers" = 2', "").replace("num_layers = 2", "num_layers = 1"))
    main([config, str(out)])

    lines = capsys.readouterr().out.splitlines()
    assert "wrote" in lines[0] and "already built" in lines[1] and "wrote" in lines[2]
    assert len(mz.load_model(out, model=config)[0].model.layers) == 1


@pytest.mark.parametrize("config, weights", [
    ({"architecture": "resnet50", "num_classes": 10, "pretrained_cfg": {"input_size": [3, 224, 224]}}, "model.safetensors"),
    ({"_class_name": "UNet2DConditionModel", "_diffusers_version": "0.30.0"}, "diffusion_pytorch_model.safetensors"),
], ids=["timm", "diffusers"])
def test_a_folder_whose_config_json_is_not_transformers_loads_as_its_tensors(config, weights, tmp_path):
    state = saved_state(reference_model(tie=False))
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    write_safetensors(state, folder / weights)

    tensors, report = mz.load_model(folder)

    assert set(tensors) == set(state) and sorted(report.loaded) == sorted(state)
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name
    with pytest.raises(mz.ModelSpecError, match=r"config.json.*names no model_type or architectures.*--model SPEC"):
        mz.load_model(folder, model="hf:AutoModel")
