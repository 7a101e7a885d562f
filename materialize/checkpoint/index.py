"""Sharded checkpoints: a ``*.index.json`` weight map over several files.

Before any shard is opened the index is checked as a whole: every shard path
stays inside the checkpoint folder, and every missing shard is named at once.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable

from ..errors import CheckpointError, CheckpointNotFoundError, summarize_names
from .base import TensorInfo
from .confine import allowed_roots, confine, leaves_folder

SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"

ShardReader = Callable[[Path], dict[str, TensorInfo]]


def read_index(index_path: Path) -> tuple[dict[str, str], dict]:
    try:
        document = json.loads(index_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError("index is not valid UTF-8", path=index_path) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"index is not valid JSON ({exc.msg} at char {exc.pos})", path=index_path) from None
    except (RecursionError, ValueError) as exc:  # nesting past the recursion limit; integers past 4300 digits
        raise CheckpointError(f"index JSON cannot be parsed safely: {type(exc).__name__}", path=index_path) from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if weight_map is None and isinstance(document, dict) and document and all(
            isinstance(value, str) for value in document.values()):
        weight_map = document  # accelerate's load_checkpoint_in_model also takes the name -> file map bare
    # A JSON object's keys are strings; its values are checked by type in one pass, at C speed (an index of a
    # hundred thousand tensors is read by every inspect)
    if not isinstance(weight_map, dict) or not set(map(type, weight_map.values())) <= {str}:
        raise CheckpointError("index has no 'weight_map' object of tensor name to shard file", path=index_path)
    metadata = (document.get("metadata") or {}) if weight_map is not document else {}
    return weight_map, metadata if isinstance(metadata, dict) else {}


def resolve_shards(index_path: Path, weight_map: dict[str, str]) -> dict[str, Path]:
    """Shard file name -> path, refusing any path or symlink that leaves the folder.

    A shard name must be a relative path below the index's folder. A symlink
    may point into the folder or, in a Hugging Face cache snapshot, into the
    repo's ``blobs/`` (that is how the cache stores files); nowhere else
    (see :mod:`materialize.checkpoint.confine`).
    """
    folder = index_path.parent.resolve()
    roots = allowed_roots(folder)
    shards: dict[str, Path] = {}
    missing: list[str] = []
    for shard_name in dict.fromkeys(weight_map.values()):
        if leaves_folder(shard_name):
            raise CheckpointError(f"shard path {shard_name!r} points outside the checkpoint folder", path=index_path)
        path = folder / shard_name
        try:
            present = path.is_file()
        except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL byte
            reason = exc.strerror if isinstance(exc, OSError) else str(exc)
            raise CheckpointError(f"shard path {shard_name[:80]!r} cannot be used: {reason}", path=index_path) from None
        if not present:
            missing.append(shard_name)
            continue
        confine(path, roots, what=f"shard {shard_name!r}", about=index_path)
        shards[shard_name] = path
    if missing:
        raise CheckpointNotFoundError(
            f"index names {len(missing)} missing shard(s): {summarize_names(missing)}", path=index_path
        )
    return shards


def read_sharded(index_path: Path, read_shard: ShardReader) -> tuple[dict[str, TensorInfo], list[Path], dict]:
    weight_map, metadata = read_index(index_path)
    shards = resolve_shards(index_path, weight_map)
    tensors: dict[str, TensorInfo] = {}
    mapped_to = Counter(weight_map.values())  # how many names the index maps to each shard
    for shard_name, shard_path in shards.items():
        found = read_shard(shard_path)
        # Every tensor the shard holds mapped to it, and as many as the index maps there: then the shard holds
        # exactly the index's names for it, told in two passes at C speed. Anything else is looked at by name.
        if len(found) != mapped_to[shard_name] or list(map(weight_map.get, found)).count(shard_name) != len(found):
            _refuse_shard_unlike_index(index_path, weight_map, shard_name, found)
        tensors.update(found)
    ordered = dict(zip(weight_map, map(tensors.__getitem__, weight_map)))  # in the index's order
    return ordered, list(shards.values()), metadata


def _refuse_shard_unlike_index(index_path: Path, weight_map: dict[str, str], shard_name: str,
                               found: dict[str, TensorInfo]) -> None:
    """Raise naming the tensors the index maps to ``shard_name`` that it does not hold, else the first it holds
    that the index maps elsewhere or not at all."""
    expected = {name for name, owner in weight_map.items() if owner == shard_name}
    absent = sorted(expected - found.keys())
    if absent:
        raise CheckpointError(
            f"index maps {summarize_names(absent)} to {shard_name}, which does not hold it", path=index_path
        )
    for name in sorted(found.keys() - expected):
        owner = weight_map.get(name)
        where = f"the index maps it to {owner}" if owner else "the index does not name it"
        raise CheckpointError(f"shard {shard_name} holds tensor '{name}' but {where}", path=index_path, tensor=name)
