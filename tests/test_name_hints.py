"""A mismatch error says which key_map lines the names up, and the one it says loads the right values."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import materialize as mz
from materialize.planning.namehints import mismatch_hint

from test_cli import materialize_command
import preforked

MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    class DenseLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.BatchNorm2d(4)
            self.conv1 = nn.Conv2d(4, 8, 1)
            self.norm2 = nn.BatchNorm2d(8)
            self.conv2 = nn.Conv2d(8, 4, 3)


    class DenseNet(nn.Module):
        """torchvision's DenseNet names: its classic weights spell norm1 as norm.1."""

        def __init__(self, layers: int = 3):
            super().__init__()
            self.features = nn.ModuleDict({f"denselayer{i}": DenseLayer() for i in range(1, layers + 1)})
            self.classifier = nn.Linear(4, 2)


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(6)
            self.fc1 = nn.Linear(6, 12)
            self.fc2 = nn.Linear(12, 6)


    class Encoder(nn.Module):
        def __init__(self, layers: int = 4):
            super().__init__()
            self.encoder = nn.ModuleList([Block() for _ in range(layers)])
            self.head = nn.Linear(6, 3)
''')


@pytest.fixture()
def models(tmp_path, monkeypatch):
    (tmp_path / "hint_models.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("hint_models", None)
    import hint_models

    return hint_models


def _saved(model: nn.Module, rename, path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    for tensor in model.state_dict().values():
        if tensor.is_floating_point():
            tensor.normal_()
    state = {rename(name): tensor.clone() for name, tensor in model.state_dict().items()}
    torch.save(state, path)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _refused(build, rename, path: Path) -> tuple[nn.Module, dict[str, torch.Tensor], str]:
    """A skeleton of ``build``, the values saved under renamed names at ``path``, and the message of the load's refusal."""
    expected = _saved(build(), rename, path)
    with mz.meta_init():
        model = build()
    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)
    return model, expected, str(caught.value)


def _classic_densenet(name: str) -> str:
    return re.sub(r"(norm|conv)([12])\.", r"\1.\2.", name)


def test_densenets_classic_names_get_the_renames_that_load_each_value_where_it_belongs(models, tmp_path):
    path = tmp_path / "densenet.pth"
    model, expected, message = _refused(models.DenseNet, _classic_densenet, path)

    assert "the checkpoint spells the model's " in message
    for old, new in (("norm.1", "norm1"), ("norm.2", "norm2"), ("conv.1", "conv1"), ("conv.2", "conv2")):
        assert f"'{new}' as '{old}'" in message
    assert "(all 36 missing names found so)" in message and len(message.splitlines()) == 1
    renames = re.findall(r"--rename '([^']*)'", message)
    assert len(renames) == 4
    # What the message says, typed at the CLI: each tensor gets its own values (norm.2 is not norm1's).
    done = preforked.run(
        [materialize_command(), str(path), "--model", "hint_models:DenseNet", "--json",
         *[arg for rename in renames for arg in ("--rename", rename)]],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    rules = dict(rename.split("=", 1) for rename in renames)
    mz.load(model, path, key_map=rules)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("rename, said", [
    (lambda n: n.replace("ln.weight", "ln.gamma").replace("ln.bias", "ln.beta"), ["'weight' as 'gamma'", "'bias' as 'beta'"]),
    (lambda n: n.replace("encoder.", "backbone.blocks."), ["'encoder' as 'backbone.blocks'"]),
    (lambda n: n.replace("encoder.", "encoder.layers."), ["'encoder' as 'encoder.layers'"]),
    (lambda n: n.replace("fc1", "mlp.0").replace("fc2", "mlp.2"), ["'fc1' as 'mlp.0'", "'fc2' as 'mlp.2'"]),
])
def test_segments_spelled_otherwise_are_found_and_the_hint_loads_the_values(models, tmp_path, rename, said):
    path = tmp_path / "encoder.pt"
    model, expected, message = _refused(models.Encoder, rename, path)

    assert all(f"the checkpoint spells the model's " in message and words in message for words in said), message
    assert "(all " in message  # every missing name found: the hint is the whole fix
    library = re.search(r"key_map=(\{.*?\}) \(CLI", message).group(1)
    mz.load(model, path, key_map=ast.literal_eval(library))  # the library spelling is a Python literal
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    cli = shlex.split(re.search(r"\(CLI: (--rename .*?)\)(;|$)", message).group(1))
    assert cli[::2] == ["--rename"] * (len(cli) // 2) and dict(arg.split("=", 1) for arg in cli[1::2]) == ast.literal_eval(library)


def test_names_that_share_no_renaming_get_no_hint():
    missing = [f"encoder.{i}.fc.weight" for i in range(4)]
    assert mismatch_hint(missing, [f"totally_{i}_different" for i in range(4)]) == ""
    # Renames that would find only half of the missing names are no hint either.
    half = [name.replace("fc", "proj") for name in missing[:2]] + ["other.weight", "another.bias"]
    assert mismatch_hint(missing, half) == ""


def test_a_prefix_is_still_said_as_a_prefix():
    missing = [f"layers.{i}.weight" for i in range(5)]
    assert "--strip-prefix model." in mismatch_hint(missing, ["model." + name for name in missing])


def test_an_index_renamed_is_said_with_the_segment_before_it_so_other_indices_stay():
    missing = [f"encoder.layers.{i}.mlp.fc{j}.{kind}" for i in range(3) for j in (1, 2) for kind in ("weight", "bias")]
    unexpected = [name.replace("fc1", "0").replace("fc2", "2") for name in missing]  # a Sequential's indices

    hint = mismatch_hint(missing, unexpected)

    assert "'mlp.fc1' as 'mlp.0'" in hint and "'mlp.fc2' as 'mlp.2'" in hint
    rules = ast.literal_eval(re.search(r"key_map=(\{.*?\}) \(CLI", hint).group(1))
    assert sorted(mz.KeyMap.regex(rules)(name) for name in unexpected) == sorted(missing)


# --------------------------------------------------------------------------------------------------
# torchvision's own DenseNet-121 and its classic weights' names; renames however many, however rare
# --------------------------------------------------------------------------------------------------


def _torchvision():
    from vision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed (make test-oldest's venvs)")
    import torchvision

    return torchvision


def _classic_densenet121(tmp_path: Path) -> Path:
    """densenet121 trained (every tensor moved), saved as torchvision's classic weights are: each dense layer's
    ``norm1``/``conv1``/``norm2``/``conv2`` spelled ``norm.1``/``conv.1``/..., and no ``num_batches_tracked``
    (those files predate it)."""
    torchvision = _torchvision()
    torch.manual_seed(1)
    trained = torchvision.models.densenet121(weights=None)
    with torch.no_grad():
        for tensor in trained.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(torch.rand_like(tensor))
    state = {re.sub(r"(denselayer\d+\.(?:norm|conv))([12])\.", r"\1.\2.", name): tensor
             for name, tensor in trained.state_dict().items() if not name.endswith("num_batches_tracked")}
    assert sum(".norm.2." in name for name in state) == 58 * 4 and sum(".conv.2." in name for name in state) == 58
    torch.save(state, tmp_path / "densenet121-classic.pth")
    return tmp_path / "densenet121-classic.pth"


def _as_torchvision_loads_it(path: Path) -> nn.Module:
    """An eager densenet121 that took ``path`` through torchvision's own classic-name handling (the function its
    builder calls with downloaded weights, given the file's state dict) and ``load_state_dict``."""
    torchvision = _torchvision()
    from torchvision.models.densenet import _load_state_dict

    class FileWeights:  # what _load_state_dict asks of a weights enum
        @staticmethod
        def get_state_dict(**_: object) -> dict[str, torch.Tensor]:
            return torch.load(path, weights_only=True)

    torch.manual_seed(0)
    model = torchvision.models.densenet121(weights=None)
    _load_state_dict(model, FileWeights, progress=False)
    return model


def test_densenet121s_classic_names_get_every_rename_and_the_hint_loads_torchvisions_model(tmp_path):
    from test_differential import compare_models

    path = _classic_densenet121(tmp_path)
    model = mz.build("torchvision:densenet121")
    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)
    message = str(caught.value)

    said = re.search(r"the checkpoint spells the model's (.*?) \(all", message).group(1)  # the checkpoint has norm.1
    assert sorted(said.split(", ")) == ["'conv1' as 'conv.1'", "'conv2' as 'conv.2'", "'norm1' as 'norm.1'",
                                        "'norm2' as 'norm.2'"]
    assert "(all 580 missing names found so)" in message and "\n" not in message
    library = ast.literal_eval(re.search(r"key_map=(\{.*?\}) \(CLI", message).group(1))
    assert len(library) == 4

    report = mz.load(model, path, key_map=library)

    assert report.missing == report.unexpected == []
    assert compare_models(model, _as_torchvision_loads_it(path)) == []


def test_densenet121s_hint_typed_at_the_cli_loads_it(tmp_path):
    from vision import pythonpath_with_shim

    path = _classic_densenet121(tmp_path)
    env = pythonpath_with_shim(tmp_path)
    command = [materialize_command(), str(path), "--model", "torchvision:densenet121"]

    refused = preforked.run(command, capture_output=True, text=True, timeout=300, env=env)
    line = refused.stderr.strip()
    offered = shlex.split(re.search(r"\(CLI: (--rename [^)]*)\)", line).group(1))
    done = preforked.run([*command, *offered, "--json"], capture_output=True, text=True, timeout=300, env=env)

    assert refused.returncode == 1 and "\n" not in line and offered[::2] == ["--rename"] * 4
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["missing"] == report["unexpected"] == []
    assert len(report["loaded"]) == len(torch.load(path, weights_only=True))


def test_renames_however_many_and_however_rare_are_all_offered():
    # Blocks of 12 renamed names (and one kept): one rename is needed by 5 names of each, one by 2, five by 1;
    # a stride through the missing names would land on the same few of each block: every rename is found.
    layers = [f"blocks.{i}.{part}" for i in range(40) for part in (
        *[f"norm1.{kind}" for kind in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")],
        "conv1.weight", "proj.weight", "proj.bias", "gate.weight", "skip.weight", "out.weight", "fc.weight", "scale")]
    renames = {"norm1": "norm.1", "conv1": "conv.1", "proj": "projection", "gate": "gating", "skip": "shortcut",
               "out": "output", "fc": "linear"}
    checkpoint = [re.sub(r"\b(" + "|".join(renames) + r")\b", lambda m: renames[m.group(1)], name) for name in layers]
    missing = [name for name in layers if name not in checkpoint]
    unexpected = [name for name in checkpoint if name not in layers]

    hint = mismatch_hint(missing, unexpected)

    assert f"(all {len(missing)} missing names found so)" in hint
    rules = ast.literal_eval(re.search(r"key_map=(\{.*?\}) \(CLI", hint).group(1))
    assert len(rules) == len(renames)
    assert sorted(mz.KeyMap.regex(rules)(name) for name in unexpected) == sorted(missing)


def test_a_hint_that_leaves_names_missing_says_which():
    missing = [f"encoder.{i}.norm1.{kind}" for i in range(30) for kind in ("weight", "bias")] + ["head.weight"]
    unexpected = [name.replace("norm1", "norm.1") for name in missing[:-1]]  # a new head: not in the checkpoint

    hint = mismatch_hint(missing, unexpected)

    assert "(60 of the 61 missing names found so; 1 stays missing under these renames: head.weight)" in hint
