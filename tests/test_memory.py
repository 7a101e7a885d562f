"""Peak host memory of a CPU load: the model's bytes plus a small constant, never two copies.

Each measurement runs in a fresh interpreter and samples anonymous memory
(RssAnon), so checkpoint pages in the page cache do not count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("memory_probe.py")
SLACK_BYTES = 64 * 1024 * 1024

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for RssAnon")


def _probe(*args: str) -> dict:
    done = subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout) if done.stdout.strip() else {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory")
    paths = {"safetensors": folder / "m.safetensors", "torch": folder / "m.pt"}
    for path in paths.values():
        _probe("write", str(path))
    return paths


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_cpu_load_grows_memory_by_the_model_size_only(kind, checkpoints):
    result = _probe("ours", str(checkpoints[kind]))

    assert result["model_bytes"] >= 256 * 1024 * 1024
    assert result["growth"] <= 1.1 * result["model_bytes"] + SLACK_BYTES, result


def test_cast_load_never_holds_a_full_size_temporary(checkpoints):
    result = _probe("ours", str(checkpoints["safetensors"]), "bf16")

    assert result["growth"] <= 1.1 * result["model_bytes"] + SLACK_BYTES, result


def test_the_measurement_catches_a_double_copy(checkpoints):
    result = _probe("naive", str(checkpoints["torch"]))

    assert result["growth"] >= 1.7 * result["model_bytes"], result


def test_zero_copy_load_costs_almost_no_anonymous_memory_even_when_read(checkpoints):
    result = _probe("ours-mmap", str(checkpoints["safetensors"]))

    assert result["growth"] <= 32 * 1024 * 1024, result


def test_a_tie_saved_as_two_equal_copies_is_compared_without_a_second_copy(tmp_path):
    path = tmp_path / "tied.safetensors"
    _probe("write-tied", str(path))

    result = _probe("ours-tied", str(path))

    assert result["model_bytes"] >= 256 * 1024 * 1024
    assert result["growth"] <= 1.1 * result["model_bytes"] + SLACK_BYTES, result


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_a_load_streamed_over_http_grows_memory_by_the_model_size_only(kind, checkpoints):
    # received straight into the tensors: no buffer of the download beside them, whatever the model's size
    from tests.remote_servers import RangeServer

    with RangeServer(checkpoints[kind].parent) as server:
        result = _probe("ours", f"{server.url}/{checkpoints[kind].name}")
    assert result["model_bytes"] >= 256 * 1024 * 1024
    assert result["growth"] <= 1.05 * result["model_bytes"] + SLACK_BYTES, result
