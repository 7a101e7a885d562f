"""A checkpoint described from its headers: what ``materialize inspect --json`` prints, as a library call."""

from __future__ import annotations

from typing import Any, Optional

from .checkpoint import Checkpoint, CheckpointLike, opened
from .integrations.hub import resolve
from .sources import RemoteOptions


def inspect(checkpoint: CheckpointLike, *, trust_pickle: bool = False, state_dict_key: Optional[str] = None,
            revision: Optional[str] = None, stream: bool = False,
            remote: Optional[RemoteOptions] = None) -> dict[str, Any]:
    """Describe a checkpoint without reading any tensor data: the dict ``materialize inspect --json`` prints.

    ``checkpoint`` is anything :func:`open_checkpoint` opens, a hub repo id (``org/name``, at ``revision``,
    found as :func:`load_model` finds it; with ``stream`` its headers are read from the hub, nothing
    downloaded but its JSON files), a URL (``s3://``, ``gs://``, ``az://``, ``https://``, read as ``remote`` says), or an open
    :class:`Checkpoint` (left open); ``trust_pickle`` and ``state_dict_key`` are as there. The dict holds ``path``, ``format``,
    ``state_dict_key`` (the entry taken, or ``None``), ``shards`` (each file's path), ``tensor_count``,
    ``nbytes``, ``metadata`` (a safetensors header's, or an index's) and ``tensors``: one dict per tensor
    with its ``name``, ``dtype`` (torch's name, ``"bfloat16"``), ``shape`` (a list), ``nbytes``, ``file``
    (the name of the file holding it) and ``offset`` (where its bytes start in that file; an empty view that torch
    lets start past its storage is said to start where the storage ends). Every value is
    JSON-ready; names are as the file spells them (the CLI's text form escapes them for a terminal).
    """
    source = checkpoint if isinstance(checkpoint, Checkpoint) else resolve(checkpoint, revision=revision, stream=stream,
                                                                                 remote=remote)
    with opened(source, trust_pickle, state_dict_key) as ckpt:
        return _described(ckpt)


def _described(ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "path": str(ckpt.path),
        "format": ckpt.format,
        "state_dict_key": ckpt.state_dict_key,
        "shards": [str(s) for s in ckpt.shards],
        "tensor_count": len(ckpt),
        "nbytes": ckpt.nbytes,
        "metadata": ckpt.metadata,
        "tensors": [
            {"name": i.name, "dtype": i.dtype_name, "shape": list(i.shape), "nbytes": i.nbytes,
             "file": i.path.name, "offset": i.offset}
            for i in ckpt.values()
        ],
    }
