"""A path that names nothing: one error, with the nearest name that does exist (:func:`not_found`).

``materialize tiny/ful`` beside a folder ``tiny/full`` is a typo far more
often than a hub repo; the error says so and what was probably meant. The
suggestion replaces each name of the path that does not exist by the closest
one (by :mod:`difflib`) in the folder before it, as far as one is close:
``tny/full/model.safetensor`` is answered with
``tiny/full/model.safetensors``.
"""

from __future__ import annotations

import difflib
import itertools
import os
from pathlib import Path
from typing import Optional, Union

from ..errors import CheckpointNotFoundError
from ..text import printable

# A folder of millions of files is not read whole for a suggestion.
MAX_NAMES_COMPARED = 10_000


def not_found(path: Union[str, os.PathLike]) -> CheckpointNotFoundError:
    """The error for ``path``, which does not exist: "no such file or folder", and "did you mean ...?" where a
    name close to it exists."""
    try:
        leads_to: Optional[str] = os.readlink(path)
    except OSError:  # not a symlink (or no longer there)
        leads_to = None
    if leads_to is not None:
        return CheckpointNotFoundError(f"is a symlink to {printable(leads_to)}, which does not exist", path=path)
    suggestion = nearest_existing(os.fspath(path))
    hint = f"; did you mean {printable(suggestion)}?" if suggestion is not None else ""
    return CheckpointNotFoundError(f"no such file or folder{hint}", path=path)


def nearest_existing(text: str) -> Optional[str]:
    """An existing path close to ``text`` (which names nothing): each of its names that does not exist replaced
    by the closest one in the folder before it, as far as one is close; None where none is.

    ``~`` is not expanded by the library (the shell expands it): a path
    starting with it that exists once expanded is suggested expanded.
    """
    expanded = os.path.expanduser(text)
    if expanded != text and os.path.lexists(expanded):
        return expanded
    path = Path(text)
    corrected = Path(path.anchor)
    changed = False
    for name in path.parts[1:] if path.anchor else path.parts:
        if not os.path.lexists(corrected / name):
            name = _closest(name, corrected)
            if name is None:
                break
            changed = True
        corrected /= name
    return os.fspath(corrected) if changed else None


def _closest(name: str, folder: Path) -> Optional[str]:
    try:  # a folder that is not one, or cannot be read: no suggestion, the error stands without one
        with os.scandir(folder) as entries:
            names = [entry.name for entry in itertools.islice(entries, MAX_NAMES_COMPARED)]
    except OSError:
        return None
    found = difflib.get_close_matches(name, names, n=1)
    return found[0] if found else None
