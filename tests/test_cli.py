"""The ``materialize`` command as a user runs it: real subprocesses of the installed script."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import materialize
from bench.models.transformer import DecoderLM

from conftest import DECODER_SPEC
from terminal import run_on_a_terminal, screen
import preforked

# ---------------------------------------------------------------- helpers

TINY_ARGS = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "intermediate_size": 64,
    "tie_embeddings": True,
}
TINY_MODEL_OPTIONS = [
    "--model", DECODER_SPEC,
    "--model-arg", "vocab_size=64",
    "--model-arg", "hidden_size=32",
    "--model-arg", "num_layers=2",
    "--model-arg", "num_heads=4",
    "--model-arg", "intermediate_size=64",
    "--model-arg", "tie_embeddings=true",
]  # fmt: skip


def materialize_command() -> str:
    found = shutil.which("materialize")
    if found is not None:
        return found
    return str(Path(sys.executable).parent / "materialize")


def run_cli(*args: object, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return preforked.run(
        [materialize_command(), *map(str, args)],
        capture_output=True, text=True, cwd=cwd, timeout=300, env=env,
    )  # fmt: skip


def tiny_decoder_state(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The state dict of the tiny tied DecoderLM, minus the tied lm_head (safetensors refuses shared tensors)."""
    torch.manual_seed(0)
    model = DecoderLM(**TINY_ARGS)
    state = {name: t.detach().to(dtype).contiguous() for name, t in model.state_dict().items()}
    del state["lm_head.weight"]
    return state


def write_tiny_decoder_checkpoint(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    state = tiny_decoder_state(dtype)
    save_file(state, str(path))
    return state


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_small_safetensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    save_file(tensors, str(path))
    return tensors


def write_small_torch(path: Path) -> dict[str, torch.Tensor]:
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "steps": torch.tensor([7], dtype=torch.int64)}
    torch.save(tensors, path)
    return tensors


def write_toml_config(path: Path, args: dict) -> Path:
    lines = ["[model]", f'factory = "{DECODER_SPEC}"', "", "[model.args]"]
    for key, value in args.items():
        lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class RunsShellCommand:
    """Pickles to a call of ``os.system``: unpickling it would run the command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def assert_one_error_line(result: subprocess.CompletedProcess, must_name: str | None) -> str:
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    assert "Traceback" not in result.stderr
    if must_name is not None:
        assert must_name in lines[0]
    return lines[0]


# ---------------------------------------------------------------- loading


def test_loading_a_safetensors_file_prints_a_report_and_exits_0(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = write_small_safetensors(path)

    result = run_cli(path)

    assert result.returncode == 0, result.stderr
    assert str(path) in result.stdout
    assert "tensors loaded" in result.stdout
    assert f"{len(tensors)}" in result.stdout.split("tensors loaded", 1)[1].splitlines()[0]


def test_loading_a_torch_state_dict_prints_a_report_and_exits_0(tmp_path):
    path = tmp_path / "model.pt"
    write_small_torch(path)

    result = run_cli(path)

    assert result.returncode == 0, result.stderr
    assert str(path) in result.stdout
    assert "(torch)" in result.stdout


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_json_report_is_one_object_listing_tensors_and_bytes_read(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    tensors = write_small_safetensors(path) if suffix == ".safetensors" else write_small_torch(path)

    result = run_cli(path, "--json")

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert isinstance(report, dict)
    assert sorted(report["loaded"]) == sorted(tensors)
    assert report["bytes_read"] == nbytes(tensors)
    assert report["model_bytes"] == nbytes(tensors)
    assert report["device"] == "cpu"
    assert report["checkpoint"] == str(path)
    assert report["dtypes"] == {str(t.dtype).removeprefix("torch."): 1 for t in tensors.values()}


def test_model_from_factory_loads_tied_checkpoint_in_its_own_dtype(tmp_path):
    path = tmp_path / "tiny.safetensors"
    state = write_tiny_decoder_checkpoint(path, torch.bfloat16)

    result = run_cli(path, *TINY_MODEL_OPTIONS, "--json")

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(report["loaded"]) == sorted(state)
    assert report["tied"] == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert report["missing"] == [] and report["unexpected"] == [] and report["initialized"] == []
    assert report["bytes_read"] == nbytes(state)
    assert report["dtypes"]["bfloat16"] == len(state)
    assert all("inv_freq" in name for name in report["kept"]) and len(report["kept"]) == TINY_ARGS["num_layers"]


def test_model_from_factory_with_dtype_fp32_casts_every_loaded_tensor(tmp_path):
    path = tmp_path / "tiny.safetensors"
    state = write_tiny_decoder_checkpoint(path, torch.bfloat16)

    result = run_cli(path, *TINY_MODEL_OPTIONS, "--dtype", "fp32", "--json")

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(report["loaded"]) == sorted(state)
    assert "bfloat16" not in report["dtypes"]
    assert report["dtypes"]["float32"] == len(report["loaded"]) + len(report["kept"])
    assert report["bytes_read"] == nbytes(state)
    assert report["model_bytes"] == 2 * nbytes(state) + sum(
        (TINY_ARGS["hidden_size"] // TINY_ARGS["num_heads"] // 2) * 4 for _ in range(TINY_ARGS["num_layers"])
    )


def test_model_from_factory_without_json_prints_a_table(tmp_path):
    path = tmp_path / "tiny.safetensors"
    write_tiny_decoder_checkpoint(path)

    result = run_cli(path, *TINY_MODEL_OPTIONS)

    assert result.returncode == 0, result.stderr
    assert "tied groups" in result.stdout
    assert "tensors loaded" in result.stdout


def test_model_from_a_toml_config_file_loads(tmp_path):
    path = tmp_path / "tiny.safetensors"
    state = write_tiny_decoder_checkpoint(path)
    config = write_toml_config(tmp_path / "tiny.toml", TINY_ARGS)

    result = run_cli(path, "--model", config, "--json")

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(report["loaded"]) == sorted(state)
    assert report["tied"] == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert report["bytes_read"] == nbytes(state)


def test_model_arg_overrides_a_toml_config_value(tmp_path):
    path = tmp_path / "tiny.safetensors"
    state = write_tiny_decoder_checkpoint(path)
    config = write_toml_config(tmp_path / "tiny.toml", dict(TINY_ARGS, vocab_size=999))

    result = run_cli(path, "--model", config, "--model-arg", "vocab_size=64", "--json")

    assert result.returncode == 0, result.stderr
    assert sorted(json.loads(result.stdout)["loaded"]) == sorted(state)


def test_trust_pickle_loads_a_pickled_module(tmp_path):
    torch.manual_seed(0)
    source = DecoderLM(**TINY_ARGS)
    path = tmp_path / "whole_model.pt"
    torch.save(source, path)

    # The classes a pickled module names must be importable where it is loaded, as for torch.load: bench/'s here.
    root = Path(__file__).resolve().parent.parent
    result = run_cli(path, "--trust-pickle", "--json",
                     env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))})

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["format"] == "torch-module"
    assert set(source.state_dict()) - {"lm_head.weight"} <= set(report["loaded"])
    assert report["tied"] == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert report["missing"] == [] and report["initialized"] == []


def test_pickled_module_without_trust_pickle_loads_its_weights_into_a_model_spec(tmp_path):
    path = tmp_path / "whole_model.pt"
    source = DecoderLM(**TINY_ARGS)
    torch.save(source, path)

    result = run_cli(path, *TINY_MODEL_OPTIONS, "--json")

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(report["loaded"]) == sorted(n for n in source.state_dict() if n != "lm_head.weight")
    assert report["missing"] == [] and report["unexpected"] == []


# ---------------------------------------------------------------- inspect and plan


def test_inspect_lists_names_dtypes_and_shapes(tmp_path):
    path = tmp_path / "model.safetensors"
    write_small_safetensors(path)

    result = run_cli("inspect", path)

    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
    assert rows["w"][1:3] == ["float32", "3x4"]
    assert rows["b"][1:3] == ["bfloat16", "5"]


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_inspect_json_gives_names_dtypes_and_shapes(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    tensors = write_small_safetensors(path) if suffix == ".safetensors" else write_small_torch(path)

    result = run_cli("inspect", path, "--json")

    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["tensor_count"] == len(tensors)
    assert summary["nbytes"] == nbytes(tensors)
    listed = {t["name"]: (t["dtype"], t["shape"]) for t in summary["tensors"]}
    assert listed == {name: (str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()}


def test_inspect_a_sharded_index_lists_every_shard(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / "s1.safetensors"))
    save_file({"b": torch.ones(3)}, str(folder / "s2.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
    )

    result = run_cli("inspect", folder, "--json")

    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["format"] == "safetensors-sharded"
    assert [Path(s).name for s in summary["shards"]] == ["s1.safetensors", "s2.safetensors"]
    assert {t["name"]: t["file"] for t in summary["tensors"]} == {"a": "s1.safetensors", "b": "s2.safetensors"}


def _written(form: str, folder: Path) -> Path:
    if form == "safetensors":
        path = folder / "model.safetensors"
        save_file({"w": torch.ones(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, str(path), metadata={"format": "pt"})
        return path
    if form == "sharded":
        path = folder / "ckpt"
        path.mkdir()
        save_file({"a": torch.ones(2)}, str(path / "s1.safetensors"))
        save_file({"b": torch.ones(3, dtype=torch.float16)}, str(path / "s2.safetensors"))
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": 14}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
        return path
    path = folder / "model.pt"
    torch.save({"state_dict": {"w": torch.arange(6).reshape(2, 3), "b": torch.ones(2)}, "epoch": 3}, path)
    return path


@pytest.mark.parametrize("form", ["safetensors", "sharded", "torch"])
def test_the_library_inspect_returns_what_inspect_json_prints(tmp_path, form):
    path = _written(form, tmp_path)

    result = run_cli("inspect", path, "--json")

    assert result.returncode == 0, result.stderr
    assert materialize.inspect(path) == json.loads(result.stdout)


def test_plan_json_reports_what_a_load_would_do(tmp_path):
    path = tmp_path / "tiny.safetensors"
    state = write_tiny_decoder_checkpoint(path)

    result = run_cli("plan", path, *TINY_MODEL_OPTIONS, "--json")

    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["tensors"]["load"] == len(state)
    assert summary["tensors"]["init"] == 0
    assert summary["read_bytes"] == nbytes(state)
    assert summary["tied_groups"] == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert summary["missing"] == [] and summary["unexpected"] == []


def test_plan_with_no_strict_lists_missing_and_unexpected(tmp_path):
    path = tmp_path / "tiny.safetensors"
    state = tiny_decoder_state()
    del state["model.norm.weight"]
    state["bogus.weight"] = torch.ones(2)
    save_file(state, str(path))

    result = run_cli("plan", path, *TINY_MODEL_OPTIONS, "--no-strict", "--json")

    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["missing"] == ["model.norm.weight"]
    assert summary["unexpected"] == ["bogus.weight"]
    # The norm, and each layer's rotary buffer: without --strict the CLI records the model's construction
    # (deferred_init), so its computed buffers are on meta too, and the load replays them with the norm.
    assert summary["tensors"]["init"] == 1 + TINY_ARGS["num_layers"]


def test_a_tie_the_checkpoint_holds_apart_is_planned_for_comparing_and_loaded_apart(tmp_path):
    path = tmp_path / "own_head.safetensors"
    state = tiny_decoder_state()
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, str(path))

    planned = run_cli("plan", path, *TINY_MODEL_OPTIONS)
    loaded = run_cli(path, *TINY_MODEL_OPTIONS, "--json")

    assert planned.returncode == 0, planned.stderr
    assert "tie to check model.embed_tokens.weight / lm_head.weight" in planned.stdout
    assert loaded.returncode == 0, loaded.stderr
    report = json.loads(loaded.stdout)
    assert report["untied"] == [["model.embed_tokens.weight", "lm_head.weight"]] and report["tied"] == []
    assert report["bytes_read"] == nbytes(state)


def test_plan_without_a_model_plans_the_plain_load(tmp_path):
    path = tmp_path / "model.pt"
    tensors = write_small_torch(path)

    result = run_cli("plan", path, "--json")

    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["into"] == "dict" and summary["tensors"]["load"] == len(tensors)
    assert summary["read_bytes"] == nbytes(tensors) and summary["bytes_by_device"] == {"cpu": nbytes(tensors)}


# ---------------------------------------------------------------- errors: one line, exit 1


def test_truncated_safetensors_names_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    write_small_safetensors(path)
    path.write_bytes(path.read_bytes()[:-4])

    result = run_cli(path)

    assert_one_error_line(result, str(path))


def test_malformed_json_header_names_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    raw = b'{"w": {"dtype": "F32", "shape": [1], '
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)

    result = run_cli(path, "--json")

    line = assert_one_error_line(result, str(path))
    assert "JSON" in line


def test_missing_shard_names_the_index_and_the_shard(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / "s1.safetensors"))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2-is-gone.safetensors"}}))

    result = run_cli(index)

    line = assert_one_error_line(result, str(index))
    assert "s2-is-gone.safetensors" in line


def test_nonexistent_path_names_the_path(tmp_path):
    path = tmp_path / "no" / "such.safetensors"

    result = run_cli(path)

    assert_one_error_line(result, str(path))


def test_code_executing_pickle_fails_without_running_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "payload": RunsShellCommand(f"touch {marker}")}, path)

    result = run_cli(path)

    assert_one_error_line(result, str(path))
    assert not marker.exists()


def test_code_executing_pickle_fails_in_inspect_without_running_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "payload": RunsShellCommand(f"touch {marker}")}, path)

    result = run_cli("inspect", path, "--json")

    assert_one_error_line(result, str(path))
    assert not marker.exists()


def test_strict_key_mismatch_names_the_file_and_every_offending_tensor(tmp_path):
    path = tmp_path / "tiny.safetensors"
    state = tiny_decoder_state()
    del state["model.norm.weight"]
    state["bogus.weight"] = torch.ones(2)
    save_file(state, str(path))

    result = run_cli(path, *TINY_MODEL_OPTIONS)

    line = assert_one_error_line(result, str(path))
    assert "model.norm.weight" in line
    assert "bogus.weight" in line


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path):
    path = tmp_path / "tiny.safetensors"
    state = tiny_decoder_state()
    state["model.norm.weight"] = torch.ones(31)
    save_file(state, str(path))

    result = run_cli("plan", path, *TINY_MODEL_OPTIONS, "--json")

    line = assert_one_error_line(result, str(path))
    assert "model.norm.weight" in line
    assert "[32]" in line and "[31]" in line


def test_model_spec_that_cannot_be_imported_is_a_usage_error(tmp_path):
    # The README: usage errors exit 2. A --model that names nothing importable is one.
    path = tmp_path / "tiny.safetensors"
    write_tiny_decoder_checkpoint(path)

    result = run_cli(path, "--model", "no_such_package.models:Thing")

    assert result.returncode == 2 and result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and "no_such_package" in last and "Traceback" not in result.stderr


def test_invalid_toml_config_names_the_config_file(tmp_path):
    path = tmp_path / "tiny.safetensors"
    write_tiny_decoder_checkpoint(path)
    config = tmp_path / "broken.toml"
    config.write_text('[model]\nfactory = "bench.models.transformer:DecoderLM\n', encoding="utf-8")

    result = run_cli(path, "--model", config)

    assert_one_error_line(result, str(config))


def test_unavailable_cuda_device_is_one_error_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here, so --device cuda is valid")
    path = tmp_path / "model.safetensors"
    write_small_safetensors(path)

    result = run_cli(path, "--device", "cuda")

    line = assert_one_error_line(result, None)
    assert "cuda" in line.lower()


# ---------------------------------------------------------------- usage errors: exit 2


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(["--dtype", "nonsense"], id="dtype"),
        pytest.param(["--device", "tpu"], id="device"),
        pytest.param(["--model-arg", "noequals"], id="model-arg"),
        pytest.param(["--no-such-flag"], id="unknown-flag"),
    ],
)
def test_usage_errors_exit_2_without_traceback(tmp_path, options):
    path = tmp_path / "model.safetensors"
    write_small_safetensors(path)

    result = run_cli(path, *options)

    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert options[0] in result.stderr or options[-1] in result.stderr


def test_version_flag_prints_the_version():
    result = run_cli("--version")

    assert result.returncode == 0
    assert materialize.__version__ in result.stdout


# ---------------------------------------------------------------- progress on a terminal

WIDE_MODEL = """from torch import nn


def make() -> nn.Module:
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])
"""
BAR_TEXTS = ("importing torch", "opening ", "building ", "planning ", "loading ", "writing ", "%|", "B/s]")


def write_wide_model(folder: Path) -> tuple[Path, str]:
    """A checkpoint of 50 MB (24 tensors), many reader tasks of 16 MB, and the spec of its model."""
    (folder / "wide.py").write_text(WIDE_MODEL)
    path = folder / "wide.safetensors"
    state = {f"{layer}.{kind}": torch.zeros(shape) for layer in range(12)
             for kind, shape in (("weight", (1024, 1024)), ("bias", (1024,)))}
    save_file(state, str(path))
    return path, f"{folder / 'wide.py'}:make"


def on_a_terminal(*args: object, redraw_each_update: bool = False) -> tuple[int, str, list[str]]:
    """The CLI on a pseudo-terminal: exit code, what the terminal received, what its screen shows after.
    ``redraw_each_update``: tqdm's own TQDM_MININTERVAL=0, so a read of a few milliseconds draws each step."""
    env = {**os.environ, "TQDM_MININTERVAL": "0"} if redraw_each_update else None
    code, output = run_on_a_terminal([materialize_command(), *map(str, args)], env=env)
    return code, output, screen(output)


def assert_no_bar_left(shown: list[str]) -> None:
    left = [line for line in shown if any(text in line for text in BAR_TEXTS)]
    assert left == []


def test_a_terminal_shows_each_step_then_bytes_rate_and_time_left_and_the_report_on_clean_lines(tmp_path):
    path, spec = write_wide_model(tmp_path)

    code, output, shown = on_a_terminal(path, "--model", spec, redraw_each_update=True)

    assert code == 0, output
    steps = ["importing torch", "opening wide.safetensors", f"building {spec}", "planning 24 tensors",
             "loading 24 tensors"]
    assert [output.index(step) for step in steps] == sorted(output.index(step) for step in steps)
    updates = re.findall(r"loading 24 tensors: +(\d+)%\|[^|]*\| ([\d.]+[kMG]?)B/50\.4MB "
                         r"\[\d\d:\d\d<(\d\d:\d\d), ([\d.]+[kMG]?B/s)\]", output)
    assert len(updates) >= 3 and updates[-1][:3] == ("100", "50.4M", "00:00")  # bytes, rate and time left
    assert "0.00 GB/s" not in output.split("checkpoint ")[0]
    assert shown[0].startswith("checkpoint ") and "wide.safetensors" in shown[0]  # the report where the bar was
    assert shown[-1].startswith("host memory growth ")
    assert_no_bar_left(shown)


def test_an_error_after_the_bar_is_drawn_starts_on_a_clean_line(tmp_path):
    _, spec = write_wide_model(tmp_path)
    small = tmp_path / "small.safetensors"
    write_small_safetensors(small)

    code, output, shown = on_a_terminal(small, "--model", spec)

    assert code == 1
    assert "planning 2 tensors" in output  # drawn, then cleared before the error
    assert len(shown) == 1 and shown[0].startswith("Error: ") and "small.safetensors" in shown[0]


def test_a_mapped_load_shows_its_steps_but_no_rate_and_ends_clean(tmp_path):
    path, spec = write_wide_model(tmp_path)

    code, output, shown = on_a_terminal(path, "--model", spec, "--mmap")

    assert code == 0, output
    assert "opening wide.safetensors" in output and "loading 24 tensors" in output
    assert "%|" not in output and "B/s]" not in output  # 0 bytes read: no bar, no 0.00 GB/s rate
    assert shown[0].startswith("checkpoint ") and "zero-copy views       24" in shown
    assert_no_bar_left(shown)


def test_a_warning_during_a_conversion_gets_a_line_of_its_own_above_the_bar(tmp_path):
    source = tmp_path / "stateful.pth"
    torch.save({"w": torch.ones(1000, 1000), "counter._extra_state": {"steps": 3}}, source)

    code, output, shown = on_a_terminal("convert", source, tmp_path / "out.safetensors", redraw_each_update=True)

    assert code == 0, output
    assert "opening stateful.pth" in output and "writing 1 tensor: 100%|" in output
    assert shown[0].startswith("Warning: ") and "counter._extra_state" in shown[0]
    assert shown[1].startswith("source ")
    assert_no_bar_left(shown)


def test_without_a_terminal_nothing_of_the_bar_is_written(tmp_path):
    path = tmp_path / "model.safetensors"
    write_small_safetensors(path)

    result = run_cli(path, env={**os.environ, "TQDM_MININTERVAL": "0"})

    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.startswith("checkpoint ") and "\r" not in result.stdout


def test_output_sent_to_a_file_shows_no_bar_on_the_terminal(tmp_path):
    # `materialize x > report.txt`: the output is a script's; the terminal left with stderr gets no bar
    path, spec = write_wide_model(tmp_path)
    report = tmp_path / "report.txt"

    with report.open("wb") as stdout:
        code, output = run_on_a_terminal([materialize_command(), str(path), "--model", spec],
                                         env={**os.environ, "TQDM_MININTERVAL": "0"}, stdout_to=stdout)

    assert code == 0, output
    assert output == ""
    assert report.read_text().startswith("checkpoint ")


def test_json_output_has_no_progress_bar_even_on_a_terminal(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = write_small_safetensors(path)

    code, output, _ = on_a_terminal(path, "--json", redraw_each_update=True)

    assert code == 0
    assert "\r" not in output.replace("\r\n", "\n")  # only JSON's own line ends: no bar drawn
    assert json.loads(output)["bytes_read"] == nbytes(tensors)


# ---------------------------------------------------------------- zero-copy and staging options


def test_mmap_flag_maps_every_tensor_instead_of_reading_it(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = write_small_safetensors(path)

    result = run_cli(path, "--mmap", "--json")

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(report["mapped"]) == sorted(tensors)
    assert report["bytes_read"] == 0


def test_staging_size_takes_human_sizes_and_rejects_nonsense(tmp_path):
    path = tmp_path / "model.safetensors"
    write_small_safetensors(path)

    good = run_cli(path, "--staging-size", "64MB", "--json")
    bad = run_cli(path, "--staging-size", "lots")

    assert good.returncode == 0, good.stderr
    assert bad.returncode == 2
    assert "not a size" in bad.stderr


# ---------------------------------------------------------------- start-up cost


def test_inspecting_safetensors_never_imports_torch(tmp_path):
    path = tmp_path / "model.safetensors"
    write_small_safetensors(path)
    script = (
        "import sys\n"
        "from materialize_cli.main import main\n"
        f"sys.argv = ['materialize', 'inspect', {str(path)!r}]\n"
        "try:\n    main()\nexcept SystemExit as done:\n    assert done.code in (0, None), done.code\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)

    assert result.returncode == 0, result.stderr
    assert "w " in result.stdout and "bfloat16" in result.stdout
    assert result.stdout.strip().endswith("torch imported: False")


def test_every_dtype_the_cli_offers_parses():
    from materialize.dtypes import parse_dtype
    from materialize_cli.params import DTYPE_CHOICES

    parsed = {name: parse_dtype(name) for name in DTYPE_CHOICES.split(", ")}

    assert parsed["auto"] is None
    assert parsed["bf16"] is torch.bfloat16 and parsed["fp32"] is torch.float32


def test_a_model_factory_that_fails_says_which_and_why_and_a_spec_that_cannot_be_used_is_a_usage_error(tmp_path):
    path = tmp_path / "m.safetensors"
    write_small_safetensors(path)
    factory = tmp_path / "offline_models.py"
    factory.write_text("def create(pretrained=True):\n"
                       "    raise OSError(5, 'Input/output error', 'https://hub.example/weights.bin')\n")

    failed = preforked.run([materialize_command(), str(path), "--model", "offline_models:create"],
                            capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    unusable = run_cli(path, "--model", "no_such_package.models:create")
    wrong_args = preforked.run([materialize_command(), str(path), "--model", "offline_models:create",
                                 "--model-arg", "classes=3"],
                                capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})

    assert failed.returncode == 1
    assert "model factory 'create' failed while building the model: OSError" in failed.stderr
    assert "Input/output error" in failed.stderr and "weights.bin" in failed.stderr
    assert unusable.returncode == 2 and "cannot import 'no_such_package.models'" in unusable.stderr
    assert wrong_args.returncode == 2 and "rejected its arguments" in wrong_args.stderr


def test_check_prints_its_verdict_and_check_finite_fails_on_what_it_finds(tmp_path):
    clean, dirty = tmp_path / "clean.safetensors", tmp_path / "dirty.safetensors"
    save_file({"w": torch.ones(3)}, str(clean))
    save_file({"w": torch.tensor([1.0, float("nan")]), "ok": torch.ones(2)}, str(dirty))

    checked = run_cli(clean, "--check")
    checked_json = run_cli(clean, "--check", "--json")
    finite = run_cli(dirty, "--check-finite")

    assert checked.returncode == 0 and "check                 passed" in checked.stdout
    assert json.loads(checked_json.stdout)["check"] == "passed"
    assert finite.returncode == 1 and "NaN/Inf in" in finite.stdout
    assert finite.stderr.strip() == f"Error: {dirty}: NaN or Inf in 1 tensor(s): w"


def test_a_prefix_that_matches_nothing_is_an_error_and_a_renaming_done_is_reported(tmp_path):
    path = tmp_path / "wrapped.pt"
    torch.save({f"module.{k}": v for k, v in torch.nn.Linear(2, 2).state_dict().items()}, path)
    factory = tmp_path / "linear_model.py"
    factory.write_text("import torch\n\ndef create():\n    return torch.nn.Linear(2, 2)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def run_here(*args: str) -> subprocess.CompletedProcess:
        return preforked.run([materialize_command(), str(path), "--model", "linear_model:create", *args],
                              capture_output=True, text=True, cwd=tmp_path, env=env)

    typo = run_here("--strip-prefix", "modul.")
    automatic = run_here("--json")
    planned = preforked.run([materialize_command(), "plan", str(path), "--model", "linear_model:create", "--json"],
                             capture_output=True, text=True, cwd=tmp_path, env=env)

    assert typo.returncode == 1 and "strip 'modul.' matches no checkpoint name" in typo.stderr
    assert json.loads(automatic.stdout)["key_map"] == "strip 'module.'"
    assert json.loads(planned.stdout)["key_map"] == "strip 'module.'"


def test_plan_offers_only_the_options_it_uses():
    shown = preforked.run([materialize_command(), "plan", "--help"], capture_output=True, text=True).stdout

    assert "--mmap" in shown and "--staging-size" in shown
    assert not any(flag in shown for flag in ("--check ", "--check-finite", "--allow-overflow", "--direct-io"))


def test_running_out_of_host_memory_says_try_mmap_without_a_gpu_and_following_it_loads(tmp_path):
    # A MemoryError the library did not turn into its own error (one the reads raise, say): the CLI's last
    # line of defence suggests a GPU only where there is one, and --mmap, which reads nothing into memory.
    path = tmp_path / "model.safetensors"
    tensors = write_small_safetensors(path)
    reads_fail = (
        "import sys, materialize.io.executor as e; real = e.Reads.read\n"
        "def read(self, jobs, **kw):\n"
        "    if jobs: raise MemoryError()\n"
        "    return real(self, jobs, **kw)\n"
        "e.Reads.read = read\n"
        "from materialize_cli.main import main; sys.argv[0] = 'materialize'; main()"
    )
    run = lambda *extra: preforked.run([sys.executable, "-c", reads_fail, str(path), "--json", *extra],
                                        capture_output=True, text=True, timeout=300)

    failed = run()
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr == "Error: out of host memory while loading; try --mmap, or a machine with more RAM\n"

    followed = run("--mmap")
    assert followed.returncode == 0, followed.stderr
    assert sorted(json.loads(followed.stdout)["mapped"]) == sorted(tensors)
