"""torch zip checkpoints (``.pt``/``.pth``/``.bin``) read without loading tensors.

``data.pkl`` of a plain state dict is read without torch (see
:mod:`.plainpickle`); any other is unpickled onto ``meta`` (see
:mod:`.torchpickle`), which imports torch only then. Each tensor then maps
to its storage record in the zip, whose bytes are stored uncompressed at a
known offset: the same direct path as safetensors, with no ``torch.load`` of
the data. The zip's own checks (records located, duplicates, byte order,
small records' CRCs, each tensor's bounds) are the same on both paths.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import itertools
import operator
import os
import struct
import sys
import zipfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterator, NamedTuple, Optional, Sequence

from ..errors import CheckpointError, UnsupportedFormatError, first_line
from ..sources.fileio import file_size_of, remote_pread
from ..sources.readahead import ReadAhead, read_ahead_if_uncached
from ..sources.remotepath import is_remote
from .base import TensorInfo
from .payload import Payload
from .plainpickle import plain_infos, plain_payload

if TYPE_CHECKING:
    from .torchpickle import StorageRef

_LOCAL_HEADER = struct.Struct("<4s4xH16xHH")
_SMALL_RECORD = 1 << 20
_DOS_DIRECTORY = 0x10


def _record_offsets(
    path: Path, archive: "_Archive", prefix: str, window: Optional["_Window"] = None,
) -> dict[str, tuple[int, int]]:
    """Storage key -> (absolute data offset, size) for every stored record (of the zip in ``window``, if given).

    Every record's local header is checked against the central directory
    (signature, name, method) and records must not overlap each other or the
    central directory: readers that trust one or the other would otherwise
    read different bytes from a damaged file. No record's data is read here,
    so a compressed or oversized record is refused before it costs anything;
    the cost is one header read per record (records close together read by
    one read, see :func:`_local_headers`) and the checks, made over all
    records at once where they all pass (:func:`_located_at_once`), else one
    record at a time, with a sort of their spans (:func:`_located_in_turn`).
    Record CRCs are checked by :func:`_verify_small_records`.
    """
    data_dir = f"{prefix}/data/"
    base = window.base if window is not None else 0
    with contextlib.ExitStack() as opened:
        # A zip inside a bigger file is read through its window's descriptor, not a second open.
        handle = window.copy() if window is not None else opened.enter_context(open(path, "rb"))
        pread = window.pread if window is not None else functools.partial(os.pread, handle.fileno())
        _check_end_record(path, archive, handle)
        columns = archive.columns
        refused = _first_refused(archive)
        names, _, raw_names, _, methods, _, compressed, sizes, _, _, header_offsets = columns
        lengths = list(map(_LOCAL_HEADER.size.__add__, map(len, raw_names)))
        # (a zip inside a bigger file holds one tensor's few records: its headers are not worth asking for ahead)
        headers = _local_headers(header_offsets, lengths, pread, base,
                                 descriptor=handle.fileno() if window is None else None)
        if refused == len(names):  # every header is read: once, for both checks
            headers = list(headers)
            located = _located_at_once(headers, columns, lengths, data_dir, base, archive.start_dir)
            if located is not None:
                return located
        return _located_in_turn(path, archive, columns, refused, iter(headers), data_dir, base)


def _located_at_once(headers: list[bytes], columns: tuple[list, ...], lengths: list[int], data_dir: str,
                     base: int, start_dir: int) -> Optional[dict[str, tuple[int, int]]]:
    """What :func:`_located_in_turn` returns where every local header agrees with the directory and the records
    lie in the file in the directory's order, none overlapping another or the directory; None anywhere else
    (it then checks each record in turn and says which one is wrong).

    Every check runs over all records at once in C (``map``, ``zip``, comparisons of whole lists): a zip of
    100,000 records in a fraction of what a Python loop over them costs.
    """
    names, _, raw_names, _, methods, _, compressed, sizes, _, _, header_offsets = columns
    if not headers:
        return {}
    try:
        signatures, local_methods, name_lengths, extra_lengths = zip(*map(_LOCAL_HEADER.unpack_from, headers))
    except struct.error:  # a header cut short by the file's end
        return None
    # Each header was read as long as the directory's name makes it: its own name, of the same length,
    # then ends it exactly when it is that name.
    if set(signatures) != {b"PK\x03\x04"} or list(local_methods) != methods or list(map(len, headers)) != lengths \
            or list(name_lengths) != list(map(len, raw_names)) or not all(map(bytes.endswith, headers, raw_names)):
        return None
    # (a header's length, as read, is its fixed part and its name's: checked above)
    data_starts = list(map(operator.add, map(operator.add, header_offsets, lengths), extra_lengths))
    data_ends = list(map(operator.add, data_starts, compressed))
    following = header_offsets[1:] + [start_dir]
    if not all(map(operator.lt, header_offsets, following)) or any(map(operator.gt, data_ends, following)):
        return None
    in_data = list(map(str.startswith, names, itertools.repeat(data_dir)))
    keys = map(operator.itemgetter(slice(len(data_dir), None)), itertools.compress(names, in_data))
    starts = itertools.compress(map(base.__add__, data_starts) if base else data_starts, in_data)
    return dict(zip(keys, zip(starts, itertools.compress(sizes, in_data))))


def _located_in_turn(path: Path, archive: "_Archive", columns: tuple[list, ...], refused: int,
                     headers: Iterator[bytes], data_dir: str, base: int) -> dict[str, tuple[int, int]]:
    """Storage key -> (absolute data offset, size), each record checked in turn against its local header
    (``headers``, in the directory's order), the first that fails refused by name."""
    offsets: dict[str, tuple[int, int]] = {}
    spans: list[tuple[int, int, str]] = []
    infos = archive.infolist()
    unpack_header, header_size, cut = _LOCAL_HEADER.unpack_from, _LOCAL_HEADER.size, len(data_dir)
    names, _, raw_names, _, methods, _, compressed, sizes, _, _, header_offsets = columns
    # The central directory's own checks ran first, for all records at once; the first record they refuse
    # is refused after the local headers of those before it, as a loop over the records checking each
    # in turn would refuse it.
    for name, raw_name, method_listed, header_offset, compressed_size, size, header in zip(
            names[:refused], raw_names, methods, header_offsets, compressed, sizes, headers):
        # (each header read once its record passed the directory's checks: zip takes the names first)
        if len(header) < header_size:
            raise CheckpointError(f"zip local header of record {name!r} is truncated", path=path)
        signature, method, name_len, extra_len = unpack_header(header)
        if signature != b"PK\x03\x04" or method != method_listed or header[header_size:header_size + name_len] != raw_name:
            raise CheckpointError(f"zip local header of record {name!r} disagrees with the central directory "
                                  "(corrupt zip)", path=path)
        data_start = header_offset + header_size + name_len + extra_len
        spans.append((header_offset, data_start + compressed_size, name))
        if name.startswith(data_dir):
            offsets[name[cut:]] = (base + data_start, size)
    if refused < len(infos):
        raise CheckpointError(_refusal(infos[refused], data_dir), path=path)
    spans.sort()
    starts, ends, _ = zip(*spans) if spans else ((), (), ())
    if any(map(operator.gt, ends, starts[1:] + (archive.start_dir,))):
        for (_, end, name), (next_start, _, next_name) in zip(spans, spans[1:] + [(archive.start_dir, 0, "central directory")]):
            if end > next_start:
                raise CheckpointError(f"zip record {name!r} overlaps {next_name!r} (corrupt zip)", path=path)
    return offsets


def _first_refused(archive: "_Archive") -> int:
    """The index of the first record the central directory's own checks refuse (:func:`_refusal`); the count
    of records where none is. Checked on the set of each field's values, unless one is off."""
    _, _, _, flags, methods, _, compressed, sizes, volumes, attributes, _ = archive.columns
    if flags and not any(flag & 0x1 for flag in set(flags)) and set(methods) == {zipfile.ZIP_STORED} \
            and compressed == sizes and set(volumes) == {0} \
            and not any(attribute & _DOS_DIRECTORY for attribute in set(attributes)):
        return len(flags)
    infos = archive.infolist()
    return next((index for index, info in enumerate(infos) if _refusal(info, "") is not None), len(infos))


def _refusal(info: "_Entry", data_dir: str) -> Optional[str]:
    """Why the central directory's entry of a record refuses it, before its local header is read; None if not."""
    name = info.filename
    if info.flag_bits & 0x1:
        return f"zip record {name!r} is encrypted; torch never writes that"
    if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
        return f"zip record {name!r} is stored but its two sizes differ (corrupt zip)"
    if info.external_attr & _DOS_DIRECTORY:  # torch's reader then returns unread memory for it
        return f"zip record {name!r} is marked as a directory (corrupt zip)"
    if info.volume != 0:
        return f"zip record {name!r} claims to be on another disk (corrupt zip)"
    if info.compress_type != zipfile.ZIP_STORED:  # a few compressed bytes could inflate to gigabytes
        what = f"storage record {name[len(data_dir):]!r}" if name.startswith(data_dir) else f"zip record {name!r}"
        return f"{what} is compressed; torch writes every record stored"
    return None


# Local headers at most _HEADER_GAP bytes apart are read by one positional read of at most _HEADER_RUN bytes
# (with the record data between them): a zip of small tensors in few reads, one of big tensors in one small read
# a header, never their data.
_HEADER_RUN = 1 << 16
_HEADER_GAP = 1 << 12


def _local_headers(offsets: Sequence[int], lengths: Sequence[int], pread: Callable[[int, int], bytes], base: int,
                   descriptor: Optional[int] = None) -> Iterator[bytes]:
    """The bytes of each span, ``lengths[i]`` at ``offsets[i]``, in turn (each record's local header and name),
    as one positional read each would return them.

    Spans that follow one another in the file, each at most
    :data:`_HEADER_GAP` bytes after the one before and all within
    :data:`_HEADER_RUN` bytes of the first, are read by one positional read
    of the run: a zip of 100,000 small tensors takes a read per hundred or
    so records, not one each; a run is read only when its first span is asked for.
    Where the file open as ``descriptor`` is not in the page cache, the
    headers are asked of the kernel ahead of their reads
    (:mod:`materialize.sources.readahead`): cold, one read at a time waits for the
    disk 100,000 times in turn.
    """
    if not offsets:
        return iter(())
    ahead = read_ahead_if_uncached(descriptor, offsets, lengths, base)
    # Whether the span after each may share its read: where it may not, each is read alone, as asked for.
    joins = list(map(range(_HEADER_GAP + 1).__contains__,
                     map(operator.sub, offsets[1:], map(operator.add, offsets, lengths))))
    joins.append(False)
    return _joined_headers(offsets, lengths, pread, base, ahead, joins)


def _joined_headers(offsets: Sequence[int], lengths: Sequence[int], pread: Callable[[int, int], bytes], base: int,
                    ahead: Optional[ReadAhead], joins: list[bool]) -> Iterator[bytes]:
    """:func:`_local_headers`' reads, runs of spans close together read at once and the kernel asked ahead."""
    count = len(offsets)
    index = 0
    while index < count:
        if ahead is not None and index >= ahead.next_index:
            ahead.reach(index)
        if not joins[index]:  # up to the next span that joins the one after it, a read each (made in C)
            try:
                stop = joins.index(True, index)
            except ValueError:
                stop = count
            if ahead is not None:
                stop = min(stop, ahead.next_index)
            yield from map(pread, lengths[index:stop],
                           map(base.__add__, offsets[index:stop]) if base else offsets[index:stop])
            index = stop
            continue
        offset = offsets[index]
        run_end = offset + lengths[index]
        last = index + 1
        limit = min(index + 1024, count)
        while last < limit:
            next_offset, next_length = offsets[last], lengths[last]
            if not run_end <= next_offset <= run_end + _HEADER_GAP or next_offset + next_length - offset > _HEADER_RUN:
                break
            run_end = next_offset + next_length
            last += 1
        window = pread(run_end - offset, base + offset)
        if last == index + 1:
            yield window  # (what a read of its own returns)
        else:  # a slice of a read that stopped short at the file's end is what a read of its own returns too
            for next_offset, next_length in zip(offsets[index:last], lengths[index:last]):
                yield window[next_offset - offset:next_offset - offset + next_length]
        index = last


def _verify_small_records(path: Path, archive: "_Archive", prefix: str, already_read: set[str]) -> None:
    """Reads every record outside ``data/`` of up to 1 MB so that its CRC is checked (:meth:`_Archive.read`); only after
    :func:`_record_offsets` has bounded each one to its own stored bytes, so this is one pass over them."""
    names, sizes = archive.columns[0], archive.columns[7]
    outside_data = map(operator.not_, map(str.startswith, names, itertools.repeat(f"{prefix}/data/")))
    for name in itertools.compress(names, map(operator.and_, map(_SMALL_RECORD.__ge__, sizes), outside_data)):
        if name not in already_read:
            _read(path, archive, name)


_END_RECORD = struct.Struct("<4sHHHHIIH")
_CENTRAL_ENTRY_SIZE = 46
_ENTRY_LENGTHS = struct.Struct("<HHH")  # a directory entry's name, extra and comment lengths, 28 bytes in
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_END_RECORD = struct.Struct("<4sQHHIIQQQQ")


def _check_end_record(path: Path, archive: "_Archive", handle: BinaryIO) -> None:
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
    count = len(archive.columns[0])
    if any(c != count for c in counts):
        raise CheckpointError(f"zip end record counts {max(counts)} records, its directory holds {count} (corrupt zip)", path=path)
    if directory_size == archive.tiled_size:
        return  # its entries were found to fill exactly these bytes where it starts: the walk below would agree
    handle.seek(archive.start_dir)
    directory = handle.read(directory_size)
    walked = 0
    lengths, last_entry_at, is_entry = _ENTRY_LENGTHS.unpack_from, len(directory) - _CENTRAL_ENTRY_SIZE, directory.startswith
    for _ in range(count):  # zipfile reads past a short directory silently; torch's reader does not
        if walked > last_entry_at or not is_entry(b"PK\x01\x02", walked):
            break
        name_len, extra_len, comment_len = lengths(directory, walked + 28)
        walked += _CENTRAL_ENTRY_SIZE + name_len + extra_len + comment_len
    if walked != directory_size or len(directory) != directory_size:
        raise CheckpointError("zip central directory entries do not add up to its recorded size (corrupt zip)", path=path)


# What a damaged zip can raise from zipfile besides BadZipFile.
ZIP_ERRORS = (zipfile.BadZipFile, RuntimeError, zlib.error, EOFError, OSError, NotImplementedError, UnicodeDecodeError, ValueError)


def _read(path: Path, archive: "_Archive", name: str) -> bytes:
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

    def read_at(self, length: int, offset: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` of the window, as seeking there and reading would give them."""
        if offset < 0:
            raise ValueError("negative seek position")
        wanted = max(0, min(length, self.length - offset))
        return self.pread(wanted, self.base + offset) if wanted else b""

    def readinto(self, buffer: Any) -> int:
        wanted = max(0, min(len(buffer), self.length - self._at))
        data = self.pread(wanted, self.base + self._at) if wanted else b""
        buffer[:len(data)] = data
        self._at += len(data)
        return len(data)


# zipfile decodes a record's extra fields by slicing off one at a time, each slice a copy of the rest: quadratic in
# their count, 70 ms for one 64 KB extra of 4-byte fields, a minute for a zip of a thousand such records. torch
# writes at most two fields a record; _read_directory, which reads them as zipfile does but walks them without the
# copies, refuses a record with more than this many as it meets it, before any record is read.
MAX_EXTRA_FIELDS = 64


class _TooManyExtraFields(Exception):
    """A central directory entry of more than :data:`MAX_EXTRA_FIELDS` extra fields (its name, as stored)."""


def _extra_fields_count(extra: bytes) -> int:
    """How many fields an entry's extra bytes hold, counted up to one past :data:`MAX_EXTRA_FIELDS`."""
    fields = walked = 0
    while walked + 4 <= len(extra) and fields <= MAX_EXTRA_FIELDS:
        walked += 4 + int.from_bytes(extra[walked + 2:walked + 4], "little")
        fields += 1
    return fields


class _Entry(NamedTuple):
    """A central directory entry, with the fields of zipfile's ``ZipInfo`` that the checks read."""

    filename: str  # cut at a NUL, as zipfile cuts it
    orig_filename: str
    raw_name: bytes  # as stored
    flag_bits: int
    compress_type: int
    CRC: int
    compress_size: int
    file_size: int
    volume: int
    external_attr: int
    header_offset: int


_CENTRAL_ENTRY = struct.Struct(zipfile.structCentralDir)
# The fields of a central directory entry that _read_directory reads, the rest skipped (zipfile.structCentralDir).
_CENTRAL_FIELDS = struct.Struct("<4s2xBxHH4xIIIHHHH2xII")
assert _CENTRAL_FIELDS.size == _CENTRAL_ENTRY.size
_FILE_HEADER = struct.Struct(zipfile.structFileHeader)
_ZIP64_SIZES = struct.Struct("<Q")
_UTF8_NAME = 0x800


class _Archive:
    """A torch zip's central directory and stored records, read as ``zipfile.ZipFile`` reads them: the same
    checks in the same order, raising the same errors, without a ``ZipInfo`` object per record (the cost of
    opening a zip of 100,000 records, twice what these checks cost).

    ``columns`` holds the directory a field at a time (each a list in :class:`_Entry`'s field order, a record's
    values at one index); :meth:`infolist` makes the entries only when asked. ``pread(length, offset)`` reads
    the file (or a window of one); ``handle``, its file object, is closed with the archive where the archive
    opened it.
    """

    def __init__(self, handle: BinaryIO, pread: Callable[[int, int], bytes], owned: bool) -> None:
        self.handle, self.pread, self._owned = handle, pread, owned
        self.columns, self.start_dir, self.tiled_size = _read_directory(handle)
        self._entries: Optional[list[_Entry]] = None
        self._by_name: Optional[dict[str, int]] = None

    def infolist(self) -> list[_Entry]:
        if self._entries is None:
            self._entries = list(map(_Entry._make, zip(*self.columns)))
        return self._entries

    def by_name(self) -> dict[str, int]:
        """Each record's name -> the index of its last entry (zipfile keeps the last of a name), made when first
        asked for."""
        if self._by_name is None:
            self._by_name = dict(zip(self.columns[0], range(len(self.columns[0]))))
        return self._by_name

    def _entry(self, name: str) -> Optional[_Entry]:
        """The last entry of ``name``, as zipfile keeps it."""
        index = self.by_name().get(name)
        return None if index is None else _Entry._make(column[index] for column in self.columns)

    def read(self, name: str) -> bytes:
        """A stored record's bytes, as ``ZipFile.read`` returns them (its local header and CRC checked)."""
        entry = self._entry(name)
        if entry is None:
            raise KeyError(f"There is no item named {name!r} in the archive")
        header = self.pread(_FILE_HEADER.size, entry.header_offset)
        if len(header) != _FILE_HEADER.size:
            raise zipfile.BadZipFile("Truncated file header")
        fields = _FILE_HEADER.unpack(header)
        if fields[zipfile._FH_SIGNATURE] != zipfile.stringFileHeader:  # type: ignore[attr-defined]
            raise zipfile.BadZipFile("Bad magic number for file header")
        name_length = fields[zipfile._FH_FILENAME_LENGTH]  # type: ignore[attr-defined]
        extra_length = fields[zipfile._FH_EXTRA_FIELD_LENGTH]  # type: ignore[attr-defined]
        local_name = self.pread(name_length, entry.header_offset + _FILE_HEADER.size) if name_length else b""
        if entry.flag_bits & 0x20:
            raise NotImplementedError("compressed patched data (flag bit 5)")
        if entry.flag_bits & 0x40:
            raise NotImplementedError("strong encryption (flag bit 6)")
        local_flags = fields[zipfile._FH_GENERAL_PURPOSE_FLAG_BITS]  # type: ignore[attr-defined]
        if local_name.decode("utf-8" if local_flags & _UTF8_NAME else "cp437") != entry.orig_filename:
            raise zipfile.BadZipFile(f"File name in directory {entry.orig_filename!r} and header {local_name!r} differ.")
        if entry.flag_bits & 0x1:
            raise RuntimeError(f"File {name!r} is encrypted, password required for extraction")
        if entry.compress_type != zipfile.ZIP_STORED:  # refused before any read (see _record_offsets)
            raise NotImplementedError("only stored records are read")
        data = self.pread(entry.compress_size, entry.header_offset + _FILE_HEADER.size + name_length + extra_length) \
            if entry.compress_size else b""
        if len(data) < entry.compress_size:
            raise EOFError
        data = data[:entry.file_size]
        if zlib.crc32(data) != entry.CRC:
            raise zipfile.BadZipFile(f"Bad CRC-32 for file {entry.filename!r}")
        return data

    def close(self) -> None:
        if self._owned:
            self.handle.close()

    def __enter__(self) -> "_Archive":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _read_directory(handle: BinaryIO) -> tuple[tuple[list, ...], int, Optional[int]]:
    """The entries of a zip's central directory, a field at a time (see :class:`_Archive`), where it starts, and
    its size where its entries were found to fill it exactly (None where not looked at); read as zipfile's
    ``_RealGetContents`` reads them: its checks, its order, its errors."""
    try:
        end = zipfile._EndRecData(handle)  # type: ignore[attr-defined]
    except OSError:
        raise zipfile.BadZipFile("File is not a zip file") from None
    if not end:
        raise zipfile.BadZipFile("File is not a zip file")
    size = end[zipfile._ECD_SIZE]  # type: ignore[attr-defined]
    concat = end[zipfile._ECD_LOCATION] - size - end[zipfile._ECD_OFFSET]  # type: ignore[attr-defined]
    if end[zipfile._ECD_SIGNATURE] == zipfile.stringEndArchive64:  # type: ignore[attr-defined]
        concat -= zipfile.sizeEndCentDir64 + zipfile.sizeEndCentDir64Locator  # type: ignore[attr-defined]
    start_dir = end[zipfile._ECD_OFFSET] + concat  # type: ignore[attr-defined]
    if start_dir < 0:
        raise zipfile.BadZipFile("Bad offset for central directory")
    handle.seek(start_dir)
    directory = handle.read(size)
    columns = _directory_at_once(directory, size, concat)
    if columns is not None:
        return columns, start_dir, size
    entries = _directory_in_turn(directory, size, concat)
    return (tuple(map(list, zip(*entries))) if entries else tuple([] for _ in _Entry._fields)), start_dir, None


# A directory entry after its signature: the fields _directory_at_once reads (see _CENTRAL_FIELDS), 42 bytes.
_ENTRY_AFTER_SIGNATURE = struct.Struct("<2xBxHH4xIIIHHHH2xII")
_NAME_ENCODINGS = ("cp437", "utf-8")  # by whether an entry's flags set the UTF-8 bit
_NATIVE_WIDTHS = (struct.calcsize("H"), struct.calcsize("I"))  # what memoryview.cast("H"), cast("I") read


def _directory_at_once(directory: bytes, size: int, concat: int) -> Optional[tuple[list, ...]]:
    """:func:`_directory_in_turn`'s entries, a field at a time, where the directory is cut into its entries by
    their signature (no name, extra field or comment holding one) and every entry passes its checks; read by
    passes over all entries at once, each in C. None anywhere else: the loop then reads the directory an entry
    at a time and raises what zipfile raises, for the entry zipfile raises it for.

    Entries with extra fields (ZIP64 sizes and offsets: every record past 4 GB of a big checkpoint) are read one
    at a time, as the loop reads them.
    """
    signature = zipfile.stringCentralDir
    if len(directory) != size or not directory.startswith(signature):
        return None
    pieces = directory.split(signature)
    del pieces[0]
    fields = _entry_fields(pieces)
    if fields is None:  # a piece too short to be an entry: a signature inside one
        return None
    (versions, flags, methods, crcs, compressed, sizes, name_lengths, extra_lengths, comment_lengths, volumes,
     externals, header_offsets) = fields
    if max(versions) > zipfile.MAX_EXTRACT_VERSION:  # type: ignore[attr-defined]
        return None
    fixed = _ENTRY_AFTER_SIGNATURE.size
    name_ends = list(map(fixed.__add__, name_lengths))
    if list(map(len, pieces)) != list(map(operator.add, map(operator.add, name_ends, extra_lengths), comment_lengths)):
        return None  # each piece is not one entry: a signature inside a name, extra field or comment
    raw_names = list(map(operator.getitem, pieces, map(slice, itertools.repeat(fixed), name_ends)))
    name_flags = {flag & _UTF8_NAME for flag in set(flags)}
    encodings = itertools.repeat(_NAME_ENCODINGS[bool(name_flags.pop())]) if len(name_flags) == 1 \
        else map(_NAME_ENCODINGS.__getitem__, map(bool, map(_UTF8_NAME.__and__, flags)))
    try:
        names = list(map(bytes.decode, raw_names, encodings))
    except UnicodeDecodeError:
        return None
    filenames = names
    if any(map(operator.contains, names, itertools.repeat("\0"))):
        filenames = list(map(_cut_at_nul, names))
    if any(extra_lengths):
        for index in itertools.compress(range(len(pieces)), extra_lengths):
            extra_length = extra_lengths[index]
            extra = pieces[index][name_ends[index]:name_ends[index] + extra_length]
            if extra_length >= 4 * (MAX_EXTRA_FIELDS + 1) and _extra_fields_count(extra) > MAX_EXTRA_FIELDS:
                return None
            try:
                sizes[index], compressed[index], header_offsets[index] = _zip64_fields(
                    extra, sizes[index], compressed[index], header_offsets[index])
            except zipfile.BadZipFile:
                return None
    if concat:
        header_offsets = list(map(concat.__add__, header_offsets))
    return (filenames, names, raw_names, flags, methods, crcs, compressed, sizes, volumes, externals, header_offsets)


def _entry_fields(pieces: list[bytes]) -> Optional[list[list[int]]]:
    """Each field of :data:`_ENTRY_AFTER_SIGNATURE` of every piece (an entry after its signature), a list a field;
    None where a piece is too short to hold them.

    The pieces' fixed parts are laid end to end, each padded to 44 bytes, and each field read as a strided view
    of them (``memoryview.cast``): a list of integers a field, with no tuple made an entry (half the time of
    unpacking each piece and transposing, and a third of the memory); two views of 4-byte words, one of them 2
    bytes in, hold the fields at either alignment. The views read the machine's byte order and C's widths: on a
    big-endian machine, or one whose ``short`` and ``int`` are not 2 and 4 bytes, each piece is unpacked.
    """
    fixed = _ENTRY_AFTER_SIGNATURE.size
    if sys.byteorder != "little" or _NATIVE_WIDTHS != (2, 4):
        try:
            return list(map(list, zip(*map(_ENTRY_AFTER_SIGNATURE.unpack_from, pieces))))
        except struct.error:
            return None
    laid = b"\0\0".join(map(operator.getitem, pieces, itertools.repeat(slice(0, fixed)))) + b"\0\0"
    if len(laid) != (fixed + 2) * len(pieces):
        return None
    view = memoryview(laid)
    halves, words, words_shifted = view.cast("H"), view.cast("I"), view[2:-2].cast("I")
    # (byte offsets in a piece: version 2, flags 4, method 6, CRC 12, sizes 16 and 20, name, extra and comment
    # lengths 24, 26, 28, disk 30, external attributes 34, header offset 38; see _CENTRAL_FIELDS)
    return [view[2::44].tolist(), halves[2::22].tolist(), halves[3::22].tolist(), words[3::11].tolist(),
            words[4::11].tolist(), words[5::11].tolist(), halves[12::22].tolist(), halves[13::22].tolist(),
            halves[14::22].tolist(), halves[15::22].tolist(), words_shifted[8::11].tolist(),
            words_shifted[9::11].tolist()]


def _directory_in_turn(directory: bytes, size: int, concat: int) -> list[_Entry]:
    """The entries of a central directory read an entry at a time, as zipfile's loop reads them."""
    entries = []
    unpack = _CENTRAL_FIELDS.unpack_from
    make = tuple.__new__
    entry_size, available, central, newest = _CENTRAL_ENTRY.size, len(directory), zipfile.stringCentralDir, \
        zipfile.MAX_EXTRACT_VERSION  # type: ignore[attr-defined]
    total = 0
    while total < size:
        if total + entry_size > available:
            raise zipfile.BadZipFile("Truncated central directory")
        (signature, extract_version, flags, method, crc, compressed, file_size, name_length, extra_length,
         comment_length, volume, external, header_offset) = unpack(directory, total)
        if signature != central:
            raise zipfile.BadZipFile("Bad magic number for central directory")
        at = total + entry_size
        name_end = at + name_length
        raw_name = directory[at:name_end]
        name = raw_name.decode("utf-8" if flags & _UTF8_NAME else "cp437")
        if extract_version > newest:
            raise NotImplementedError("zip file version %.1f" % (extract_version / 10))
        if extra_length:
            extra = directory[name_end:name_end + extra_length]
            # (each field takes 4 bytes at least: fewer bytes hold too few fields to count)
            if extra_length >= 4 * (MAX_EXTRA_FIELDS + 1) and _extra_fields_count(extra) > MAX_EXTRA_FIELDS:
                raise _TooManyExtraFields(raw_name.decode("utf-8" if flags & _UTF8_NAME else "cp437", "replace"))
            if extra:
                file_size, compressed, header_offset = _zip64_fields(extra, file_size, compressed, header_offset)
        entries.append(make(_Entry, (_cut_at_nul(name), name, raw_name, flags, method, crc, compressed, file_size,
                                     volume, external, header_offset + concat)))
        total = name_end + extra_length + comment_length
    return entries


def _cut_at_nul(name: str) -> str:
    """A record's name as zipfile gives it: cut at its first NUL."""
    return name if "\0" not in name else name[:name.find("\0")]


def _zip64_fields(extra: bytes, file_size: int, compressed: int, header_offset: int) -> tuple[int, int, int]:
    """A directory entry's sizes and offset after its extra fields, as zipfile's ``_decodeExtra`` reads them
    (a ZIP64 field holds the values stored as 0xFFFFFFFF), with its errors."""
    at = 0
    while len(extra) - at >= 4:
        kind, length = struct.unpack_from("<HH", extra, at)
        if length + 4 > len(extra) - at:
            raise zipfile.BadZipFile("Corrupt extra field %04x (size=%d)" % (kind, length))
        if kind == 0x0001:
            data = extra[at + 4:at + 4 + length]
            field = ""
            try:
                if file_size in (0xFFFF_FFFF_FFFF_FFFF, 0xFFFF_FFFF):
                    field = "File size"
                    file_size, = _ZIP64_SIZES.unpack(data[:8])
                    data = data[8:]
                if compressed == 0xFFFF_FFFF:
                    field = "Compress size"
                    compressed, = _ZIP64_SIZES.unpack(data[:8])
                    data = data[8:]
                if header_offset == 0xFFFF_FFFF:
                    field = "Header offset"
                    header_offset, = _ZIP64_SIZES.unpack(data[:8])
            except struct.error:
                raise zipfile.BadZipFile(f"Corrupt zip64 extra field. {field} not found.") from None
        at += length + 4
    return file_size, compressed, header_offset


def _open_archive(path: Path, source: Optional[BinaryIO] = None) -> _Archive:
    with contextlib.ExitStack() as opened:
        handle = source.copy() if isinstance(source, _Window) else opened.enter_context(open(path, "rb"))
        try:
            if isinstance(source, _Window):
                return _Archive(source.copy(), source.read_at, owned=False)
            archive = _Archive(handle, functools.partial(_pread_all, handle.fileno()), owned=True)
            opened.pop_all()  # the archive closes the file
            return archive
        except (NotImplementedError, UnicodeDecodeError, ValueError, EOFError) as exc:
            raise CheckpointError(f"is not a readable zip: {first_line(exc)}", path=path) from None
        except zipfile.BadZipFile:
            raise CheckpointError("is not a valid torch zip checkpoint (bad or truncated zip)", path=path) from None
        except _TooManyExtraFields as exc:
            raise CheckpointError(f"zip record {exc.args[0]!r} carries more than {MAX_EXTRA_FIELDS} extra fields "
                                  "(corrupt zip)", path=path) from None


def _pread_all(descriptor: int, length: int, offset: int) -> bytes:
    """``length`` bytes at ``offset``, fewer only at the file's end (``os.pread`` may return fewer at once)."""
    data = os.pread(descriptor, length, offset)
    while len(data) < length:
        more = os.pread(descriptor, length - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def _archive_prefix(path: Path, names: list[str]) -> str:
    # (each question asked of all names by one pass in C; the names are cut at a NUL by zipfile: none holds one)
    pickles = [name for name in itertools.compress(names, map(str.endswith, names, itertools.repeat("/data.pkl")))
               if name.count("/") == 1]
    joined = "\0".join(names) + "\0"
    if "/constants.pkl\0" in joined or "/code/" in joined:
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
        names = archive.columns[0]
        # Counted once, not per name: a zip of 150,000 records would otherwise take minutes to refuse.
        present = archive.by_name()  # (the index reads use: one table of the names, not two)
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
        # A plain state dict is read without torch; the rest imports it (see .plainpickle's note on loads).
        plain = plain_payload(path, data, state_dict_key) if single is None and not trust_pickle else None
        if plain is not None:
            payload = plain
        elif single is None:
            from .torchpickle import read_payload

            payload = read_payload(path, data, refs, trust_pickle=trust_pickle, state_dict_key=state_dict_key)
        else:
            from .torchpickle import read_bare_tensor

            payload = Payload({single: read_bare_tensor(path, data, refs, what=f"tensor '{single}'")}, None, {})
        _verify_small_records(path, archive, prefix, {byteorder, f"{prefix}/data.pkl"})
    if plain is not None:
        return payload._replace(tensors=plain_infos(path, payload.tensors, records, file_size))
    from .torchpickle import located_extra_states, tensor_infos

    return payload._replace(tensors=tensor_infos(path, payload.tensors, refs, records, file_size),
                            extra_states=located_extra_states(path, payload.extra_states, refs, records, file_size))
