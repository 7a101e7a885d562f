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
written under a temporary name and renamed into place at the end: a
conversion that fails leaves ``dst`` as it was (nothing, where it was not
there). ``overwrite=True`` replaces an existing file, and in an existing
folder only what a conversion writes, keeping every other file in it; a file
is never turned into a folder, nor a folder into a file (see
:mod:`materialize.io.destination` for the exact guarantee).

safetensors has no shared storage: tensors that were views of one storage
in a torch file (a tied embedding saved under two names) are written once
per name.

Hostile sources: every file written lies inside ``dst`` by construction (the
only names taken from the source, its companion files', are reduced to base
names and checked after resolution); a companion file that is a symlink
leading out of the source folder is refused, never copied; and a tensor that
would write far more than the bytes it reads (a view that repeats a few
stored bytes, as ``expand`` makes) is refused unless ``allow_expansion=True``
(see :func:`convert`).
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

from .checkpoint import Checkpoint, TensorInfo, opened
from .checkpoint.confine import allowed_roots, confine
from .checkpoint.safetensors import SAFETENSORS_DTYPES
from .dtypes import parse_dtype
from .checkpoint.pieces import Job
from .io.executor import Reads, reads
from .options import ProgressFn, ReadOptions
from .progress import ProgressLike, counted, report_phase, takes_progress
from .io.destination import (INDEX_NAME, check_destination, check_room, cleared, left_by_the_killed, place, remove,
                             shard_names, staging)
from .errors import ConvertWarning, ExpansionError, MaterializeError, ModelSpecError, OutputError, summarize_names
from .sources.fileio import byte_view
from .gcpause import gc_paused
from .io.hostmem import empty_destination
from .loading import DtypeLike, announce_opening
from .integrations.hub import resolve as resolve_source
from .sources.companions import companion_folder
from .sources.remotepath import RemotePath
from .sizes import format_bytes, parse_size
from .text import printable

BATCH_BYTES = 256 * 1024 * 1024
# A tensor may write up to MAX_EXPANSION times the bytes it reads (a cast from fp8 to fp32 is 4x) without
# counting as expanded; what expanded tensors write beyond that may total EXPANSION_ALLOWANCE per conversion.
MAX_EXPANSION = 16
EXPANSION_ALLOWANCE = 16 * 1024 * 1024
_CODES = {torch_name: code for code, (torch_name, _) in SAFETENSORS_DTYPES.items()}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


@dataclass
class ConvertReport:
    """The outcome of one :func:`convert`. ``str(report)`` is a table, its names escaped; :meth:`to_dict` is
    JSON-ready (``materialize convert --json``).

    Fields:
        source: the checkpoint converted (its path, or a hub repo's local folder).
        destination: the file or folder written.
        files: the safetensors files written (a folder's shards; its index, if any, lies beside them).
        tensors: how many tensors were written.
        bytes_written: the bytes of tensor data written.
        seconds: how long the conversion took.
        copied: the source folder's other files copied beside them (``config.json``, tokenizer files).
        state_dict_key: the entry of the source's saved dict its tensors came from.
        removed: an earlier conversion's shards and index in ``destination`` that this one did not write
            again (``overwrite``), removed so that the folder holds one checkpoint.
        cleared: what conversions to ``destination`` killed midway had left (their hidden staging, named for
            this host and their process, which no process has now), removed before this one wrote; one that
            cannot be removed is left, and named in a ``ConvertWarning``.
    """

    source: str
    destination: str
    files: list[str]
    tensors: int
    bytes_written: int
    seconds: float
    copied: list[str] = field(default_factory=list)
    state_dict_key: Optional[str] = None
    removed: list[str] = field(default_factory=list)
    cleared: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Every field, as JSON-ready values."""
        return asdict(self)

    def __str__(self) -> str:
        rows = [
            ("source", self.source + (f" (entry {self.state_dict_key!r})" if self.state_dict_key is not None else "")),
            ("destination", self.destination),
            ("files", ", ".join(Path(f).name for f in self.files)),
            ("tensors", str(self.tensors)),
            ("bytes written", format_bytes(self.bytes_written)),
            ("time", f"{self.seconds:.3f} s"),
        ]
        if self.copied:
            rows.append(("copied", ", ".join(self.copied)))
        if self.removed:
            rows.append(("removed", ", ".join(self.removed) + " (an earlier conversion's)"))
        if self.cleared:
            rows.append(("cleared", ", ".join(Path(p).name for p in self.cleared) + " (left by a conversion killed midway)"))
        # escaped: the source's file names (its companion files') are the source's choice
        return "\n".join(f"{key:<14} {printable(value)}" for key, value in rows)


@dataclass(frozen=True)
class _Item:
    info: TensorInfo
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.info.numel * self.dtype.itemsize


@gc_paused
@takes_progress
def convert(
    src: Union[str, os.PathLike, Checkpoint],
    dst: Union[str, os.PathLike],
    *,
    dtype: DtypeLike = None,
    shard_size: Union[str, int, None] = "5GB",
    overwrite: bool = False,
    trust_pickle: bool = False,
    state_dict_key: Optional[str] = None,
    allow_overflow: bool = False,
    allow_expansion: bool = False,
    revision: Optional[str] = None,
    progress: ProgressLike = None,
) -> ConvertReport:
    """Write the tensors of ``src`` to ``dst`` as safetensors, a batch of tensors at a time.

    ``src`` is anything :func:`open_checkpoint` opens, a Hugging Face folder or a hub repo id (at
    ``revision``). ``dst`` ending in ``.safetensors`` is one file; any other ``dst`` is a folder in the
    Hugging Face layout: ``model.safetensors``, or shards and ``model.safetensors.index.json``, with the
    source folder's config and tokenizer files copied beside them. It is written under a temporary name and
    renamed at the end: a failed conversion leaves ``dst`` as it was. Memory stays near one batch (256 MiB)
    whatever the checkpoint's size.

    Args:
        dtype: cast floating tensors to this dtype (``None``: keep each one's).
        shard_size: the most bytes per shard of a folder output (``None``: one
            file). A tensor larger than a shard gets a shard of its own.
        overwrite: write over an existing ``dst``; otherwise it is an error.
            A ``.safetensors`` file is replaced. In a folder only what a
            conversion writes is: the shards (``model.safetensors``,
            ``model-0000k-of-0000n.safetensors``), the index
            ``model.safetensors.index.json`` and the files copied from the
            source folder (``config.json``, tokenizer files). Shards and an
            index of an earlier conversion that this one does not write
            again (another shard count, one file where it is now sharded)
            are removed, so that the folder holds one checkpoint
            (``ConvertReport.removed``); every other file and subfolder
            stays, ``.safetensors`` files of other names included. A file
            where a folder is meant, or a folder where a ``.safetensors``
            file is, is refused even so.
        trust_pickle: see :func:`open_checkpoint`.
        state_dict_key: the entry of a training checkpoint whose tensors are
            written, where it holds several (see :func:`open_checkpoint`).
        allow_overflow: let a narrowing cast turn large values into inf.
        allow_expansion: write tensors that expand their stored bytes past
            the limit in full. By default a tensor writing more than
            ``MAX_EXPANSION`` (16) times the bytes of the storage span it
            reads counts as expanded, and expanded tensors may write at most
            ``EXPANSION_ALLOWANCE`` (16 MiB) beyond that in all; past it the
            conversion is an :class:`~materialize.errors.ExpansionError`
            naming the tensor, before anything is written. A torch file of
            2 KB can hold ``torch.zeros(1).expand(400_000_000)``: 1.6 GB to write.
            Tensors sharing a storage (a tie, views of one weight) each read
            their own span and never count as expanded.
        revision: the hub revision (branch, tag or commit) when ``src`` is a repo id.
        progress: as :func:`~materialize.load`'s; the bytes are those written.

    Raises:
        CheckpointError: a companion file of a source folder is a symlink
            leading out of it (besides everything :func:`open_checkpoint` refuses).
        OutputError: ``dst`` exists (without ``overwrite``), is a file where
            a folder is meant or a folder where a file is, cannot be written,
            holds a folder under a name the conversion writes, a companion file's
            name cannot be a file name in it, or a tensor's name cannot be a
            safetensors name: ``__metadata__`` (the header's metadata) or one
            holding a lone surrogate (no UTF-8 form). Such a tensor is refused,
            never renamed, before anything is written: rename it in the source.
    """
    started = time.perf_counter()
    cast = parse_dtype(dtype)
    shard_bytes = parse_size(shard_size) if shard_size is not None else None
    destination = Path(dst)
    single_file = destination.suffix == ".safetensors"
    merging = check_destination(destination, single_file=single_file, overwrite=overwrite)
    announce_opening(progress, src)  # before a hub id's download, which is part of the opening
    source = src if isinstance(src, Checkpoint) else resolve_source(src, revision=revision)
    with opened(source, trust_pickle, state_dict_key) as ckpt:
        if ckpt.extra_states:
            warnings.warn(ConvertWarning(
                f"{ckpt.path}: modules' extra state that is not a tensor ({summarize_names(list(ckpt.extra_states))}) "
                "has no place in safetensors and is left out; keep the torch file for it"), stacklevel=2)
        items = [_Item(info, cast if cast is not None and info.dtype.is_floating_point else info.dtype) for info in ckpt.values()]
        _check_names(items)
        if not allow_expansion:
            _check_expansion(items)
        companions = [] if single_file else _companions(source)  # refused before a byte is written, as expansion is
        config = _read_config(companions) if cast is not None else None  # so is a config.json that cannot be read
        shards = [items] if single_file or shard_bytes is None else _groups(items, shard_bytes)
        weights = [] if single_file else shard_names(len(shards))
        copied = [name for _, name in companions]
        outputs = weights + ([INDEX_NAME] if len(shards) > 1 else []) + copied
        if merging:
            check_room(destination, outputs)
        temporary: Optional[Path] = None
        report_phase(progress, f"writing {counted(len(items), 'tensor')}")
        swept, kept = cleared(left_by_the_killed(destination, merging=merging))
        for leftover, error in kept:  # housekeeping: the conversion asked for goes on
            reason = os.strerror(error.errno) if error.errno else str(error)
            warnings.warn(ConvertWarning(f"{leftover}: a killed conversion's staging cannot be removed ({reason}); "
                                         "it is left as it is: remove it by hand"), stacklevel=2)
        try:
            temporary = staging(destination, single_file=single_file, merging=merging)
            with reads(ckpt.files, ReadOptions(allow_overflow=allow_overflow)) as reader:
                _write_all(ckpt, companions, shards, weights, temporary, single_file, reader, progress)
            if cast is not None and "config.json" in copied:
                _config_says_dtype(temporary / "config.json", cast, config)
            removed = place(temporary, destination, outputs, merging=merging)
        except BaseException as exc:
            if temporary is not None:
                remove(temporary)
            if isinstance(exc, OSError) and not isinstance(exc, MaterializeError):
                raise OutputError(f"cannot write: {os.strerror(exc.errno) if exc.errno else exc}", path=destination) from None
            raise
        files = [str(destination)] if single_file else [str(destination / name) for name in weights]
        return ConvertReport(
            source=os.fspath(ckpt.path), destination=str(destination), files=files, tensors=len(items),
            bytes_written=sum(item.nbytes for item in items), seconds=time.perf_counter() - started, copied=copied,
            state_dict_key=ckpt.state_dict_key, removed=removed, cleared=[str(path) for path in swept],
        )


def _check_names(items: list[_Item]) -> None:
    """Refuse, before anything is written, a tensor name a safetensors file cannot hold.

    ``__metadata__`` is where the header keeps the file's metadata (safetensors
    and this library's reader refuse a tensor under it), and a name with a lone
    surrogate (a torch file's ``str`` can hold one) has no UTF-8 form, which the
    header's JSON must have. Neither is renamed silently: a load by name would
    then miss it. The fix is the source's: give the tensor another name there.
    """
    fix = ("rename it in the source (a torch file: torch.load it, move the tensor to another key of the dict, "
           "torch.save it) and convert that")
    for item in items:
        name = item.info.name
        if name == "__metadata__":
            raise OutputError(f"safetensors keeps a file's metadata under this name, so no tensor can have it; {fix}",
                              path=item.info.path, tensor=name)
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise OutputError("the name holds a lone surrogate, which has no UTF-8 form, as safetensors names must; "
                              f"{fix}", path=item.info.path, tensor=name) from None


def _check_expansion(items: list[_Item]) -> None:
    """Refuse a conversion whose tensors write far more than they read (see ``allow_expansion`` in :func:`convert`).

    A tensor is expanded when it writes more than ``MAX_EXPANSION`` times
    the bytes it reads from the file (its storage span: a view made by
    ``expand`` reads its few stored bytes and writes every element). What
    expanded tensors write beyond that counts against
    ``EXPANSION_ALLOWANCE``, summed over the conversion, so that small
    broadcast buffers pass and many of them cannot add up to gigabytes.
    """
    excess = 0
    for item in items:
        stored = item.info.read_nbytes
        if item.nbytes <= MAX_EXPANSION * stored:
            continue
        excess += item.nbytes - MAX_EXPANSION * stored
        if excess > EXPANSION_ALLOWANCE:
            raise ExpansionError(
                f"writes {format_bytes(item.nbytes)} from {format_bytes(stored)} stored in the file "
                f"({item.nbytes / max(stored, 1):,.0f}x: a view repeating its bytes, as expand makes), past the limit "
                f"of {MAX_EXPANSION}x (expanded tensors may write {EXPANSION_ALLOWANCE / 2**20:g} MiB beyond it in all); "
                "pass allow_expansion=True (CLI: --allow-expansion) to write it in full",
                path=item.info.path, tensor=item.info.name,
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
    ckpt: Checkpoint, companions: list[tuple[Path, str]], shards: list[list[_Item]], names: list[str],
    temporary: Path, single_file: bool, reader: Reads, progress: Optional[ProgressFn],
) -> None:
    """The shards (``names``, in a folder ``temporary``; else the one file ``temporary``), the index, the
    companion files copied."""
    total = sum(item.nbytes for shard in shards for item in shard)
    done = [0]
    if progress is not None and total:
        progress(0, total)  # writing starts now: a rate shown from here on is the conversion's own

    def advanced(nbytes: int) -> None:
        done[0] += nbytes
        if progress is not None:
            progress(done[0], total)

    if single_file:
        _write_file(ckpt, shards[0], temporary, reader, advanced)
        return
    for name, shard in zip(names, shards):
        _write_file(ckpt, shard, _output_path(temporary, name), reader, advanced)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {item.info.name: name for name, shard in zip(names, shards) for item in shard},
        }
        _output_path(temporary, INDEX_NAME).write_text(json.dumps(index, indent=2))
    for real, name in companions:
        shutil.copyfile(real, _output_path(temporary, name, source=real))


def _write_file(ckpt: Checkpoint, items: list[_Item], path: Path, reader: Reads, advanced) -> None:
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
            reader.read([Job(tensor, item.info) for tensor, item in zip(tensors, batch)])
            for tensor in tensors:
                if tensor.numel():
                    out.write(byte_view(tensor))
            advanced(sum(item.nbytes for item in batch))
        out.flush()
        os.fsync(out.fileno())


def _read_config(companions: list[tuple[Path, str]]) -> object:
    """The source's ``config.json`` as read by :func:`~materialize.skeleton.hfbuild.read_config` (one error naming it
    where it cannot be read); None where the folder has none."""
    from .skeleton.hfbuild import read_config

    return next((read_config(real) for real, name in companions if name == "config.json"), None)


def _config_says_dtype(path: Path, dtype: torch.dtype, config: object) -> None:
    """A copied Hugging Face ``config.json`` (``config``, as read) says the dtype written (``from_pretrained``
    loads in it): its ``dtype`` / ``torch_dtype`` fields, the nested configs' (``text_config``) too; ``dtype``
    if it had none."""
    if not isinstance(config, dict):
        return
    name = str(dtype).removeprefix("torch.")

    found = False
    nodes = [config]  # a walk, not a recursion: a config may nest as deep as its read allowed
    while nodes:
        node = nodes.pop()
        for key, value in node.items():
            if key in ("dtype", "torch_dtype") and (value is None or isinstance(value, str)):
                node[key], found = name, True
            elif isinstance(value, dict):
                nodes.append(value)
    if not found:
        config["dtype"] = name
    try:
        text = json.dumps(config, indent=2)
    except RecursionError:  # read just inside the limit, written a few frames deeper
        raise ModelSpecError("cannot be written back: its JSON is nested as deep as Python's recursion limit",
                             path=path.name) from None
    path.write_text(text + "\n", encoding="utf-8")


def _companions(source: object) -> list[tuple[Path, str]]:
    """A Hugging Face folder's other files (config, tokenizer), what makes the output loadable as a model.

    Each as (the file it really is, its name): a symlink leading out of the
    folder (``tokenizer.json`` -> ``/etc/passwd``) is refused, never copied.
    """
    if isinstance(source, RemotePath):  # a remote folder's small files, fetched to local disk first
        wanted = lambda name: not name.endswith(_WEIGHT_SUFFIXES)  # noqa: E731
        source = companion_folder(source, wanted=wanted) if source.is_dir() else None
    if source is None or isinstance(source, Checkpoint) or not Path(source).is_dir():
        return []
    folder = Path(source)
    roots = allowed_roots(folder)
    found = []
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name.endswith(_WEIGHT_SUFFIXES) or path.name.endswith(".index.json"):
            continue
        real = confine(path, roots, what=f"companion file {path.name!r}", about=folder)
        found.append((real, _output_name(path.name, source=path)))
    return found


def _output_name(name: str, *, source: Path) -> str:
    """``name``, from the source, as the name of a file of the output folder: its base name, or refused.

    A base name that is empty, ``.``, ``..``, or still holds a separator (a
    Windows ``\\``) or a NUL is an :class:`OutputError` about ``source``.
    """
    base = os.path.basename(name)
    if base in ("", ".", "..") or any(bad in base for bad in ("/", "\\", "\0")):
        raise OutputError(f"{name!r} cannot be the name of a file in the output folder", path=source)
    return base


def _output_path(folder: Path, name: str, *, source: Optional[Path] = None) -> Path:
    """Where the file ``name`` is written in the output ``folder``: inside it, checked after resolution."""
    path = folder / _output_name(name, source=source or folder)
    if not path.resolve().is_relative_to(folder.resolve()):
        raise OutputError(f"{name!r} would be written outside the output folder, at {path.resolve()}",
                          path=source or folder)
    return path

