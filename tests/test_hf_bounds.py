"""Building a Hugging Face model from config.json: no process-wide state changes while it runs, what a config asks
for is bounded by the checkpoint it is built for, and a config that cannot be read is one error naming it.

The hostile configs would build for hours or allocate gigabytes: they run in child processes with a time limit
and an address-space limit, so that a regression fails the test instead of stopping the suite.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import materialize as mz
from materialize.skeleton import hfbuild

transformers = pytest.importorskip("transformers")

CLI = str(Path(sys.executable).parent / "materialize")
ADDRESS_SPACE = 6 << 30  # torch alone maps ~1-2 GiB; the hostile configs ask for 24 GB and more
SECONDS = 60


def _tiny_bert(folder: Path, *, dtype: torch.dtype = torch.float32, **config: object) -> Path:
    """A tiny BERT saved in ``dtype``; ``config`` then overrides fields of its saved config.json."""
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=99,
        max_position_embeddings=64))
    model.to(dtype).save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    saved.update(config)
    (folder / "config.json").write_text(json.dumps(saved))
    return folder


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=SECONDS, preexec_fn=_limited)


def _one_error_line(done: subprocess.CompletedProcess, *names: str) -> str:
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in done.stderr, done.stderr
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- no process-wide dtype


def test_a_float16_build_leaves_other_threads_and_torchs_default_dtype_alone(tmp_path, monkeypatch):
    folder = _tiny_bert(tmp_path / "bert", dtype=torch.float16)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float16"
    inside, checked = threading.Event(), threading.Event()
    constructor = transformers.BertModel.__init__

    def paused_inside(self, *args, **kwargs):  # the other thread checks while the build is under way
        constructor(self, *args, **kwargs)
        inside.set()
        assert checked.wait(60)

    monkeypatch.setattr(transformers.BertModel, "__init__", paused_inside)
    loaded: dict = {}
    loader = threading.Thread(target=lambda: loaded.update(model=mz.load_model(folder)[0]))
    loader.start()
    try:
        assert inside.wait(60)
        for _ in range(20):
            assert torch.zeros(1).dtype == torch.float32
            assert torch.nn.Linear(2, 2).weight.dtype == torch.float32
            assert torch.get_default_dtype() == torch.float32
            assert (torch.arange(4) / 3).dtype == torch.float32
    finally:
        checked.set()
        loader.join(60)

    assert torch.get_default_dtype() == torch.float32
    reference = transformers.BertModel.from_pretrained(folder)
    ours, theirs = loaded["model"].state_dict(), reference.state_dict()
    assert {n: t.dtype for n, t in ours.items()} == {n: t.dtype for n, t in theirs.items()}
    assert ours["embeddings.word_embeddings.weight"].dtype == torch.float16


# ---------------------------------------------------------------- bounded by the checkpoint


HOSTILE = {"layers": {"num_hidden_layers": 5_000_000}, "positions": {"max_position_embeddings": 3_000_000_000}}
FIELDS = {"layers": "num_hidden_layers=5000000", "positions": "max_position_embeddings=3000000000"}

_LOAD_EACH = textwrap.dedent("""
    import json, resource, sys
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import materialize as mz
    results = {}
    for name, folder in json.loads(sys.argv[1]).items():
        try:
            mz.load_model(folder)
            results[name] = ["loaded", "", False]
        except Exception as error:
            results[name] = [type(error).__name__, str(error), isinstance(error, mz.ModelSpecError)]
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-configs")
    return {name: _tiny_bert(root / name, **fields) for name, fields in HOSTILE.items()}


def test_a_config_asking_for_more_than_its_checkpoint_is_refused_by_load_model_naming_the_field(hostile):
    done = subprocess.run([sys.executable, "-c", _LOAD_EACH, json.dumps({k: str(v) for k, v in hostile.items()}),
                           str(ADDRESS_SPACE)], capture_output=True, text=True, timeout=2 * SECONDS)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    for name, (kind, message, is_spec_error) in results.items():
        assert is_spec_error, f"{name}: {kind}: {message}"
        assert message.startswith(str(hostile[name] / "config.json")) and FIELDS[name] in message
        assert "--model" in message and "\n" not in message


@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_cli_refuses_a_config_asking_for_more_than_its_checkpoint_in_one_line(hostile, name):
    line = _one_error_line(_cli(str(hostile[name])), "config.json", FIELDS[name])
    assert "fix that field of config.json" in line and "--model" in line


def test_the_bounds_let_the_checkpoint_a_config_was_saved_with_load(tmp_path):
    folder = _tiny_bert(tmp_path / "bert")
    model, report = mz.load_model(folder)
    assert report.loaded and model.config.num_hidden_layers == 2


def test_the_largest_sizes_are_the_integer_fields_token_ids_aside():
    config = {"num_hidden_layers": 5_000_000, "eos_token_id": 9_000_000, "text_config": {"hidden_size": 64},
              "use_cache": True, "vocab_size": 99}
    assert hfbuild._largest_sizes(config) == [("num_hidden_layers", 5_000_000), ("vocab_size", 99)]


# ---------------------------------------------------------------- a config that cannot be read


@pytest.fixture(scope="module")
def deep(tmp_path_factory) -> Path:
    folder = _tiny_bert(tmp_path_factory.mktemp("deep") / "bert")
    (folder / "config.json").write_text('{"model_type": "bert", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return folder


def test_load_model_refuses_a_config_nested_too_deep_naming_it(deep):
    script = ("import sys, materialize as mz\ntry:\n    mz.load_model(sys.argv[1])\nexcept mz.MaterializeError as e:\n"
              "    print(type(e).__name__, e)\n")
    done = subprocess.run([sys.executable, "-c", script, str(deep)], capture_output=True, text=True, timeout=SECONDS)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith(f"ModelSpecError {deep / 'config.json'}: cannot be read"), done.stdout


@pytest.mark.parametrize("command", [[], ["plan"], ["convert"]], ids=["load", "plan", "convert"])
def test_the_cli_refuses_a_config_nested_too_deep_in_one_line(deep, tmp_path, command):
    args = [*command, str(deep)] + ([str(tmp_path / "out"), "--dtype", "bfloat16"] if command == ["convert"] else [])
    _one_error_line(_cli(*args), "config.json", "nested deeper")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, says", [(b'{"model_type": ', "not valid JSON"), (b'{"a": "\xff"}', "not UTF-8")],
                         ids=["invalid", "not-utf8"])
def test_read_config_names_the_file_it_cannot_read(tmp_path, text, says):
    (tmp_path / "config.json").write_bytes(text)
    with pytest.raises(mz.ModelSpecError, match=rf"config\.json: cannot be read: {says}"):
        hfbuild.read_config(tmp_path / "config.json")


def test_a_default_dtype_a_constructor_sets_inside_a_build_is_the_builds_own():
    # transformers' from_config, building a part of a model inside its constructor, sets torch's default dtype
    # and puts back what torch.get_default_dtype() answered: in a build, both are the build's own.
    from materialize.skeleton.buildmode import building

    with building(torch.bfloat16):
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float16)
        inner = torch.zeros(1).dtype
        torch.set_default_dtype(before)
        after = torch.zeros(1).dtype
        legacy = torch.Tensor(2).dtype  # wav2vec2's masked_spec_embed, Deformable DETR's level_embed

    assert (before, inner, after, legacy) == (torch.bfloat16, torch.float16, torch.bfloat16, torch.bfloat16)
    assert torch.Tensor(2).dtype == torch.float32 and "__new__" not in torch.Tensor.__dict__
    assert torch.get_default_dtype() == torch.float32 and torch.zeros(1).dtype == torch.float32
    assert torch.set_default_dtype.__module__ == "torch" and not torch.get_default_dtype.__module__.startswith("materialize")
