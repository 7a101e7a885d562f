"""Hub repo ids (``org/name``) resolved to a local folder through huggingface_hub.

Only configs and the weights a load reads are fetched, chosen as a folder
is read (see :func:`materialize.checkpoint.open_checkpoint`): the shards a
``model.safetensors.index.json`` names, else ``model.safetensors``, else the
same for ``pytorch_model.bin``; only a repo with none of these gets all its
weight files. Many repos hold the weights twice (Mistral's
``consolidated.safetensors`` beside the shards, ``original/`` folders), and
a load reads one copy. huggingface_hub's own settings apply unchanged: the
cache location (``HF_HOME``, ``HF_HUB_CACHE``), offline mode
(``HF_HUB_OFFLINE``) and tokens. A repo already in the cache needs no network.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional, Union

from ..errors import CheckpointAccessError, CheckpointNotFoundError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
CONFIG_PATTERNS = ["*.json"]
SAFETENSORS_PATTERNS = ["*.safetensors"]
TORCH_PATTERNS = ["*.bin", "*.pt", "*.pth"]
INDEXED_SAFETENSORS = ("model.safetensors.index.json", "model.safetensors")
INDEXED_TORCH = ("pytorch_model.bin.index.json", "pytorch_model.bin")


def looks_like_repo_id(source: Union[str, os.PathLike]) -> bool:
    text = os.fspath(source)
    return bool(REPO_ID.match(text)) and ".." not in text and not Path(text).exists()


def resolve(source: Union[str, os.PathLike], *, revision: Optional[str] = None) -> Path:
    """A local path as it is; a repo id as the folder of its cached snapshot."""
    if not looks_like_repo_id(source):
        return Path(source)
    repo_id = os.fspath(source)
    folder = _download(repo_id, revision, CONFIG_PATTERNS)
    for index_name, single_name in (INDEXED_SAFETENSORS, INDEXED_TORCH):
        if (folder / index_name).is_file():
            return _download(repo_id, revision, _shards_named_by(folder / index_name))
        folder = _download(repo_id, revision, [single_name])
        if (folder / single_name).is_file():
            return folder
    folder = _download(repo_id, revision, SAFETENSORS_PATTERNS)
    if not any(folder.glob("*.safetensors")):
        folder = _download(repo_id, revision, TORCH_PATTERNS)
    return folder


def _shards_named_by(index: Path) -> list[str]:
    """The files an index maps tensors to; an unreadable index is left for the checkpoint reader to report."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({name for name in weight_map.values() if isinstance(name, str)}) or [index.name]
    except (OSError, ValueError, AttributeError):
        return [index.name]


def _download(repo_id: str, revision: Optional[str], patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}@{revision}" if revision else repo_id
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise CheckpointNotFoundError(
            "not in the local Hugging Face cache, and the hub cannot be reached (offline, HF_HUB_OFFLINE=1 "
            "or no network); download it once where the hub is reachable",
            path=where,
        ) from None
    except RevisionNotFoundError:
        raise CheckpointNotFoundError(f"the hub repo has no revision {revision!r}", path=where) from None
    except GatedRepoError:
        raise CheckpointAccessError("the hub repo is gated: accept its terms and log in (hf auth login)", path=where) from None
    except RepositoryNotFoundError:
        raise CheckpointNotFoundError("no such hub repo (or it is private: log in with hf auth login)", path=where) from None
    except HfHubHTTPError as exc:
        raise CheckpointAccessError(f"hub request failed: {str(exc).splitlines()[0]}", path=where) from None
