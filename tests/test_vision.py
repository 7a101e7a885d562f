"""timm and torchvision models, the libraries' own, through the ``timm:NAME`` and ``torchvision:NAME`` specs.

Each model is compared with the oracle of ``tests/test_differential.py``: the same model built eagerly that
took the same file with ``load_state_dict`` (values, dtypes, strides, ``requires_grad``, classes, modules'
attributes, a forward pass and a few SGD steps). Both libraries are test dependencies of the locked
environment, installed apart in ``.venv/vision`` and imported through ``tests/vision.py`` (PyPI's
torchvision is a CUDA build whose compiled ops do not load beside the CPU torch; the models never call
them). The venvs of ``make test-oldest`` install neither, and these tests skip there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import materialize as mz
from test_differential import Case, compare_models, differences
from vision import compiled_ops_load, import_torchvision, pythonpath_with_shim, pythonpath_without_shim
import preforked

if import_torchvision() is None:
    pytest.skip("torchvision is not installed (make test-oldest's venvs)", allow_module_level=True)
timm = pytest.importorskip("timm", reason="timm is not installed (make test-oldest's venvs)")
tv_models = pytest.importorskip("torchvision.models")

CLI = str(Path(sys.executable).parent / "materialize")


def images(size: int):
    return lambda g: (torch.randn(2, 3, size, size, generator=g),)


# (family, name, model arguments, input side): small members of each family a new user tried, small
# inputs where the architecture accepts them. Swin's window needs its 224.
TIMM = [
    ("resnet50", {}, 64),
    ("vit_tiny_patch16_224", {"img_size": 64}, 64),
    ("deit_tiny_patch16_224", {"img_size": 64}, 64),
    ("convnext_atto", {}, 64),
    ("efficientnet_b0", {}, 64),
    ("swin_tiny_patch4_window7_224", {}, 224),
    ("regnetx_002", {}, 64),
    ("mobilenetv3_small_050", {}, 64),
]
TORCHVISION = [
    ("resnet50", {}, 64),
    ("mobilenet_v3_small", {}, 64),
    ("efficientnet_b0", {}, 64),
    ("regnet_y_400mf", {}, 64),
    ("convnext_tiny", {}, 64),
]


def factory(family: str, name: str, args: dict):
    if family == "timm":
        return lambda: timm.create_model(name, pretrained=False, **args)
    return lambda: tv_models.get_model(name, weights=None, **args)


@pytest.mark.parametrize("family, name, args, side",
                         [("timm", *case) for case in TIMM] + [("torchvision", *case) for case in TORCHVISION],
                         ids=[f"timm:{c[0]}" for c in TIMM] + [f"torchvision:{c[0]}" for c in TORCHVISION])
def test_a_family_model_loads_as_eager_construction_plus_load_state_dict(family, name, args, side, tmp_path):
    build = factory(family, name, args)
    case = Case(build, tmp_path, "pt", make_input=images(side), variants=False)

    assert differences(case, "meta_init") == []

    # The shorthand builds that same skeleton, under meta_init, without weights.
    torch.manual_seed(0)
    eager = build()
    assert compare_models(mz.build(f"{family}:{name}", **args), eager, metadata_only=True) == []


def test_a_real_model_is_filled_in_place_as_load_state_dict_fills_it(tmp_path):
    case = Case(factory("timm", "resnet50", {}), tmp_path, "safetensors", make_input=images(64), variants=False)

    assert differences(case, "cpu") == []  # object identity and storage included


def test_a_bf16_checkpoint_gives_a_bf16_timm_model_whose_forward_runs(tmp_path):
    # The model built on meta takes the checkpoint's dtype (README: one dtype decision for the model), so the
    # oracle is the eager model cast to bf16 before load_state_dict; the batch-norm statistics follow.
    torch.manual_seed(1)
    trained = timm.create_model("resnet18", pretrained=False).to(torch.bfloat16)
    torch.save(trained.state_dict(), tmp_path / "resnet18-bf16.pth")
    torch.manual_seed(0)
    reference = timm.create_model("resnet18", pretrained=False).to(torch.bfloat16)
    reference.load_state_dict(torch.load(tmp_path / "resnet18-bf16.pth", weights_only=True))

    model = mz.build("timm:resnet18")
    mz.load(model, tmp_path / "resnet18-bf16.pth")

    assert compare_models(model, reference) == []
    assert {t.dtype for t in model.state_dict().values() if t.is_floating_point()} == {torch.bfloat16}
    x = torch.randn(1, 3, 64, 64, dtype=torch.bfloat16)
    assert torch.equal(model.eval()(x), reference.eval()(x))


def cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return preforked.run([CLI, *args], capture_output=True, text=True, env=env, timeout=300)


def test_a_new_head_from_the_cli_is_initialized_by_its_module_and_reported(tmp_path):
    torch.manual_seed(1)
    trained = timm.create_model("resnet18", pretrained=False)
    torch.save(trained.state_dict(), tmp_path / "resnet18.pth")
    env = pythonpath_with_shim(tmp_path)
    spec = ["--model", "timm:resnet18", "--model-arg", "num_classes=10"]

    refused = cli(str(tmp_path / "resnet18.pth"), *spec, env=env)
    done = cli(str(tmp_path / "resnet18.pth"), *spec, "--ignore-mismatched-sizes", "--json", env=env)

    assert refused.returncode == 1 and "fc.weight (model [10, 512], checkpoint [1000, 512])" in refused.stderr
    assert "--ignore-mismatched-sizes" in refused.stderr
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert sorted(report["reinitialized"]) == ["fc.bias", "fc.weight"]
    assert sorted(report["loaded"]) == sorted(k for k in trained.state_dict() if not k.startswith("fc."))

    # The library does the same; the head is nn.Linear's own init (|w| <= 1/sqrt(fan_in)), the rest the file's.
    model = mz.build("timm:resnet18", num_classes=10)
    mz.load(model, tmp_path / "resnet18.pth", ignore_mismatched_sizes=True)
    state = model.state_dict()
    assert state["fc.weight"].shape == (10, 512) and 0 < state["fc.weight"].abs().max() <= 512 ** -0.5
    assert all(torch.equal(state[k], v) for k, v in trained.state_dict().items() if not k.startswith("fc."))


def test_a_smaller_resnet_into_a_larger_one_fails_with_hints_that_load_when_followed(tmp_path):
    torch.save(timm.create_model("resnet18", pretrained=False).state_dict(), tmp_path / "resnet18.pth")
    env = pythonpath_with_shim(tmp_path)
    args = [str(tmp_path / "resnet18.pth"), "--model", "timm:resnet50"]

    refused = cli(*args, env=env)
    only_no_strict = cli(*args, "--no-strict", env=env)
    both = cli(*args, "--no-strict", "--ignore-mismatched-sizes", "--json", env=env)

    assert refused.returncode == 1
    assert "--ignore-mismatched-sizes" in refused.stderr and "--no-strict" in refused.stderr
    # --no-strict alone does not get past shapes: the error says so, and offers the flag that does.
    assert only_no_strict.returncode == 1 and "with a different shape" in only_no_strict.stderr
    assert "--ignore-mismatched-sizes" in only_no_strict.stderr
    assert "another architecture" in refused.stderr and "new head" not in refused.stderr
    assert both.returncode == 0, both.stderr
    report = json.loads(both.stdout)
    assert "layer1.0.conv1.weight" in report["reinitialized"] and "layer1.0.conv3.weight" in report["initialized"]
    # What the flags gave is said, not only counted: most of the model is not the checkpoint's.
    assert report["mostly_not_loaded"] and len(report["not_from_checkpoint"]) > len(report["loaded"])
    assert "Warning: " in both.stderr and "the model is mostly initialized" in both.stderr


def test_a_torchvision_model_from_the_cli_takes_model_args(tmp_path):
    torch.save(tv_models.get_model("mobilenet_v3_small", weights=None, num_classes=3).state_dict(), tmp_path / "m.pt")
    env = pythonpath_with_shim(tmp_path)

    done = cli(str(tmp_path / "m.pt"), "--model", "torchvision:mobilenet_v3_small", "--model-arg", "num_classes=3",
               "--json", env=env)
    default_head = cli(str(tmp_path / "m.pt"), "--model", "torchvision:mobilenet_v3_small", env=env)

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["missing"] == [] and "classifier.3.weight" in json.loads(done.stdout)["loaded"]
    assert default_head.returncode == 1 and "classifier.3.weight (model [1000, 1024], checkpoint [3, 1024])" in \
        default_head.stderr


@pytest.mark.parametrize("family", ["timm", "torchvision"])
def test_an_unknown_family_name_or_a_failing_factory_says_which_and_why(family, tmp_path):
    with pytest.raises(mz.ModelSpecUsageError, match="has no model 'nosuchnet'"):
        mz.build(f"{family}:nosuchnet")
    torch.save({}, tmp_path / "empty.pt")
    env = {**pythonpath_with_shim(tmp_path), "HF_HUB_OFFLINE": "1"}  # asked for weights, offline: the factory fails
    weights = ["--model-arg", "pretrained=true"] if family == "timm" else ["--model-arg", "weights=DEFAULT"]
    name = "resnet18"

    unknown = cli(str(tmp_path / "empty.pt"), "--model", f"{family}:nosuchnet", env=env)
    failing = cli(str(tmp_path / "empty.pt"), "--model", f"{family}:{name}", *weights, env=env)

    assert unknown.returncode == 2 and "has no model 'nosuchnet'" in unknown.stderr
    assert failing.returncode == 1 and "failed while building the model" in failing.stderr
    assert f"{name!r}" in failing.stderr and len(failing.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(compiled_ops_load(), reason="torchvision's compiled ops load here: its import does not fail")
def test_a_torchvision_that_does_not_fit_this_torch_is_named_in_the_error(tmp_path):
    torch.save({}, tmp_path / "empty.pt")
    env = pythonpath_without_shim()  # what a user of this torch and this torchvision sees

    done = cli(str(tmp_path / "empty.pt"), "--model", "timm:resnet18", env=env)

    assert done.returncode == 1
    assert "timm cannot be imported here" in done.stderr and "torchvision::nms" in done.stderr
    assert f"torch {torch.__version__}" in done.stderr and "torchvision 0.28" in done.stderr


@pytest.mark.skipif(compiled_ops_load(), reason="torchvision's compiled ops load here: its import does not fail")
def test_a_hugging_face_model_whose_code_cannot_import_beside_that_torchvision_says_why(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=99)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny-llama")

    done = cli(str(tmp_path / "tiny-llama"), env=pythonpath_without_shim())  # transformers finds that torchvision

    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
    assert "config.json: transformers cannot import the code of this model" in done.stderr
    assert f"torch {torch.__version__}" in done.stderr and "torchvision 0.28" in done.stderr


@pytest.mark.parametrize("family, name, args",
                         [("timm", n, a) for n, a, _ in TIMM] + [("torchvision", n, a) for n, a, _ in TORCHVISION],
                         ids=[f"timm:{c[0]}" for c in TIMM] + [f"torchvision:{c[0]}" for c in TORCHVISION])
def test_a_family_model_recorded_by_deferred_init_materializes_as_eager_construction(family, name, args):
    # timm's init_weights and trunc_normal_ class tokens, stochastic-depth schedules read with .item(),
    # torchvision's RegNet widths computed with .tolist(): every tensor as eager construction under seed 0.
    build = factory(family, name, args)
    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    recorded = mz.deferred_init(build)

    mz.materialize(recorded)

    assert compare_models(recorded, eager) == []
