"""A training checkpoint holding more than one copy of the model's state (an EMA beside the trained weights) is
refused naming each copy, and ``state_dict_key`` (CLI: ``--state-dict-key``) picks one.

timm's train script is the case in point: its ``CheckpointSaver`` writes the trained weights under
``state_dict`` (``module.``-prefixed where the model was wrapped for data parallelism) and the EMA's under
``state_dict_ema``, and timm's own ``load_checkpoint`` takes the EMA by default. Each pick is compared with
what timm's ``load_checkpoint`` makes of the same file into an eager model (``test_differential``'s
``compare_models``: values, dtypes, strides, classes, ``requires_grad``, ties). The rule for what counts as a
copy is tried on the layouts of other training scripts, built here with small torch models.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch as sft
import torch
from torch import nn

import materialize as mz
from test_differential import compare_models
from vision import import_torchvision, pythonpath_with_shim
import preforked

CLI = str(Path(sys.executable).parent / "materialize")


# --------------------------------------------------------------------------------------------------
# timm's training checkpoint, written by timm's own CheckpointSaver
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def timm():
    if import_torchvision() is None:
        pytest.skip("torchvision is not installed (make test-oldest's venvs)")
    return pytest.importorskip("timm", reason="timm is not installed (make test-oldest's venvs)")


@pytest.fixture(scope="module")
def timm_checkpoint(timm, tmp_path_factory) -> Path:
    """``last.pth.tar`` of a resnet18 trained a few steps with an EMA, as timm's train script saves it: the
    model wrapped for data parallelism (its names saved with ``module.``), the EMA's unwrapped, the optimizer's
    momentum, the arguments as an ``argparse.Namespace``, the epoch, the metric and the saver's bookkeeping."""
    from timm.utils import CheckpointSaver, ModelEmaV3

    folder = tmp_path_factory.mktemp("timm-train")
    torch.manual_seed(1)
    model = timm.create_model("resnet18", pretrained=False)
    ema = ModelEmaV3(model, decay=0.5)
    wrapped = nn.DataParallel(model)  # on a CPU it only forwards; its state dict is DDP's, names under module.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        wrapped(torch.randn(4, 3, 32, 32)).square().mean().backward()
        optimizer.step()
        ema.update(model)
    saver = CheckpointSaver(wrapped, optimizer, args=argparse.Namespace(model="resnet18", lr=0.5), model_ema=ema,
                            checkpoint_dir=str(folder),
                            unwrap_fn=lambda m: m.module if isinstance(m, ModelEmaV3) else m)
    saver.save_checkpoint(epoch=3, metric=0.25)
    path = folder / "last.pth.tar"
    saved = torch.load(path, weights_only=False)
    assert set(saved) >= {"epoch", "arch", "state_dict", "state_dict_ema", "optimizer", "version", "args", "metric"}
    assert all(name.startswith("module.") for name in saved["state_dict"])
    assert not any(name.startswith("module.") for name in saved["state_dict_ema"])
    # The two copies differ: a load of the wrong one cannot pass for the right one.
    assert not torch.equal(saved["state_dict"]["module.fc.weight"], saved["state_dict_ema"]["fc.weight"])
    return path


def timm_reference(timm, path: Path, *, use_ema: bool) -> nn.Module:
    """An eager resnet18 that took ``path`` through timm's own load_checkpoint."""
    from timm.models import load_checkpoint

    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False)
    load_checkpoint(model, str(path), use_ema=use_ema)
    return model


def library_picks(message: str) -> list[str]:
    """The entries a refusal offers, in the library's spelling (``state_dict_key='...'``)."""
    return [ast.literal_eval(literal) for literal in re.findall(r"state_dict_key=('[^']*')", message)]


def test_a_timm_training_checkpoint_with_an_ema_is_refused_naming_each_copy_and_how_to_pick(timm, timm_checkpoint):
    with pytest.raises(mz.StateDictKeyError) as caught:
        mz.load(mz.build("timm:resnet18"), timm_checkpoint)
    message = str(caught.value)

    assert message.startswith(f"{timm_checkpoint}: holds 2 state dicts of one model: ") and "\n" not in message
    assert "'state_dict' (122 tensors), 'state_dict_ema' (122 tensors)" in message
    assert library_picks(message) == ["state_dict", "state_dict_ema"]
    assert "--state-dict-key state_dict" in message and "--state-dict-key state_dict_ema" in message
    # Every way in opens the file the same way, and refuses it the same way.
    for attempt in (lambda: mz.open_checkpoint(timm_checkpoint),
                    lambda: mz.plan(mz.build("timm:resnet18"), timm_checkpoint),
                    lambda: mz.load_model(timm_checkpoint, model="timm:resnet18"),
                    lambda: mz.load_tensors(timm_checkpoint),
                    lambda: mz.convert(timm_checkpoint, timm_checkpoint.parent / "out.safetensors")):
        with pytest.raises(mz.StateDictKeyError, match="holds 2 state dicts of one model"):
            attempt()
    assert not (timm_checkpoint.parent / "out.safetensors").exists()


@pytest.mark.parametrize("use_ema", [True, False], ids=["ema", "trained"])
def test_the_pick_the_refusal_offers_loads_what_timms_load_checkpoint_loads(timm, timm_checkpoint, use_ema):
    with pytest.raises(mz.StateDictKeyError) as caught:
        mz.load(mz.build("timm:resnet18"), timm_checkpoint)
    key = "state_dict_ema" if use_ema else "state_dict"
    assert key in library_picks(str(caught.value))
    model = mz.build("timm:resnet18")

    report = mz.load(model, timm_checkpoint, state_dict_key=key)

    assert compare_models(model, timm_reference(timm, timm_checkpoint, use_ema=use_ema)) == []
    assert report.state_dict_key == key and report.to_dict()["state_dict_key"] == key
    assert f"entry '{key}' of the saved dict" in str(report)
    assert len(report.loaded) == 122 and report.missing == report.unexpected == []
    assert report.key_map == ("" if use_ema else "strip 'module.'")  # DDP's prefix, as timm's clean_state_dict


def test_every_way_in_takes_the_key(timm, timm_checkpoint, tmp_path):
    reference = timm_reference(timm, timm_checkpoint, use_ema=True).state_dict()

    model, report = mz.load_model(timm_checkpoint, model="timm:resnet18", state_dict_key="state_dict_ema")
    plan = mz.plan(mz.build("timm:resnet18"), timm_checkpoint, state_dict_key="state_dict_ema")
    tensors, _ = mz.load_tensors(timm_checkpoint, state_dict_key="state_dict_ema")
    converted = mz.convert(timm_checkpoint, tmp_path / "ema.safetensors", state_dict_key="state_dict_ema")
    with mz.open_checkpoint(timm_checkpoint, state_dict_key="state_dict_ema") as ckpt:
        loaded_into = mz.build("timm:resnet18")
        mz.load(loaded_into, ckpt, state_dict_key="state_dict_ema")  # the key it was opened with: agreed
        with pytest.raises(mz.StateDictKeyError, match="opened with its tensors taken from entry 'state_dict_ema'"):
            mz.load(mz.build("timm:resnet18"), ckpt, state_dict_key="state_dict")

    assert report.state_dict_key == plan.state_dict_key == converted.state_dict_key == "state_dict_ema"
    assert plan.to_dict()["state_dict_key"] == "state_dict_ema" and plan.missing == plan.unexpected == []
    for got in (model.state_dict(), loaded_into.state_dict(), tensors, sft.load_file(tmp_path / "ema.safetensors")):
        assert got.keys() == reference.keys()
        assert all(torch.equal(got[name], value) for name, value in reference.items())


def cli(*args: object, env: dict) -> subprocess.CompletedProcess:
    return preforked.run([CLI, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def test_the_cli_refuses_in_one_line_and_the_flag_it_offers_loads_each_copy(timm, timm_checkpoint, tmp_path):
    env = pythonpath_with_shim(tmp_path)
    spec = ["--model", "timm:resnet18"]

    refused = cli(timm_checkpoint, *spec, env=env)

    assert refused.returncode == 1 and refused.stdout == ""
    line = refused.stderr.strip()
    assert "\n" not in line and line.startswith(f"Error: {timm_checkpoint}: holds 2 state dicts of one model")
    offered = re.findall(r"\(CLI: (--state-dict-key [^)]*)\)", line)
    assert offered == ["--state-dict-key state_dict", "--state-dict-key state_dict_ema"]
    for flag, use_ema in zip(offered, (False, True)):
        key = shlex.split(flag)[1]
        done = cli(timm_checkpoint, *spec, *shlex.split(flag), "--json", env=env)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["state_dict_key"] == key and len(report["loaded"]) == 122
        assert report["missing"] == report["unexpected"] == []
        # What the CLI took is timm's pick, value for value: written out by convert with the same flag.
        out = tmp_path / f"{key}.safetensors"
        converted = cli("convert", timm_checkpoint, out, *shlex.split(flag), env=env)
        assert converted.returncode == 0, converted.stderr
        written = {name.removeprefix("module."): tensor for name, tensor in sft.load_file(out).items()}
        reference = timm_reference(timm, timm_checkpoint, use_ema=use_ema).state_dict()
        assert written.keys() == reference.keys()
        assert all(torch.equal(written[name], value) for name, value in reference.items())
    planned = cli("plan", timm_checkpoint, *spec, "--state-dict-key", "state_dict_ema", env=env)
    inspected = cli("inspect", timm_checkpoint, "--state-dict-key", "state_dict_ema", env=env)
    assert planned.returncode == 0 and "(entry 'state_dict_ema')" in planned.stdout.splitlines()[0]
    assert inspected.returncode == 0 and "state dict: entry 'state_dict_ema' of the saved dict" in inspected.stdout


def test_a_key_the_file_does_not_hold_is_refused_naming_those_it_does(timm_checkpoint, tmp_path):
    with pytest.raises(mz.StateDictKeyError) as caught:
        mz.open_checkpoint(timm_checkpoint, state_dict_key="model_ema")

    assert str(caught.value) == (
        f"{timm_checkpoint}: has no entry 'model_ema' holding tensors (state_dict_key='model_ema'); its entries "
        "holding tensors are 'state_dict' (122 tensors), 'state_dict_ema' (122 tensors)")  # not the optimizer's
    refused = cli(timm_checkpoint, "--state-dict-key", "model_ema", env=pythonpath_with_shim(tmp_path))
    assert refused.returncode == 1 and "has no entry 'model_ema'" in refused.stderr
    assert "materialize inspect" not in refused.stderr  # inspect would refuse it the same way


def test_a_training_checkpoint_of_one_model_state_loads_as_before_and_says_where_from(timm, tmp_path):
    torch.manual_seed(2)
    trained = timm.create_model("resnet18", pretrained=False)
    optimizer = torch.optim.Adam(trained.parameters())
    trained(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    path = tmp_path / "model_best.pth.tar"
    torch.save({"epoch": 9, "arch": "resnet18", "state_dict": trained.state_dict(), "optimizer": optimizer.state_dict(),
                "version": 2, "args": argparse.Namespace(model="resnet18"), "metric": 71.5}, path)
    model = mz.build("timm:resnet18")

    report = mz.load(model, path)

    assert compare_models(model, timm_reference(timm, path, use_ema=True)) == []  # no EMA: timm takes state_dict
    assert report.state_dict_key == "state_dict"


# --------------------------------------------------------------------------------------------------
# The rule: another entry holding the same model's tensors is another copy; anything else is not
# --------------------------------------------------------------------------------------------------


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1))


def saved(tmp_path: Path, obj: object, name: str = "ckpt.pt", **options) -> Path:
    torch.save(obj, tmp_path / name, **options)
    return tmp_path / name


def refused_keys(path: Path) -> list[str]:
    with pytest.raises(mz.StateDictKeyError) as caught:
        mz.open_checkpoint(path)
    return library_picks(str(caught.value))


def adam_state(model: nn.Module) -> dict:
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 3, 8, 8)).sum().backward()
    optimizer.step()
    return optimizer.state_dict()


@pytest.mark.parametrize("layout, copies", [
    ("deit", ["model", "model_ema"]),  # DeiT's main.py
    ("dit", ["model", "ema"]),  # DiT's train.py: its optimizer under "opt", a name training state does not list
    ("parameters-only ema", ["state_dict", "ema_params"]),  # an EMA of the parameters, not the statistics
    ("compiled ddp", ["model", "swa_model"]),  # torch.compile(DDP(model))'s names beside an average's
])
def test_other_training_scripts_copies_are_found_and_each_loads_when_named(tmp_path, layout, copies):
    trained, averaged = net(1), net(2)
    if layout == "deit":
        obj = {"model": trained.state_dict(), "optimizer": adam_state(trained), "lr_scheduler": {"last_epoch": 3},
               "epoch": 3, "model_ema": averaged.state_dict(), "scaler": {}, "args": argparse.Namespace(lr=1)}
    elif layout == "dit":
        obj = {"model": trained.state_dict(), "ema": averaged.state_dict(), "opt": adam_state(trained),
               "args": argparse.Namespace(model="DiT-XL/2")}
    elif layout == "parameters-only ema":
        obj = {"state_dict": trained.state_dict(), "ema_params": dict(averaged.named_parameters()), "step": 10}
    else:
        obj = {"model": {f"_orig_mod.module.{k}": v for k, v in trained.state_dict().items()},
               "swa_model": averaged.state_dict()}
    path = saved(tmp_path, obj)

    assert refused_keys(path) == copies
    for key, source in zip(copies, (trained, averaged)):
        model = net(0)
        report = mz.load(model, path, state_dict_key=key, strict=key != "ema_params")
        expected = dict(source.named_parameters()) if key == "ema_params" else source.state_dict()
        assert report.state_dict_key == key
        assert all(torch.equal(model.state_dict()[name], value) for name, value in expected.items())


def test_an_entry_holding_another_network_is_no_copy_and_the_model_state_loads_as_before(tmp_path):
    generator = net(1)
    torch.manual_seed(3)
    discriminator = nn.Sequential(nn.Conv2d(3, 16, 5), nn.ReLU(), nn.Linear(16, 1))
    path = saved(tmp_path, {"model": generator.state_dict(), "discriminator": discriminator.state_dict(),
                            "opt": adam_state(generator), "loss": {"center": torch.zeros(1, 4)}})
    model = net(0)

    report = mz.load(model, path)

    assert report.state_dict_key == "model"
    assert all(torch.equal(model.state_dict()[name], value) for name, value in generator.state_dict().items())


def test_without_a_state_dict_key_entries_of_one_shape_are_submodules_and_nothing_is_picked(tmp_path):
    # {"encoder": ..., "decoder": ...} of twin networks is one model's state, as state_dict() names submodules.
    twins = nn.ModuleDict({"encoder": net(1), "decoder": net(2)})
    path = saved(tmp_path, {"encoder": twins["encoder"].state_dict(), "decoder": twins["decoder"].state_dict()})
    model = nn.ModuleDict({"encoder": net(0), "decoder": net(0)})

    report = mz.load(model, path)

    assert report.state_dict_key is None
    assert all(torch.equal(model.state_dict()[name], value) for name, value in twins.state_dict().items())


def test_pickled_modules_side_by_side_are_copies_too(tmp_path):
    # YOLOv5's last.pt: the model and its EMA pickled whole; read through stand-ins, no class imported.
    trained, averaged = net(1), net(2)
    path = saved(tmp_path, {"epoch": 5, "model": trained, "ema": averaged, "updates": 40})

    assert refused_keys(path) == ["model", "ema"]
    model = net(0)
    mz.load(model, path, state_dict_key="ema")
    assert all(torch.equal(model.state_dict()[name], value) for name, value in averaged.state_dict().items())


def test_a_legacy_torch_file_is_read_the_same_way(tmp_path):
    trained, averaged = net(1), net(2)
    path = saved(tmp_path, {"state_dict": trained.state_dict(), "state_dict_ema": averaged.state_dict()},
                 _use_new_zipfile_serialization=False)

    assert refused_keys(path) == ["state_dict", "state_dict_ema"]
    model = net(0)
    mz.load(model, path, state_dict_key="state_dict_ema")
    assert all(torch.equal(model.state_dict()[name], value) for name, value in averaged.state_dict().items())


@pytest.mark.filterwarnings("ignore::UserWarning")  # a single-process DCP save warns that no process group exists
def test_a_dcp_save_of_a_model_and_its_ema_is_refused_and_picked_alike(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    trained, averaged = net(1), net(2)
    dcp.save({"model": trained.state_dict(), "model_ema": averaged.state_dict(), "optim": adam_state(trained)},
             checkpoint_id=str(tmp_path / "step-3"))

    assert refused_keys(tmp_path / "step-3") == ["model", "model_ema"]
    for key, source in (("model", trained), ("model_ema", averaged)):
        model = net(0)
        assert mz.load(model, tmp_path / "step-3", state_dict_key=key).state_dict_key == key
        assert all(torch.equal(model.state_dict()[name], value) for name, value in source.state_dict().items())
    with pytest.raises(mz.StateDictKeyError, match="has no entry 'ema'.*'model' .*'model_ema' "):
        mz.open_checkpoint(tmp_path / "step-3", state_dict_key="ema")


def test_a_key_for_a_file_without_entries_to_pick_from_is_refused_not_ignored(tmp_path):
    state = net(1).state_dict()
    sft.save_file(state, tmp_path / "m.safetensors")
    flat = saved(tmp_path, state)

    with pytest.raises(mz.StateDictKeyError, match="is safetensors.*leave state_dict_key='model' out"):
        mz.open_checkpoint(tmp_path / "m.safetensors", state_dict_key="model")
    with pytest.raises(mz.StateDictKeyError,
                       match="none of its entries holds a state dict; without state_dict_key the saved object is"):
        mz.open_checkpoint(flat, state_dict_key="model")
    assert mz.open_checkpoint(flat).state_dict_key is None
