"""Where a conversion's files go: a new destination placed whole, an existing folder merged into file by file.

:func:`~materialize.convert` checks the destination first
(:func:`check_destination`), writes everything under a temporary name
(:func:`staging`), and only then puts it in place (:func:`place`):

- a new destination, file or folder, is one rename: a conversion that fails
  leaves nothing at it;
- an existing file (``overwrite=True``, a ``.safetensors`` destination) is
  replaced by one rename: a reader sees the old file or the new one;
- an existing folder (``overwrite=True``) is merged into: the files written
  are renamed into it one by one (shards first, the shard index last), then
  what an earlier conversion wrote there under this conversion's own names
  (:data:`OUTPUT_NAME`) and this one did not write again is removed: shards
  of another count, a ``model.safetensors`` where the output is now sharded,
  an index where it is now one file. A loader would otherwise find two
  checkpoints, or an index naming stale shards. Every other file and
  subfolder stays as it was: notes, other ``.safetensors`` files, and
  companion files (``tokenizer.json``) this conversion's source did not have.

The merge's guarantee: a conversion that fails, or is interrupted, while
writing leaves the folder as it was (its files are written in a hidden
folder inside it, removed on failure). A failure or interruption while the
files are moved puts back every file replaced or removed so far, as it was
(each kept, as a hard link where the file system has them, until the last
move is done). What is weaker: a process killed during the moves (renames
within the folder, a fraction of a second) leaves them half done, the old
files in a hidden ``.materialize-replaced-*`` folder in it; and a reader of
the folder during the moves may see some new files beside old ones (new
shards named as the old ones beside the old index). Each file, though, is
always there whole, old or new: a replaced file is never missing, not even
for an instant, where the file system has hard links.

A process killed while writing cannot remove its staging: each is named for
its host and process id, and the next conversion to that destination on the
same host removes those no process has now (:func:`left_by_the_killed`).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from ..checkpoint.index import SAFETENSORS_INDEX_NAME as INDEX_NAME
from ..errors import OutputError

# The names a folder output's weights have: model.safetensors, model-00001-of-00003.safetensors, the index.
OUTPUT_NAME = re.compile(r"model(-\d{5,}-of-\d{5,})?\.safetensors|model\.safetensors\.index\.json")
REPLACES = ("model.safetensors or its model-0000k-of-0000n.safetensors shards and index, and the source's "
            "config and tokenizer files")  # what an existing folder's refusal says overwrite would replace


def shard_names(count: int) -> list[str]:
    """The file names of a folder output of ``count`` shards."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def check_destination(destination: Path, *, single_file: bool, overwrite: bool) -> bool:
    """Refuse a destination the conversion may not write; True where it merges into an existing folder.

    A destination is never turned into the other kind, ``overwrite`` or
    not: a folder where one file is meant, or a file where a folder is.
    """
    if not os.path.lexists(destination):
        return False
    there = what_is_there(destination)
    if single_file:
        if destination.is_dir():
            raise OutputError(f"is {there}, and a destination ending in .safetensors is one file, never written in "
                              "place of a folder (even with overwrite): remove it, or name another file",
                              path=destination)
        if not _file_or_link(destination):
            raise OutputError(f"is {there}, not a file a conversion may replace", path=destination)
        if not overwrite:
            raise OutputError("already exists; remove it, or pass overwrite=True (CLI: --overwrite) to replace it",
                              path=destination)
        return False
    if not destination.is_dir():
        raise OutputError(f"is {there}, and a destination not ending in .safetensors is a folder, never written in "
                          "place of a file (even with overwrite): remove it, or name another folder (or a "
                          ".safetensors file, to write one file)", path=destination)
    if not overwrite:
        raise OutputError(f"already exists; remove it, or pass overwrite=True (CLI: --overwrite) to replace in it what "
                          f"a conversion writes ({REPLACES}), keeping every other file", path=destination)
    return True


def check_room(folder: Path, names: list[str]) -> None:
    """Refuse, before anything is written, a merge into ``folder`` where a name the conversion writes is taken
    by a folder (or a pipe, a device): a file cannot be renamed over it."""
    for name in names:
        there = folder / name
        if os.path.lexists(there) and not _file_or_link(there):
            raise OutputError(f"holds {name!r}, {what_is_there(there)}, where the conversion writes a file: move it "
                              "away, or convert to another folder", path=folder)


def what_is_there(path: Path) -> str:
    """What ``path`` is, in words: a file, a folder, a symlink to one, ..."""
    if path.is_symlink() and not path.exists():
        return "a symlink to a path that does not exist"
    kind = "a folder" if path.is_dir() else "a file" if path.is_file() else "a pipe, socket or device"
    return f"a symlink to {kind}" if path.is_symlink() else kind


# This process, as a staging name says it: a conversion killed before it could remove its staging left it
# under this mark, and a later one on this host removes it once no process has that id (see left_by_the_killed)
_HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"
_MARK = re.compile(r"(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)(?:-|$)")
MERGE_STAGING = ".materialize-partial-"


def _mark() -> str:
    return f"{_HOST}-{os.getpid()}"


def staging(destination: Path, *, single_file: bool, merging: bool) -> Path:
    """Where the files are written before :func:`place`: beside a new destination or a replaced file (one
    rename puts it in place), inside a folder merged into (renames within it, never across file systems).
    Named for this host and process (:func:`left_by_the_killed`)."""
    if merging:
        return Path(tempfile.mkdtemp(prefix=f"{MERGE_STAGING}{_mark()}-", dir=destination))
    staged = destination.parent / f".{destination.name}.partial-{_mark()}"
    if not single_file:
        staged.mkdir()  # not mkdtemp: the folder, renamed into place, keeps the mode the user's umask gives
    return staged


def left_by_the_killed(destination: Path, *, merging: bool) -> list[Path]:
    """The stagings of earlier conversions to ``destination`` that were killed before they could remove them
    (a failed conversion removes its own): named for this host and a process id no process has now. A
    staging of another host (a shared file system), of a live process (a conversion under way), or named
    otherwise is never among them."""
    folder, prefix = (destination, MERGE_STAGING) if merging else (destination.parent, f".{destination.name}.partial-")
    found = []
    try:
        names = _names_in(folder)
    except OSError:
        return []
    for name in names:
        mark = _MARK.match(name, len(prefix)) if name.startswith(prefix) else None
        if mark is not None and mark["host"] == _HOST and not _alive(int(mark["pid"])):
            found.append(folder / name)
    return found


def _alive(pid: int) -> bool:
    """Whether a process of this id may be running; where that cannot be told, it may (its files are kept)."""
    if pid <= 0 or pid == os.getpid():  # (0 and negative ids signal process groups)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process (PermissionError), or an id past any there is
        return True
    return True


def place(staged: Path, destination: Path, names: list[str], *, merging: bool) -> list[str]:
    """Put the files written at ``staged`` (those ``names``, in a folder) at ``destination`` (see the module
    docstring); returns the names of an earlier conversion's files removed from a folder merged into."""
    if not merging:
        os.replace(staged, destination)
        return []
    stale = sorted((name for name in _names_in(destination)
                    if OUTPUT_NAME.fullmatch(name) and name not in names and _file_or_link(destination / name)),
                   key=lambda name: (name != INDEX_NAME, name))  # the index first: it names the shards
    aside = Path(tempfile.mkdtemp(prefix=".materialize-replaced-", dir=destination))
    moved: list[tuple[str, bool]] = []  # each name changed so far, and whether its old file is in `aside`
    try:
        for name in sorted(names, key=_placing_order):
            target = destination / name
            kept = os.path.lexists(target)
            if kept:
                _keep(target, aside / name)
            moved.append((name, kept))
            os.replace(staged / name, target)
        for name in stale:
            os.replace(destination / name, aside / name)
            moved.append((name, True))
    except BaseException:
        _put_back(moved, destination, aside)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    shutil.rmtree(staged, ignore_errors=True)  # empty by now
    return stale


def remove(path: Path, *, whole: bool = False) -> None:
    """A staging file or folder, gone (a failed conversion's); a folder's files that cannot be removed are
    left quietly, unless ``whole`` asks the OSError of the first."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=not whole)
    elif os.path.lexists(path):
        path.unlink()


def cleared(leftovers: list[Path]) -> tuple[list[Path], list[tuple[Path, OSError]]]:
    """Those of ``leftovers`` (:func:`left_by_the_killed`) removed whole, and each one that could not be with
    why: what :func:`remove` leaves quietly on a failure path, a sweep says."""
    removed, kept = [], []
    for path in leftovers:
        try:
            remove(path, whole=True)
        except OSError as error:
            kept.append((path, error))
        else:
            removed.append(path)
    return removed, kept


def _placing_order(name: str) -> int:
    # shards before the files beside them, the index last: an index never names a shard not yet there
    if name == INDEX_NAME:
        return 2
    return 0 if OUTPUT_NAME.fullmatch(name) else 1


def _keep(target: Path, kept: Path) -> None:
    """``target``'s file kept at ``kept`` until the merge is done: a second link, so ``target`` is never
    missing while it is replaced; moved there where the file system has no hard links."""
    try:
        os.link(target, kept, follow_symlinks=False)
    except OSError:
        os.replace(target, kept)


def _put_back(moved: list[tuple[str, bool]], destination: Path, aside: Path) -> None:
    """Undo the moves of a merge that failed: each old file back in place, each new one gone."""
    for name, kept in reversed(moved):
        try:
            if kept and _same_file(aside / name, destination / name):
                os.unlink(aside / name)  # still in place (it was linked, not moved): renaming a link over it does nothing
            elif kept:
                os.replace(aside / name, destination / name)
            elif os.path.lexists(destination / name):
                os.unlink(destination / name)
        except OSError:
            pass  # what cannot be put back stays in `aside`, which is then kept
    try:
        aside.rmdir()
    except OSError:
        pass


def _same_file(one: Path, other: Path) -> bool:
    try:
        return os.path.samestat(os.lstat(one), os.lstat(other))
    except OSError:
        return False


def _names_in(folder: Path) -> list[str]:
    with os.scandir(folder) as entries:
        return [entry.name for entry in entries]


def _file_or_link(path: Path) -> bool:
    """A regular file, or a symlink (renaming over it replaces the link, never what it leads to)."""
    return path.is_symlink() or path.is_file()
