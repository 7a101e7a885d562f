"""Open any supported checkpoint lazily: headers and indexes, never tensor data.

The format is recognised from the file's first bytes, not its name: a zip or a
pickle stream (torch's legacy format) is a torch checkpoint, a JSON document is a shard index, anything whose first 8
bytes are a plausible header length followed by ``{`` is safetensors.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from ..errors import CheckpointError, CheckpointNotFoundError, StateDictKeyError, UnsupportedFormatError
from ..sources.fileio import read_head
from ..gcpause import gc_paused
from .base import DCP_DATA_SUFFIX, DCP_METADATA_NAME, Checkpoint, TensorInfo
from .confine import allowed_roots, confine
from .index import SAFETENSORS_INDEX_NAME, read_sharded
from .missing import not_found
from .safetensors import read_header
from ..sources import RemoteOptions, as_source
from ..sources.remotepath import RemotePath, is_remote

if TYPE_CHECKING:
    from torch import nn

    from .payload import Payload

__all__ = ["Checkpoint", "CheckpointLike", "TensorInfo", "open_checkpoint", "opened"]

logger = logging.getLogger(__name__)

TORCH_SUFFIXES = (".bin", ".pt", ".pth")
TRAINING_CHECKPOINT_ENDINGS = (".ckpt", ".pth.tar", ".pt.tar")  # Lightning's; ImageNet scripts' model_best.pth.tar
PathLike = Union[str, os.PathLike]
CheckpointLike = Union[str, os.PathLike, RemotePath, Checkpoint]


@gc_paused
def open_checkpoint(path: Union[PathLike, RemotePath], *, trust_pickle: bool = False,
                    state_dict_key: Optional[str] = None, remote: Optional[RemoteOptions] = None) -> Checkpoint:
    """Open a checkpoint file, shard index or Hugging Face-style folder.

    Args:
        path: a ``.safetensors`` file, a torch file (``.pt``/``.pth``/``.bin``,
            zip or legacy), a ``*.index.json`` shard index, or a folder holding
            one of these.
        trust_pickle: allow a torch file holding a pickled ``nn.Module``
            (``torch.save(model)``); its classes are imported and its code may
            run. The module is rebuilt on ``meta`` as ``Checkpoint.module``.
        state_dict_key: the entry of a torch file's saved dict (or of a DCP
            save's) that holds the model's state, for a training checkpoint
            holding more than one (timm's ``state_dict`` and
            ``state_dict_ema``): such a file is refused without it, naming
            each (see :mod:`.modelstate`). The entry taken is
            ``Checkpoint.state_dict_key``. A safetensors file has no entries
            to pick from: naming one is an error.
        remote: how a URL (``s3://bucket/prefix/``, ``https://host/model.safetensors``) is read
            (:class:`~materialize.RemoteOptions`); every format above is read from one as from a
            local path, through ranged GETs (see :mod:`materialize.sources`).

    Only headers, indexes and (for torch files) the pickled structure are
    read; tensor bytes are read later, straight into their destinations.
    A path that names nothing is a :class:`CheckpointNotFoundError` saying
    "no such file or folder" and the closest name there (see :mod:`.missing`).
    """
    target = as_source(path, remote)
    if "\0" in str(target):
        raise CheckpointError("is not a usable file name (it contains a NUL byte)", path=repr(str(target)))
    if not target.exists():
        raise CheckpointNotFoundError("no such object or folder", path=target) if is_remote(target) else not_found(target)
    if target.name == DCP_METADATA_NAME and target.is_file():
        target = target.parent  # a DCP folder's index, as an index.json is a sharded checkpoint's
    if target.is_dir():
        folder = target
        target, passed_over = _choose_from_folder(folder)
        _log_folder_choice(folder, target, passed_over)
    if target.is_dir():
        return _open_dcp(target, state_dict_key)
    if not target.is_file():  # opening a pipe would wait for a writer; a device has no end to read a header from
        raise CheckpointError("is not a regular file (a pipe, socket or device): a checkpoint is read at offsets "
                              "within a file; save the stream to a file first", path=target)
    kind = _sniff(target)
    logger.debug("%s: read as %s (from its first bytes)", target, _KIND_WORDS[kind])
    if kind == "index":
        return _open_index(target, trust_pickle=trust_pickle, state_dict_key=state_dict_key)
    if kind == "safetensors":
        _no_entries_to_pick(target, state_dict_key)
        tensors, metadata = read_header(target)
        return Checkpoint(path=target, format="safetensors", tensors=tensors, shards=[target], metadata=metadata)
    payload = _read_torch(target, legacy=kind == "torch-legacy", trust_pickle=trust_pickle, state_dict_key=state_dict_key)
    return Checkpoint(
        path=target,
        format="torch-module" if payload.module is not None else "torch",
        tensors=payload.tensors,
        shards=[target],
        module=payload.module,
        extra_states=payload.extra_states,
        state_dict_key=payload.key,
        module_metadata=payload.module_metadata if payload.module is None else _versions_of(payload.module),
    )


@contextmanager
def opened(checkpoint: CheckpointLike, trust_pickle: bool, state_dict_key: Optional[str] = None,
           remote: Optional[RemoteOptions] = None) -> Iterator[Checkpoint]:
    """A path opened for the length of the block; an open :class:`Checkpoint` as it is (its caller closes it)."""
    if isinstance(checkpoint, Checkpoint):
        if state_dict_key is not None and state_dict_key != checkpoint.state_dict_key:
            # its tensors were taken from another entry when it was opened: the key would be silently ignored
            raise StateDictKeyError(
                f"was opened with its tensors taken from {_entry_words(checkpoint.state_dict_key)}, not entry "
                f"{state_dict_key!r}: pass state_dict_key to open_checkpoint instead", path=checkpoint.path)
        yield checkpoint  # the caller owns it and closes it
        return
    with open_checkpoint(checkpoint, trust_pickle=trust_pickle, state_dict_key=state_dict_key, remote=remote) as ckpt:
        yield ckpt


def _entry_words(key: Optional[str]) -> str:
    return f"entry {key!r}" if key is not None else "the saved object itself"


def _no_entries_to_pick(path: Path, state_dict_key: Optional[str]) -> None:
    if state_dict_key is not None:  # silently ignored, the option would seem to have picked something
        raise StateDictKeyError(f"is safetensors, a flat map of tensors with no entries to pick from: leave "
                                f"state_dict_key={state_dict_key!r} out", path=path)


def _open_index(index_path: Path, *, trust_pickle: bool, state_dict_key: Optional[str]) -> Checkpoint:
    kinds: set[str] = set()  # of the shards read, each sniffed once
    extra_states: dict[str, Any] = {}
    keys: set[Optional[str]] = set()  # the entries the shards' tensors were taken from
    module_metadata: dict[str, dict[str, Any]] = {}  # the shards' together: each saved its modules' part
    saved_any: list[bool] = []

    def read_shard(shard: Path) -> dict[str, TensorInfo]:
        kind = _sniff(shard)
        if kind == "safetensors":
            _no_entries_to_pick(shard, state_dict_key)
            kinds.add("safetensors")
            return read_header(shard)[0]
        kinds.add("torch")
        payload = _read_torch(shard, legacy=kind == "torch-legacy", trust_pickle=trust_pickle,
                              state_dict_key=state_dict_key)
        if payload.module is not None:
            raise CheckpointError("a shard holds a pickled module, not a state dict", path=shard)
        extra_states.update(payload.extra_states)
        keys.add(payload.key)
        if payload.module_metadata is not None:
            saved_any.append(True)
            module_metadata.update(payload.module_metadata)
        return payload.tensors

    tensors, shards, metadata = read_sharded(index_path, read_shard)
    fmt = f"{kinds.pop()}-sharded" if len(kinds) == 1 else "mixed-sharded"
    return Checkpoint(path=index_path, format=fmt, tensors=tensors, shards=shards, metadata=metadata,
                      extra_states=extra_states, state_dict_key=keys.pop() if len(keys) == 1 else None,
                      module_metadata=module_metadata if saved_any else None)


def _versions_of(module: "nn.Module") -> dict[str, dict[str, Any]]:
    """The ``_metadata`` a pickled module's ``state_dict()`` gives: each module's ``_version``, by its name."""
    return {name: {"version": getattr(part, "_version", None)} for name, part in module.named_modules()}


def _read_torch(path: Path, *, legacy: bool, trust_pickle: bool, state_dict_key: Optional[str]) -> "Payload":
    if legacy and is_remote(path):
        raise UnsupportedFormatError("is a legacy (before torch 1.6) torch file, which is read from local disk only: "
                                     "download it, or save it again with torch.save", path=path)
    if legacy:
        from .torchlegacy import read_torch_legacy  # imports torch, which safetensors headers do not need

        return read_torch_legacy(path, trust_pickle=trust_pickle, state_dict_key=state_dict_key)
    from .torchzip import read_torch_zip  # imports torch only for a pickle that is not a plain state dict

    return read_torch_zip(path, trust_pickle=trust_pickle, state_dict_key=state_dict_key)


def _open_dcp(folder: Path, state_dict_key: Optional[str]) -> Checkpoint:
    from .pieces import pieces_of
    from .dcp import read_dcp  # imports torch.distributed, which other formats do not need

    tensors, key = read_dcp(folder, state_dict_key=state_dict_key)
    shards = sorted({piece.info.path for info in tensors.values() for piece in pieces_of(info)})
    return Checkpoint(path=folder, format="dcp", tensors=tensors, shards=shards, state_dict_key=key)


def _sniff(path: Path) -> str:
    if path.suffix == DCP_DATA_SUFFIX:
        raise UnsupportedFormatError(f"is one data file of a torch.distributed.checkpoint (DCP) folder; open the folder, "
                                     f"{path.parent}", path=path)
    head = _head(path)
    foreign = None if head[8:9] == b"{" else _foreign_format(head, path)  # a safetensors header may start like a magic
    if foreign is not None:
        what, advice = foreign
        raise UnsupportedFormatError(f"is {what}, not a PyTorch checkpoint: {advice}", path=path)
    head = head[:9]
    if (len(head) == 9 and head[8:9] == b"{") or head.startswith(b"version "):
        return "safetensors"  # "version " starts a Git LFS pointer, which that reader explains
    if head.startswith(b"\x80"):
        return "torch-legacy"  # a pickle stream: torch's pre-1.6 format
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")) or path.suffix in TORCH_SUFFIXES:
        return "torch"
    if head.lstrip()[:1] == b"{":
        return "index"
    if len(head) < 9 or path.suffix == ".safetensors":
        return "safetensors"  # the safetensors reader gives the precise error
    raise UnsupportedFormatError(
        "is neither safetensors, a torch zip checkpoint nor a shard index", path=path
    )


_SNIFF_BYTES = 512  # a tar header's magic sits at byte 257


def _head(path: Path) -> bytes:
    """The first bytes of a file, enough to tell its format."""
    return read_head(path, _SNIFF_BYTES)

_READ_BY_US = "this loader reads safetensors, torch.save files and torch.distributed.checkpoint folders"
_MAGIC: tuple[tuple[bytes, str, str], ...] = (  # first bytes, what the file is, what to do
    (b"GGUF", "a GGUF file (llama.cpp's format)", _READ_BY_US),
    (b"\x93NUMPY", "a numpy array file (.npy)", "load it with numpy.load, then save it with safetensors"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras or TensorFlow .h5 weights)", _READ_BY_US),
    (b"\x1f\x8b", "gzip-compressed data", "decompress it first"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data", "decompress it first"),
    (b"\xfd7zXZ\x00", "xz-compressed data", "decompress it first"),
    (b"BZh", "bzip2-compressed data", "decompress it first"),  # so can a safetensors header length start: see _sniff
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive", "extract it first"),
)
_SUFFIXES = {".onnx": "an ONNX model", ".pb": "a TensorFlow graph", ".tflite": "a TensorFlow Lite model",
             ".mlmodel": "a Core ML model", ".msgpack": "a Flax checkpoint (msgpack)"}


def _foreign_format(head: bytes, path: Path) -> Optional[tuple[str, str]]:
    """What a file is and what to do, where its first bytes or its name say it is another format than ours."""
    for magic, what, advice in _MAGIC:
        if head.startswith(magic):
            return what, advice
    if head[257:262] == b"ustar":
        return "a tar archive", "extract it first"
    if path.suffix.lower() in _SUFFIXES and not head.startswith((b"PK\x03\x04", b"\x80")):
        return _SUFFIXES[path.suffix.lower()], _READ_BY_US
    return None


# Hugging Face layout first, safetensors before torch; the first rule that
# matches exactly one file wins, a rule matching several is ambiguous.
_FOLDER_RULES: tuple[Callable[[Path], bool], ...] = (
    lambda p: p.name == SAFETENSORS_INDEX_NAME,
    lambda p: p.name == "model.safetensors",
    lambda p: p.name.endswith(".safetensors.index.json"),
    lambda p: p.suffix == ".safetensors",
    lambda p: p.name == "pytorch_model.bin.index.json",
    lambda p: p.name == "pytorch_model.bin",
    lambda p: p.name.endswith(".index.json"),
    lambda p: p.name.startswith("mp_rank_") and p.name.endswith("_model_states.pt"),  # DeepSpeed, beside its optimizer's
    lambda p: p.suffix in TORCH_SUFFIXES and p.name != "training_args.bin",
    lambda p: p.name.endswith(TRAINING_CHECKPOINT_ENDINGS),
)


def pick_from_folder(folder: Path) -> Path:
    """The one checkpoint a Hugging Face-style folder holds; refused where it is a symlink leading out of the folder."""
    return _choose_from_folder(folder)[0]


def _choose_from_folder(folder: Path) -> tuple[Path, list[Path]]:
    """:func:`pick_from_folder`'s choice, and the other checkpoints the folder holds, which it passed over (a
    ``pytorch_model.bin`` beside ``model.safetensors``; an index's own shards are not others)."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    for rule in _FOLDER_RULES:
        group = [p for p in files if rule(p)]
        if len(group) == 1:
            confine(group[0], allowed_roots(folder), what=f"{group[0].name!r}", about=folder)
            return group[0], _passed_over(files, group[0])
        if len(group) > 1:
            raise CheckpointError(
                f"holds several candidate checkpoints ({', '.join(p.name for p in group)}); pass one of them",
                path=folder,
            )
    # An HTTP folder cannot be listed: its .metadata names the data files, and reading it finds them or says which not.
    if (folder / DCP_METADATA_NAME).is_file() and (is_remote(folder) or any(p.suffix == DCP_DATA_SUFFIX for p in files)):
        return folder, []  # a torch.distributed.checkpoint folder: read as a whole
    raise CheckpointNotFoundError(
        f"holds no safetensors, torch checkpoint or shard index ({_what_folder_holds(files)})"
        + _subfolders_holding_checkpoints(folder),
        path=folder,
    )


# A shard of a sharded checkpoint, as transformers names them: model-00001-of-00004.safetensors
_SHARD_NAME = re.compile(r"-\d+-of-\d+(\.[^.]+)$")
_INDEX_SUFFIX = ".index.json"


def _passed_over(files: list[Path], chosen: Path) -> list[Path]:
    """The files of a folder a rule of :data:`_FOLDER_RULES` takes, ``chosen`` aside, and the shards of an index
    among them (or of ``chosen``) aside: the other checkpoints a user may have meant."""
    candidates = [p for p in files if p != chosen and any(rule(p) for rule in _FOLDER_RULES)]
    indexed = {p.name[:-len(_INDEX_SUFFIX)].rpartition(".")[2] for p in (chosen, *candidates)
               if p.name.endswith(_INDEX_SUFFIX)}  # the suffixes of the files the indexes name: safetensors, bin

    def a_shard(path: Path) -> bool:
        found = _SHARD_NAME.search(path.name)
        return found is not None and found.group(1)[1:] in indexed

    return [p for p in candidates if not a_shard(p)]


def _log_folder_choice(folder: Path, chosen: Path, passed_over: list[Path]) -> None:
    """Which of a folder's checkpoints is read: said (INFO) where it held others, which the load leaves unread."""
    if chosen == folder:
        logger.debug("%s: read as a torch.distributed.checkpoint (DCP) folder", folder)
    elif passed_over:
        logger.info("%s: reading %s, passing over %s (a folder's checkpoint is taken in the Hugging Face order: "
                    "safetensors before torch files, an index before a single file); pass a file to read another",
                    folder, chosen.name, ", ".join(p.name for p in passed_over))
    else:
        logger.debug("%s: reading %s, the folder's one checkpoint", folder, chosen.name)


_KIND_WORDS = {"index": "a shard index", "safetensors": "safetensors", "torch": "a torch zip file",
               "torch-legacy": "a legacy torch file (before torch 1.6)"}


def _subfolders_holding_checkpoints(folder: Path) -> str:
    """Where a folder of components (a diffusers pipeline: unet/, vae/, text_encoder/) keeps its checkpoints."""
    try:
        children = sorted(child for child in folder.iterdir() if child.is_dir())
        holding = [child.name for child in children
                   if any(rule(p) for p in child.iterdir() if p.is_file() for rule in _FOLDER_RULES)]
    except OSError:
        return ""
    if not holding:
        return ""
    kind = "a diffusers pipeline: its" if (folder / "model_index.json").is_file() else "its"
    more = f" and {len(holding) - 5} more" if len(holding) > 5 else ""
    return f"; {kind} subfolders {', '.join(holding[:5])}{more} hold checkpoints: pass one of them"


def _what_folder_holds(files: list[Path]) -> str:
    """The files a folder without a checkpoint holds, those of a known other format named as such."""
    if not files:
        return "no files at all"
    described = []
    roots = allowed_roots(files[0].parent)
    for path in files[:5]:
        try:
            confine(path, roots, what=path.name, about=path)  # a link out of the folder is named, never read
            foreign = _foreign_format(_head(path), path)
        except (OSError, CheckpointError):  # unreadable: named as it is
            foreign = None
        described.append(f"{path.name}: {foreign[0]}" if foreign else path.name)
    more = f", and {len(files) - 5} more" if len(files) > 5 else ""
    return "it has " + ", ".join(described) + more
