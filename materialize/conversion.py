"""Rewrite any checkpoint as safetensors, a batch of tensors at a time: :func:`convert`.

The source is anything :func:`open_checkpoint` reads (torch zip, sharded
``.bin``, safetensors, a Hugging Face folder, a hub id). Tensors are read by
the same engine as a load (the cast included, with its overflow check) into
a batch of at most ``BATCH_BYTES`` (or one tensor, if larger), written, and
dropped, so memory stays near one batch whatever the checkpoint size.

Output: ``dst`` ending in ``.safetensors`` is one file. Any other ``dst`` is
a folder in the Hugging Face layout: ``model.safetensors`` when everything
fits in one shard, else ``model-0000k-of-0000n.safetensors`` shards and
``model.safetensors.index.json``; the source folder's other files
(``config.json``, tokenizer files) are copied beside them. Everything is
written under a temporary name beside ``dst`` and renamed into place at the
end: a conversion that fails leaves nothing at ``dst``.

safetensors has no shared storage: tensors that were views of one storage
in a torch file (a tied embedding saved under two names) are written once
per name.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from .checkpoint import Checkpoint, TensorInfo
from .checkpoint.index import SAFETENSORS_INDEX_NAME
from .checkpoint.safetensors import SAFETENSORS_DTYPES
from .dtypes import parse_dtype
from .engine import Job, ProgressFn, stream
from .errors import ConvertWarning, MaterializeError, OutputError, summarize_names
from .fileio import byte_view
from .gcpause import gc_paused
from .hostmem import empty_destination
from .loading import DtypeLike, _opened
from .hub import resolve as resolve_source
from .sizes import format_bytes, parse_size
from .transfer import staging_for
from .validate import check_bools

BATCH_BYTES = 256 * 1024 * 1024
_CODES = {torch_name: code for code, (torch_name, _) in SAFETENSORS_DTYPES.items()}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


@dataclass
class ConvertReport:
    source: str
    destination: str
    files: list[str]
    tensors: int
    bytes_written: int
    seconds: float
    copied: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        rows = [
            ("source", self.source),
            ("destination", self.destination),
            ("files", ", ".join(Path(f).name for f in self.files)),
            ("tensors", str(self.tensors)),
            ("bytes written", format_bytes(self.bytes_written)),
            ("time", f"{self.seconds:.3f} s"),
        ]
        if self.copied:
            rows.append(("copied", ", ".join(self.copied)))
        return "\n".join(f"{key:<14} {value}" for key, value in rows)


@dataclass(frozen=True)
class _Item:
    info: TensorInfo
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.info.numel * self.dtype.itemsize


@gc_paused
def convert(
    src: Union[str, os.PathLike, Checkpoint],
    dst: Union[str, os.PathLike],
    *,
    dtype: DtypeLike = None,
    shard_size: Union[str, int, None] = "5GB",
    overwrite: bool = False,
    trust_pickle: bool = False,
    allow_overflow: bool = False,
    revision: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
) -> ConvertReport:
    """Write the tensors of ``src`` to ``dst`` as safetensors (see the module docstring).

    Args:
        dtype: cast floating tensors to this dtype (``None``: keep each one's).
        shard_size: the most bytes per shard of a folder output (``None``: one
            file). A tensor larger than a shard gets a shard of its own.
        overwrite: replace an existing ``dst``; otherwise it is an error.
        allow_overflow: let a narrowing cast turn large values into inf.
    """
    started = time.perf_counter()
    cast = parse_dtype(dtype)
    shard_bytes = parse_size(shard_size) if shard_size is not None else None
    destination = Path(dst)
    if (destination.exists() or destination.is_symlink()) and not overwrite:
        raise OutputError("already exists; remove it or pass overwrite=True (CLI: --overwrite)", path=destination)
    source = src if isinstance(src, Checkpoint) else resolve_source(src, revision=revision)
    with _opened(source, trust_pickle) as ckpt:
        if ckpt.extra_states:
            warnings.warn(ConvertWarning(
                f"{ckpt.path}: modules' extra state that is not a tensor ({summarize_names(list(ckpt.extra_states))}) "
                "has no place in safetensors and is left out; keep the torch file for it"), stacklevel=2)
        items = [_Item(info, cast if cast is not None and info.dtype.is_floating_point else info.dtype) for info in ckpt.values()]
        single_file = destination.suffix == ".safetensors"
        shards = [items] if single_file or shard_bytes is None else _groups(items, shard_bytes)
        temporary = destination.parent / f".{destination.name}.partial-{os.getpid()}"
        try:
            written, copied = _write_all(ckpt, source, shards, temporary, single_file, allow_overflow, progress)
            _move_into_place(temporary, destination)
        except BaseException as exc:
            _remove(temporary)
            if isinstance(exc, OSError) and not isinstance(exc, MaterializeError):
                raise OutputError(f"cannot write: {os.strerror(exc.errno) if exc.errno else exc}", path=destination) from None
            raise
        files = [str(destination)] if single_file else [str(destination / name) for name in written]
        return ConvertReport(
            source=os.fspath(ckpt.path), destination=str(destination), files=files, tensors=len(items),
            bytes_written=sum(item.nbytes for item in items), seconds=time.perf_counter() - started, copied=copied,
        )


def _groups(items: list[_Item], limit: int) -> list[list[_Item]]:
    """Consecutive items, at most ``limit`` bytes a group (an item larger than that alone in its own)."""
    groups: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        if groups[-1] and size + item.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.nbytes
    return groups


def _write_all(
    ckpt: Checkpoint, source: object, shards: list[list[_Item]], temporary: Path, single_file: bool,
    allow_overflow: bool, progress: Optional[ProgressFn],
) -> tuple[list[str], list[str]]:
    total = sum(item.nbytes for shard in shards for item in shard)
    done = [0]

    def advanced(nbytes: int) -> None:
        done[0] += nbytes
        if progress is not None:
            progress(done[0], total)

    if single_file:
        _write_file(ckpt, shards[0], temporary, allow_overflow, advanced)
        return [temporary.name], []
    temporary.mkdir()
    names = (
        ["model.safetensors"] if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards):
        _write_file(ckpt, shard, temporary / name, allow_overflow, advanced)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {item.info.name: name for name, shard in zip(names, shards) for item in shard},
        }
        (temporary / SAFETENSORS_INDEX_NAME).write_text(json.dumps(index, indent=2))
    copied = _copy_companions(source, temporary)
    return names, copied


def _write_file(ckpt: Checkpoint, items: list[_Item], path: Path, allow_overflow: bool, advanced) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in items:
        code = _CODES.get(str(item.dtype).removeprefix("torch."))
        if code is None:
            raise OutputError(f"dtype {item.dtype} has no safetensors code", path=ckpt.path, tensor=item.info.name)
        header[item.info.name] = {"dtype": code, "shape": list(item.info.shape), "data_offsets": [offset, offset + item.nbytes]}
        offset += item.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data region starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for batch in _groups(items, BATCH_BYTES):
            tensors = [
                empty_destination(item.info.shape, dtype=item.dtype, device=torch.device("cpu"), name=item.info.name,
                                  path=item.info.path)
                for item in batch
            ]
            stream(
                [Job(tensor, item.info) for tensor, item in zip(tensors, batch)], ckpt.files,
                staging_factory=staging_for, allow_overflow=allow_overflow,
            )
            check_bools((item.info, tensor) for item, tensor in zip(batch, tensors))
            for tensor in tensors:
                if tensor.numel():
                    out.write(byte_view(tensor))
            advanced(sum(item.nbytes for item in batch))
        out.flush()
        os.fsync(out.fileno())


def _copy_companions(source: object, folder: Path) -> list[str]:
    """A Hugging Face folder's other files (config, tokenizer): what makes the output loadable as a model."""
    if isinstance(source, Checkpoint) or not Path(source).is_dir():
        return []
    copied = []
    for path in sorted(Path(source).iterdir()):
        if not path.is_file() or path.name.endswith(_WEIGHT_SUFFIXES) or path.name.endswith(".index.json"):
            continue
        shutil.copyfile(path, folder / path.name)
        copied.append(path.name)
    return copied


def _move_into_place(temporary: Path, destination: Path) -> None:
    if destination.exists() or destination.is_symlink():
        _remove(destination)  # only reached with overwrite=True
    os.replace(temporary, destination)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
