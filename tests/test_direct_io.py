"""Reads around the page cache (``direct_io=True``, ``--direct-io``): same values, any offset."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

import materialize as mz
from materialize.sources import fileio
from materialize.sources.fileio import DirectReads
from bench.models.transformer import DecoderLM

from conftest import TINY, reference_model, saved_state, write_safetensors, write_torch
from test_cli import run_cli


def odd_state() -> dict[str, torch.Tensor]:
    """Sizes that put nearly every tensor at an offset that is not block-aligned."""
    torch.manual_seed(1)
    state = {f"w{i}": torch.randn(1000 + 37 * i) for i in range(6)}
    state["half"] = torch.randn(333, 7).half()
    state["big"] = torch.randn(20_000)  # many bounce buffers long once the buffer is shrunk
    state["scalar"] = torch.tensor(3.5)
    state["ints"] = torch.arange(77, dtype=torch.int64)
    return state


def o_direct_supported(folder: Path) -> bool:
    probe = folder / "probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):
        return False
    finally:
        probe.unlink()


@pytest.fixture
def small_bounce(monkeypatch):
    monkeypatch.setattr(fileio, "DIRECT_BOUNCE_BYTES", 3 * fileio.DIRECT_ALIGNMENT)


@pytest.fixture
def opened_direct(monkeypatch):
    """Records whether each file really got an O_DIRECT descriptor."""
    outcomes: list[int] = []
    original = DirectReads._direct_fd

    def recording(self, path):
        fd = original(self, path)
        outcomes.append(fd)
        return fd

    monkeypatch.setattr(DirectReads, "_direct_fd", recording)
    return outcomes


@pytest.mark.parametrize("writer", [write_safetensors, write_torch])
def test_direct_reads_give_the_files_values_at_any_offset(tmp_path, small_bounce, opened_direct, writer):
    if not o_direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    state = odd_state()
    path = writer(state, tmp_path / ("m.safetensors" if writer is write_safetensors else "m.pt"))

    tensors, report = mz.load_tensors(path, direct_io=True)

    assert opened_direct and all(fd >= 0 for fd in opened_direct)
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name
    assert report.bytes_read == sum(v.numel() * v.element_size() for v in state.values())


def test_direct_reads_feed_casts_and_strided_views(tmp_path, small_bounce, opened_direct):
    if not o_direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    source = reference_model(dtype=torch.bfloat16)
    state = saved_state(source)
    path = write_torch({**state, "extra_t": state["lm_head.weight"].t()}, tmp_path / "m.pt")

    tensors, _ = mz.load_tensors(path, dtype="fp32", direct_io=True)
    assert all(fd >= 0 for fd in opened_direct)
    for name, value in state.items():
        assert torch.equal(tensors[name], value.float()), name
    assert torch.equal(tensors["extra_t"], state["lm_head.weight"].t().float())


@pytest.mark.parametrize("check", [False, True])
def test_a_model_loads_through_direct_reads(tmp_path, small_bounce, opened_direct, check):
    if not o_direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    source = reference_model()
    path = write_safetensors(saved_state(source), tmp_path / "m.safetensors")
    with mz.meta_init():
        model = DecoderLM(**TINY)

    mz.load(model, path, direct_io=True, check=check)  # the check counts bytes read through the bounce buffer

    assert all(fd >= 0 for fd in opened_direct)
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_file_system_that_refuses_o_direct_is_read_the_ordinary_way_and_says_so_once(tmp_path, monkeypatch,
                                                                                      opened_direct, caplog):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    state = odd_state()
    path = write_safetensors(state, tmp_path / "m.safetensors")
    caplog.set_level(logging.INFO, logger="materialize")

    tensors, _ = mz.load_tensors(path, direct_io=True)

    assert opened_direct and all(fd == -1 for fd in opened_direct)
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name
    # the fallback is logged, once for the file however many tensors it reads
    [said] = [record for record in caplog.records if record.name == "materialize.sources.fileio"]
    assert said.getMessage() == (f"{path}: direct_io falls back to ordinary reads (through the page cache): its "
                                 "file system refuses O_DIRECT (Invalid argument)")


def test_a_file_truncated_under_a_direct_read_names_the_tensor(tmp_path, small_bounce):
    state = {"first": torch.randn(1000), "last": torch.randn(5000)}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    with mz.open_checkpoint(path) as ckpt:
        os.truncate(path, ckpt["last"].offset + 100)
        with pytest.raises(mz.CheckpointError) as caught:
            mz.load_tensors(ckpt, direct_io=True)
    assert "'last'" in str(caught.value) and "m.safetensors" in str(caught.value)


def test_cli_direct_io_loads_a_model(tmp_path):
    source = reference_model()
    state = saved_state(source)
    path = write_safetensors(state, tmp_path / "m.safetensors")

    result = run_cli(path, "--direct-io", "--json")

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(report["loaded"]) == sorted(state)
    assert report["bytes_read"] == sum(v.numel() * v.element_size() for v in state.values())
