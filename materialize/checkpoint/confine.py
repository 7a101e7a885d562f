"""A checkpoint folder's files are read from inside it: names and symlinks that lead out are refused.

Whatever a folder names or holds (the shards of an index, a DCP folder's
metadata and chunk files, the checkpoint a folder is opened for, its
``config.json``, the companion files ``convert`` copies) may be a symlink, but
not one that leads out of the folder: a checkpoint from a stranger must not
make a load read, or a conversion copy, ``/etc/passwd`` or ``~/.ssh/id_rsa``.
The one exception is the Hugging Face hub cache, which stores a snapshot's
files as symlinks to its repo's ``blobs/``.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError


_HUB_REPO_FOLDERS = ("models--", "datasets--", "spaces--")  # the cache's repo folders, one per kind of repo


def allowed_roots(folder: Path) -> list[Path]:
    """Where a folder's files may really live: the folder, and in a hub cache snapshot its repo's blobs.

    A folder inside a snapshot (a diffusers pipeline's ``unet/``) counts as
    the snapshot: its files link to the same ``blobs/``.
    """
    folder = folder.resolve()
    roots = [folder]
    for ancestor in (folder, *folder.parents):
        if ancestor.parent.name == "snapshots" and ancestor.parent.parent.name.startswith(_HUB_REPO_FOLDERS):
            roots.append(ancestor.parent.parent / "blobs")
            break
    return roots


def leaves_folder(name: str) -> bool:
    """Whether a file name a checkpoint gives (an index's shard, a DCP chunk file) points out of its folder by itself."""
    candidate = Path(name)
    return candidate.is_absolute() or ".." in candidate.parts or not name.strip()


def confine(path: Path, roots: list[Path], *, what: str, about: Path) -> Path:
    """The real location of ``path``, a file of a checkpoint folder; refused where a symlink leads it out of ``roots``.

    ``roots`` comes from :func:`allowed_roots`. The error (a
    :class:`CheckpointError` about ``about``) names ``what`` (the link, as
    the checkpoint names it) and where it leads; nothing is opened.
    """
    try:
        target = path.resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # a name too long, a NUL byte, a loop (RuntimeError before 3.13)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise CheckpointError(f"{what} cannot be used: {reason}", path=about) from None
    if not any(target.is_relative_to(root) for root in roots):
        raise CheckpointError(f"{what} is a symlink to {target}, outside the checkpoint folder", path=about)
    return target
