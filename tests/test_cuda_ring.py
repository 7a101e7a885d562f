"""The CUDA path under stress: a ring that wraps hundreds of times, slow copies, errors mid-fill, explicit
device indexes in fresh processes, a caller's own stream, and peak device memory.

These need a GPU (``bench/gpu_host.sh test`` runs them on a lent machine); the CPU double of the same
staging logic is tests/test_staging.py. Slots are made small (``MIN_SLOT_BYTES`` lowered) so a model of a
few MB fills hundreds of them.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import materialize as mz
from materialize.io import transfer
from materialize.io.transfer import CudaStaging

from conftest import write_safetensors, write_torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SLOT = 4096
RING = 8 * SLOT
SLEEP_CYCLES = 2_000_000  # about a millisecond of GPU time: long enough for a missing wait to show


@pytest.fixture
def small_slots(monkeypatch):
    monkeypatch.setattr(transfer, "MIN_SLOT_BYTES", SLOT)
    return RING


def many_tensors(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """About 1.6 MB in tensors of many sizes: several to a 4 KiB slot, and tensors split over many slots."""
    g = torch.Generator().manual_seed(seed)
    state = {f"small.{i}": torch.randn(7 + i, generator=g).to(dtype) for i in range(64)}
    state.update({f"large.{i}": torch.randn(97, 1031 + i, generator=g).to(dtype) for i in range(4)})
    return state


class Flat(nn.Module):
    """A module holding exactly the tensors of ``many_tensors``, as parameters."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.small = nn.ParameterList([nn.Parameter(torch.empty(v.shape)) for k, v in state.items() if k.startswith("small.")])
        self.large = nn.ParameterList([nn.Parameter(torch.empty(v.shape)) for k, v in state.items() if k.startswith("large.")])


def skeleton(state: dict[str, torch.Tensor]) -> Flat:
    with mz.meta_init():
        return Flat(state)


def assert_loaded(model: nn.Module, state: dict[str, torch.Tensor], dtype=None) -> None:
    loaded = model.state_dict()
    for name, value in state.items():
        want = value.to(dtype) if dtype is not None else value
        assert loaded[name].device.type == "cuda", name
        assert torch.equal(loaded[name].cpu(), want), name


@pytest.mark.parametrize("dtype", [None, torch.float16], ids=["same", "cast"])
def test_a_ring_of_small_slots_wraps_hundreds_of_times_and_every_value_lands(small_slots, dtype, tmp_path):
    state = many_tensors()
    path = write_safetensors(state, tmp_path / "m.safetensors")
    model = skeleton(state)

    mz.load(model, path, device="cuda", dtype=dtype, staging_bytes=small_slots)

    assert sum(v.nbytes for v in state.values()) // SLOT > 300
    assert_loaded(model, state, dtype)


def test_slow_copies_on_the_side_stream_still_land_before_the_slot_is_refilled(small_slots, monkeypatch, tmp_path):
    state = many_tensors(seed=1)
    path = write_safetensors(state, tmp_path / "m.safetensors")
    original = CudaStaging.copy_all

    def slowed(self, pairs):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # the copies queued next start late: a slot reused early shows
        return original(self, pairs)

    monkeypatch.setattr(CudaStaging, "copy_all", slowed)
    model = skeleton(state)

    mz.load(model, path, device="cuda", staging_bytes=small_slots)

    assert_loaded(model, state)


def test_an_out_of_memory_mid_fill_is_an_allocation_error_and_frees_everything(small_slots, monkeypatch, tmp_path):
    state = many_tensors(seed=2, dtype=torch.bfloat16)
    path = write_safetensors(state, tmp_path / "m.safetensors")
    real_empty = torch.empty
    calls = {"side": 0}

    def empty(*args, **kwargs):  # a cast's temporary, made on the side stream, fails the 40th time
        if torch.cuda.current_stream() != torch.cuda.default_stream():
            calls["side"] += 1
            if calls["side"] == 40:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 KiB")
        return real_empty(*args, **kwargs)

    def failed_load(model: nn.Module) -> mz.AllocationError:
        try:
            mz.load(model, path, device="cuda", dtype=torch.float32, staging_bytes=small_slots)
        except mz.AllocationError as error:
            error.__traceback__ = None  # its frames hold the load's tensors: dropped, they are freed
            return error
        raise AssertionError("the load did not fail")

    model = skeleton(state)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    monkeypatch.setattr(torch, "empty", empty)
    error = failed_load(model)
    monkeypatch.setattr(torch, "empty", real_empty)
    gc.collect()
    torch.cuda.synchronize()

    assert "for the temporary of a cast" in str(error) and error.tensor in state
    assert all(p.is_meta for p in model.parameters())
    assert torch.cuda.memory_allocated() == baseline


def test_a_real_gpu_model_filled_in_place_says_what_a_failed_load_overwrote(tmp_path):
    state = many_tensors(seed=3)
    path = write_safetensors(state, tmp_path / "m.safetensors")
    model = Flat(state).cuda()
    objects = [p for p in model.parameters()]

    with mz.open_checkpoint(path) as ckpt:
        last = max(state, key=lambda name: ckpt[name].offset)
        os.truncate(path, ckpt[last].offset + 4)
        with pytest.raises(mz.CheckpointError, match="filled in place may now hold part"):
            mz.load(model, ckpt)

    assert all(now is before for now, before in zip(model.parameters(), objects))
    assert all(p.device.type == "cuda" for p in model.parameters())


class Strided(nn.Module):
    """Contiguous parameters, saved as views with other strides: each is read through the strided path."""

    def __init__(self) -> None:
        super().__init__()
        self.transposed = nn.Parameter(torch.empty(80, 96))
        self.column = nn.Parameter(torch.empty(3, 50, 40))
        self.plain = nn.Parameter(torch.empty(33))


def _strided_file(tmp_path):
    torch.manual_seed(4)
    state = {"transposed": torch.randn(96, 80).t(), "column": torch.randn(3, 40, 50).transpose(1, 2),
             "plain": torch.randn(33)}
    return state, write_torch(state, tmp_path / "strided.pt")  # torch.save keeps the views' strides


def _strided_skeleton() -> Strided:
    with mz.meta_init():
        return Strided()


@pytest.mark.parametrize("dtype", [None, torch.float16], ids=["same", "cast"])
def test_strided_tensors_reach_the_gpu_from_reader_threads(dtype, tmp_path):
    state, path = _strided_file(tmp_path)
    model = _strided_skeleton()

    mz.load(model, path, device="cuda", dtype=dtype)

    assert_loaded(model, state, dtype)


def test_a_load_under_the_callers_own_stream_is_ready_on_that_stream(small_slots, tmp_path):
    state, path = _strided_file(tmp_path)
    model = _strided_skeleton()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the caller's stream is busy: copies must queue behind it, on it
        mz.load(model, path, device="cuda", staging_bytes=small_slots)
        sums = {name: t.double().sum() for name, t in model.state_dict().items()}  # on the caller's stream at once
    side.synchronize()

    assert_loaded(model, state)
    for name, value in state.items():
        assert sums[name].item() == pytest.approx(value.double().sum().item()), name


def _fresh(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


_LOAD_IN_A_FRESH_PROCESS = """
import json, sys, torch, materialize as mz
tensors, report = mz.load_tensors(sys.argv[1], device=sys.argv[2])
print(json.dumps({"devices": sorted({str(t.device) for t in tensors.values()}), "peak": report.peak_device_bytes,
                  "by_device": report.peak_device_bytes_by_device, "model": report.model_bytes}))
"""


@pytest.mark.parametrize("index", [0, 1])
def test_an_explicit_device_index_loads_in_a_fresh_process(index, tmp_path):
    if index >= torch.cuda.device_count():
        pytest.skip(f"needs {index + 1} GPUs")
    path = write_safetensors(many_tensors(), tmp_path / "m.safetensors")

    result = _fresh(_LOAD_IN_A_FRESH_PROCESS, str(path), f"cuda:{index}")

    assert result["devices"] == [f"cuda:{index}"]
    # The model, plus at most the rounding of the caching allocator (512-byte blocks) per tensor.
    assert result["model"] <= result["peak"] <= result["model"] + 512 * 68, result
    assert list(result["by_device"]) == [f"cuda:{index}"]


_PEAK_AFTER_AN_EARLIER_PEAK = """
import json, sys, torch, materialize as mz
held = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")      # still allocated during the load
spike = torch.empty(1024 * 2**20, dtype=torch.uint8, device="cuda"); del spike  # the caller's own peak
peak_before = torch.cuda.max_memory_allocated()
tensors, report = mz.load_tensors(sys.argv[1], device="cuda")
print(json.dumps({"peak": report.peak_device_bytes, "model": report.model_bytes,
                  "caller_peak_before": peak_before, "caller_peak_after": torch.cuda.max_memory_allocated()}))
"""


def test_peak_device_memory_counts_the_load_only_and_leaves_the_callers_peak_alone(tmp_path):
    path = write_safetensors(many_tensors(), tmp_path / "m.safetensors")

    result = _fresh(_PEAK_AFTER_AN_EARLIER_PEAK, str(path))

    assert result["caller_peak_after"] == result["caller_peak_before"] >= 1024 * 2**20 + 64 * 2**20
    # Below the earlier peak the load's own is sampled: never above the model plus rounding, never the 64 MiB held.
    assert 0 < result["peak"] <= result["model"] + 512 * 68, result


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_two_gpu_device_map_measures_both(tmp_path):
    state = many_tensors()
    path = write_safetensors(state, tmp_path / "m.safetensors")
    model = skeleton(state)

    report = mz.load(model, path, device_map={"small": 0, "large": 1})

    assert set(report.peak_device_bytes_by_device) == {"cuda:0", "cuda:1"}
    assert report.peak_device_bytes_by_device["cuda:1"] >= sum(v.nbytes for k, v in state.items() if k.startswith("large"))
    assert_loaded(model, state)
