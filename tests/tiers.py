"""The suite's two tiers, and the slice of the long one that CI runs (docs/testing.md).

``make test`` runs the quick tier (``-m "not long"``): at least one test of every entry point, reader,
format, oracle family, refusal and CLI verb. ``make test-all`` runs both. A test is in the long tier where
it is marked ``@pytest.mark.long``: it repeats what a quicker test of the quick tier checks, at a larger size
(more ranks, more methods, every case of a corpus), and its comment names that quicker test.

``--slice K/N`` runs only the tests whose id's CRC-32 is K modulo N, of those selected: CI runs
``make test`` and then one slice of the long tier, chosen by the commit, so that every long test runs
within N submissions; the slice is printed, and ``make test-long SLICE=K/N`` runs it again.
"""

from __future__ import annotations

import zlib

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slice", default=None, metavar="K/N",
                     help="run only the K-th of N slices of the selected tests (by a stable hash of each test's id)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: the long tier (make test-all): a larger size of a quicker test")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = config.getoption("--slice")
    if chosen:
        index, count = _slice(chosen)
        keep = [item for item in items if zlib.crc32(item.nodeid.encode()) % count == index]
        kept = set(keep)
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = keep


def _slice(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise pytest.UsageError(f"--slice {text}: expected K/N with 0 <= K < N")
    return int(index), int(count)
