"""A command run on a pseudo-terminal, as a person runs it, and what its screen shows after.

The screen is worked out from the bytes the terminal received, as a terminal
draws them: a carriage return goes back to the start of the line, a line feed
to the next line, ``ESC [ n A`` up n lines and ``ESC [ K`` erases to the end
of the line. Any other escape fails the test: the CLI writes no other.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios
from typing import IO, Optional

COLUMNS, ROWS = 120, 40
_ESCAPE = re.compile(r"\x1b\[(\d*)([A-Za-z])")


def run_on_a_terminal(command: list[str], *, env: Optional[dict] = None, cwd: Optional[str] = None,
                      timeout: float = 300, stdout_to: Optional[IO[bytes]] = None) -> tuple[int, str]:
    """Run ``command`` with stdout and stderr on one pseudo-terminal of ``COLUMNS`` x ``ROWS`` (stdout in
    ``stdout_to`` instead, where given: a redirect to a file); its exit code and every character the terminal
    received (its line ends as ``\\r\\n``, as a terminal gets them)."""
    main_fd, child_fd = pty.openpty()
    fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout_to if stdout_to is not None else child_fd,
                               stderr=child_fd, close_fds=True, env=env, cwd=cwd)
    os.close(child_fd)
    chunks = []
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main_fd)
    return process.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")


def screen(output: str) -> list[str]:
    """The lines a terminal shows after receiving ``output`` (see the module docstring), trailing blanks
    dropped; lines are as long as their text (no wrapping at the terminal's width)."""
    lines: list[list[str]] = [[]]
    row = column = 0
    at = 0
    while at < len(output):
        char = output[at]
        if char == "\x1b":
            escape = _ESCAPE.match(output, at)
            assert escape is not None and escape.group(2) in "AK", f"an escape no terminal test expects: {output[at:at + 12]!r}"
            if escape.group(2) == "A":
                row = max(0, row - int(escape.group(1) or 1))
            else:
                del lines[row][column:]
            at = escape.end()
            continue
        if char == "\r":
            column = 0
        elif char == "\n":
            row += 1
            column = 0
            while len(lines) <= row:
                lines.append([])
        else:
            line = lines[row]
            line.extend(" " * (column - len(line)))
            if column < len(line):
                line[column] = char
            else:
                line.append(char)
            column += 1
        at += 1
    shown = ["".join(line).rstrip() for line in lines]
    while shown and not shown[-1]:
        shown.pop()
    return shown
