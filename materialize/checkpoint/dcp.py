"""torch.distributed.checkpoint (DCP) folders: ``.metadata`` and ``*.distcp`` files, read in place.

``.metadata`` is a pickle of DCP's own dataclasses. It is read by an
unpickler that knows those classes (as plain stand-ins: their fields are
set, none of their code runs, torch.distributed is not imported) and
torch's sizes, dtypes and layouts, and nothing else: any other name in it is
refused, so nothing in the file runs. Each tensor was saved as chunks, one per rank that held a part of it,
each chunk a small ``torch.save`` zip at an offset of a ``.distcp`` file:
its storage record is located as in any torch file and read in place.

A tensor saved in several chunks of whole rows (FSDP's ``Shard(0)``, the
usual case) is one stacked tensor: each chunk is read straight into its
rows. Chunks cut along other dimensions (tensor parallel) are blocks of it,
each read into its place as a strided copy. A sharded model's rank reads
only the parts of the chunks that hold its own shard. Entries that are not tensors (a step count, a data loader's state)
are left out. As in torch files, a state dict nested under ``model``,
``state_dict`` or ``module`` (``dcp.save({"model": ..., "optim": ...})``) is
the checkpoint's, under its own names; without one, the training state saved
beside the model's tensors (torchtitan's top-level ``optimizer.*``) is left out.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
import pickle
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import CheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from ..sources.fileio import file_size_of
from .base import DCP_METADATA_NAME
from .base import TensorInfo, shape_fits_int64
from .pickle_budget import check_budget
from .confine import allowed_roots, confine, leaves_folder
from .sealed import Sealed, sealed_call
from .modelstate import copies_of, not_there, several_copies
from .payload import STATE_DICT_KEYS, TRAINING_STATE_KEYS
from .torchpickle import brief as _brief, first_line
from .torchzip import read_embedded_tensor


class _Record(metaclass=Sealed):
    """A plain record standing in for one of DCP's metadata dataclasses: pickle sets its fields, nothing else runs.

    torch.distributed.checkpoint's own classes are not imported to read a
    folder (that import alone took 0.3-0.7 s, more than opening the folder).
    The classes are sealed (a BUILD on one of them is refused); their
    instances are the file's own.
    """


class Metadata(_Record):
    pass


class TensorStorageMetadata(_Record):
    pass


class BytesStorageMetadata(_Record):
    pass


class _TensorProperties(_Record):
    def __setstate__(self, state: Any) -> None:
        # Saved as (dtype, layout, requires_grad, memory format code, pin_memory); only the dtype is used.
        self.dtype = state[0] if isinstance(state, tuple) and state else None


def _memory_format_code(value: Any) -> Any:
    return value  # DCP's _MEM_FORMAT_ENCODING(value): the code is all the metadata needs


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_STAND_INS = {
    (_METADATA_MODULE, "Metadata"): Metadata,
    (_METADATA_MODULE, "TensorStorageMetadata"): TensorStorageMetadata,
    (_METADATA_MODULE, "BytesStorageMetadata"): BytesStorageMetadata,
    (_METADATA_MODULE, "TensorProperties"): _TensorProperties,
    (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): sealed_call(_memory_format_code),
    **{(_METADATA_MODULE, name): type(name, (_Record,), {}) for name in ("ChunkStorageMetadata", "MetadataIndex", "StorageMeta")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): type("_StorageInfo", (_Record,), {}),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes (as stand-ins), torch's sizes, dtypes and layouts, paths; any other global is refused."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed_globals()
        if (module, name) in allowed:
            return allowed[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"DCP metadata names {module}.{name}, which a checkpoint's metadata never needs; refused (nothing was run)",
            path=self._path,
        )


@functools.lru_cache(maxsize=None)
def _allowed_globals() -> dict[tuple[str, str], Any]:
    import collections
    import pathlib

    import torch.serialization

    # Python functions and classes are handed out sealed, so no BUILD can change them for the process
    found = {("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): sealed_call(torch.serialization._get_layout),
             ("collections", "OrderedDict"): collections.OrderedDict, **_STAND_INS}
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        found[("pathlib", name)] = sealed_call(getattr(pathlib, name))
    return found


def _read_metadata(path: Path) -> Any:
    try:
        data = path.read_bytes()
        check_budget(data, path=path, what="DCP metadata")
        return _MetadataUnpickler(io.BytesIO(data), path).load()
    except (CheckpointError, OSError):
        raise
    except Exception as exc:  # a damaged pickle raises anything: it is the file's fault
        raise CheckpointError(f"DCP metadata cannot be read: {first_line(exc)}", path=path) from None


def read_dcp(folder: Path, *, state_dict_key: Optional[str] = None) -> tuple[dict[str, TensorInfo], Optional[str]]:
    """Every tensor of the DCP checkpoint in ``folder``, its chunks located and checked; no tensor data read;
    and the entry of the saved dict they were taken from (see :func:`_names`).

    ``.metadata`` and every chunk file must lie in the folder: a symlink
    leading out of it is refused, as in a shard index.
    """
    path = folder / DCP_METADATA_NAME
    data_files = _DataFiles(folder, path)
    confine(path, data_files.roots, what=f"'{DCP_METADATA_NAME}'", about=folder)
    metadata = _read_metadata(path)
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"holds a {type(metadata).__name__}, not DCP metadata", path=path)
    entries = _field(metadata, "state_dict_metadata", dict, "the metadata", path)
    storage = {}
    for index, where in _field(metadata, "storage_data", dict, "the metadata", path).items():
        fqn = _field(index, "fqn", str, "a storage index", path)
        offset = getattr(index, "offset", None)
        storage[fqn, None if offset is None else _sizes(offset, f"the storage index of '{fqn}'", path)] = where
    names, key = _names(metadata, path, state_dict_key)
    tensors = {}
    for fqn, entry in entries.items():
        if isinstance(entry, BytesStorageMetadata) or fqn not in names:
            continue
        if not isinstance(fqn, str) or not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"the metadata describes {fqn!r} as a {type(entry).__name__}", path=path)
        shape = _sizes(getattr(entry, "size", None), f"tensor '{fqn}'", path)
        dtype = _field(_field(entry, "properties", object, f"tensor '{fqn}'", path), "dtype", torch.dtype, f"tensor '{fqn}'", path)
        chunks = [_chunk(data_files, path, fqn, shape, dtype, chunk, storage)
                  for chunk in _field(entry, "chunks", list, f"tensor '{fqn}'", path)]
        tensors[names[fqn]] = _assemble(names[fqn], shape, chunks, path)
    return tensors, key


def _field(obj: Any, name: str, kind: Any, what: str, path: Path) -> Any:
    """``obj.name``, which must be a ``kind``: a damaged pickle may have built its objects with anything, or nothing."""
    value = getattr(obj, name, None)
    if not isinstance(value, kind) or value is None:
        raise CheckpointError(f"DCP metadata is malformed: {what} has no valid {name}", path=path)
    return value


def _sizes(value: Any, what: str, path: Path) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise CheckpointError(f"DCP metadata is malformed: {what} has sizes or offsets {_brief(value)}", path=path)
    if not shape_fits_int64(list(value)):
        raise CheckpointError(f"DCP metadata is malformed: {what} has sizes or offsets past 2**63", path=path)
    return tuple(value)


# What training saves beside the model (torchtitan's top-level "optimizer", "lr_scheduler", ...).


def _names(metadata: Any, metadata_path: Path, state_dict_key: Optional[str]) -> tuple[dict[str, str], Optional[str]]:
    """DCP key -> checkpoint name, and the entry of the saved dict the names were taken from: the nested model
    state dict's own names where there is one, as in torch files.

    The entry is the one ``state_dict_key`` names, else the first under a
    state-dict key, refused where another entry holds another copy of that
    model's state (see :mod:`.modelstate`). Without one, every entry but the
    training state saved beside the model (:data:`TRAINING_STATE_KEYS`:
    optimizer moments are not weights) keeps its DCP key.
    """
    paths = getattr(metadata, "planner_data", None)
    paths = paths if isinstance(paths, dict) else {}
    nested = {fqn: path for fqn, path in paths.items() if isinstance(path, tuple) and len(path) > 1}
    for fqn, path in nested.items():  # a name is made of them: anything else prints as an object's address
        odd = next((part for part in path if type(part) not in (str, int)), None)
        if odd is not None:
            raise CheckpointError(
                f"DCP metadata is malformed: the planner path of {_brief(fqn)} holds a {type(odd).__name__}, "
                "not a key or an index", path=metadata_path)
    entries = _entry_shapes(metadata, nested)
    if state_dict_key is not None:
        if state_dict_key not in entries:
            raise not_there(state_dict_key, {k: v for k, v in entries.items() if k not in TRAINING_STATE_KEYS},
                            path=metadata_path)
        return _under(nested, state_dict_key), state_dict_key
    for key in STATE_DICT_KEYS:
        if key in entries:
            others = {k: v for k, v in entries.items() if k not in TRAINING_STATE_KEYS}
            copies = copies_of(key, others)
            if len(copies) > 1:
                raise several_copies(copies, others, path=metadata_path)
            return _under(nested, key), key
    return {fqn: fqn for fqn in metadata.state_dict_metadata
            if not (fqn in nested and nested[fqn][0] in TRAINING_STATE_KEYS)}, None


def _under(nested: dict[str, tuple], key: str) -> dict[str, str]:
    """DCP key -> its name within entry ``key``, for the tensors saved under it."""
    return {fqn: ".".join(map(str, path[1:])) for fqn, path in nested.items() if path[0] == key}


def _entry_shapes(metadata: Any, nested: dict[str, tuple]) -> dict[str, dict[str, Optional[tuple[int, ...]]]]:
    """Each top-level entry (by string key) holding tensors: its tensors' shapes by their names within it."""
    described = metadata.state_dict_metadata
    entries: dict[str, dict[str, Optional[tuple[int, ...]]]] = {}
    for fqn, path in nested.items():
        entry = described.get(fqn) if isinstance(described, dict) else None
        if not isinstance(path[0], str) or not isinstance(entry, TensorStorageMetadata):
            continue
        size = getattr(entry, "size", None)
        entries.setdefault(path[0], {})[".".join(map(str, path[1:]))] = \
            tuple(size) if isinstance(size, (tuple, list)) else None
    return entries


class _DataFiles:
    """The folder's chunk files by the name the metadata gives them, each checked once to lie in the folder."""

    def __init__(self, folder: Path, metadata_path: Path) -> None:
        self.folder = folder
        self.metadata_path = metadata_path
        self.roots = allowed_roots(folder)
        self._checked: dict[str, Path] = {}
        self.sizes: dict[Path, int] = {}
        # Chunks stored at the same bytes are read once: metadata listing 20,000 chunks in one stored tensor
        # costs one zip read, not 20,000.
        self.tensors: dict[tuple[Path, int, int], TensorInfo] = {}

    def get(self, relative: str, fqn: str) -> Path:
        path = self._checked.get(relative)
        if path is not None:
            return path
        path = self.folder / relative
        if leaves_folder(relative) or not path.is_file():
            raise CheckpointError(f"the chunk of '{fqn}' is in '{relative}', which is not a file of this folder",
                                  path=self.metadata_path)
        confine(path, self.roots, what=f"the chunk file '{relative}' of '{fqn}'", about=self.metadata_path)
        self._checked[relative] = path
        self.sizes[path] = file_size_of(path)
        return path


def _chunk(data_files: _DataFiles, metadata_path: Path, fqn: str, shape: tuple[int, ...], dtype: Any, chunk: Any,
           storage: dict) -> tuple[tuple, TensorInfo]:
    what = f"a chunk of tensor '{fqn}'"
    offsets = _sizes(getattr(chunk, "offsets", None), what, metadata_path)
    sizes = _sizes(getattr(chunk, "sizes", None), what, metadata_path)
    if len(offsets) != len(shape) or len(sizes) != len(shape) or any(o + n > d for o, n, d in zip(offsets, sizes, shape)):
        raise CheckpointError(f"{what} at {list(offsets)} of size {list(sizes)} lies outside its shape {list(shape)}",
                              path=metadata_path)
    where = storage.get((fqn, offsets))
    if where is None:
        raise CheckpointError(f"DCP metadata has no storage for the chunk of '{fqn}' at {list(offsets)}", path=metadata_path)
    transforms = getattr(where, "transform_descriptors", None)
    if transforms:
        raise UnsupportedFormatError(
            f"tensor '{fqn}' is stored transformed ({', '.join(map(str, transforms))}); only plain "
            "torch.save chunks are read", path=metadata_path)
    relative = _field(where, "relative_path", str, f"the storage of {what}", metadata_path)
    data_path = data_files.get(relative, fqn)
    start = _field(where, "offset", int, f"the storage of {what}", metadata_path)
    length = _field(where, "length", int, f"the storage of {what}", metadata_path)
    if start < 0 or length <= 0 or start + length > data_files.sizes[data_path]:
        raise CheckpointError(f"the chunk of '{fqn}' at bytes [{start}, {start + length}) runs past the end of the file "
                              "(truncated?)", path=data_path, tensor=fqn)
    info = data_files.tensors.get((data_path, start, length))
    if info is None:
        info = data_files.tensors[data_path, start, length] = read_embedded_tensor(data_path, start, length, fqn)
    if info.shape != sizes or info.dtype != dtype:
        raise CheckpointError(f"a chunk holds a {list(info.shape)} {info.dtype_name} tensor; the metadata says "
                              f"{list(sizes)} {str(dtype).removeprefix('torch.')}", path=data_path, tensor=fqn)
    return offsets, info


def _assemble(name: str, shape: tuple[int, ...], chunks: list[tuple[tuple, TensorInfo]], metadata_path: Path) -> TensorInfo:
    """One tensor from its chunks: the chunk itself if it is whole, else runs of rows or blocks; they must tile it exactly."""
    from .pieces import Piece, Stacked

    if not chunks:
        raise CheckpointError(f"DCP metadata lists no chunk of tensor '{name}'", path=metadata_path)
    if math.prod(shape) == 0:  # nothing to read; any chunk describes it
        return dataclasses.replace(chunks[0][1], name=name, shape=shape, stride=None, span_nbytes=None)
    chunks = [(offsets, info) for offsets, info in chunks if info.numel > 0]
    if len(chunks) == 1 and chunks[0][1].shape == shape:
        return dataclasses.replace(chunks[0][1], name=name)
    if not shape or any(offsets[1:] != (0,) * (len(shape) - 1) or info.shape[1:] != shape[1:] for offsets, info in chunks):
        return _blocks(name, shape, chunks, metadata_path)
    chunks.sort(key=lambda chunk: chunk[0][0])
    row = math.prod(shape[1:])
    pieces, next_row = [], 0
    for offsets, info in chunks:
        if offsets[0] != next_row:
            raise CheckpointError(f"the chunks of tensor '{name}' {'overlap' if offsets[0] < next_row else 'leave a gap'} "
                                  f"at row {min(offsets[0], next_row)}", path=metadata_path)
        pieces.append(Piece(dataclasses.replace(info, name=f"{name}[{offsets[0]}:{offsets[0] + info.shape[0]}]"),
                            offsets[0] * row))
        next_row = offsets[0] + info.shape[0]
    if next_row != shape[0]:
        raise CheckpointError(f"the chunks of tensor '{name}' cover {next_row} of its {shape[0]} rows", path=metadata_path)
    first = pieces[0].info
    return Stacked(name=name, dtype_name=first.dtype_name, itemsize=first.itemsize, shape=shape, path=first.path,
                   offset=first.offset, pieces=tuple(pieces))


def _blocks(name: str, shape: tuple[int, ...], chunks: list[tuple[tuple, TensorInfo]], metadata_path: Path) -> TensorInfo:
    """Chunks cut along any dimensions (tensor parallel): each a block of the tensor, read into its place."""
    from .pieces import Piece, Stacked

    def describe(offsets: tuple, info: TensorInfo) -> str:
        return ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, info.shape))

    _check_tiling(name, shape, chunks, metadata_path, describe)
    pieces = tuple(Piece(dataclasses.replace(info, name=f"{name}[{describe(offsets, info)}]"), 0,
                         box=(offsets, tuple(info.shape))) for offsets, info in sorted(chunks, key=lambda chunk: chunk[0]))
    first = pieces[0].info
    return Stacked(name=name, dtype_name=first.dtype_name, itemsize=first.itemsize, shape=shape, path=first.path,
                   offset=first.offset, pieces=pieces)


# Corners weighed per chunk in the tiling check: 2**d for each chunk cut along d dimensions. Real saves cut one to
# three dimensions (a device mesh's sharded axes), so this admits over 500,000 chunks of a tensor cut along two.
MAX_TILING_CORNERS = 1 << 21


def _check_tiling(name: str, shape: tuple[int, ...], chunks: list[tuple[tuple, TensorInfo]], metadata_path: Path,
                  describe: Any) -> None:
    """Refuses blocks that overlap or leave a gap, in time and memory linear in the chunks (times 2**d).

    The count of chunks covering each element is a sum of signed corner terms
    (inclusion-exclusion, +1 or -1 at each of a block's 2**d corners); the
    blocks tile the tensor exactly where their corner weights add up to the
    tensor's own four (or 2**d) corners. Where they do not, the lowest corner
    left over (in row-major order) is an element covered twice or not at all:
    each corner term below it in every dimension has cancelled, so the count
    there is 1 plus the leftover weight. Dimensions no chunk cuts are left out.
    """
    cut = [k for k in range(len(shape)) if any(offsets[k] != 0 or info.shape[k] != shape[k] for offsets, info in chunks)]
    if len(chunks) << len(cut) > MAX_TILING_CORNERS:
        raise UnsupportedFormatError(
            f"the {len(chunks)} chunks of tensor '{name}' are cut along {len(cut)} dimensions; checking that they tile "
            f"it would weigh more than {MAX_TILING_CORNERS} corners", path=metadata_path)
    weights: dict[tuple[int, ...], int] = {}

    def weigh(low: tuple[int, ...], high: tuple[int, ...], sign: int) -> None:
        corners: list[tuple[tuple[int, ...], int]] = [((), sign)]
        for lo, hi in zip(low, high):
            corners = [(c + (lo,), w) for c, w in corners] + [(c + (hi,), -w) for c, w in corners]
        for corner, weight in corners:
            weights[corner] = weights.get(corner, 0) + weight

    for offsets, info in chunks:
        weigh(tuple(offsets[k] for k in cut), tuple(offsets[k] + info.shape[k] for k in cut), 1)
    weigh((0,) * len(cut), tuple(shape[k] for k in cut), -1)
    leftover = [corner for corner, weight in weights.items() if weight]
    if not leftover:
        return
    element = min(leftover)
    covering = [(offsets, info) for offsets, info in chunks
                if all(offsets[k] <= at < offsets[k] + info.shape[k] for k, at in zip(cut, element))]
    if len(covering) > 1:
        (offsets, info), (other_offsets, other) = covering[:2]
        raise CheckpointError(f"the chunks of tensor '{name}' overlap: [{describe(offsets, info)}] and "
                              f"[{describe(other_offsets, other)}]", path=metadata_path)
    covered, total = sum(info.numel for _, info in chunks), math.prod(shape)
    if covered != total:
        raise CheckpointError(f"the chunks of tensor '{name}' cover {covered} of its {total} elements", path=metadata_path)
    at = dict(zip(cut, element))
    raise CheckpointError(f"the chunks of tensor '{name}' overlap: they hold its {total} elements but leave element "
                          f"{[at.get(k, 0) for k in range(len(shape))]} uncovered", path=metadata_path)
