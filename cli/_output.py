"""Everything the CLI writes goes through here: text escaped (see materialize.text.printable), JSON strict.

Text: each line of a command's output, each ``Error:``, ``Warning:``, ``Info:``
and ``Debug:`` line (the last two: the library's log records, with ``-v``) and
each step the progress bar names pass through
:func:`~materialize.text.printable`, so no control character of a tensor or
file name reaches the terminal and no name adds a line; the only control
characters written are the line ends (and the progress bar's own carriage
returns).

JSON: :func:`json_text` writes strict JSON (RFC 8259, I-JSON): ``NaN``,
``Infinity`` and ``-Infinity`` (which a shard index's metadata can hold, as
Python's json reads them) are written as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``; a lone surrogate in a string (a tensor
name can hold one; it has no UTF-8 form) as the text of its escape,
``"\\ud800"`` (a backslash, then ``ud800``); everything else exactly.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Iterable
from typing import Any, Optional

import click

import materialize as mz
from materialize.progress import above_the_bar
from materialize.text import printable

JSON_HELP = ('Print one JSON object on stdout and nothing else there (strict JSON: NaN and infinities as the '
             'strings "NaN", "Infinity", "-Infinity").')
# Deeper than this, a value (a shard index's metadata) is refused rather than printed: writing it would take a
# Python frame a level, and the nesting of a file's JSON is the file's choice.
MAX_JSON_DEPTH = 200
_LINES_PER_WRITE = 1024
_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def never_fail_to_encode() -> None:
    """Characters the terminal's encoding lacks (an ``é`` where stdout is ASCII) are written as backslash
    escapes instead of failing the command with a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def echo_lines(lines: Iterable[str], *, escaped: bool = False) -> None:
    """Write ``lines`` on stdout, each escaped, a batch at a time: never the whole text at once. ``escaped``:
    the lines were made of escaped parts already (``inspect``'s hundred thousand rows are not escaped twice)."""
    batch: list[str] = []
    for line in lines:
        batch.append(line if escaped else printable(line))
        if len(batch) >= _LINES_PER_WRITE:
            click.echo("\n".join(batch))
            batch.clear()
    if batch:
        click.echo("\n".join(batch))


def one_line(text: str) -> str:
    """``text`` as one escaped line: its whitespace runs (line breaks too) become one space each."""
    return printable(" ".join(text.split()))


def echo_stderr_line(prefix: str, text: str) -> None:
    click.echo(f"{prefix}: {one_line(text)}", err=True)


class _StderrLines(logging.Handler):
    """The library's log records on stderr, each one escaped line (``Info: ...``, ``Debug: ...``), above the
    progress bar as a warning is: the CLI's ``-v``."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            with above_the_bar():
                echo_stderr_line(record.levelname.capitalize(), text)
        except Exception:  # a record that cannot be written is logging's to report, never the command's failure
            self.handleError(record)


_LOG_LINES = _StderrLines()
VERBOSE_HELP = ("Log on stderr what was chosen or fallen back to unasked (the file read of a folder, the dtype "
                "kept, a request retried); -vv: more detail.")


def show_logs(verbosity: int) -> None:
    """Show the ``materialize`` logger's records on stderr: none at 0 (the library's default: quiet), INFO at 1
    (``-v``), DEBUG from 2 (``-vv``). Called again, it replaces what it set; at 0 it takes it away."""
    logger = logging.getLogger("materialize")
    if _LOG_LINES in logger.handlers:
        logger.removeHandler(_LOG_LINES)
        logger.setLevel(logging.NOTSET)
    if verbosity <= 0:
        return
    level = logging.INFO if verbosity == 1 else logging.DEBUG
    _LOG_LINES.setLevel(level)
    logger.setLevel(level)
    logger.addHandler(_LOG_LINES)


def json_text(payload: Any, *, about: Optional[str] = None) -> str:
    """``payload`` as strict JSON, indented (see the module docstring); ``about``: the file a value too deeply
    nested to write is refused for (a :class:`~materialize.CheckpointError` naming it)."""
    return json.dumps(_strict(payload, about), indent=2, allow_nan=False, default=str)


def _strict(value: Any, about: Optional[str], depth: int = 0) -> Any:
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else _NON_FINITE.get(value, "NaN")
    if isinstance(value, (dict, list, tuple)):
        if depth >= MAX_JSON_DEPTH:
            raise mz.CheckpointError(f"its metadata is nested more than {MAX_JSON_DEPTH} levels deep, too deep to "
                                     "print as JSON (without --json, inspect lists its tensors)", path=about)
        if isinstance(value, dict):
            return {_strict(k, about, depth + 1) if isinstance(k, (str, float)) else k: _strict(v, about, depth + 1)
                    for k, v in value.items()}
        return [_strict(v, about, depth + 1) for v in value]
    return value


def _text(value: str) -> str:
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: strict parsers refuse their \ud800 escapes
        return "".join(f"\\u{ord(c):04x}" if 0xD800 <= ord(c) <= 0xDFFF else c for c in value)
    return value
