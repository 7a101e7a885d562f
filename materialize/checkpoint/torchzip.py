"""torch zip checkpoints (``.pt``/``.pth``/``.bin``) read without loading tensors.

``data.pkl`` is unpickled with torch's weights-only unpickler, classes it does
not allow replaced by inert stand-ins (see :mod:`.standins`), or, only with
``trust_pickle``, the full pickler to rebuild a pickled module, with every
storage created on ``meta``. Each tensor then maps to its storage record in
the zip, whose bytes are stored uncompressed at a known offset: the same
direct path as safetensors, with no ``torch.load`` of the data.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

import torch
from torch import _weights_only_unpickler, nn

from ..errors import CheckpointError, UnsafeCheckpointError, UnsupportedFormatError, summarize_names
from .base import TensorInfo
from .pickle_scan import negative_layouts
from .standins import CalledStandIn, StandIn, is_module_state, is_numpy_array, module_state, stand_in_class

STATE_DICT_KEYS = ("state_dict", "model", "module")
_LOCAL_HEADER = struct.Struct("<4s4xH16xHH")
_SMALL_RECORD = 1 << 20
_DOS_DIRECTORY = 0x10


class _StorageRef:
    def __init__(self, key: str, nbytes: int) -> None:
        self.key = key
        self.nbytes = nbytes


def _persistent_loader(path: Path, refs: dict[int, _StorageRef]):
    def persistent_load(saved_id: Any) -> Any:
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5):
            raise CheckpointError(f"unexpected persistent id {saved_id!r} in data.pkl", path=path)
        _, storage_type, key, _location, numel = saved_id
        if storage_type is torch.UntypedStorage:
            dtype = torch.uint8
        else:
            dtype = getattr(storage_type, "_dtype", None) or getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype) or type(numel) is not int or numel < 0:
            raise CheckpointError(f"malformed storage record {key!r} in data.pkl", path=path)
        storage = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
        refs[storage._cdata] = _StorageRef(str(key), numel * dtype.itemsize)
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    return persistent_load


class _TrustedUnpickler(pickle.Unpickler):
    pass


class _WeightsOnlyUnpickler(_weights_only_unpickler.Unpickler):
    def _check_set_item_target(self, opcode: str) -> None:
        if not isinstance(self.stack[-1], StandIn):  # a stand-in for a dict subclass takes its items inertly
            super()._check_set_item_target(opcode)


_MAX_STAND_INS = 256
_STAND_IN_SCOPE = getattr(torch.serialization, "safe_globals", None)  # torch 2.5+; before it, no stand-ins


def _unpickle(
    path: Path, data: bytes, refs: dict[int, _StorageRef], *, trust_pickle: bool,
    persistent: Callable[[Path, dict[int, _StorageRef]], Any] = _persistent_loader, what: str = "data.pkl",
) -> Any:
    """The object ``torch.save`` was given, its tensors on meta; classes torch does not allow become stand-ins.

    Each class the weights-only unpickler refuses is given a stand-in (see
    :mod:`.standins`) and the pickle is read again, up to a bound; a call of
    anything it names is refused. While a read runs, torch's allowlist (one
    per process) holds its stand-ins: inert, so another thread's
    ``torch.load`` that meets them is no less safe.
    """
    if trust_pickle:
        unpickler: Any = _TrustedUnpickler(io.BytesIO(data), encoding="utf-8")
        unpickler.persistent_load = persistent(path, refs)
        return _load(path, unpickler, trust_pickle=True, what=what)
    stand_ins: dict[str, type] = {}
    while True:
        refs.clear()
        unpickler = _WeightsOnlyUnpickler(io.BytesIO(data), encoding="utf-8")
        unpickler.persistent_load = persistent(path, refs)
        try:
            if not stand_ins:
                return _load(path, unpickler, trust_pickle=False, what=what)
            with _STAND_IN_SCOPE(list(stand_ins.values())):
                return _load(path, unpickler, trust_pickle=False, what=what)
        except _RefusedGlobal as refused:
            if (_STAND_IN_SCOPE is None or "." not in refused.name or refused.name in stand_ins
                    or len(stand_ins) >= _MAX_STAND_INS):
                raise refused.error from None
            stand_ins[refused.name] = stand_in_class(refused.name)


class _RefusedGlobal(Exception):
    def __init__(self, name: str, error: UnsafeCheckpointError) -> None:
        super().__init__(name)
        self.name = name
        self.error = error


def _load(path: Path, unpickler: Any, *, trust_pickle: bool, what: str) -> Any:
    try:
        return unpickler.load()
    except CheckpointError:
        raise
    except CalledStandIn as call:
        raise UnsafeCheckpointError(
            f"refused to unpickle a call of '{call.name}': calling it could run code from the file. If you trust "
            "the file, pass trust_pickle=True (CLI: --trust-pickle)",
            path=path,
        ) from None
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if found and not trust_pickle:
            error = UnsafeCheckpointError(
                f"refused to unpickle global '{found.group(1)}': it is not plain tensor data and loading it "
                "could run code from the file. To allow this one class, if you know it is safe, register it with "
                "torch.serialization.add_safe_globals; if the file is a pickled model (torch.save(model)) that you "
                "trust, pass trust_pickle=True (CLI: --trust-pickle) to build the model from it",
                path=path,
            )
            if str(exc).startswith("Unsupported global:"):
                raise _RefusedGlobal(found.group(1), error) from None
            raise error from None
        raise CheckpointError(f"{what} is malformed: {_first_line(exc)}", path=path) from None
    except Exception as exc:  # a hostile pickle can raise anything the unpickler touches
        raise CheckpointError(f"cannot unpickle {what}: {type(exc).__name__}: {_first_line(exc)}", path=path) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _find_payload(obj: Any) -> tuple[dict[str, torch.Tensor], Optional[nn.Module]]:
    """The state dict (or module) inside what ``torch.save`` was given.

    A module pickled whole but read without ``trust_pickle`` is made of
    stand-ins: its state-dict entries are taken from them, no module is built.
    """
    if isinstance(obj, nn.Module):
        return _module_tensors(obj), obj
    if is_module_state(obj):
        return dict(module_state(obj)), None
    if isinstance(obj, dict):
        for key in STATE_DICT_KEYS:
            nested = obj.get(key)
            if isinstance(nested, nn.Module):
                return _module_tensors(nested), nested
            if is_module_state(nested):
                return dict(module_state(nested)), None
            if isinstance(nested, dict) and any(isinstance(v, torch.Tensor) for v in nested.values()):
                return _tensor_entries(nested), None
        return _tensor_entries(obj), None
    return {}, None


def _tensor_entries(mapping: dict) -> dict[str, torch.Tensor]:
    arrays = [str(k) for k, v in mapping.items() if is_numpy_array(v)]
    if arrays:
        raise CheckpointError(
            f"holds numpy arrays where tensors are expected ({summarize_names(arrays)}); this loader reads tensors "
            "only: re-save them as tensors (torch.from_numpy), or load the file with torch.load if you trust it")
    return {str(k): v for k, v in mapping.items() if isinstance(v, torch.Tensor)}


def _module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return {name: tensor for name, tensor in named.items() if tensor is not None}


def _record_offsets(path: Path, archive: zipfile.ZipFile, prefix: str) -> dict[str, tuple[int, int]]:
    """Storage key -> (absolute data offset, size) for every stored record.

    Every record's local header is checked against the central directory
    (signature, name, method) and records must not overlap each other or the
    central directory: readers that trust one or the other would otherwise
    read different bytes from a damaged file. Record CRCs are not verified
    (that would cost a pass over all the data).
    """
    offsets: dict[str, tuple[int, int]] = {}
    data_dir = f"{prefix}/data/"
    spans: list[tuple[int, int, str]] = []
    with open(path, "rb") as handle:
        _check_end_record(path, archive, handle)
        for info in archive.infolist():
            name = info.filename
            if info.flag_bits & 0x1:
                raise CheckpointError(f"zip record {name!r} is encrypted; torch never writes that", path=path)
            if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
                raise CheckpointError(f"zip record {name!r} is stored but its two sizes differ (corrupt zip)", path=path)
            if info.external_attr & _DOS_DIRECTORY:  # torch's reader then returns unread memory for it
                raise CheckpointError(f"zip record {name!r} is marked as a directory (corrupt zip)", path=path)
            if info.volume != 0:
                raise CheckpointError(f"zip record {name!r} claims to be on another disk (corrupt zip)", path=path)
            if info.compress_type != zipfile.ZIP_STORED and name.startswith(data_dir):
                raise CheckpointError(f"storage record {name[len(data_dir):]!r} is compressed; torch writes them stored", path=path)
            handle.seek(info.header_offset)
            header = handle.read(_LOCAL_HEADER.size)
            if len(header) != _LOCAL_HEADER.size:
                raise CheckpointError(f"zip local header of record {name!r} is truncated", path=path)
            signature, method, name_len, extra_len = _LOCAL_HEADER.unpack(header)
            local_name = handle.read(name_len)
            if signature != b"PK\x03\x04" or method != info.compress_type or local_name != _raw_name(info):
                raise CheckpointError(f"zip local header of record {name!r} disagrees with the central directory (corrupt zip)", path=path)
            data_start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            spans.append((info.header_offset, data_start + info.compress_size, name))
            if name.startswith(data_dir):
                offsets[name[len(data_dir):]] = (data_start, info.file_size)
            elif info.file_size <= _SMALL_RECORD:
                _read(path, archive, name)  # zipfile checks its CRC: the cheap records are verified in full
    spans.sort()
    for (_, end, name), (next_start, _, next_name) in zip(spans, spans[1:] + [(archive.start_dir, 0, "central directory")]):
        if end > next_start:
            raise CheckpointError(f"zip record {name!r} overlaps {next_name!r} (corrupt zip)", path=path)
    return offsets


_END_RECORD = struct.Struct("<4sHHHHIIH")
_CENTRAL_ENTRY_SIZE = 46
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_END_RECORD = struct.Struct("<4sQHHIIQQQQ")


def _check_end_record(path: Path, archive: zipfile.ZipFile, handle: BinaryIO) -> None:
    """The end-of-central-directory fields zipfile ignores but torch's reader checks."""
    handle.seek(0, os.SEEK_END)
    file_size = handle.tell()
    tail_size = min(file_size, _END_RECORD.size + 0xFFFF)
    handle.seek(file_size - tail_size)
    tail = handle.read(tail_size)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _END_RECORD.size > len(tail):
        raise CheckpointError("zip end-of-central-directory record is missing (truncated zip?)", path=path)
    _, disk, cd_disk, entries_here, entries_total, directory_size, _, _ = _END_RECORD.unpack_from(tail, at)
    counts = [entries_here, entries_total]
    disks = [disk, cd_disk]
    if at >= _ZIP64_LOCATOR.size and tail[at - _ZIP64_LOCATOR.size: at - _ZIP64_LOCATOR.size + 4] == b"PK\x06\x07":
        _, locator_disk, record_offset, total_disks = _ZIP64_LOCATOR.unpack_from(tail, at - _ZIP64_LOCATOR.size)
        handle.seek(record_offset)
        record = handle.read(_ZIP64_END_RECORD.size)
        if len(record) != _ZIP64_END_RECORD.size or record[:4] != b"PK\x06\x06":
            raise CheckpointError("zip64 end-of-central-directory record is missing or corrupt", path=path)
        fields = _ZIP64_END_RECORD.unpack(record)
        disks += [locator_disk, total_disks - 1, fields[4], fields[5]]
        counts = [c for c in counts if c != 0xFFFF] + [fields[6], fields[7]]
        directory_size = fields[8]
    if any(d not in (0, 0xFFFF) for d in disks):
        raise CheckpointError("zip claims to span several disks (corrupt zip)", path=path)
    count = len(archive.infolist())
    if any(c != count for c in counts):
        raise CheckpointError(f"zip end record counts {max(counts)} records, its directory holds {count} (corrupt zip)", path=path)
    handle.seek(archive.start_dir)
    directory = handle.read(directory_size)
    walked = 0
    for _ in range(count):  # zipfile reads past a short directory silently; torch's reader does not
        if directory[walked:walked + 4] != b"PK\x01\x02" or walked + _CENTRAL_ENTRY_SIZE > len(directory):
            break
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", directory, walked + 28)
        walked += _CENTRAL_ENTRY_SIZE + name_len + extra_len + comment_len
    if walked != directory_size or len(directory) != directory_size:
        raise CheckpointError("zip central directory entries do not add up to its recorded size (corrupt zip)", path=path)


def _raw_name(info: zipfile.ZipInfo) -> bytes:
    return info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")


# What a damaged zip can raise from zipfile besides BadZipFile.
ZIP_ERRORS = (zipfile.BadZipFile, RuntimeError, zlib.error, EOFError, OSError, NotImplementedError, UnicodeDecodeError, ValueError)


def _read(path: Path, archive: zipfile.ZipFile, name: str) -> bytes:
    try:
        return archive.read(name)
    except ZIP_ERRORS as exc:
        raise CheckpointError(f"cannot read record {name!r} of the zip: {_first_line(exc)}", path=path) from None


def _open_archive(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (NotImplementedError, UnicodeDecodeError, ValueError, EOFError) as exc:
        raise CheckpointError(f"is not a readable zip: {_first_line(exc)}", path=path) from None
    except zipfile.BadZipFile:
        raise CheckpointError("is not a valid torch zip checkpoint (bad or truncated zip)", path=path) from None


def _archive_prefix(path: Path, names: list[str]) -> str:
    pickles = [n for n in names if n.count("/") == 1 and n.endswith("/data.pkl")]
    if any(n.endswith("/constants.pkl") for n in names) or any("/code/" in n for n in names):
        raise UnsupportedFormatError(
            "is a TorchScript archive, not a checkpoint; load it with torch.jit.load and save its state_dict()",
            path=path,
        )
    if len(pickles) != 1:
        raise CheckpointError("torch zip has no data.pkl record (not a torch.save file)", path=path)
    return pickles[0].split("/", 1)[0]


def read_torch_zip(path: Path, *, trust_pickle: bool) -> tuple[dict[str, TensorInfo], Optional[nn.Module]]:
    file_size = os.path.getsize(path)
    with _open_archive(path) as archive:
        names = archive.namelist()
        duplicated = sorted({n for n in names if names.count(n) > 1}) if len(set(names)) != len(names) else []
        if duplicated:  # readers disagree on which copy counts: torch's takes the first, zipfile the last
            raise CheckpointError(f"the zip holds records more than once: {', '.join(duplicated[:5])}", path=path)
        prefix = _archive_prefix(path, names)
        if f"{prefix}/byteorder" in names and _read(path, archive, f"{prefix}/byteorder").strip() == b"big":
            raise UnsupportedFormatError("was saved on a big-endian machine; re-save it on a little-endian one", path=path)
        refs: dict[int, _StorageRef] = {}
        data = _read(path, archive, f"{prefix}/data.pkl")
        unpickled = _unpickle(path, data, refs, trust_pickle=trust_pickle)
        try:
            payload, module = _find_payload(unpickled)
        except CheckpointError as error:
            error.path = error.path or str(path)
            raise
        hostile = negative_layouts(data)
        if hostile:
            offset, size, stride = hostile[0]
            raise CheckpointError(
                f"a tensor has a negative size, stride or offset ({list(size)}, {list(stride)}, {offset})", path=path
            )
        try:
            records = _record_offsets(path, archive, prefix)
        except CheckpointError:
            raise
        except ZIP_ERRORS as exc:
            raise CheckpointError(f"cannot locate the storage records: {_first_line(exc)}", path=path) from None
    tensors = {name: _tensor_info(path, name, t, refs, records, file_size) for name, t in payload.items()}
    return tensors, module


def _tensor_info(
    path: Path,
    name: str,
    tensor: torch.Tensor,
    refs: dict[int, _StorageRef],
    records: dict[str, tuple[int, int]],
    file_size: int,
) -> TensorInfo:
    def fail(reason: str) -> CheckpointError:
        return CheckpointError(reason, path=path, tensor=name)

    if tensor.layout != torch.strided or tensor.is_quantized:
        raise fail(f"has layout {tensor.layout}; only dense tensors are supported")
    ref = refs.get(tensor.untyped_storage()._cdata)
    if ref is None:
        raise fail("its storage is not a record of this file")
    if ref.key not in records:
        raise fail(f"storage record data/{ref.key} is missing from the zip")
    record_offset, record_size = records[ref.key]
    if record_size < ref.nbytes:
        raise fail(f"storage record data/{ref.key} holds {record_size} bytes, {ref.nbytes} expected")
    if record_offset + ref.nbytes > file_size:
        raise fail(f"storage record data/{ref.key} runs past the end of the file (truncated?)")
    itemsize = tensor.element_size()
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape) or any(st < 0 for st in tensor.stride()) or tensor.storage_offset() < 0:
        raise fail(f"has a negative size, stride or offset ({list(shape)}, {list(tensor.stride())}, {tensor.storage_offset()})")
    start = tensor.storage_offset() * itemsize
    contiguous = tensor.is_contiguous()
    numel = math.prod(shape)
    if numel == 0:
        span = 0
    elif contiguous:
        span = numel * itemsize
    else:
        span = (sum((size - 1) * stride for size, stride in zip(shape, tensor.stride())) + 1) * itemsize
    if start + span > ref.nbytes:
        raise fail(f"view of bytes [{start}, {start + span}) lies outside its {ref.nbytes}-byte storage")
    return TensorInfo(
        name=name,
        dtype_name=str(tensor.dtype).removeprefix("torch."),
        itemsize=itemsize,
        shape=shape,
        path=path,
        offset=record_offset + start,
        stride=None if contiguous else tuple(tensor.stride()),
        span_nbytes=None if contiguous else span,
        storage=record_offset,
    )
