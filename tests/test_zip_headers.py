"""Local headers read in runs (torchzip._local_headers) are the bytes one read each would give, in order, and
a run is read only when its first header is asked for."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

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
        got = list(torchzip._local_headers([(offset - base, length) for offset, length in spans], pread, base))
        assert got == [os.pread(handle.fileno(), length, offset) for offset, length in spans]
    assert all(length <= max(torchzip._HEADER_RUN, 120) for _, length in reads)
    assert len(reads) <= len(spans)


def test_a_run_is_read_when_its_first_header_is_asked_for():
    reads = []
    headers = torchzip._local_headers([(0, 30), (40, 30), (1 << 20, 30)], lambda n, at: reads.append(at) or b"x" * n, 0)
    assert reads == []
    next(headers)
    assert reads == [0]
    next(headers)
    assert reads == [0]  # in the first run
    next(headers)
    assert reads == [0, 1 << 20]
