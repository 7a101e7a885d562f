"""A mismatch error says which key_map lines the names up, and the one it says loads the right values."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import materialize as mz
from materialize.planning.namehints import mismatch_hint

from test_cli import materialize_command

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

    for old, new in (("norm.1", "norm1"), ("norm.2", "norm2"), ("conv.1", "conv1"), ("conv.2", "conv2")):
        assert f"'{old}' as '{new}'" in message
    assert "(36 of the 36 missing names found so)" in message and len(message.splitlines()) == 1
    renames = re.findall(r"--rename '([^']*)'", message)
    assert len(renames) == 4
    # What the message says, typed at the CLI: each tensor gets its own values (norm.2 is not norm1's).
    done = subprocess.run(
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
    (lambda n: n.replace("ln.weight", "ln.gamma").replace("ln.bias", "ln.beta"), ["'gamma' as 'weight'", "'beta' as 'bias'"]),
    (lambda n: n.replace("encoder.", "backbone.blocks."), ["'backbone.blocks' as 'encoder'"]),
    (lambda n: n.replace("encoder.", "encoder.layers."), ["'encoder.layers' as 'encoder'"]),
    (lambda n: n.replace("fc1", "mlp.0").replace("fc2", "mlp.2"), ["'mlp.0' as 'fc1'", "'mlp.2' as 'fc2'"]),
])
def test_segments_spelled_otherwise_are_found_and_the_hint_loads_the_values(models, tmp_path, rename, said):
    path = tmp_path / "encoder.pt"
    model, expected, message = _refused(models.Encoder, rename, path)

    assert all(words in message for words in said), message
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

    assert "'mlp.0' as 'mlp.fc1'" in hint and "'mlp.2' as 'mlp.fc2'" in hint
    rules = ast.literal_eval(re.search(r"key_map=(\{.*?\}) \(CLI", hint).group(1))
    assert sorted(mz.KeyMap.regex(rules)(name) for name in unexpected) == sorted(missing)
