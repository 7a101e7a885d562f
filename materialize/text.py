"""Text taken from files (tensor names, file names, metadata) made safe to show: :func:`printable`.

A checkpoint chooses its tensor names freely (safetensors allows any JSON
string as a key; a torch file any ``str``), and a folder its file names. Shown
raw, a name can drive the terminal it is printed on (``ESC ] 52`` writes the
clipboard, ``ESC [ 2J`` clears the screen, a carriage return overwrites the
line, U+202E reverses the text after it) or forge a line of output (a newline).
Every text the library and the CLI show to people passes through
:func:`printable`; the exact names stay in the objects (``error.tensor``,
``report.loaded``) and in JSON output.
"""

from __future__ import annotations

import re

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every character Python does not call printable written as its backslash escape.

    The rule, Python's ``str.isprintable``: C0 controls, DEL and C1 controls,
    format characters (the bidirectional overrides U+202A-U+202E, U+2066-U+2069,
    zero-width characters), line and paragraph separators, spaces other than
    U+0020, surrogates (a lone one cannot even be encoded as UTF-8), private-use
    and unassigned code points become ``\\n``, ``\\r``, ``\\t``, ``\\xNN``,
    ``\\uNNNN`` or ``\\UNNNNNNNN``, as ``repr`` writes them. Letters, digits,
    punctuation and symbols of any script (``é``, ``中``) stay as they are, and
    so does the backslash itself: the text stays readable, and a name shown
    escaped is recognizable (JSON output, not this, is the exact form).

    The result has no character outside the printable set, so it holds no
    line break and always encodes to UTF-8. It is at most 4 characters for
    each byte an escaped character takes in UTF-8 (``\\x1b`` for 1 byte,
    ``\\u202e`` for 3; a lone surrogate, which has no UTF-8 form, arrives as
    a 6-byte ``\\ud800`` JSON escape or 3 bytes of a torch file's pickle):
    what it shows of a file is a few times that file's size at most.
    """
    if text.isprintable():  # the common case, at C speed
        return text
    return _OUTSIDE_ASCII.sub(_escape_run, text)


# Runs of characters other than printable ASCII: only those need a look, one character at a time, and only
# where the run as a whole is not printable (a name in another script is one printable run).
_OUTSIDE_ASCII = re.compile(r"[^ -~]+")


def _escape_run(match: re.Match) -> str:
    run = match.group()
    if run.isprintable():
        return run
    return "".join(char if char.isprintable() else _NAMED.get(char) or repr(char)[1:-1] for char in run)
