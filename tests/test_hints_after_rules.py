"""A rename hint is said after the rules the user gave: appended to the same command as printed, it loads.

For each kind of rule a command can give (``--strip-prefix``, ``--add-prefix``, ``--rename``) and each
kind of hint (a prefix to strip, one to add, segments renamed), a checkpoint is written that the given
rule half fixes; the command fails with a hint, the hint is appended to it as printed, and the second
run loads what torch's ``load_state_dict`` loads from the state dict renamed by the library spelling
of the same hint. Run in-process (click's runner): the CLI's output is what is tested, not a process.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from click.testing import CliRunner

import materialize as mz
from materialize.planning.namehints import mismatch_hint
from materialize_cli.main import main

MODEL_SCRIPT = '''\
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(6)
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 6)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(6, 3)


class Wrapper(nn.Module):
    def __init__(self, attr, inner):
        super().__init__()
        self.add_module(attr, inner)


def make(wrap: str = ""):
    """The encoder, inside a wrapper module per segment of ``wrap`` ("net.body." -> net.body.encoder...)."""
    model = Encoder()
    for attr in reversed([part for part in wrap.split(".") if part]):
        model = Wrapper(attr, model)
    return model
'''


@dataclass(frozen=True)
class Rule:
    """A kind of rename: the CLI options that give it, the model prefix it accounts for (an added prefix's),
    and how a checkpoint spells a name before it acts (its inverse)."""

    options: tuple[str, ...]
    wrap: str
    before: Callable[[str], str]
    said: str = ""  # what a hint for it says


GIVEN = {  # what the user typed already
    "strip-prefix": Rule(("--strip-prefix", "model."), "", lambda name: "model." + name),
    "add-prefix": Rule(("--add-prefix", "net."), "net.", lambda name: name),
    "rename": Rule(("--rename", r"\bproj\b=fc2"), "", lambda name: re.sub(r"\bfc2\b", "proj", name)),
}
NEEDED = {  # what the model needs besides, and the hint says
    "strip-prefix": Rule((), "", lambda name: "backbone." + name, "the checkpoint names carry the prefix 'backbone.'"),
    "add-prefix": Rule((), "body.", lambda name: name, "the model names carry the prefix 'body.'"),
    "rename": Rule((), "", lambda name: re.sub(r"\bln\b", "norm", name), "the checkpoint spells the model's 'ln' as 'norm'"),
}


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    (tmp_path / "encoders.py").write_text(MODEL_SCRIPT)
    return tmp_path / "encoders.py"


def _make(script: Path, wrap: str) -> torch.nn.Module:
    import runpy

    return runpy.run_path(str(script))["make"](wrap)


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("needed", sorted(NEEDED))
@pytest.mark.parametrize("given", sorted(GIVEN))
def test_a_hint_after_a_given_rule_appended_to_the_same_command_loads_what_torch_loads(
        script, tmp_path, monkeypatch, given, needed):
    user, hint = GIVEN[given], NEEDED[needed]
    wrap = user.wrap + hint.wrap  # the user's --add-prefix is the CLI's last step: its prefix comes first
    torch.manual_seed(0)
    values = {name.removeprefix(wrap): tensor.normal_() for name, tensor in _make(script, wrap).state_dict().items()}
    checkpoint = {user.before(hint.before(core)): tensor for core, tensor in values.items()}
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    command = [str(tmp_path / "ckpt.pt"), "--model", f"{script}:make", *(["--model-arg", f"wrap={wrap}"] if wrap else []),
               *user.options]

    refused = _invoke(*command)

    line = refused.stderr.strip()
    assert refused.exit_code == 1 and line.startswith("Error: ") and "\n" not in line, refused.output
    assert hint.said in line, line
    offered = shlex.split(re.search(r"\(CLI: (--[^)]*)\)", line).group(1))
    loaded: list[torch.nn.Module] = []
    real_load_model = mz.load_model

    def keeping_the_model(*args, **kwargs):
        model, report = real_load_model(*args, **kwargs)
        loaded.append(model)
        return model, report

    monkeypatch.setattr(mz, "load_model", keeping_the_model)
    done = _invoke(*command, *offered, "--json")

    assert done.exit_code == 0, done.output
    # torch's own load of the state dict renamed by the hint's library spelling (the given rules and the new)
    key_map = eval(re.search(r"key_map=(.*?) \(CLI", line).group(1), {"KeyMap": mz.KeyMap})  # noqa: S307
    eager = _make(script, wrap)
    eager.load_state_dict({key_map(name): tensor for name, tensor in checkpoint.items()})
    expected = eager.state_dict()
    assert loaded[0].state_dict().keys() == expected.keys()
    for name, tensor in loaded[0].state_dict().items():
        assert torch.equal(tensor, expected[name]), name
        assert torch.equal(tensor, values[name.removeprefix(wrap)]), name


def test_a_repeated_rename_pattern_keeps_both_rules_in_order(script, tmp_path):
    """Two --rename with one pattern (the user's, and a hint's acting after it) are two rules, not one."""
    torch.manual_seed(0)
    state = _make(script, "").state_dict()
    torch.save({name.replace("fc1", "x").replace("fc2", "y"): tensor for name, tensor in state.items()}, tmp_path / "c.pt")

    done = _invoke(str(tmp_path / "c.pt"), "--model", f"{script}:make", "--rename", r"\by\b=fc2",
                   "--rename", r"\bx\b=y", "--rename", r"\by\b=fc1", "--json")

    assert done.exit_code == 0, done.output


def test_a_callable_key_map_is_not_looked_into_and_the_hint_replaces_it():
    missing = [f"layers.{i}.weight" for i in range(5)]
    unexpected = ["model." + name for name in missing]

    assert mismatch_hint(missing, unexpected, lambda name: name) == mismatch_hint(missing, unexpected)
    assert "KeyMap.strip_prefix('model.') (CLI: --strip-prefix model.)" in mismatch_hint(missing, unexpected)


def test_a_library_key_map_in_an_order_no_cli_options_make_gets_the_library_spelling_only():
    missing = [f"layers.{i}.weight" for i in range(5)]
    given = mz.KeyMap.add_prefix("x.") + mz.KeyMap.regex({r"^x\.": "y."})  # a prefix added, then renamed
    unexpected = [f"layers.{i}.w" for i in range(5)]

    hint = mismatch_hint([f"y.{name}" for name in missing], unexpected, given)

    assert "pass key_map=KeyMap.add_prefix('x.') + KeyMap.regex({r'^x\\.': 'y.'}) + KeyMap.regex(" in hint, hint
    assert "(CLI:" not in hint
