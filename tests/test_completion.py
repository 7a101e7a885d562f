"""Shell completion, as docs/library.md tells a user to turn it on (click's, through the ``materialize`` script)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from materialize_cli.main import main

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "library.md"
# eval "$(_MATERIALIZE_COMPLETE=bash_source materialize)"
DOCUMENTED = re.compile(r'^eval "\$\((?P<variable>\w+)=(?P<shell>\w+)_source (?P<script>[\w-]+)\)"', flags=re.M)


def documented() -> dict[str, tuple[str, str]]:
    """shell -> (variable, script) of each ``eval "$(VAR=SHELL_source SCRIPT)"`` line the docs give."""
    return {m["shell"]: (m["variable"], m["script"]) for m in DOCUMENTED.finditer(DOCS.read_text())}


def test_the_docs_name_the_installed_script_and_its_variable():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    given = documented()

    assert set(given) >= {"bash", "zsh"}
    assert "_MATERIALIZE_COMPLETE=fish_source materialize | source" in DOCS.read_text()
    for variable, script in given.values():
        assert script in scripts  # the console script pyproject.toml installs
        assert variable == f"_{script.replace('-', '_').upper()}_COMPLETE"  # the variable click reads for it


def test_the_documented_bash_line_prints_a_bash_completion_script():
    variable, script = documented()["bash"]
    installed = Path(sys.executable).parent / script  # the entry point pip installed beside this Python

    done = subprocess.run([str(installed)], env={**os.environ, variable: "bash_source"}, capture_output=True,
                          text=True, timeout=120)

    assert done.returncode == 0, done.stderr
    assert f"complete -o nosort -F _{script}_completion {script}" in done.stdout
    assert f"_{script.upper()}_COMPLETE=bash_complete" in done.stdout  # how the script asks for completions
    assert done.stdout.lstrip().startswith(f"_{script}_completion() {{")


def complete(monkeypatch, capsys, line: str) -> list[str]:
    """What bash's completion function gets for ``line`` (the cursor at its end): the variables bash sets,
    then the CLI as its entry point runs it."""
    words = line.split(" ")
    monkeypatch.setenv("_MATERIALIZE_COMPLETE", "bash_complete")
    monkeypatch.setenv("COMP_WORDS", line)
    monkeypatch.setenv("COMP_CWORD", str(len(words) - 1))
    with pytest.raises(SystemExit) as done:
        main.main(args=[], prog_name="materialize")
    assert done.value.code == 0
    return capsys.readouterr().out.splitlines()


def test_a_subcommand_name_is_completed(monkeypatch, capsys):
    assert complete(monkeypatch, capsys, "materialize ins") == ["plain,inspect"]
    assert {"plain,inspect", "plain,plan", "plain,convert", "plain,load"} <= set(
        complete(monkeypatch, capsys, "materialize "))
    assert "plain,inspect" in complete(monkeypatch, capsys, "materialize -v ")  # the group's option first
    assert not logging.getLogger("materialize").handlers[1:]  # completing -v turned no logging on


def test_an_option_is_completed_for_a_subcommand_and_for_the_default_one(monkeypatch, capsys):
    assert complete(monkeypatch, capsys, "materialize inspect model.safetensors --revi") == ["plain,--revision"]
    assert complete(monkeypatch, capsys, "materialize model.safetensors --staging") == ["plain,--staging-size"]
