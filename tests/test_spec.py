"""Model specs (callable, module:callable, TOML), build, load_model, and the checkpoint writer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import materialize as mz
from bench.writer import write_sharded_checkpoint
from bench.models.transformer import DecoderLM

from conftest import TINY, reference_model, saved_state, write_safetensors, write_torch
import preforked

FACTORY = "bench.models.transformer:DecoderLM"


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
        ("bench.models.transformer:Missing", "has no attribute"),
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
    from bench.writer import main

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


# A model defined in a script beside the checkpoint: the form a user without a package reaches for.
USER_MODEL = '''
import torch
from torch import nn

from layers import Scale  # a sibling file, found as running the script would find it

RUNS = []
RUNS.append(1)


class Net(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.scale = Scale(width)
'''
USER_LAYERS = '''
import torch
from torch import nn


class Scale(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
'''


def _user_project(folder: Path) -> dict[str, torch.Tensor]:
    """model.py and its sibling layers.py in ``folder``, and a checkpoint of Net(width=4) there; its tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(USER_MODEL)
    (folder / "layers.py").write_text(USER_LAYERS)
    state = {"proj.weight": torch.randn(4, 4), "proj.bias": torch.randn(4), "scale.weight": torch.randn(4)}
    write_safetensors(state, folder / "net.safetensors")
    return state


def _cli(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).parent / "materialize"
    return preforked.run([str(cli), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_a_model_in_a_python_file_loads_through_the_cli_from_its_own_folder(tmp_path):
    project = tmp_path / "project"
    state = _user_project(project)

    done = _cli("net.safetensors", "--model", "model.py:Net", "--json", cwd=project)

    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)["loaded"]) == set(state)


def test_a_toml_names_its_factory_file_relative_to_itself_whatever_the_working_directory(tmp_path):
    project = tmp_path / "project"
    state = _user_project(project)
    config = tmp_path / "configs" / "net.toml"
    config.parent.mkdir()
    config.write_text('[model]\nfactory = "../project/model.py:Net"\n\n[model.args]\nwidth = 4\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    done = _cli(project / "net.safetensors", "--model", config, "--json", cwd=elsewhere)

    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)["loaded"]) == set(state)


def test_a_model_file_loads_as_eager_construction_and_load_state_dict_make_it(tmp_path, monkeypatch):
    project = tmp_path / "project"
    state = _user_project(project)
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))  # for the eager side's own import of the script
    import importlib

    eager = importlib.import_module("model").Net()
    eager.load_state_dict(state)

    model = mz.build("model.py:Net")
    mz.load(model, project / "net.safetensors")

    assert type(model) is type(eager)  # the file already imported is not run again
    for (name, ours), (_, theirs) in zip(model.state_dict(keep_vars=True).items(), eager.state_dict(keep_vars=True).items()):
        assert type(ours) is type(theirs) and ours.requires_grad == theirs.requires_grad, name
        assert ours.dtype == theirs.dtype and ours.stride() == theirs.stride() and torch.equal(ours, theirs), name
    assert importlib.import_module("model").RUNS == [1]


def test_a_module_that_is_a_file_here_is_named_as_the_file_by_the_error_and_that_works(tmp_path):
    project = tmp_path / "project"
    state = _user_project(project)

    refused = _cli("net.safetensors", "--model", "model:Net", cwd=project)  # a console script: cwd not on the path
    hint = refused.stderr.strip().splitlines()[-1]
    offered = hint.split("name it as the file, ")[1].strip("'")
    done = _cli("net.safetensors", "--model", offered, "--json", cwd=project)

    assert refused.returncode == 2 and hint.startswith("Error: model spec 'model:Net'"), refused.stderr  # a usage error
    assert offered == "model.py:Net"
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)["loaded"]) == set(state)


@pytest.mark.parametrize(
    "source, message, code",
    [
        (None, "no such file", 2),
        ("raise RuntimeError('needs a GPU to build')\n", "the file failed to run: RuntimeError: needs a GPU to build", 1),
        ("def oops(:\n", "the file failed to run: SyntaxError", 1),
    ],
)
def test_a_model_file_that_is_missing_or_fails_is_one_line_naming_it(tmp_path, source, message, code):
    if source is not None:
        (tmp_path / "model.py").write_text(source)
    write_safetensors({"w": torch.ones(2)}, tmp_path / "m.safetensors")

    done = _cli("m.safetensors", "--model", "model.py:Net", cwd=tmp_path)

    error = done.stderr.strip().splitlines()[-1]  # a usage error (2) comes after click's usage lines
    assert done.returncode == code and message in error and "model.py" in error, done.stderr
    assert code == 2 or len(done.stderr.strip().splitlines()) == 1, done.stderr
