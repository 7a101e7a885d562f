"""Hub repo ids (``org/name``) resolved to a local folder through huggingface_hub.

A source is a repo id only where it can be one and cannot be a local path
(:func:`looks_like_repo_id`): ``tiny/ful`` beside a folder ``tiny/``, or
``ckpt/model.pt``, is a local path that does not exist, and opening it says
"no such file or folder" and the closest name there, never that the hub
cache lacks it.

Only configs and the weights a load reads are fetched, chosen as a folder
is read (see :func:`materialize.checkpoint.open_checkpoint`): the shards a
``model.safetensors.index.json`` names, else ``model.safetensors``, else the
same for ``pytorch_model.bin``; only a repo with none of these gets all its
weight files. Many repos hold the weights twice (Mistral's
``consolidated.safetensors`` beside the shards, ``original/`` folders), and
a load reads one copy. huggingface_hub's own settings apply unchanged: the
cache location (``HF_HOME``, ``HF_HUB_CACHE``), offline mode
(``HF_HUB_OFFLINE``) and tokens. A repo already in the cache needs no network.

What the cache says is confined like a checkpoint folder's links: the
snapshot a revision resolves to must be a folder of the repo's own
``snapshots/``, and the file naming a branch's commit (``refs/main``) a small
plain file holding a commit hash, or the load is refused naming it and where
it leads (``refs/main`` holding ``../../../elsewhere`` would otherwise make an
offline load read another folder, a FIFO there would hang it).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Optional, Union

from ..errors import CheckpointAccessError, CheckpointError, CheckpointNotFoundError
from ..sources import RemoteOptions, as_source, is_url
from ..sources.remotepath import ObjectInfo, RemotePath

logger = logging.getLogger(__name__)

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
CONFIG_PATTERNS = ["*.json"]
SAFETENSORS_PATTERNS = ["*.safetensors"]
TORCH_PATTERNS = ["*.bin", "*.pt", "*.pth"]
INDEXED_SAFETENSORS = ("model.safetensors.index.json", "model.safetensors")
INDEXED_TORCH = ("pytorch_model.bin.index.json", "pytorch_model.bin")
COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")
MAX_REF_BYTES = 256  # a commit hash, and room for a line end
LOCAL_PREFIXES = ("./", "../", "/", "~")
LOCAL_SUFFIXES = frozenset({".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".tar", ".json", ".toml", ".distcp",
                            ".pkl", ".pickle", ".gguf", ".onnx", ".h5", ".msgpack", ".npz"})


def looks_like_repo_id(source: Union[str, os.PathLike]) -> bool:
    """Whether ``source`` is taken for a hub repo id: ``org/name`` as huggingface_hub validates one, and no
    local path (see :func:`looks_local`)."""
    text = os.fspath(source)
    return bool(REPO_ID.match(text)) and ".." not in text and not looks_local(text) and _valid_for_the_hub(text)


def looks_local(text: str) -> bool:
    """Whether ``text`` names a local file or folder, there or not: something is there, or it starts as a path
    does (``./``, ``../``, ``/``, ``~``), ends in a checkpoint's or config's suffix, or lies in a folder that
    exists here (``tiny/ful`` beside ``tiny/``: a typo of ``tiny/full``, not a repo of the user ``tiny``)."""
    return (
        os.path.lexists(text)
        or text.startswith(LOCAL_PREFIXES)
        or os.path.splitext(text)[1].lower() in LOCAL_SUFFIXES
        or os.path.isdir(os.path.dirname(text) or os.curdir)
    )


def _valid_for_the_hub(text: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def resolve(source: Union[str, os.PathLike, RemotePath], *, revision: Optional[str] = None, stream: bool = False,
            remote: Optional[RemoteOptions] = None) -> Union[Path, RemotePath]:
    """A local path as it is (opening one that does not exist is an error naming the closest name there, see
    :mod:`materialize.checkpoint.missing`); a URL as its remote object or folder; a repo id as the folder of
    its cached snapshot, or with ``stream`` as a remote folder of the repo's files (see :func:`streamed`)."""
    if isinstance(source, RemotePath) or is_url(source):
        if revision is not None:
            raise ValueError(f"revision={revision!r} picks a hub revision; {os.fspath(source)} is a URL")
        return as_source(source, remote)
    if not looks_like_repo_id(source):
        if stream:
            raise ValueError(f"stream=True streams a hub repo's weights; {os.fspath(source)!r} is a local path "
                             "(it is read where it is)")
        return Path(source)
    repo_id = os.fspath(source)
    logger.info("%s: no such local path: read as a hub repo id%s%s", repo_id,
                f" at revision {revision}" if revision is not None else "",
                ", its weights streamed" if stream else " (from the local cache, or downloaded)")
    if stream:
        return streamed(repo_id, revision, remote or RemoteOptions())
    folder = _download(repo_id, revision, CONFIG_PATTERNS)
    for index_name, single_name in (INDEXED_SAFETENSORS, INDEXED_TORCH):
        if (folder / index_name).is_file():
            return _download(repo_id, revision, _shards_named_by(folder / index_name))
        folder = _download(repo_id, revision, [single_name])
        if (folder / single_name).is_file():
            return folder
    folder = _download(repo_id, revision, SAFETENSORS_PATTERNS)
    if not any(folder.glob("*.safetensors")):
        logger.info("%s: the repo holds no safetensors file: falling back to its torch files (%s)", repo_id,
                    ", ".join(TORCH_PATTERNS))
        folder = _download(repo_id, revision, TORCH_PATTERNS)
    return folder


def streamed(repo_id: str, revision: Optional[str], options: RemoteOptions) -> RemotePath:
    """The repo's files as a remote folder: weights read by ranged GETs of the hub's ``resolve`` URLs at the
    revision's commit (so a push during the load changes nothing read), the JSON files (configs, the shard
    index) fetched to the cache through huggingface_hub as a download fetches them; ``HF_TOKEN``,
    ``HF_ENDPOINT`` and the cache settings apply as they do there."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import build_hf_headers

    # (imported here: http.client and ssl would cost every command of the CLI a thirtieth of a second)
    from ..sources.http import Transport
    from ..sources.httpstore import HttpStore

    snapshot = _download(repo_id, revision, CONFIG_PATTERNS)
    commit = snapshot.name  # a snapshot folder is named by its commit
    where = f"{repo_id}@{revision}" if revision else repo_id
    try:
        info = HfApi().model_info(repo_id, revision=commit, files_metadata=True)
    except Exception as exc:  # noqa: BLE001  (its errors are huggingface_hub's many; each becomes one line)
        raise CheckpointAccessError(f"hub request failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                                    path=where) from None
    files = {sibling.rfilename: ObjectInfo(int(sibling.size), None)
             for sibling in info.siblings or [] if sibling.size is not None}
    base = f"{constants.ENDPOINT.rstrip('/')}/{repo_id}/resolve/{commit}/"
    store = HttpStore(base, Transport(options), build_hf_headers(), check_tags=False, files=files, companions=snapshot)
    return RemotePath(store, "", folder=True)


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
    _check_ref(repo_id, revision)
    try:
        return _inside_snapshots(repo_id, Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns)))
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


def _check_ref(repo_id: str, revision: Optional[str]) -> None:
    """The cache's file naming the revision's commit, where there is one: a small plain file holding a hash."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    name = revision or "main"
    if COMMIT_HASH.match(name):
        return  # a commit is looked up under snapshots/ directly
    ref = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs" / name
    if not os.path.lexists(ref):
        return
    if ref.is_symlink() or not ref.is_file():
        target = os.path.realpath(ref)
        raise CheckpointError(f"the hub cache's refs/{name} is not a plain file (it leads to {target})", path=ref)
    if ref.stat().st_size > MAX_REF_BYTES:
        raise CheckpointError(f"the hub cache's refs/{name} holds {ref.stat().st_size:,} bytes, not a commit hash", path=ref)
    held = ref.read_text(encoding="utf-8", errors="replace")
    if not COMMIT_HASH.match(held):
        leads = os.path.normpath(ref.parent.parent / "snapshots" / held)
        raise CheckpointError(f"the hub cache's refs/{name} holds {held!r}, not a commit hash; it would lead to {leads}",
                              path=ref)


def _inside_snapshots(repo_id: str, folder: Path) -> Path:
    """``folder``, the snapshot huggingface_hub gave, refused unless it is a folder of the repo's own ``snapshots/``."""
    from huggingface_hub.file_download import repo_folder_name

    lexical = Path(os.path.normpath(folder))
    repo = lexical.parent.parent
    if lexical.parent.name != "snapshots" or repo.name != repo_folder_name(repo_id=repo_id, repo_type="model"):
        raise CheckpointError(f"the hub cache resolves this repo to {lexical}, outside its own snapshots folder",
                              path=folder)
    real = folder.resolve()
    if not real.is_relative_to(repo.resolve() / "snapshots"):
        raise CheckpointError(f"the hub cache's snapshot {folder.name} is a symlink to {real}, outside the repo's "
                              "cache folder", path=folder)
    return folder
