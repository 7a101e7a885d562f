"""The tiers' slices (tests/tiers.py): every test of the long tier is in exactly one slice of any count, the
slice is the test's own whatever else is selected, and a slice that cannot be is a usage error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.tiers import pytest_collection_modifyitems

IDS = [f"tests/test_bench.py::test_{n}" for n in range(40)] + [f"tests/test_corpus.py::test_case[{n}]" for n in range(9)]


class _Item:
    """What the hook reads of a collected test: its id (hashable by identity, as pytest's items are)."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid


def _sliced(ids: list[str], chosen: str) -> tuple[list[str], list[str]]:
    deselected: list[str] = []
    config = SimpleNamespace(getoption=lambda name: chosen,
                             hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(i.nodeid for i in items)))
    items = [_Item(nodeid) for nodeid in ids]
    pytest_collection_modifyitems(config, items)
    return [item.nodeid for item in items], deselected


@pytest.mark.parametrize("count", [1, 2, 4, 7])
def test_every_test_is_in_exactly_one_slice(count):
    slices = [_sliced(IDS, f"{index}/{count}") for index in range(count)]
    kept = [nodeid for selected, _ in slices for nodeid in selected]
    assert sorted(kept) == sorted(IDS)  # each once: none lost, none twice
    for selected, deselected in slices:
        assert sorted(selected + deselected) == sorted(IDS)


def test_a_tests_slice_does_not_depend_on_what_else_is_selected():
    whole, _ = _sliced(IDS, "1/4")
    part, _ = _sliced(IDS[::3], "1/4")
    assert set(part) == set(whole) & set(IDS[::3])


@pytest.mark.parametrize("chosen", ["4/4", "-1/4", "1", "a/b", "1/0"])
def test_a_slice_that_cannot_be_is_a_usage_error(chosen):
    with pytest.raises(pytest.UsageError, match="expected K/N"):
        _sliced(IDS, chosen)
