"""Model specs (callable, module:callable, TOML), build, load_model, and the checkpoint writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


# timm and torchvision are not installed here: timm imports torchvision, whose wheels reachable from this
# machine are CUDA builds that fail to import on the CPU torch ("operator torchvision::nms does not exist").
# So the shorthands' plumbing runs against stand-in packages of the same interface (create_model / get_model,
# is_model / list_models), and the comparison with the real libraries runs where they import.
_STAND_IN_TIMM = '''
import torch
from torch import nn
asked = []
def is_model(name):
    return name == "tinynet"
def create_model(name, pretrained=True, num_classes=1000, **kwargs):
    asked.append(pretrained)
    if pretrained:
        raise OSError(5, "Input/output error: would download weights")
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(num_classes))
'''
_STAND_IN_TORCHVISION = '''
import torch
from torch import nn
def list_models():
    return ["tinynet"]
def get_model(name, weights="DEFAULT", num_classes=1000):
    if weights is not None:
        raise OSError(5, "Input/output error: would download weights")
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, num_classes))
'''


@pytest.fixture
def stand_in_families(tmp_path, monkeypatch):
    (tmp_path / "timm.py").write_text(_STAND_IN_TIMM)
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text("")
    (tmp_path / "torchvision" / "models.py").write_text(_STAND_IN_TORCHVISION)
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ("timm", "torchvision", "torchvision.models")
    before = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    yield tmp_path
    for name in names:  # the stand-ins go; whatever was imported before comes back
        sys.modules.pop(name, None)
    sys.modules.update(before)


@pytest.mark.parametrize("family", ["timm", "torchvision"])
def test_a_family_shorthand_builds_its_model_without_weights_and_passes_model_args(stand_in_families, tmp_path, family):
    import importlib

    module = importlib.import_module("timm" if family == "timm" else "torchvision.models")
    make = (lambda: module.create_model("tinynet", pretrained=False, num_classes=10)) if family == "timm" else \
        (lambda: module.get_model("tinynet", weights=None, num_classes=10))
    eager = make()
    if family == "timm":
        eager(torch.zeros(1, 3, 6, 6))  # sizes its lazy layer
    torch.save(eager.state_dict(), tmp_path / "trained.pt")

    model = mz.build(f"{family}:tinynet", num_classes=10)
    report = mz.load(model, tmp_path / "trained.pt")

    assert report.missing == [] and report.unexpected == []
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in eager.state_dict().items()}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in eager.state_dict().items())
    with pytest.raises(mz.ModelSpecUsageError, match="has no model 'nosuchnet'"):
        mz.build(f"{family}:nosuchnet")


def test_a_family_shorthand_from_the_cli_takes_model_args(stand_in_families, tmp_path):
    module = __import__("torchvision.models", fromlist=["get_model"])
    torch.save(module.get_model("tinynet", weights=None, num_classes=3).state_dict(), tmp_path / "m.pt")
    env = {**os.environ, "PYTHONPATH": str(stand_in_families)}
    cli = str(Path(sys.executable).parent / "materialize")

    done = subprocess.run([cli, str(tmp_path / "m.pt"), "--model", "torchvision:tinynet", "--model-arg", "num_classes=3",
                           "--json"], capture_output=True, text=True, env=env)
    wrong = subprocess.run([cli, str(tmp_path / "m.pt"), "--model", "torchvision:tinynet"],
                           capture_output=True, text=True, env=env)

    assert done.returncode == 0 and sorted(json.loads(done.stdout)["loaded"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert wrong.returncode == 1 and "--ignore-mismatched-sizes" in wrong.stderr  # 1000 classes against 3


def test_the_real_timm_resnet_through_its_shorthand_equals_the_eager_model(tmp_path):
    timm = pytest.importorskip("timm", reason="timm imports torchvision, which does not import on this CPU torch")
    torch.manual_seed(0)
    eager = timm.create_model("resnet18", pretrained=False, num_classes=7).eval()
    torch.save(eager.state_dict(), tmp_path / "resnet18.pt")

    model = mz.build("timm:resnet18", num_classes=7)
    mz.load(model, tmp_path / "resnet18.pt")

    x = torch.randn(1, 3, 64, 64)
    assert torch.equal(model.eval()(x), eager(x))
