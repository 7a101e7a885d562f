"""The floor of a Python loader: what any load that makes one tensor and one parameter per checkpoint tensor pays.

``bench.many``'s "floor" rows load the same checkpoint into the same ``meta_init`` model with nothing but the
steps every such loader takes, and no check of anything: the file is trusted (its header's offsets, its zip's
records, its pickle), nothing is reported, every tensor is a plain parameter or buffer of its module. What is
left is the interpreter's and torch's own cost a tensor:

- open: the safetensors header parsed by ``json.loads``; a torch zip's directory by ``zipfile``, its pickle by
  the C unpickler (its globals and storages stood in for by plain functions), every record's local header
  read once for where its bytes start;
- plan: each name's module, by one ``named_modules`` dict;
- allocate: each tensor ``torch.frombuffer`` over its slice of one private anonymous mapping (its own storage, as
  ours are), shaped in place by ``resize_``, made a parameter by taking the class ``nn.Parameter`` (the cheapest
  way torch has: ``view`` and ``Tensor._make_subclass`` each make another tensor object, 1 us a tensor each)
  and set in its module's dict;
- read: the bytes read into the mapping by every core, each chunk's pages faulted in first (as the raw
  read is); a zip's mapping is the file from its first record's bytes to its last's, headers between
  records read with them.

A load of ours does all that and checks and reports what it did; the floor is what no check removes. It is a
measurement, not a loader: it trusts the file, which ours never does.
"""

from __future__ import annotations

import gc
import json
import math
import mmap
import os
import pickle
import struct
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from materialize.checkpoint.plainpickle import _STORAGE_CLASSES
from materialize.checkpoint.safetensors import SAFETENSORS_DTYPES
from materialize.checkpoint.torchzip import _LOCAL_HEADER
from materialize.io.hostmem import prefault

# The formats' dtype codes as torch dtypes, from the library's own tables (the floor reads the same files).
_SAFETENSORS_DTYPES = {code: getattr(torch, name) for code, (name, _) in SAFETENSORS_DTYPES.items()
                       if hasattr(torch, name)}
_STORAGE_DTYPES = {storage: getattr(torch, name) for storage, name in _STORAGE_CLASSES.items()}
_CHUNK = 16 * 1024 * 1024


def bare_load(model: torch.nn.Module, path: Path, mark: Callable[[str], None]) -> None:
    """Load ``path`` (one safetensors file or a torch zip) into ``model`` as the floor does, calling ``mark`` with
    ``"plan"``, ``"allocate"`` and ``"read"`` as each step begins; the cyclic collector paused throughout, as
    ours pauses it (``materialize.gcpause``)."""
    gc.disable()
    try:
        _bare_load(model, path, mark)
    finally:
        gc.enable()


def _bare_load(model: torch.nn.Module, path: Path, mark: Callable[[str], None]) -> None:
    opened = _open_torch_zip(path) if path.suffix == ".pt" else _open_safetensors(path)
    entries, data_size, spans = opened
    mark("plan")
    modules = dict(model.named_modules())
    targets = [(modules[owner], attribute) for owner, _, attribute in (name.rpartition(".") for name in entries)]
    mark("allocate")
    # (private: Python's default, a shared mapping, is shared memory, whose pages fault in at twice the cost)
    arena = mmap.mmap(-1, max(data_size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    frombuffer, parameter = torch.frombuffer, torch.nn.Parameter
    for (module, attribute), (dtype, shape, at, count) in zip(targets, entries.values()):
        tensor = frombuffer(arena, dtype=dtype, count=count, offset=at).resize_(*shape) if count else \
            torch.empty(shape, dtype=dtype)
        if attribute in module._parameters:
            tensor.__class__ = parameter
            module._parameters[attribute] = tensor.requires_grad_()  # (the read writes no tensor: no autograd)
        else:
            module._buffers[attribute] = tensor
    mark("read")
    _read(path, arena, spans)


def _open_safetensors(path: Path) -> tuple[dict[str, tuple], int, list[tuple[int, int, int]]]:
    """Name -> (dtype, shape, offset in the mapping, element count); the data's size; its one span to read
    ``(file offset, mapping offset, length)``."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    data_size = os.path.getsize(path) - 8 - length
    entries = {}
    for name, entry in header.items():
        dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        entries[name] = (dtype, entry["shape"], begin, (end - begin) // dtype.itemsize)
    return entries, data_size, [(8 + length, 0, data_size)]


class _StateDict(dict):
    """An ``OrderedDict`` of the pickle: a dict that takes the ``_metadata`` attribute torch.save's state dicts set."""


class _StandIns(pickle.Unpickler):
    """torch.save's state dict pickle read by the C unpickler, each tensor as ``(key, dtype, offset, shape)``."""

    def find_class(self, module: str, name: str) -> Any:
        if name == "_rebuild_tensor_v2":
            return lambda storage, offset, shape, *_: (storage[0], storage[1], offset, shape)
        if name == "OrderedDict":
            return _StateDict
        if name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, saved_id: tuple) -> tuple:
        _, dtype, key, _, _ = saved_id
        return key, dtype


def _open_torch_zip(path: Path) -> tuple[dict[str, tuple], int, list[tuple[int, int, int]]]:
    archive = zipfile.ZipFile(path)
    pickle_name = next(name for name in archive.namelist() if name.endswith("/data.pkl"))
    prefix = pickle_name.removesuffix("data.pkl")
    state = _StandIns(archive.open(pickle_name)).load()
    records = {info.filename.removeprefix(prefix + "data/"): info for info in archive.infolist()
               if info.filename.startswith(prefix + "data/")}
    starts = {}
    with open(path, "rb") as handle:
        descriptor = handle.fileno()
        for key, info in records.items():
            header = os.pread(descriptor, _LOCAL_HEADER.size, info.header_offset)
            _, _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
            starts[key] = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    # The mapping mirrors the file from the first record's bytes to the last's: one read, the headers between
    # records read with them.
    first = min(starts.values(), default=0)
    end = max((starts[key] + info.file_size for key, info in records.items()), default=first)
    places = {key: start - first for key, start in starts.items()}
    entries = {}
    for name, (key, dtype, offset, shape) in state.items():
        entries[name] = (dtype, shape, places[key] + offset * dtype.itemsize, math.prod(shape))
    return entries, end - first, [(first, 0, end - first)]


def _read(path: Path, arena: mmap.mmap, spans: list[tuple[int, int, int]]) -> None:
    """The spans read into the mapping by every core, in chunks of at most 16 MB, each faulted in first."""
    view = memoryview(arena)
    base = torch.frombuffer(arena, dtype=torch.uint8).data_ptr() if len(arena) else 0
    pieces = [(source + start, place + start, min(_CHUNK, length - start))
              for source, place, length in spans for start in range(0, length, _CHUNK)]
    with open(path, "rb") as handle:
        descriptor = handle.fileno()

        def read(piece: tuple[int, int, int]) -> None:
            source, place, length = piece
            prefault(base + place, length)
            done = 0
            while done < length:
                done += os.preadv(descriptor, [view[place + done:place + length]], source + done)

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(read, pieces))
