"""Every ``--help`` the CLI prints is plain text: no control character but the line ends, no bidi override.

The pages are made from the click group itself (every command it holds, each asked for its help as a user asks,
``materialize --help`` and ``materialize COMMAND --help`` / ``-h``), in process with click's runner: a command
added later is checked without a line here.
"""

from __future__ import annotations

import unicodedata

import click
import pytest
from click.testing import CliRunner

from materialize_cli.main import main

# Cc: C0 and C1 controls (ESC, a carriage return, a backspace); Cf: format characters, the bidirectional
# overrides and isolates (U+202A-U+202E, U+2066-U+2069) and the zero-width ones among them; Zl, Zp: line and
# paragraph separators, which some terminals break lines at.
UNSHOWABLE = {"Cc", "Cf", "Zl", "Zp"}


def command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The group's own path and every command's under it, nested groups included."""
    paths = [prefix]
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            paths += command_paths(command, (*prefix, name))
        else:
            paths.append((*prefix, name))
    return paths


PATHS = command_paths(main)


def unshowable(text: str) -> list[str]:
    return [f"U+{ord(c):04X} at {i}" for i, c in enumerate(text) if c != "\n" and unicodedata.category(c) in UNSHOWABLE]


def test_every_command_is_checked():
    # the group's help, the default command's and the others': a group emptied by mistake checks nothing
    assert {(), ("load",), ("inspect",), ("plan",), ("convert",)} <= set(PATHS)


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("path", PATHS, ids=[" ".join(p) or "materialize" for p in PATHS])
def test_help_holds_no_control_or_bidi_character(path, flag):
    result = CliRunner().invoke(main, [*path, flag], prog_name="materialize")

    assert result.exit_code == 0, result.output
    assert result.output.startswith("Usage: materialize")
    assert unshowable(result.output) == [], result.output


def test_the_escapes_the_help_describes_are_shown_as_text():
    # The group's help says how names from files are shown: the escapes themselves, as text.
    shown = CliRunner().invoke(main, ["--help"], prog_name="materialize").output

    assert "\\x1b" in shown and "\\u202e" in shown and "\\n" in shown
