"""The CPU paths of the engine: chunked parallel casts, thread settings, huge-page hints."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
from pathlib import Path

import pytest
import torch

import materialize as mz
from materialize.io import engine
from materialize.io import hostmem
from materialize.io.hostmem import MIN_ADVISED_BYTES, advise_huge_pages

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


def _small_tensors_of_mixed_dtypes() -> dict[str, torch.Tensor]:
    """Tensors small enough to be cast together, in runs of one dtype and another, and one large one among them."""
    torch.manual_seed(4)
    state = {}
    for i in range(60):
        dtype = (torch.bfloat16, torch.float16, torch.float32)[i // 20]
        state[f"layer{i:02d}.weight"] = torch.randn(3 + i % 7, 5, dtype=dtype)
        state[f"layer{i:02d}.steps"] = torch.tensor([i], dtype=torch.int64)  # read as is, between the casts
    state["layer30.large"] = torch.randn(40_000, dtype=torch.bfloat16)  # cast alone, chunk by chunk
    return state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_small_tensors_cast_together_each_get_exactly_their_values(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(engine, "CAST_CHUNK_BYTES", 8192)  # several runs, spread over the threads
    state = _small_tensors_of_mixed_dtypes()
    for path in (write_safetensors(state, tmp_path / "m.safetensors"), write_torch(state, tmp_path / "m.pt")):
        tensors, report = mz.load_tensors(path, dtype=dtype)

        for name, value in state.items():
            want = value.to(dtype) if value.is_floating_point() else value
            assert tensors[name].dtype == want.dtype and torch.equal(tensors[name], want), (path, name)
        assert report.bytes_read == sum(v.numel() * v.element_size() for v in state.values())


def test_an_overflow_among_small_tensors_cast_together_names_its_tensor(tmp_path):
    state = {f"norm{i}.weight": torch.full((4,), 2.0 + i) for i in range(30)}
    state["norm17.weight"][2] = 1e6  # beyond fp16, in the middle of one run of small tensors
    path = write_safetensors(state, tmp_path / "m.safetensors")

    with pytest.raises(mz.CastOverflowError) as caught:
        mz.load_tensors(path, dtype="fp16")

    assert str(caught.value).startswith(f"{path}: tensor 'norm17.weight': casting float32 to float16 overflows")


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


@pytest.mark.parametrize("cores, expected", [(1, 4), (2, 4), (6, 6), (64, 8), (None, 4)])
def test_reader_threads_keep_reads_in_flight_on_small_machines(monkeypatch, cores, expected):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)

    assert engine.default_reader_threads() == expected
    assert engine.default_cast_threads() == min(8, cores or 1)  # casts are bound by the cores, not the disk


@pytest.mark.skipif(
    not THP_MODE.exists() or "[never]" in THP_MODE.read_text(), reason="transparent huge pages unavailable"
)
def test_fresh_destinations_are_eligible_for_huge_pages(monkeypatch):
    monkeypatch.setattr(hostmem, "huge_pages_pay", lambda: True)
    tensor = _fresh_mapping(4 * MIN_ADVISED_BYTES)

    advise_huge_pages(tensor)

    assert _vma_flag(tensor.data_ptr() + MIN_ADVISED_BYTES, "THPeligible") == "1"


@pytest.mark.skipif(not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(), reason="needs THP mode madvise")
def test_no_huge_page_hint_where_free_memory_goes_back_to_the_host(monkeypatch):
    monkeypatch.setattr(hostmem, "huge_pages_pay", lambda: False)
    tensor = _fresh_mapping(4 * MIN_ADVISED_BYTES)

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


def _fresh_mapping(nbytes: int) -> torch.Tensor:
    """Memory in a mapping of its own: torch.empty may reuse heap memory an earlier load in this process
    advised for huge pages, whose flag stays with it."""
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=torch.uint8)


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


def test_prefault_makes_pages_resident_and_keeps_their_contents():
    pages = 64
    region = mmap.mmap(-1, pages * mmap.PAGESIZE)  # its own mapping: nothing resident until touched
    region[5 * mmap.PAGESIZE: 5 * mmap.PAGESIZE + 5] = b"kept!"
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))

    hostmem.prefault(address + 3 * mmap.PAGESIZE + 100, 20 * mmap.PAGESIZE)  # unaligned start

    assert region[5 * mmap.PAGESIZE: 5 * mmap.PAGESIZE + 5] == b"kept!"
    resident = _resident_pages(address, pages)
    assert resident[3:24] == [True] * 21
    assert not any(resident[30:])


def test_prefault_stops_asking_a_kernel_that_does_not_know_it(monkeypatch):
    calls = []

    class OldKernel:
        def madvise(self, address, length, advice):
            calls.append(advice)
            return -1

    monkeypatch.setattr(hostmem, "_libc", OldKernel())
    monkeypatch.setattr(hostmem._Populate, "supported", True)
    monkeypatch.setattr(hostmem.ctypes, "get_errno", lambda: 22)  # EINVAL: advice unknown before Linux 5.14

    hostmem.prefault(4096, 4096)
    hostmem.prefault(8192, 4096)

    assert calls == [23]


@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_every_destination_byte_is_prefaulted_once_before_it_is_filled(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(engine, "DIRECT_CHUNK_BYTES", 4096)
    monkeypatch.setattr(engine, "CAST_CHUNK_BYTES", 1000)
    monkeypatch.setattr(engine, "PREFAULT_MIN_BYTES", 0)
    state = {f"w{i}": torch.randn(3000 + 7 * i, dtype=torch.bfloat16) for i in range(4)}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    ranges = []
    monkeypatch.setattr(engine, "prefault", lambda address, nbytes: ranges.append((address, address + nbytes)))

    tensors, _ = mz.load_tensors(path, dtype=dtype)

    for name, tensor in tensors.items():
        start, stop = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        inside = sorted(r for r in ranges if start <= r[0] < stop)
        assert inside[0][0] == start and inside[-1][1] == stop, name
        assert all(a[1] == b[0] for a, b in zip(inside, inside[1:])), name  # contiguous, no overlap
        assert torch.equal(tensor, state[name].to(tensor.dtype)), name


def _resident_pages(address: int, pages: int) -> list[bool]:
    libc = ctypes.CDLL(None, use_errno=True)
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(pages * mmap.PAGESIZE), vector) == 0
    return [bool(v & 1) for v in vector]


def _small_tensors(count: int = 300) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"layers.{i}.norm": torch.randn(5 + i % 7, dtype=torch.bfloat16) for i in range(count)}


def _norms_model(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in state)
    for layer, value in zip(model.layers, state.values()):
        layer.norm = torch.nn.Parameter(torch.empty(value.shape, dtype=value.dtype, device="meta"))
    return model


WRITERS = [pytest.param(write_safetensors, id="safetensors"), pytest.param(write_torch, id="torch-zip")]


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_small_tensors_that_follow_each_other_are_read_a_run_at_a_time(tmp_path, monkeypatch, dtype, writer):
    state = _small_tensors()
    path = writer(state, tmp_path / "m.bin")  # a torch zip puts a record header between every two tensors
    real_preadv = os.preadv
    calls = []
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: calls.append(len(buffers)) or real_preadv(fd, buffers, offset))
    model = _norms_model(state)

    mz.load(model, path, dtype=dtype, check=True)  # the audit: every tensor got exactly its bytes, once

    tensors = model.state_dict()
    for name, value in state.items():
        assert torch.equal(tensors[name], value.to(tensors[name].dtype)), name
    assert sum(calls) >= len(state) and len(calls) <= 4  # 300 tensors, a handful of reads


@pytest.mark.parametrize("writer", WRITERS)
def test_tensors_left_out_between_loaded_ones_are_passed_over_or_skipped(tmp_path, monkeypatch, writer):
    state = _small_tensors(40)
    state["layers.6.norm"] = torch.randn(engine.GAP_BYTES, dtype=torch.bfloat16)  # left out, a gap too wide to read through
    path = writer(state, tmp_path / "m.bin")
    kept = {name: value for i, (name, value) in enumerate(state.items()) if i % 3}
    model = _norms_model(state)
    for i, layer in enumerate(model.layers):
        if f"layers.{i}.norm" not in kept:
            del layer.norm  # the checkpoint's tensor is unexpected: skipped
    real_preadv = os.preadv
    calls = []
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: calls.append(len(buffers)) or real_preadv(fd, buffers, offset))

    report = mz.load(model, path, strict=False, check=True)

    tensors = model.state_dict()
    assert tensors.keys() == kept.keys()
    for name, value in kept.items():
        assert torch.equal(tensors[name], value), name
    assert len(calls) == 2  # one read each side of the wide gap
    assert report.bytes_read == sum(v.numel() * v.element_size() for v in kept.values())


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_a_run_survives_reads_that_stop_short_anywhere(tmp_path, monkeypatch, dtype, writer):
    state = _small_tensors()
    path = writer(state, tmp_path / "m.bin")
    real_preadv = os.preadv

    def stingy(fd, buffers, offset):  # at most 7 bytes a call: ends mid-element and mid-tensor
        return real_preadv(fd, [memoryview(buffers[0])[:7]], offset)

    monkeypatch.setattr(os, "preadv", stingy)

    tensors, _ = mz.load_tensors(path, dtype=dtype)

    for name, value in state.items():
        assert torch.equal(tensors[name], value.to(tensors[name].dtype)), name


@pytest.mark.parametrize("writer, into", [(write_safetensors, 3), (write_torch, -3)])
def test_a_file_that_ends_inside_a_run_names_the_tensor_it_cuts(tmp_path, writer, into):
    state = _small_tensors()
    path = writer(state, tmp_path / "m.bin")
    with mz.open_checkpoint(path) as ckpt:
        cut = ckpt["layers.200.norm"]
        with open(path, "r+b") as handle:
            # Shrinks after opening, as a rewrite during a load would: inside the tensor, or in the
            # record header before it (bytes a run passes over on the way to it).
            handle.truncate(cut.offset + into)

        with pytest.raises(mz.CheckpointError) as caught:
            mz.load_tensors(ckpt)

    assert "layers.200.norm" in str(caught.value) and str(path) in str(caught.value)


def _unsorted_safetensors(state: dict[str, torch.Tensor], path: Path) -> Path:
    """A valid safetensors file with tensors in the given order, not sorted by dtype as safetensors writes them."""
    header, blobs, at = {}, [], 0
    names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int64: "I64"}
    for name, value in state.items():
        blob = value.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[value.dtype], "shape": list(value.shape), "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path


def test_a_cast_of_small_tensors_of_mixed_sizes_packed_in_any_order_is_exact(tmp_path):
    torch.manual_seed(0)
    state = {}
    for i in range(30):  # odd byte lengths: the next tensor starts at any offset in the run
        state[f"h{i}"] = torch.randn(3 + 2 * i, dtype=torch.bfloat16)
        state[f"f{i}"] = torch.randn(5 + i, dtype=torch.float32)
        state[f"i{i}"] = torch.arange(i + 1, dtype=torch.int64)
    path = _unsorted_safetensors(state, tmp_path / "m.safetensors")

    tensors, _ = mz.load_tensors(path, dtype="fp64")

    for name, value in state.items():
        expected = value.double() if value.is_floating_point() else value
        assert torch.equal(tensors[name], expected), name
