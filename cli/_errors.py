"""One table from exception to the one line the user sees, with a next step."""

from __future__ import annotations

import errno
import os

import materialize as mz
from materialize.text import ELIDED, printable

# Most specific first: the first matching class gives the hint.
HINTS: list[tuple[type[BaseException], str]] = [
    (mz.UnsafeCheckpointError, ""),
    (mz.StateDictKeyError, ""),  # it names each entry and how to pick it
    (mz.UnsupportedFormatError, ""),
    (mz.CheckpointNotFoundError, ""),
    (mz.CheckpointAccessError, ""),
    (mz.CheckpointError, " (run 'materialize inspect' on it to see what it holds)"),
    (mz.KeyMismatchError, ""),  # asks about --model where the names or shapes say so: see ARCHITECTURE
    (mz.InitError, ""),
    (mz.ModelSpecError, ""),
    (mz.DeviceError, " (try --device cpu)"),
    (mz.CastOverflowError, ""),
    (mz.SanitizerError, " (a bug in the model's init or in this loader: please report it)"),
    (mz.MaterializeError, ""),
]

# Where a mismatch's names or shapes say the checkpoint was saved from another architecture (not a head sized for
# other classes, not a prefix): the library says so, and the CLI asks about what the user typed.
ARCHITECTURE = " (is --model the architecture this checkpoint was saved from?)"


def one_line(error: BaseException, *, inspecting: bool = False) -> str:
    """The message printed after 'Error: ' for an error the CLI expects, escaped (see
    :func:`~materialize.text.printable`): a file or tensor name in it cannot drive the terminal.

    ``inspecting``: the command was ``inspect`` already, so no hint sends the user there.
    """
    return printable(_message(error, inspecting))


def _message(error: BaseException, inspecting: bool) -> str:
    if isinstance(error, mz.MaterializeError):
        hint = next(h for cls, h in HINTS if isinstance(error, cls))
        if isinstance(error, mz.KeyMismatchError) and error.architecture_differs:
            hint = ARCHITECTURE
        if "materialize inspect" in hint and (inspecting or not _inspect_would_work(error)):
            hint = ""
        return _flatten(str(error)) + hint
    if isinstance(error, MemoryError):
        import torch  # loaded already: a load ran

        elsewhere = "--device cuda" if torch.cuda.is_available() else "--mmap"  # a GPU only where there is one
        return f"out of host memory while loading; try {elsewhere}, or a machine with more RAM"
    if isinstance(error, OSError):
        where = f"{error.filename}: " if error.filename else ""
        return f"{where}{os.strerror(error.errno or errno.EIO)}"
    return f"unexpected {type(error).__name__}: {_flatten(str(error))} (rerun with --debug for the traceback)"


def _inspect_would_work(error: mz.MaterializeError) -> bool:
    """Whether ``materialize inspect`` opens the file the error is about: a hint is only given where it helps
    (a file damaged in its headers fails there with the same error)."""
    path = getattr(error, "path", None)
    if not path or ELIDED in path:  # a URL shown without its signature: opening it would only be refused
        return False
    try:
        mz.open_checkpoint(path).close()
    except Exception:  # noqa: BLE001 - whatever inspect would meet, the hint would not help
        return False
    return True


def _flatten(text: str) -> str:
    return " ".join(text.split())
