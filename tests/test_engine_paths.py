"""The CPU paths of the engine: chunked parallel casts, thread settings, huge-page hints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import materialize as mz
from materialize import engine
from materialize import hostmem
from materialize.hostmem import MIN_ADVISED_BYTES, advise_huge_pages

from conftest import write_safetensors, write_torch

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_cast_of_tensors_larger_than_a_chunk_is_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(engine, "CAST_CHUNK_BYTES", 1000)  # many chunks, spread over threads
    state = {f"w{i}": torch.randn(3000 + 17 * i, dtype=torch.bfloat16) for i in range(5)}
    state["odd"] = torch.randn(7, 13).half()
    for path in (write_safetensors(state, tmp_path / "m.safetensors"), write_torch(state, tmp_path / "m.pt")):
        tensors, report = mz.load_tensors(path, dtype="fp32")

        for name, value in state.items():
            assert torch.equal(tensors[name], value.float()), name
        assert report.bytes_read == sum(v.numel() * v.element_size() for v in state.values())


def test_direct_reads_split_across_chunks_are_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(engine, "DIRECT_CHUNK_BYTES", 4096)
    state = {f"w{i}": torch.randn(5000 + i) for i in range(4)}
    path = write_safetensors(state, tmp_path / "m.safetensors")

    tensors, _ = mz.load_tensors(path)

    for name, value in state.items():
        assert torch.equal(tensors[name], value), name


def test_loading_leaves_the_callers_thread_count_alone(tmp_path):
    path = write_safetensors({"w": torch.randn(1000)}, tmp_path / "m.safetensors")
    before = torch.get_num_threads()

    mz.load_tensors(path, dtype="bf16")

    assert torch.get_num_threads() == before


@pytest.mark.skipif(
    not THP_MODE.exists() or "[never]" in THP_MODE.read_text(), reason="transparent huge pages unavailable"
)
def test_fresh_destinations_are_eligible_for_huge_pages(monkeypatch):
    monkeypatch.setattr(hostmem, "_huge_pages_pay", lambda: True)
    tensor = torch.empty(4 * MIN_ADVISED_BYTES, dtype=torch.uint8)

    advise_huge_pages(tensor)

    assert _vma_flag(tensor.data_ptr() + MIN_ADVISED_BYTES, "THPeligible") == "1"


@pytest.mark.skipif(not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(), reason="needs THP mode madvise")
def test_no_huge_page_hint_where_free_memory_goes_back_to_the_host(monkeypatch):
    monkeypatch.setattr(hostmem, "_huge_pages_pay", lambda: False)
    tensor = torch.empty(4 * MIN_ADVISED_BYTES, dtype=torch.uint8)

    advise_huge_pages(tensor)

    assert _vma_flag(tensor.data_ptr() + MIN_ADVISED_BYTES, "THPeligible") == "0"


@pytest.mark.parametrize("bits, reports", [
    ("0110010100000000000000000000000010", True),  # a Firecracker balloon: free page reporting is bit 5
    ("0110000100000000000000000000000010", False),
    ("01101", False),
])
def test_free_page_reporting_is_read_from_the_balloons_feature_bits(bits, reports, tmp_path):
    (tmp_path / "virtio3").mkdir()
    (tmp_path / "virtio3" / "features").write_text(bits + "\n")

    assert hostmem.reports_free_memory_to_host(tmp_path) is reports


def test_no_balloon_means_no_free_page_reporting(tmp_path):
    assert hostmem.reports_free_memory_to_host(tmp_path / "absent") is False


def _vma_flag(address: int, flag: str) -> str:
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith(flag + ":"):
            return line.split()[1]
    return ""
