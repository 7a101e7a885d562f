"""torch zip checkpoints (``.pt``/``.pth``/``.bin``) read without loading tensors.

``data.pkl`` is unpickled onto ``meta`` (see :mod:`.torchpickle`). Each
tensor then maps to its storage record in the zip, whose bytes are stored
uncompressed at a known offset: the same direct path as safetensors, with no
``torch.load`` of the data.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional

from ..errors import CheckpointError, UnsupportedFormatError
from ..io.fileio import file_size_of, remote_pread
from ..sources.remotepath import is_remote
from .base import TensorInfo
from .torchpickle import Payload, StorageRef, first_line, read_bare_tensor, read_payload, tensor_infos

_LOCAL_HEADER = struct.Struct("<4s4xH16xHH")
_SMALL_RECORD = 1 << 20
_DOS_DIRECTORY = 0x10


def _record_offsets(
    path: Path, archive: zipfile.ZipFile, prefix: str, window: Optional["_Window"] = None,
) -> dict[str, tuple[int, int]]:
    """Storage key -> (absolute data offset, size) for every stored record (of the zip in ``window``, if given).

    Every record's local header is checked against the central directory
    (signature, name, method) and records must not overlap each other or the
    central directory: readers that trust one or the other would otherwise
    read different bytes from a damaged file. No record's data is read here,
    so a compressed or oversized record is refused before it costs anything;
    the cost is one header read per record (records close together read by
    one read, see :func:`_local_headers`) and a sort of their spans.
    Record CRCs are checked by :func:`_verify_small_records`.
    """
    offsets: dict[str, tuple[int, int]] = {}
    data_dir = f"{prefix}/data/"
    spans: list[tuple[int, int, str]] = []
    base = window.base if window is not None else 0
    with contextlib.ExitStack() as opened:
        # A zip inside a bigger file is read through its window's descriptor, not a second open.
        handle = window.copy() if window is not None else opened.enter_context(open(path, "rb"))
        pread = window.pread if window is not None else functools.partial(os.pread, handle.fileno())
        _check_end_record(path, archive, handle)
        infos = archive.infolist()
        raw_names = [_raw_name(info) for info in infos]
        headers = _local_headers([(info.header_offset, _LOCAL_HEADER.size + len(raw_name))
                                  for info, raw_name in zip(infos, raw_names)], pread, base)
        for info, raw_name in zip(infos, raw_names):
            name = info.filename
            if info.flag_bits & 0x1:
                raise CheckpointError(f"zip record {name!r} is encrypted; torch never writes that", path=path)
            if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
                raise CheckpointError(f"zip record {name!r} is stored but its two sizes differ (corrupt zip)", path=path)
            if info.external_attr & _DOS_DIRECTORY:  # torch's reader then returns unread memory for it
                raise CheckpointError(f"zip record {name!r} is marked as a directory (corrupt zip)", path=path)
            if info.volume != 0:
                raise CheckpointError(f"zip record {name!r} claims to be on another disk (corrupt zip)", path=path)
            if info.compress_type != zipfile.ZIP_STORED:  # a few compressed bytes could inflate to gigabytes
                what = f"storage record {name[len(data_dir):]!r}" if name.startswith(data_dir) else f"zip record {name!r}"
                raise CheckpointError(f"{what} is compressed; torch writes every record stored", path=path)
            header = next(headers)  # read here, once the record passed the checks above, as it always was
            if len(header) < _LOCAL_HEADER.size:
                raise CheckpointError(f"zip local header of record {name!r} is truncated", path=path)
            signature, method, name_len, extra_len = _LOCAL_HEADER.unpack_from(header)
            local_name = header[_LOCAL_HEADER.size: _LOCAL_HEADER.size + name_len]
            if signature != b"PK\x03\x04" or method != info.compress_type or local_name != raw_name:
                raise CheckpointError(f"zip local header of record {name!r} disagrees with the central directory (corrupt zip)", path=path)
            data_start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            spans.append((info.header_offset, data_start + info.compress_size, name))
            if name.startswith(data_dir):
                offsets[name[len(data_dir):]] = (base + data_start, info.file_size)
    spans.sort()
    for (_, end, name), (next_start, _, next_name) in zip(spans, spans[1:] + [(archive.start_dir, 0, "central directory")]):
        if end > next_start:
            raise CheckpointError(f"zip record {name!r} overlaps {next_name!r} (corrupt zip)", path=path)
    return offsets


# Local headers this close together are read by one positional read (with what lies between them).
_HEADER_RUN = 1 << 16


def _local_headers(spans: list[tuple[int, int]], pread: Callable[[int, int], bytes], base: int) -> Iterator[bytes]:
    """The bytes at each ``(offset, length)`` of ``spans`` in turn (each record's local header and name), as
    one positional read each would return them.

    Spans that follow one another in the file, all within
    :data:`_HEADER_RUN` bytes of the first, are read by one positional read
    of the run: a zip of 100,000 small tensors takes a read per few hundred
    records, not one each; a run is read only when its first span is asked for.
    """
    window, window_at = b"", 0
    for index, (offset, length) in enumerate(spans):
        start = offset - window_at
        if not (0 <= start and start + length <= len(window)):
            run_end = offset + length
            for next_offset, next_length in spans[index + 1:index + 1024]:
                if next_offset < run_end or next_offset + next_length - offset > _HEADER_RUN:
                    break
                run_end = next_offset + next_length
            window, window_at, start = pread(run_end - offset, base + offset), offset, 0
        yield window[start:start + length]


def _verify_small_records(path: Path, archive: zipfile.ZipFile, prefix: str, already_read: set[str]) -> None:
    """Reads every record outside ``data/`` of up to 1 MB so that zipfile checks its CRC; only after
    :func:`_record_offsets` has bounded each one to its own stored bytes, so this is one pass over them."""
    data_dir = f"{prefix}/data/"
    for info in archive.infolist():
        if info.file_size <= _SMALL_RECORD and not info.filename.startswith(data_dir) \
                and info.filename not in already_read:
            _read(path, archive, info.filename)


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
        raise CheckpointError(f"cannot read record {name!r} of the zip: {first_line(exc)}", path=path) from None


class _Window(io.RawIOBase):
    """Bytes ``[base, base + length)`` of a file, as a file of their own (a zip inside a bigger file, or a remote
    object's whole length), read through ``pread(length, offset)`` as ``os.pread`` reads."""

    def __init__(self, pread: Callable[[int, int], bytes], base: int, length: int) -> None:
        super().__init__()
        self.pread, self.base, self.length, self._at = pread, base, length, 0

    def copy(self) -> "_Window":
        """The same bytes, read from a position of its own."""
        return _Window(self.pread, self.base, self.length)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        start = {os.SEEK_SET: 0, os.SEEK_CUR: self._at, os.SEEK_END: self.length}[whence]
        if start + offset < 0:
            raise ValueError("negative seek position")
        self._at = start + offset
        return self._at

    def readinto(self, buffer: Any) -> int:
        wanted = max(0, min(len(buffer), self.length - self._at))
        data = self.pread(wanted, self.base + self._at) if wanted else b""
        buffer[:len(data)] = data
        self._at += len(data)
        return len(data)


# zipfile decodes a record's extra fields by slicing off one at a time, each slice a copy of the rest: quadratic in
# their count, 70 ms for one 64 KB extra of 4-byte fields, a minute for a zip of a thousand such records. torch
# writes at most two fields a record; a record with more than this many is refused before zipfile reads any.
MAX_EXTRA_FIELDS = 64


def _check_extra_fields(path: Path, handle: BinaryIO) -> None:
    """Refuses a central directory entry of more than :data:`MAX_EXTRA_FIELDS` extra fields (one pass over the
    directory); anything else wrong with the directory is left to zipfile, which reads it next."""
    try:
        end = zipfile._EndRecData(handle)  # type: ignore[attr-defined]
        size, offset, location = (end[zipfile._ECD_SIZE], end[zipfile._ECD_OFFSET],  # type: ignore[attr-defined]
                                  end[zipfile._ECD_LOCATION]) if end else (0, 0, 0)  # type: ignore[attr-defined]
        start = location - size - (_ZIP64_LOCATOR.size + _ZIP64_END_RECORD.size
                                   if end and end[zipfile._ECD_SIGNATURE] == b"PK\x06\x06" else 0)  # type: ignore[attr-defined]
    except (*ZIP_ERRORS, AttributeError, IndexError, struct.error):  # zipfile, reading it next, says what is wrong
        return
    if not end or start < 0:
        return
    handle.seek(start)
    directory = handle.read(size)
    at = 0
    while directory.startswith(b"PK\x01\x02", at) and at + _CENTRAL_ENTRY_SIZE <= len(directory):
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", directory, at + 28)
        extra_at = at + _CENTRAL_ENTRY_SIZE + name_len
        if extra_len < 4 * (MAX_EXTRA_FIELDS + 1):  # each field takes 4 bytes at least: too few for too many
            at = extra_at + extra_len + comment_len
            continue
        extra, fields = directory[extra_at:extra_at + extra_len], 0
        walked = 0
        while walked + 4 <= len(extra) and fields <= MAX_EXTRA_FIELDS:
            walked += 4 + int.from_bytes(extra[walked + 2:walked + 4], "little")
            fields += 1
        if fields > MAX_EXTRA_FIELDS:
            flags, = struct.unpack_from("<H", directory, at + 8)
            name = directory[at + _CENTRAL_ENTRY_SIZE:extra_at].decode("utf-8" if flags & 0x800 else "cp437", "replace")
            raise CheckpointError(f"zip record {name!r} carries more than {MAX_EXTRA_FIELDS} extra fields "
                                  "(corrupt zip)", path=path)
        at = extra_at + extra_len + comment_len


def _open_archive(path: Path, source: Optional[BinaryIO] = None) -> zipfile.ZipFile:
    with contextlib.ExitStack() as opened:
        handle = source.copy() if isinstance(source, _Window) else opened.enter_context(open(path, "rb"))
        _check_extra_fields(path, handle)
    try:
        return zipfile.ZipFile(source if source is not None else path)
    except (NotImplementedError, UnicodeDecodeError, ValueError, EOFError) as exc:
        raise CheckpointError(f"is not a readable zip: {first_line(exc)}", path=path) from None
    except zipfile.BadZipFile:
        raise CheckpointError("is not a valid torch zip checkpoint (bad or truncated zip)", path=path) from None


def _archive_prefix(path: Path, names: list[str]) -> str:
    pickles = [n for n in names if n.count("/") == 1 and n.endswith("/data.pkl")]
    if any(n.endswith("/constants.pkl") for n in names) or any("/code/" in n for n in names):
        raise UnsupportedFormatError(
            "is a TorchScript archive, not a checkpoint; load it with torch.jit.load and save its state_dict()",
            path=path,
        )
    if len(pickles) > 1:
        raise CheckpointError(f"torch zip has {len(pickles)} data.pkl records ({', '.join(sorted(pickles)[:3])}): "
                              "not one torch.save file", path=path)
    if not pickles:
        raise UnsupportedFormatError(f"is a zip archive without a data.pkl record, so not a torch.save file: "
                                     f"{_what_zip_holds(names)}", path=path)
    return pickles[0].split("/", 1)[0]


def _what_zip_holds(names: list[str]) -> str:
    """What a zip that is not a checkpoint looks like, for the error that refuses it."""
    if names and all(name.endswith(".npy") for name in names):
        return "it holds numpy arrays (an .npz file; load it with numpy.load, then save the tensors with safetensors)"
    if any(name.endswith(".weights.h5") for name in names) or "config.json" in names and "metadata.json" in names:
        return "it looks like a Keras archive (.keras), which this loader does not read"
    shown = ", ".join(sorted(names)[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"it holds {shown}" if names else "it is empty"


def read_torch_zip(path: Path, *, trust_pickle: bool, state_dict_key: Optional[str] = None) -> Payload:
    """The model state of a torch zip (see :func:`~.torchpickle.find_payload`), each tensor located in the file."""
    return _read_zip(path, trust_pickle=trust_pickle, state_dict_key=state_dict_key)


def read_embedded_tensor(path: Path, base: int, length: int, name: str) -> TensorInfo:
    """The one tensor ``torch.save`` wrote as a zip at ``[base, base + length)`` of ``path`` (a DCP chunk), named ``name``."""
    if is_remote(path):
        return _read_zip(path, trust_pickle=False, window=_Window(remote_pread(path), base, length),
                         single=name).tensors[name]
    with open(path, "rb") as handle:
        payload = _read_zip(path, trust_pickle=False, window=_Window(functools.partial(os.pread, handle.fileno()),
                                                                       base, length), single=name)
    return payload.tensors[name]


def _read_zip(
    path: Path, *, trust_pickle: bool, window: Optional[_Window] = None, single: Optional[str] = None,
    state_dict_key: Optional[str] = None,
) -> Payload:
    """A torch zip's model state (see :func:`~.torchpickle.find_payload`); in a ``window`` of the file, and
    with ``single``, the one bare tensor it holds."""
    if window is None and is_remote(path):  # read through ranged GETs, as one window of the whole object
        window = _Window(remote_pread(path), 0, file_size_of(path))
    file_size = window.base + window.length if window is not None else os.path.getsize(path)
    with _open_archive(path, window) as archive:
        names = archive.namelist()
        # Counted once, not per name: a zip of 150,000 records would otherwise take minutes to refuse.
        present = set(names)
        duplicated = sorted(n for n, k in collections.Counter(names).items() if k > 1) if len(present) != len(names) else []
        if duplicated:  # readers disagree on which copy counts: torch's takes the first, zipfile the last
            raise CheckpointError(f"the zip holds records more than once: {', '.join(duplicated[:5])}", path=path)
        prefix = _archive_prefix(path, names)
        # Every record is checked (method, sizes, place) before any is read: a compressed data.pkl of a few MB
        # would otherwise be inflated to gigabytes only to be refused afterwards.
        try:
            records = _record_offsets(path, archive, prefix, window)
        except CheckpointError:
            raise
        except ZIP_ERRORS as exc:
            raise CheckpointError(f"cannot locate the storage records: {first_line(exc)}", path=path) from None
        byteorder = f"{prefix}/byteorder"
        if byteorder in present and _read(path, archive, byteorder).strip() == b"big":
            raise UnsupportedFormatError("was saved on a big-endian machine; re-save it on a little-endian one", path=path)
        refs: dict[int, StorageRef] = {}
        data = _read(path, archive, f"{prefix}/data.pkl")
        if single is None:
            payload = read_payload(path, data, refs, trust_pickle=trust_pickle, state_dict_key=state_dict_key)
        else:
            payload = Payload({single: read_bare_tensor(path, data, refs, what=f"tensor '{single}'")}, None, {})
        _verify_small_records(path, archive, prefix, {byteorder, f"{prefix}/data.pkl"})
    return payload._replace(tensors=tensor_infos(path, payload.tensors, refs, records, file_size))
