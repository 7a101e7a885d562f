"""The suite's two tiers, and the slice of the long one that CI runs (docs/testing.md).

``make test`` runs the quick tier (``-m "not long"``): at least one test of every entry point, reader,
format, oracle family, refusal and CLI verb. ``make test-all`` runs both. A test is in the long tier where
it is marked ``long`` or where it repeats a family past the cases the quick tier keeps:

- ``@pytest.mark.repeats(keep=K)`` on a parametrized test keeps K of its cases in the quick tier, spread
  evenly over the family in its order (the first always among them), and marks the rest ``long``. So a
  family is never out of the quick tier, only its repetitions are;
- ``@pytest.mark.long``, for a test that repeats what a quicker one checks at a larger size (more ranks,
  a bigger file), with a comment naming that quicker test.

``--slice K/N`` runs only the tests whose id's CRC-32 is K modulo N, of those selected: CI runs
``make test`` and then one slice of the long tier, chosen by the commit, so that every long test runs
within N submissions; the slice is printed, and ``make test-long SLICE=K/N`` runs it again.
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slice", default=None, metavar="K/N",
                     help="run only the K-th of N slices of the selected tests (by a stable hash of each test's id)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: the long tier (make test-all): a repetition of a family the quick tier "
                                       "holds a case of, or a larger size of a quicker test")
    config.addinivalue_line("markers", "repeats(keep): a parametrized family of which the quick tier runs `keep` "
                                       "cases, spread over it; the rest are long")


@pytest.hookimpl(tryfirst=True)  # before -m selects: the marks it selects by are set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_repetitions(items)
    chosen = config.getoption("--slice")
    if chosen:
        index, count = _slice(chosen)
        keep = [item for item in items if zlib.crc32(item.nodeid.encode()) % count == index]
        config.hook.pytest_deselected(items=[item for item in items if item not in set(keep)])
        items[:] = keep


def _mark_repetitions(items: list[pytest.Item]) -> None:
    families: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        if item.get_closest_marker("repeats") is not None:
            families[item.nodeid.partition("[")[0]].append(item)
    for family in families.values():
        keep = family[0].get_closest_marker("repeats").kwargs.get("keep", 1)
        step = max(1, math.ceil(len(family) / keep))
        for position, item in enumerate(family):
            if position % step:
                item.add_marker(pytest.mark.long)


def _slice(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise pytest.UsageError(f"--slice {text}: expected K/N with 0 <= K < N")
    return int(index), int(count)
