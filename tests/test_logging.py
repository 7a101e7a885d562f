"""What a load chose or fell back to without being asked is logged (``logging``, under the ``materialize`` logger):
quiet unless the application configures logging, shown on stderr by the CLI's ``-v``.

The library's records are read with pytest's ``caplog``; the CLI's lines with click's runner, in process.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from torch import nn

import materialize as mz
from materialize_cli import _output
from materialize_cli.main import main

from conftest import write_sharded

TENSORS = {"weight": torch.ones(3, 4), "bias": torch.zeros(3)}


def two_formats(folder: Path) -> Path:
    """A folder holding the same weights twice, as a hub repo often does: safetensors and a torch file."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(TENSORS, str(folder / "model.safetensors"))
    torch.save(TENSORS, folder / "pytorch_model.bin")
    return folder


def records(caplog, name: str, level: int = logging.INFO) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == name and r.levelno == level]


# ---------------------------------------------------------------- the library


def test_each_module_logs_under_the_materialize_logger_which_has_only_a_null_handler():
    import materialize.api
    import materialize.checkpoint
    import materialize.integrations.hub
    import materialize.sources.fileio
    import materialize.loading

    package = logging.getLogger("materialize")
    assert [type(h) for h in package.handlers] == [logging.NullHandler]
    for module in (materialize.api, materialize.checkpoint, materialize.integrations.hub, materialize.sources.fileio,
                   materialize.loading):
        assert module.logger.name == module.__name__ and module.logger.parent is package


def test_the_library_prints_nothing_where_the_application_configured_no_logging(tmp_path, monkeypatch, capsys):
    # Python's last-resort handler writes WARNING and above on stderr where a record finds no handler at all;
    # the package's NullHandler is one, so not even a warning-level record of ours reaches stderr.
    monkeypatch.setattr(logging.root, "handlers", [])  # as in a script that never configured logging
    folder = two_formats(tmp_path / "repo")

    mz.load_tensors(folder)
    logging.getLogger("materialize.checkpoint").warning("a record at the last-resort handler's level")

    assert capsys.readouterr().err == ""


def test_a_folder_of_two_formats_says_which_file_it_reads_and_which_it_passes_over(tmp_path, caplog):
    folder = two_formats(tmp_path / "repo")
    caplog.set_level(logging.INFO, logger="materialize")

    tensors, report = mz.load_tensors(folder)

    assert report.checkpoint.endswith("model.safetensors")
    [record] = records(caplog, "materialize.checkpoint")
    assert record.getMessage().startswith(f"{folder}: reading model.safetensors, passing over pytorch_model.bin (")


def test_an_index_s_own_shards_are_not_passed_over_but_another_format_is(tmp_path, caplog):
    state = {f"w{i}": torch.full((2,), float(i)) for i in range(4)}
    folder = tmp_path / "sharded"
    write_sharded(state, folder, shards=2)
    caplog.set_level(logging.DEBUG, logger="materialize")

    mz.load_tensors(folder)

    assert records(caplog, "materialize.checkpoint") == []  # one checkpoint: nothing to say at INFO
    assert any("the folder's one checkpoint" in r.getMessage()
               for r in records(caplog, "materialize.checkpoint", logging.DEBUG))

    write_sharded(state, folder, kind="bin", shards=2)
    caplog.clear()
    mz.load_tensors(folder)

    [record] = records(caplog, "materialize.checkpoint")
    assert "reading model.safetensors.index.json, passing over pytorch_model.bin.index.json (" in record.getMessage()
    assert record.args[1:3] == ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # no shard named


def test_a_model_on_meta_taking_the_checkpoint_s_dtype_is_said_and_a_cast_asked_for_is_not(tmp_path, caplog):
    path = tmp_path / "m.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in TENSORS.items()}, str(path))
    caplog.set_level(logging.INFO, logger="materialize")
    with mz.meta_init():
        model = nn.Linear(4, 3)

    mz.load(model, path)

    assert model.weight.dtype == torch.bfloat16
    said = [r.getMessage() for r in records(caplog, "materialize.loading")]
    assert f"{path}: the model's tensors on meta take the checkpoint's dtype: 2 tensor(s) in bfloat16 where the " \
           "model has float32; dtype= (CLI --dtype) casts them" in said
    assert any(m.startswith("no device given: the model goes to cpu") for m in said)

    caplog.clear()
    with mz.meta_init():
        model = nn.Linear(4, 3)
    mz.load(model, path, dtype=torch.float32, device="cpu")

    assert records(caplog, "materialize.loading") == []


def test_a_rename_no_key_map_asked_for_is_said(tmp_path, caplog):
    path = tmp_path / "ddp.safetensors"
    save_file({f"module.{k}": v for k, v in TENSORS.items()}, str(path))
    caplog.set_level(logging.INFO, logger="materialize")
    with mz.meta_init():
        model = nn.Linear(4, 3)

    mz.load(model, path, device="cpu")

    said = [r.getMessage() for r in records(caplog, "materialize.loading")]
    assert said == [f"{path}: checkpoint names renamed to the model's, no key_map given: strip 'module.'"]


# ---------------------------------------------------------------- the CLI's -v


def invoke(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args], prog_name="materialize", catch_exceptions=False)


@pytest.mark.parametrize("args", [
    ["-v", "{folder}"], ["{folder}", "-v"], ["-v", "load", "{folder}"], ["--verbose", "{folder}", "--json"],
    ["-v", "inspect", "{folder}"], ["inspect", "{folder}", "--verbose"], ["plan", "-v", "{folder}"],
], ids=lambda args: " ".join(args))
def test_dash_v_shows_the_folder_s_choice_on_stderr_one_escaped_line(tmp_path, args):
    folder = two_formats(tmp_path / "repo\x1b[2J")  # a name that would clear the screen, shown escaped

    result = invoke(*(a.format(folder=folder) for a in args))

    assert result.exit_code == 0, result.stderr
    escaped = str(folder).replace("\x1b", "\\x1b")
    assert f"Info: {escaped}: reading model.safetensors, passing over pytorch_model.bin (" in result.stderr
    assert "\x1b" not in result.stderr and "Debug:" not in result.stderr
    assert "Info:" not in result.stdout  # stdout keeps to the command's output (--json's one object)
    assert _output._LOG_LINES not in logging.getLogger("materialize").handlers  # taken away as the command ends


def test_without_dash_v_nothing_is_logged_on_stderr(tmp_path):
    folder = two_formats(tmp_path / "repo")

    result = invoke(folder)

    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""


@pytest.mark.parametrize("args", [["-vv", "{folder}"], ["-v", "{folder}", "-v"], ["{folder}", "-v", "-v"]])
def test_dash_vv_adds_the_debug_lines(tmp_path, args):
    folder = two_formats(tmp_path / "repo")

    result = invoke(*(a.format(folder=folder) for a in args))

    lines = result.stderr.splitlines()
    assert f"Debug: {folder}/model.safetensors: read as safetensors (from its first bytes)" in lines
    assert any(line.startswith(f"Info: {folder}: reading model.safetensors") for line in lines)


def test_every_command_takes_dash_v():
    for name, command in main.commands.items():
        assert any("-v" in p.opts and "--verbose" in p.opts for p in command.params), name


def test_a_log_line_is_written_above_the_progress_bar(monkeypatch, capsys):
    entered: list[bool] = []

    @contextmanager
    def recording_above_the_bar():
        entered.append(True)
        yield

    monkeypatch.setattr(_output, "above_the_bar", recording_above_the_bar)
    _output.show_logs(1)
    try:
        logging.getLogger("materialize.checkpoint").info("%s: a line\nand a forged one", "name\u202e")
    finally:
        _output.show_logs(0)

    assert entered == [True]
    assert capsys.readouterr().err == "Info: name\\u202e: a line and a forged one\n"
