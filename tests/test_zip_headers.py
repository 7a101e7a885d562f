"""Local headers read in runs (torchzip._local_headers) are the bytes one read each would give, in order, and
a run is read only when its first header is asked for."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

import materialize as mz
from materialize.checkpoint import torchzip


@pytest.mark.parametrize("seed", range(20))
def test_headers_read_in_runs_are_those_read_one_by_one(tmp_path: Path, seed: int):
    rng = random.Random(seed)
    path = tmp_path / "bytes"
    path.write_bytes(rng.randbytes(rng.choice((300, 5000, 200_000))))
    size = path.stat().st_size
    spans = []
    at = rng.randrange(50)
    for _ in range(rng.randrange(1, 300)):
        spans.append((at, rng.randrange(30, 120)))
        # Mostly onward, near or far, sometimes back or past the end: every order a damaged zip can list.
        at = rng.choice((at + rng.randrange(0, 400), at + rng.randrange(0, 1 << 17), rng.randrange(size + 100),
                         max(0, at - rng.randrange(200)), size - rng.randrange(60)))
    with open(path, "rb") as handle:
        reads = []

        def pread(length: int, offset: int) -> bytes:
            reads.append((offset, length))
            return os.pread(handle.fileno(), length, offset)

        base = rng.choice((0, 7))
        got = list(torchzip._local_headers([offset - base for offset, _ in spans], [length for _, length in spans],
                                           pread, base))
        assert got == [os.pread(handle.fileno(), length, offset) for offset, length in spans]
    assert all(length <= max(torchzip._HEADER_RUN, 120) for _, length in reads)
    assert len(reads) <= len(spans)


def test_a_run_is_read_when_its_first_header_is_asked_for():
    reads = []
    headers = torchzip._local_headers([0, 40, 1 << 20], [30, 30, 30], lambda n, at: reads.append(at) or b"x" * n, 0)
    assert reads == []
    next(headers)
    assert reads == [0]
    next(headers)
    assert reads == [0]  # in the first run
    next(headers)
    assert reads == [0, 1 << 20]


# torchzip._read_directory and _Archive.read read a zip as zipfile reads it: the same entries, the same errors.

import io  # noqa: E402
import struct  # noqa: E402
import zipfile  # noqa: E402

import torch  # noqa: E402


def _zip_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save({"a": torch.arange(6.0), "b": torch.ones(2, 3, dtype=torch.int64), "ü": torch.zeros(1)}, buffer)
    return buffer.getvalue()


def _zipfile_view(data: bytes):
    """What zipfile makes of ``data``: its entries and every stored record's bytes, or its error."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except Exception as error:  # noqa: BLE001
        return "error", type(error), str(error)
    entries = [(i.filename, i.orig_filename, i.flag_bits, i.compress_type, i.CRC, i.compress_size, i.file_size,
                i.volume, i.external_attr, i.header_offset) for i in archive.infolist()]
    return "read", archive.start_dir, entries, _reads(archive)


def _our_view(data: bytes):
    handle = io.BytesIO(data)
    try:
        archive = torchzip._Archive(handle, lambda length, offset: _pread(data, length, offset), owned=False)
    except Exception as error:  # noqa: BLE001
        return "error", type(error), str(error)
    entries = [(e.filename, e.orig_filename, e.flag_bits, e.compress_type, e.CRC, e.compress_size, e.file_size,
                e.volume, e.external_attr, e.header_offset) for e in archive.infolist()]
    assert all(e.raw_name == e.orig_filename.encode("utf-8" if e.flag_bits & 0x800 else "cp437")
               for e in archive.infolist())
    return "read", archive.start_dir, entries, _reads(archive)


def _pread(data: bytes, length: int, offset: int) -> bytes:
    if offset < 0:
        raise OSError(22, "Invalid argument")
    return data[offset:offset + length]


def _reads(archive) -> list:
    outcomes = []
    for info in archive.infolist():
        # _Archive.read is asked only of records that passed _record_offsets: stored, sizes equal, not encrypted,
        # a local header where one can be read.
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size or info.flag_bits & 1 \
                or info.header_offset < 0:
            continue
        try:
            outcomes.append(("data", archive.read(info.filename)))
        except (zipfile.BadZipFile, EOFError, OSError, NotImplementedError, UnicodeDecodeError, ValueError) as error:
            outcomes.append(("error", type(error), str(error)))
    return outcomes


def test_a_genuine_zip_reads_as_zipfile_reads_it():
    data = _zip_bytes()
    ours = _our_view(data)
    assert ours[0] == "read" and ours == _zipfile_view(data)


@pytest.mark.parametrize("seed", range(8))
def test_a_damaged_zip_reads_as_zipfile_reads_it(seed):
    data = _zip_bytes()
    directory = data.rfind(b"PK\x01\x02", 0, data.rfind(b"PK\x05\x06"))
    first_entry = data.find(b"PK\x01\x02")
    rng = random.Random(seed)
    for trial in range(150):
        damaged = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 3))):
            # Mostly the directory and its end record, sometimes a local header.
            at = rng.randrange(first_entry, len(data)) if rng.random() < 0.8 else rng.randrange(0, first_entry)
            damaged[at] = rng.choice((rng.randrange(256), 0x00, 0xFF, damaged[at] ^ 0x08, damaged[at] ^ 0x80))
        assert _our_view(bytes(damaged)) == _zipfile_view(bytes(damaged)), (seed, trial, directory)


def _with_zip64_entry(data: bytes, values: tuple, stored: bytes) -> bytes:
    """``data`` with its first directory entry's sizes and offset set to 0xFFFFFFFF and a ZIP64 extra field of
    ``values`` (as ``stored`` bytes) before its other extra fields."""
    start = data.find(b"PK\x01\x02")
    end_at = data.rfind(b"PK\x05\x06")
    entry = bytearray(data[start:start + 46])
    name_length, extra_length = struct.unpack_from("<HH", entry, 28)
    struct.pack_into("<LL", entry, 20, 0xFFFFFFFF, 0xFFFFFFFF)
    struct.pack_into("<L", entry, 42, 0xFFFFFFFF)
    extra = struct.pack("<HH", 1, len(stored)) + stored
    struct.pack_into("<H", entry, 30, extra_length + len(extra))
    rest_at = start + 46 + name_length
    rebuilt = bytearray(data[:start] + bytes(entry) + data[start + 46:rest_at] + extra + data[rest_at:])
    grown = len(extra)
    end_at += grown
    size, = struct.unpack_from("<L", rebuilt, end_at + 12)
    struct.pack_into("<L", rebuilt, end_at + 12, size + grown)
    zip64_at = rebuilt.rfind(b"PK\x06\x06", 0, end_at)  # torch writes a ZIP64 end record and its locator too
    if zip64_at >= 0:
        size, = struct.unpack_from("<Q", rebuilt, zip64_at + 40)
        struct.pack_into("<Q", rebuilt, zip64_at + 40, size + grown)
        locator_at = rebuilt.rfind(b"PK\x06\x07", 0, end_at)
        struct.pack_into("<Q", rebuilt, locator_at + 8, zip64_at)
    return bytes(rebuilt)


@pytest.mark.parametrize("fields", [3, 2, 1, 0])
def test_a_zip64_entry_reads_as_zipfile_reads_it(fields):
    data = _zip_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        first = archive.infolist()[0]
        values = (first.file_size, first.compress_size, first.header_offset)
    damaged = _with_zip64_entry(data, values, struct.pack("<3Q", *values)[:8 * fields])
    ours = _our_view(damaged)
    assert ours == _zipfile_view(damaged)
    assert ours[0] == ("read" if fields == 3 else "error")


@pytest.mark.parametrize("seed", range(12))
def test_a_directory_read_at_once_reads_as_zipfile_reads_it(seed):
    # The directory is cut into its entries at their signature and read a field at a time where each piece is one
    # entry; a signature anywhere else (a name, an extra field, a comment, or across two of them: every other
    # seed puts one in one of these) makes it read an entry at a time. Either way, what zipfile reads.
    rng = random.Random(seed)
    buffer = io.BytesIO()
    count = rng.randrange(1, 30)
    hostile_entry, where = rng.randrange(count), rng.choice(("name", "extra", "comment", "name and extra"))
    with zipfile.ZipFile(buffer, "w") as archive:
        for index in range(count):
            # ASCII names (cp437), others UTF-8 (flagged): both in one directory
            name, extra, comment = rng.choice(("w", "layers.0/w", "ü", "é/x")) + str(index), b"", b""
            if rng.random() < 0.3:
                extra = struct.pack("<HH", 0xCAFE, 9) + rng.randbytes(9).replace(b"PK", b"pk")
            if rng.random() < 0.2:
                comment = b"a comment"
            if seed % 2 and index == hostile_entry:
                if where == "name":
                    name += "PK\x01\x02"
                elif where == "extra":
                    extra = struct.pack("<HH", 0xCAFE, 4) + b"PK\x01\x02"
                elif where == "comment":
                    comment = b"PK\x01\x02"
                else:  # the name's end and the extra field's start
                    name, extra = name + "PK", struct.pack("<HH", 0x0201, 0)
            info = zipfile.ZipInfo(name)
            info.extra, info.comment = extra, comment
            archive.writestr(info, rng.randbytes(rng.randrange(40)))
    data = buffer.getvalue()
    ours = _our_view(data)
    assert ours[0] == "read" and ours == _zipfile_view(data)
    with torchzip._Archive(io.BytesIO(data), lambda length, offset: _pread(data, length, offset), False) as archive:
        assert (archive.tiled_size is None) == bool(seed % 2)


@pytest.mark.parametrize("seed", range(6))
def test_entry_fields_read_through_views_are_those_unpacked(seed, monkeypatch):
    # _entry_fields reads each field through a strided view of the pieces laid end to end; where the machine is
    # big-endian, or its C short and int are not 2 and 4 bytes, it unpacks each piece. Both give what unpacking
    # gives, and both refuse a piece too short.
    rng = random.Random(seed)
    pieces = [rng.randbytes(rng.choice((42, 42, 43, 60, 300))) for _ in range(rng.randrange(1, 50))]
    unpacked = [list(field) for field in zip(*map(torchzip._ENTRY_AFTER_SIGNATURE.unpack_from, pieces))]
    assert torchzip._entry_fields(pieces) == unpacked
    short = pieces[:rng.randrange(len(pieces))] + [rng.randbytes(rng.randrange(42))] + pieces
    assert torchzip._entry_fields(short) is None
    monkeypatch.setattr(torchzip, "sys", type("BigEndian", (), {"byteorder": "big"}))
    assert torchzip._entry_fields(pieces) == unpacked
    assert torchzip._entry_fields(short) is None
    monkeypatch.undo()
    monkeypatch.setattr(torchzip, "_NATIVE_WIDTHS", (4, 8))  # a C of wider short and int
    assert torchzip._entry_fields(pieces) == unpacked
    assert torchzip._entry_fields(short) is None


def test_a_big_checkpoints_directory_is_read_at_once(tmp_path: Path):
    # Records past 4 GB carry their offsets in ZIP64 extra fields: read at once all the same.
    data = _zip_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        first = archive.infolist()[0]
        values = (first.file_size, first.compress_size, first.header_offset)
    zip64 = _with_zip64_entry(data, values, struct.pack("<3Q", *values))
    with torchzip._Archive(io.BytesIO(zip64), lambda length, offset: _pread(zip64, length, offset), False) as archive:
        assert archive.tiled_size is not None
    assert _our_view(zip64) == _zipfile_view(zip64)


def test_a_directory_size_that_only_the_zip64_record_the_locator_points_to_gives_is_refused(tmp_path: Path):
    # zipfile reads the ZIP64 end record just before its locator; torch's reader, and the end-record check, the one
    # the locator points to. Pointed at a copy (in the archive's comment) whose directory is one entry's length
    # longer, the two disagree: the directory read at once does not fill that size, so its walk runs, and refuses
    # (docs/reliability.md: torch.load reads this file, taking the larger size as a bound).
    data = _zip_bytes()
    end_at, locator_at, record_at = data.rfind(b"PK\x05\x06"), data.rfind(b"PK\x06\x07"), data.rfind(b"PK\x06\x06")
    assert data[end_at + 20:end_at + 22] == b"\0\0" and locator_at == end_at - 20  # no comment yet
    copy = bytearray(data[record_at:locator_at])
    size, = struct.unpack_from("<Q", copy, 40)
    struct.pack_into("<Q", copy, 40, size + 46)
    damaged = bytearray(data + bytes(copy))
    struct.pack_into("<H", damaged, end_at + 20, len(copy))  # the copy is the comment
    struct.pack_into("<Q", damaged, locator_at + 8, len(data))  # where the copy starts
    path = tmp_path / "two-zip64-records.pt"
    path.write_bytes(bytes(damaged))
    with zipfile.ZipFile(path) as archive:  # zipfile reads it whole
        assert archive.testzip() is None
    with pytest.raises(mz.CheckpointError, match="do not add up to its recorded size"):
        mz.open_checkpoint(path)


def test_headers_far_apart_are_read_alone():
    # Big records between them: each header its own small read, not the records' data with it.
    reads = []
    offsets, lengths = [i * 24_000 for i in range(10)], [100] * 10
    list(torchzip._local_headers(offsets, lengths, lambda n, at: reads.append(n) or b"x" * n, 0))
    assert reads == [100] * 10


# torchzip._located_at_once checks every record's local header at once; where anything disagrees it hands over to
# _located_in_turn, which names the record at fault. Whatever the damage, the two agree.

def _located_both_ways(path: Path):
    archive = torchzip._open_archive(path)
    with archive, open(path, "rb") as handle:
        infos = archive.infolist()
        columns = tuple(map(list, zip(*infos)))
        names, _, raw_names, _, _, _, _, _, _, _, header_offsets = columns
        lengths = [torchzip._LOCAL_HEADER.size + len(raw) for raw in raw_names]
        prefix = names[0].split("/")[0]
        data_dir = f"{prefix}/data/"

        def pread(length: int, offset: int) -> bytes:
            return os.pread(handle.fileno(), length, offset)

        def headers():
            return torchzip._local_headers(header_offsets, lengths, pread, 0)

        at_once = torchzip._located_at_once(list(headers()), columns, lengths, data_dir, 0, archive.start_dir)
        try:
            in_turn = torchzip._located_in_turn(path, archive, columns, len(infos), headers(), data_dir, 0)
        except torchzip.CheckpointError as error:
            in_turn = error
    return at_once, in_turn


def test_a_genuine_zip_is_located_at_once(tmp_path: Path):
    path = tmp_path / "genuine.pt"
    path.write_bytes(_zip_bytes())
    at_once, in_turn = _located_both_ways(path)
    assert at_once is not None and at_once == in_turn and len(at_once) >= 2


@pytest.mark.parametrize("seed", range(4))
def test_a_damaged_local_header_is_never_located_at_once(tmp_path: Path, seed: int):
    data = _zip_bytes()
    first_entry = data.find(b"PK\x01\x02")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        headers = [(info.header_offset, 30 + len(info.filename.encode())) for info in archive.infolist()]
    rng = random.Random(seed)
    outcomes = set()
    for trial in range(60):
        damaged = bytearray(data)
        # A byte of a local header (its signature, method, name and extra lengths, name), or of the records
        # between them.
        offset, length = rng.choice(headers)
        at = rng.randrange(offset, offset + length) if rng.random() < 0.8 else rng.randrange(0, first_entry)
        damaged[at] = rng.choice((rng.randrange(256), damaged[at] ^ 0x01, damaged[at] ^ 0x80))
        path = tmp_path / f"damaged-{trial}.pt"
        path.write_bytes(bytes(damaged))
        at_once, in_turn = _located_both_ways(path)
        # At once only what in turn locates the same; what in turn refuses, never at once.
        assert at_once is None or at_once == in_turn, (seed, trial, at)
        outcomes.add("refused" if isinstance(in_turn, Exception) else "same" if at_once is not None else "handed over")
    assert "refused" in outcomes, outcomes


def test_records_listed_out_of_the_files_order_are_located_in_turn_alike(tmp_path: Path):
    data = _zip_bytes()
    start = data.find(b"PK\x01\x02")
    entries, at = [], start
    while data.startswith(b"PK\x01\x02", at):
        name_length, extra_length, comment_length = struct.unpack_from("<HHH", data, at + 28)
        end = at + 46 + name_length + extra_length + comment_length
        entries.append(data[at:end])
        at = end
    path = tmp_path / "reordered.pt"
    path.write_bytes(data[:start] + b"".join(reversed(entries)) + data[at:])

    at_once, in_turn = _located_both_ways(path)

    assert at_once is None and isinstance(in_turn, dict) and len(in_turn) >= 2
    with zipfile.ZipFile(path) as archive:
        assert archive.namelist() == [entry[46:46 + struct.unpack_from("<H", entry, 28)[0]].decode()
                                      for entry in reversed(entries)]
    expected = torch.load(path, weights_only=True)
    loaded, _ = mz.load_tensors(path)
    assert list(loaded) == list(expected) and all(torch.equal(loaded[name], expected[name]) for name in expected)
