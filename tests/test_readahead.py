"""Scattered small reads of a file the page cache does not hold are asked of the kernel ahead
(materialize.sources.readahead): a torch zip's local headers when it is opened cold, and only then."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

import materialize as mz
from materialize.checkpoint import torchzip
from materialize.sources import readahead


def evict(path: Path) -> bool:
    """Drops ``path`` from the page cache; whether it is gone (some file systems keep every page)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # dirty pages are not dropped
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        return readahead.any_uncached(descriptor, [0])
    finally:
        os.close(descriptor)


def advised(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (offset, length) of every WILLNEED asked from now on, the call still made."""
    asked: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def recording(descriptor: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append((offset, length))
        real(descriptor, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    return asked


@pytest.fixture
def zip_of_many(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    # Records 8 KB apart: each local header is a read of its own (more than _HEADER_GAP apart).
    generator = torch.Generator().manual_seed(0)
    state = {f"experts.{index}.weight": torch.randn(2048, generator=generator) for index in range(readahead.MIN_READS + 40)}
    path = tmp_path / "many.pt"
    torch.save(state, path)
    return path, state


def test_a_cold_zip_has_its_headers_asked_for_ahead_and_reads_the_same(zip_of_many, monkeypatch):
    path, state = zip_of_many
    if not evict(path):
        pytest.skip("this file system keeps the file's pages in memory")
    # Evicted again just before the headers are read: the reads that come first (of the zip's end, and the
    # probe above, which starts the kernel's readahead) may have brought the small file back. Read whole first,
    # so no read of it is still in flight: the kernel does not drop a page that is being read.
    real = torchzip.read_ahead_if_uncached

    def cold_at_the_headers(descriptor, offsets, lengths, base=0):
        os.pread(descriptor, os.fstat(descriptor).st_size, 0)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        return real(descriptor, offsets, lengths, base)

    monkeypatch.setattr(torchzip, "read_ahead_if_uncached", cold_at_the_headers)
    asked = advised(monkeypatch)
    cold, _ = mz.load_tensors(path)

    headers = {offset for offset, _ in asked}
    assert len(asked) == len(headers)  # each asked once
    assert len(headers) >= len(state)  # every record's header (and the zip's other records)
    with torchzip._open_archive(path) as archive:
        assert {info.header_offset for info in archive.infolist()} <= headers
    assert cold.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(cold[name], tensor), name


def test_a_cached_zip_asks_for_nothing(zip_of_many, monkeypatch):
    path, state = zip_of_many
    mz.load_tensors(path)  # (in the page cache now, as just written)
    asked = advised(monkeypatch)
    warm, _ = mz.load_tensors(path)

    assert asked == []
    assert all(torch.equal(warm[name], tensor) for name, tensor in state.items())


def test_a_zip_of_few_records_asks_for_nothing_even_cold(tmp_path, monkeypatch):
    path = tmp_path / "few.pt"
    torch.save({f"w{index}": torch.ones(2048) for index in range(readahead.MIN_READS // 4)}, path)
    if not evict(path):
        pytest.skip("this file system keeps the file's pages in memory")
    asked = advised(monkeypatch)

    assert len(mz.load_tensors(path)[0]) == readahead.MIN_READS // 4
    assert asked == []


@pytest.mark.parametrize("seed", range(5))
def test_each_span_is_asked_for_once_in_order_and_ahead_of_its_read(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    path = tmp_path / "bytes"
    path.write_bytes(bytes(1 << 16))
    count = rng.randrange(1, 3 * readahead.WINDOW)
    base = rng.choice((0, 100))
    spans = [(rng.randrange(1 << 15), rng.randrange(1, 200)) for _ in range(count)]
    asked = advised(monkeypatch)
    with open(path, "rb") as handle:
        ahead = readahead.ReadAhead(handle.fileno(), [offset for offset, _ in spans], [length for _, length in spans],
                                    base)
        index = 0
        while index < count:
            ahead.reach(index)
            assert len(asked) > index  # this one asked for before its read
            assert len(asked) <= index + readahead.WINDOW * 3 // 2  # never much more than a window ahead
            index += rng.choice((1, 1, 7, 600))  # as runs of headers step over several at once
        ahead.reach(count - 1)

    assert asked == [(base + offset, length) for offset, length in spans]


def test_looking_at_the_page_cache_reads_nothing_in(tmp_path):
    # The probe must not start the read it asks about: one that did found its own page there a moment later.
    path = tmp_path / "bytes"
    path.write_bytes(bytes(4 << 20))
    if not evict(path):
        pytest.skip("this file system keeps the file's pages in memory")
    with open(path, "rb") as handle:
        for _ in range(200):
            assert readahead.any_uncached(handle.fileno(), [0])
        os.pread(handle.fileno(), 64, 0)
        assert not readahead.any_uncached(handle.fileno(), [0])
        assert readahead.any_uncached(handle.fileno(), [0, (4 << 20) - 64])  # the last page still out


def test_no_page_missing_in_a_sample_of_a_cached_file(tmp_path):
    path = tmp_path / "bytes"
    path.write_bytes(bytes(1 << 20))
    with open(path, "rb") as handle:
        offsets = list(range(0, 1 << 20, 1024))
        assert readahead.read_ahead_if_uncached(handle.fileno(), offsets, [64] * len(offsets)) is None
        if not evict(path):
            pytest.skip("this file system keeps the file's pages in memory")
        ahead = readahead.read_ahead_if_uncached(handle.fileno(), offsets, [64] * len(offsets))
        assert isinstance(ahead, readahead.ReadAhead)
        # A handful of spans is never worth the look, cold or not.
        few = readahead.MIN_READS - 1
        assert readahead.read_ahead_if_uncached(handle.fileno(), [0] * few, [64] * few) is None
