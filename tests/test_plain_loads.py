"""A checkpoint loaded with no model, as a plain dict of its tensors (``load_tensors``, the CLI without
--model): what it checks is checked, and what it cannot honour is refused, never quietly ignored."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import materialize as mz
from materialize.io import executor
import preforked

STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16),
         "tied": torch.arange(6, dtype=torch.int64)}


def write_checkpoints(tmp: Path) -> list[Path]:
    safetensors, torch_file = tmp / "plain.safetensors", tmp / "plain.pt"
    save_file({name: value for name, value in STATE.items() if name != "tied"}, str(safetensors))
    torch.save({**STATE, "view": STATE["tied"][2:]}, torch_file)  # views of one storage: one read
    return [safetensors, torch_file]


@pytest.mark.parametrize("kind", [0, 1], ids=["safetensors", "torch"])
def test_check_on_a_plain_load_audits_each_read_and_passes_a_sound_one(tmp_path, kind):
    path = write_checkpoints(tmp_path)[kind]

    tensors, report = mz.load_tensors(path, check=True)

    reference = torch.load(path, weights_only=True) if path.suffix == ".pt" else STATE
    assert sorted(tensors) == sorted(report.loaded)
    for name, value in tensors.items():
        assert torch.equal(value, reference[name])


@pytest.mark.parametrize("kind", [0, 1], ids=["safetensors", "torch"])
def test_check_on_a_plain_load_catches_a_tensor_the_reads_left_unwritten(tmp_path, monkeypatch, kind):
    path = write_checkpoints(tmp_path)[kind]
    real = executor.Reads.read

    def dropping_the_first(self, jobs, **kw):  # a read path that forgets a tensor
        return real(self, jobs[1:], **kw)

    monkeypatch.setattr(executor.Reads, "read", dropping_the_first)

    mz.load_tensors(path)  # unchecked, the dropped tensor goes unnoticed: what check is for
    with pytest.raises(mz.SanitizerError) as caught:
        mz.load_tensors(path, check=True)

    message = str(caught.value)
    assert message.startswith(f"{path}: check failed for 1 tensor(s): ")
    assert message.endswith(", still holds poison: never written")
    assert ": 0 bytes written from the file, " in message


def test_the_cli_check_on_a_plain_load_fails_where_a_read_is_lost(tmp_path):
    path = write_checkpoints(tmp_path)[0]
    losing_a_read = (
        "import sys, materialize.io.executor as e; real = e.Reads.read\n"
        "e.Reads.read = lambda self, jobs, **kw: real(self, jobs[1:], **kw)\n"
        "from materialize_cli.main import main; sys.argv[0] = 'materialize'; main()"
    )

    done = preforked.run([sys.executable, "-c", losing_a_read, str(path), "--check", "--json"],
                          capture_output=True, text=True, timeout=300)

    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(f"Error: {path}: check failed for 1 tensor(s): ")


MODEL_ONLY = [
    (["--no-strict"], {"strict": False}, "--no-strict (strict=False)"),
    (["--strip-prefix", "model."], {"key_map": mz.KeyMap.strip_prefix("model.")}, "--strip-prefix, --add-prefix, --rename (key_map)"),
    (["--ignore-mismatched-sizes"], {"ignore_mismatched_sizes": True}, "--ignore-mismatched-sizes (ignore_mismatched_sizes)"),
    (["--ignore-unexpected"], {"ignore_unexpected": True}, "--ignore-unexpected, --ignore-unexpected-matching (ignore_unexpected)"),
    (["--max-memory", "cpu=1GiB"], {"max_memory": {"cpu": "1GiB"}}, "--max-memory (max_memory)"),
]


@pytest.mark.parametrize("flags, keywords, words", MODEL_ONLY, ids=[case[0][0] for case in MODEL_ONLY])
def test_an_option_for_a_model_is_refused_without_one_and_a_model_takes_it(tmp_path, flags, keywords, words):
    path = write_checkpoints(tmp_path)[0]
    if "--strip-prefix" in flags:  # a checkpoint whose names the option lines up with the model's
        path = tmp_path / "prefixed.safetensors"
        save_file({f"model.{name}": value for name, value in load_file(tmp_path / "plain.safetensors").items()}, str(path))
    model_file = tmp_path / "plain_model.py"
    model_file.write_text(
        "import torch\n\nclass Plain(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.w = torch.nn.Parameter(torch.zeros(3, 4))\n        self.b = torch.nn.Parameter(torch.zeros(5))\n\n"
        "def create():\n    return Plain()\n")

    with pytest.raises(mz.ModelRequiredError) as from_load:
        mz.load_model(path, **keywords)
    with pytest.raises(mz.ModelRequiredError) as from_plan:
        mz.plan(None, path, **keywords)
    for command in ([], ["plan"]):
        refused = preforked.run([sys.executable, "-m", "materialize_cli.main", *command, str(path), *flags],
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and refused.stdout == ""
        assert words in refused.stderr and "pass a model (CLI: --model SPEC)" in refused.stderr
    followed = preforked.run([sys.executable, "-m", "materialize_cli.main", str(path), *flags,
                               "--model", f"{model_file}:create", "--json"], capture_output=True, text=True, timeout=300)

    assert str(from_load.value) == str(from_plan.value)
    assert words in str(from_load.value)
    assert followed.returncode == 0, followed.stderr
    assert sorted(json.loads(followed.stdout)["loaded"]) == ["b", "w"]
