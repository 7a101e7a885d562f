"""torch's legacy (pre-1.6, non-zip) checkpoints, read without loading tensors.

The file is five pickles in a row (a magic number, the protocol version, the
saving machine's byte order and type sizes, the saved object, the list of
storage keys), then every storage in key order: an 8-byte little-endian
element count followed by its bytes. Each pickle's end is found by walking
its opcodes, which runs nothing; the object is unpickled exactly as a zip
checkpoint's ``data.pkl`` is (weights only, with stand-ins, tensors on
``meta``), and each storage's offset in the file is found by walking the
counts. Tensor bytes are then read straight into their destinations, as for
any other format.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch

from ..errors import CheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from .pickle_budget import check_budget
from .torchpickle import Payload, StorageRef, first_line, located_extra_states, read_payload, tensor_info

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
_MAX_SMALL_PICKLE = 1 << 20  # the header pickles and the key list; the saved object may be larger
_COUNT = struct.Struct("<q")


def read_torch_legacy(path: Path, *, trust_pickle: bool, state_dict_key: Optional[str] = None) -> Payload:
    """The model state of a pre-1.6 torch file (see :func:`~.torchpickle.find_payload`), each tensor located."""
    file_size = os.path.getsize(path)
    with open(path, "rb") as handle:
        magic = _small_pickle(path, handle, "magic number")
        if magic != MAGIC_NUMBER:
            raise CheckpointError("is a pickle, not a torch checkpoint (wrong magic number)", path=path)
        version = _small_pickle(path, handle, "protocol version")
        if version != PROTOCOL_VERSION:
            raise UnsupportedFormatError(f"is a legacy torch file of protocol {version!r}; only {PROTOCOL_VERSION} is read", path=path)
        system = _small_pickle(path, handle, "system description")
        if not isinstance(system, dict) or system.get("little_endian") is not True:
            raise UnsupportedFormatError("was saved on a big-endian machine; re-save it on a little-endian one", path=path)
        data = _pickle_bytes(path, handle, "saved object", limit=None)
        refs: dict[int, StorageRef] = {}
        views: dict[int, tuple[str, int]] = {}
        itemsizes: dict[str, int] = {}

        def loader(path: Path, refs: dict[int, StorageRef]) -> Any:  # a fresh one for each reading of the pickle
            views.clear()
            itemsizes.clear()
            return _legacy_loader(path, refs, views, itemsizes)

        try:
            found = read_payload(path, data, refs, trust_pickle=trust_pickle, persistent=loader,
                                 what="the saved object", state_dict_key=state_dict_key)
            payload = found.tensors
        except CheckpointError as error:
            if "persistent_load of storage" not in str(error):
                raise
            raise UnsafeCheckpointError(  # torch's weights-only unpickler takes storages only, not a module's source
                "holds a module pickled whole in torch's legacy format, which is read only by rebuilding it: "
                "pass trust_pickle=True (CLI: --trust-pickle) if you trust the file", path=path) from None
        keys = _small_pickle(path, handle, "storage key list")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
            raise CheckpointError("its storage key list is malformed", path=path)
        owners = {}  # which tensor to name when a storage is damaged
        for name, tensor in payload.items():
            ref = refs.get(tensor.untyped_storage()._cdata)
            if ref is not None:
                owners.setdefault(ref.key, name)
        records = _storage_records(path, handle, keys, refs, itemsizes, owners, file_size)
    for cdata, (root, offset) in views.items():  # storages saved as views of others (pre-1.0 files)
        if root not in records:
            raise CheckpointError(f"a storage views storage {root!r}, which the file does not hold", path=path)
        base, size = records[root]
        records[refs[cdata].key] = (base + offset, size - offset)
    return found._replace(tensors={name: tensor_info(path, name, t, refs, records, file_size)
                                   for name, t in payload.items()},
                          extra_states=located_extra_states(path, found.extra_states, refs, records, file_size))


def _legacy_loader(path: Path, refs: dict[int, StorageRef], views: dict[int, tuple[str, int]], itemsizes: dict[str, int]):
    storages: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(saved_id: Any) -> Any:
        if isinstance(saved_id, tuple) and len(saved_id) == 4 and saved_id[0] == "module":
            return saved_id[1]  # a module's class, saved with its source: the class (or its stand-in) is enough
        if not (isinstance(saved_id, tuple) and len(saved_id) == 6 and saved_id[0] == "storage"):
            raise CheckpointError(f"unexpected persistent id {_short(saved_id)} in the saved object", path=path)
        _, storage_type, key, _location, numel, view = saved_id
        dtype = getattr(storage_type, "_dtype", None) or getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype) or type(numel) is not int or numel < 0 or not isinstance(key, str):
            raise CheckpointError(f"malformed storage record {_short(key)} in the saved object", path=path)
        if key not in storages:
            storage = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
            refs[storage._cdata] = StorageRef(key, numel * dtype.itemsize)
            itemsizes[key] = dtype.itemsize
            storages[key] = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
        if view is None:
            return storages[key]
        if not (isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str)
                and all(type(v) is int and v >= 0 for v in view[1:])):
            raise CheckpointError(f"malformed storage view {_short(view)} in the saved object", path=path)
        view_key, offset, size = view
        if view_key not in storages:
            storage = torch.UntypedStorage(size * dtype.itemsize, device="meta")
            refs[storage._cdata] = StorageRef(view_key, size * dtype.itemsize)
            views[storage._cdata] = (key, offset * dtype.itemsize)
            storages[view_key] = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
        return storages[view_key]

    return persistent_load


def _storage_records(
    path: Path, handle: BinaryIO, keys: list[str], refs: dict[int, StorageRef], itemsizes: dict[str, int],
    owners: dict[str, str], file_size: int,
) -> dict[str, tuple[int, int]]:
    """Each storage key's (offset, byte size) in the file, found by walking the element counts."""
    nbytes = {ref.key: ref.nbytes for ref in refs.values()}
    records = {}
    position = handle.tell()
    for key in keys:
        def fail(reason: str) -> CheckpointError:
            return CheckpointError(f"its storage {key!r} {reason}", path=path, tensor=owners.get(key))

        if key not in itemsizes:
            raise fail("is never named by the saved object (damaged key list?)")
        head = os.pread(handle.fileno(), _COUNT.size, position)
        if len(head) < _COUNT.size:
            raise fail("is missing: the file ends before it (truncated?)")
        count = _COUNT.unpack(head)[0]
        if count < 0 or count * itemsizes[key] != nbytes[key]:
            raise fail(f"holds {count} elements, {nbytes[key] // itemsizes[key]} expected")
        start = position + _COUNT.size
        if start + nbytes[key] > file_size:
            raise fail("runs past the end of the file (truncated?)")
        records[key] = (start, nbytes[key])
        position = start + nbytes[key]
    return records


class _PlainDataUnpickler(pickle.Unpickler):
    """Numbers, strings, lists, dicts and tuples, of any pickle protocol (``torch.save(...,
    pickle_protocol=4)`` frames them; torch's weights-only unpickler refuses the frames): every name a
    pickle could call is refused, so nothing runs."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not plain data")


def _small_pickle(path: Path, handle: BinaryIO, what: str) -> Any:
    data = _pickle_bytes(path, handle, what, limit=_MAX_SMALL_PICKLE)
    check_budget(data, path=path, what=f"its {what}")
    try:
        return _PlainDataUnpickler(io.BytesIO(data), encoding="utf-8").load()
    except Exception as exc:  # plain data only: anything else is damage or a trap
        raise UnsafeCheckpointError(f"its {what} is not plain data: {first_line(exc)}", path=path) from None


def _pickle_bytes(path: Path, handle: BinaryIO, what: str, *, limit: Optional[int]) -> bytes:
    """The bytes of the pickle starting at the handle's position, which moves past it; nothing is unpickled."""
    start = handle.tell()
    try:
        for opcode, _, position in pickletools.genops(handle):
            if limit is not None and position - start > limit:
                raise CheckpointError(f"its {what} is over {limit} bytes", path=path)
            if opcode.name == "STOP":
                break
    except CheckpointError:
        raise
    except Exception as exc:  # genops raises ValueError and others on damaged opcodes
        raise CheckpointError(f"its {what} is not a valid pickle: {first_line(exc)}", path=path) from None
    end = handle.tell()
    handle.seek(start)
    data = handle.read(end - start)
    return data


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
