"""The small files beside a remote checkpoint (``config.json``, ``generation_config.json``), fetched to local disk.

Building a transformers model reads its configuration through
transformers' own loaders, which read local folders; those files are a few
kilobytes, so they are fetched whole into a temporary folder (removed when
the process exits) while the weights stay remote. The hub's store names its
own cache snapshot instead, filled through huggingface_hub as a local load
fills it.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

from ..errors import CheckpointError
from .remotepath import RemotePath

MAX_COMPANION_BYTES = 16 * 1024 * 1024  # a config or generation config; anything larger is no companion
_made: list[str] = []


def _remove_made() -> None:
    for folder in _made:
        shutil.rmtree(folder, ignore_errors=True)


atexit.register(_remove_made)


def companion_folder(source: RemotePath, *, wanted: Callable[[str], bool] = lambda name: name.endswith("config.json")
                     ) -> Optional[Path]:
    """A local folder holding the small files of the remote folder ``source`` whose names are ``wanted`` (by
    default the configs a model is built from: ``config.json``, ``generation_config.json``), shard indexes
    left out; ``None`` where there are none."""
    given = getattr(source.store, "companions", None)
    if given is not None:
        return given
    folder = source
    try:
        names = [path for path in folder.iterdir() if wanted(path.name) and not path.name.endswith(".index.json")]
    except CheckpointError:
        return None
    names = [path for path in names if path.is_file() and path.info().size <= MAX_COMPANION_BYTES]
    if not names:
        return None
    local = tempfile.mkdtemp(prefix="materialize-companions-")
    _made.append(local)
    for path in names:
        (Path(local) / path.name).write_bytes(path.read_bytes())
    return Path(local)
