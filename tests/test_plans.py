"""A plan says what its load will do: the same bytes read and mapped, the same memory verdict, and where the
load would be refused for memory, the same refusal (the CLI's ``plan`` then exits 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import materialize as mz
import materialize.api
from materialize.io import hostmem
from materialize.sizes import format_bytes

from conftest import DECODER_SPEC, TINY, reference_model, saved_state, tiny_skeleton, write_safetensors
import preforked

CLI = str(Path(sys.executable).parent / "materialize")
MODEL_OPTIONS = ["--model", DECODER_SPEC, *(arg for key, value in TINY.items() for arg in ("--model-arg", f"{key}={value}"))]

# The CLI in a process whose view of this machine's memory is patched first (the load's and the plan's checks
# both read it through materialize.io.hostmem).
AS_IF = ("import sys, materialize.io.hostmem as h; {patch}; "
         "from materialize_cli.main import main; sys.argv[0] = 'materialize'; main()")
RAM_AND_SWAP = "h.ram_and_swap_bytes = lambda: {nbytes}"
AVAILABLE_NOW = "real = h.meminfo_bytes; h.meminfo_bytes = lambda *f: {nbytes} if f == ('MemAvailable',) else real(*f)"


def run_cli(*args: object) -> subprocess.CompletedProcess:
    return preforked.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=300)


def run_cli_as_if(patch: str, *args: object) -> subprocess.CompletedProcess:
    return preforked.run([sys.executable, "-c", AS_IF.format(patch=patch), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def write_plain(kind: str, path: Path) -> Path:
    """A state dict of every kind a plain load treats apart: floats to cast or map, a bf16 tensor, an integer
    one (never cast), an empty one; a torch file adds a transposed save and two views of one storage."""
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 32), "half": torch.randn(16, 8).to(torch.bfloat16),
             "steps": torch.tensor([7, 8]), "empty": torch.zeros(0, 4)}
    if kind == "safetensors":
        save_file(state, str(path))
    else:
        base = torch.randn(32, 48)
        torch.save({**state, "transposed": torch.randn(8, 16).t(), "whole": base, "columns": base[:, :8]}, path)
    return path


def unique_storage_bytes(tensors: dict[str, torch.Tensor], names: list[str]) -> int:
    storages = {tensors[name].untyped_storage().data_ptr(): tensors[name].untyped_storage().nbytes() for name in names}
    return sum(storages.values())


LOAD_OPTIONS = [{}, {"dtype": "fp16"}, {"mmap": True}, {"mmap": True, "dtype": "bf16"}]


@pytest.mark.parametrize("options", LOAD_OPTIONS, ids=["copy", "cast", "mmap", "mmap-and-cast"])
@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_the_plan_of_a_plain_load_is_what_the_load_does(tmp_path, monkeypatch, kind, options):
    path = write_plain(kind, tmp_path / f"m.{kind}")
    admitted = []
    real_admit = materialize.api.admit_host_copies
    monkeypatch.setattr(materialize.api, "admit_host_copies", lambda needed, at: admitted.append(needed) or real_admit(needed, at))

    planned = mz.plan(None, path, **options)
    tensors, report = mz.load_tensors(path, **options)

    summary = planned.to_dict()
    assert isinstance(planned, mz.TensorsPlan) and summary["into"] == "dict"
    assert summary["tensors"] == {"load": len(tensors), "init": 0, "keep": 0}
    assert summary["bytes_by_device"] == report.bytes_by_device == {"cpu": report.bytes_by_device["cpu"]}
    assert summary["read_bytes"] == report.bytes_read
    assert summary["mapped_bytes"] == unique_storage_bytes(tensors, report.mapped)
    assert bool(report.mapped) == options.get("mmap", False)
    assert summary["dtypes"] == report.dtypes
    assert summary["memory"]["cpu"]["needed"] == admitted[0] == report.bytes_by_device["cpu"] - summary["mapped_bytes"]
    assert planned.fits["cpu"]["fits"] is True


def test_a_mapped_and_cast_plain_load_reads_only_what_it_casts(tmp_path):
    path = write_plain("safetensors", tmp_path / "m.safetensors")
    state = mz.load_tensors(path)[0]

    planned = mz.plan(None, path, mmap=True, dtype="bf16")
    _, report = mz.load_tensors(path, mmap=True, dtype="bf16")

    cast = state["w"].numel() * 4  # read as fp32, then cast (and the empty fp32 one made); bf16 and int64 stay mapped
    assert planned.read_bytes == report.bytes_read == cast
    assert planned.mapped_bytes == state["half"].nbytes + state["steps"].nbytes
    assert sorted(report.mapped) == ["half", "steps"]
    assert report.gb_per_second == pytest.approx(report.bytes_read / report.seconds / 1e9)


@pytest.mark.parametrize("kind, options", [("safetensors", []), ("pt", ["--mmap", "--dtype", "bf16"])])
def test_the_cli_plans_a_checkpoint_without_a_model_as_the_plain_load_it_does(tmp_path, kind, options):
    path = write_plain(kind, tmp_path / f"m.{kind}")

    planned = run_cli("plan", path, *options, "--json")
    shown = run_cli("plan", path, *options)
    loaded = run_cli(path, *options, "--json")

    assert planned.returncode == shown.returncode == loaded.returncode == 0, planned.stderr + loaded.stderr
    summary, report = json.loads(planned.stdout), json.loads(loaded.stdout)
    assert summary["into"] == "dict" and summary["tensors"]["load"] == len(report["loaded"])
    assert summary["bytes_by_device"] == report["bytes_by_device"]
    assert summary["read_bytes"] == report["bytes_read"]
    assert f"tensors      {len(report['loaded'])} to load, as a plain dict (no model)" in shown.stdout.splitlines()
    assert "peak host memory: " in shown.stdout and shown.stdout.rstrip().endswith(": fits")


def test_a_plan_with_mmap_reads_nothing_that_stays_mapped(tmp_path):
    state = saved_state(reference_model(dtype=torch.bfloat16))
    path = write_safetensors(state, tmp_path / "m.safetensors")
    total = sum(t.nbytes for t in state.values())

    copied = mz.plan(tiny_skeleton(), path)
    planned = mz.plan(tiny_skeleton(), path, mmap=True)
    report = mz.load(tiny_skeleton(), path, mmap=True)
    shown = run_cli("plan", path, *MODEL_OPTIONS, "--mmap")

    assert (copied.read_bytes, copied.mapped_bytes) == (total, 0)
    assert (planned.read_bytes, planned.mapped_bytes) == (0, total) == (report.bytes_read, total)
    assert planned.to_dict()["read_bytes"] == 0 and planned.to_dict()["mapped_bytes"] == total
    assert shown.returncode == 0, shown.stderr
    assert f"read         0 B, and {format_bytes(total)} mapped from the files (read as used)" in shown.stdout


def test_a_mixed_load_reports_the_bytes_it_read_and_the_rate_over_them(tmp_path):
    state = saved_state(reference_model())
    for name in list(state)[::2]:
        state[name] = state[name].to(torch.bfloat16)  # stays mapped under a bf16 load; the fp32 ones are cast
    path = write_safetensors(state, tmp_path / "m.safetensors")
    cast = sum(t.nbytes for t in state.values() if t.dtype == torch.float32)

    planned = mz.plan(tiny_skeleton(), path, mmap=True, dtype="bf16")
    report = mz.load(tiny_skeleton(), path, mmap=True, dtype="bf16")

    assert planned.read_bytes == report.bytes_read == cast
    assert planned.mapped_bytes == sum(t.nbytes for t in state.values() if t.dtype == torch.bfloat16)
    assert sorted(report.mapped) == sorted(name for name, t in state.items() if t.dtype == torch.bfloat16)
    assert report.gb_per_second == pytest.approx(cast / report.seconds / 1e9)
    assert report.to_dict()["gb_per_second"] == round(report.gb_per_second, 3)


def row(table: str, label: str) -> str:
    return next(line[len(label):].strip() for line in table.splitlines() if line.startswith(label + " "))


def test_a_load_that_only_maps_reports_no_bytes_read_and_no_rate(tmp_path):
    path = write_safetensors(saved_state(reference_model(dtype=torch.bfloat16)), tmp_path / "m.safetensors")

    report = mz.load(tiny_skeleton(), path, mmap=True)
    _, plain = mz.load_tensors(path, mmap=True)
    shown = run_cli(path, "--mmap")
    as_json = run_cli(path, "--mmap", "--json")

    for each in (report, plain):
        assert each.bytes_read == 0 and each.gb_per_second is None and each.to_dict()["gb_per_second"] is None
        assert row(str(each), "bytes read") == "0 B" and row(str(each), "throughput") == "-"
    assert shown.returncode == as_json.returncode == 0, shown.stderr
    assert row(shown.stdout, "bytes read") == "0 B" and row(shown.stdout, "throughput") == "-"
    assert json.loads(as_json.stdout)["gb_per_second"] is None and json.loads(as_json.stdout)["bytes_read"] == 0


@pytest.mark.parametrize("model", [[], MODEL_OPTIONS], ids=["plain", "model"])
def test_a_plan_whose_load_is_refused_exits_1_with_the_loads_error_and_its_way_out_works(tmp_path, model):
    path = write_safetensors(saved_state(reference_model()), tmp_path / "m.safetensors")  # about 100 KB
    small = RAM_AND_SWAP.format(nbytes=2**16)

    planned = run_cli_as_if(small, "plan", path, *model)
    planned_json = run_cli_as_if(small, "plan", path, *model, "--json")
    loaded = run_cli_as_if(small, path, *model)
    mapped_plan = run_cli_as_if(small, "plan", path, *model, "--mmap")
    mapped_load = run_cli_as_if(small, path, *model, "--mmap", "--json")

    refusal = loaded.stderr.splitlines()
    assert loaded.returncode == 1 and len(refusal) == 1 and refusal[0].startswith("Error: ")
    assert "--mmap" in refusal[0]
    for each in (planned, planned_json):
        assert each.returncode == 1 and each.stderr.splitlines() == refusal
    assert "the load is refused" in planned.stdout  # the plan itself is printed first
    assert json.loads(planned_json.stdout)["memory"]["cpu"]["limit"] == 2**16
    assert mapped_plan.returncode == 0 and mapped_plan.stderr == "", mapped_plan.stderr
    assert "peak host memory: " in mapped_plan.stdout and "DOES NOT FIT" not in mapped_plan.stdout
    assert mapped_load.returncode == 0, mapped_load.stderr
    assert json.loads(mapped_load.stdout)["bytes_read"] == 0


def test_a_plan_beyond_the_memory_available_now_warns_as_the_load_does_and_exits_0(tmp_path):
    path = write_safetensors(saved_state(reference_model()), tmp_path / "m.safetensors")
    little = AVAILABLE_NOW.format(nbytes=2**16)

    planned = run_cli_as_if(little, "plan", path)
    loaded = run_cli_as_if(little, path, "--json")

    assert planned.returncode == loaded.returncode == 0, planned.stderr + loaded.stderr
    assert planned.stderr == loaded.stderr and len(planned.stderr.splitlines()) == 1
    assert planned.stderr.startswith("Warning: ") and "--mmap" in planned.stderr
    assert "DOES NOT FIT now: the load would warn and go on" in planned.stdout


def test_the_library_plan_raises_the_refusal_its_load_raises(tmp_path, monkeypatch):
    path = write_safetensors(saved_state(reference_model()), tmp_path / "m.safetensors")
    monkeypatch.setattr(hostmem, "ram_and_swap_bytes", lambda: 2**16)

    planned = mz.plan(tiny_skeleton(), path)
    plain = mz.plan(None, path)
    with pytest.raises(mz.AllocationError) as from_load:
        mz.load(tiny_skeleton(), path)
    with pytest.raises(mz.AllocationError) as from_plain_load:
        mz.load_tensors(path)

    for each, refusal in ((planned, from_load.value), (plain, from_plain_load.value)):
        with pytest.raises(mz.AllocationError) as from_plan:
            mz.check_memory(each)
        assert str(from_plan.value) == str(refusal)
    mz.check_memory(mz.plan(None, path, mmap=True))  # nothing copied: nothing to refuse


def test_a_gpu_without_room_for_what_the_plan_puts_there_is_an_error_with_the_loads_ways_out():
    memory = {"cuda:0": {"needed": 3 * 10**9, "available": 10**9, "fits": False},
              "cpu": {"needed": 64 * 2**20, "available": None, "fits": None, "limit": None}}

    with pytest.raises(mz.AllocationError) as caught:
        hostmem.admit_planned(memory, "m.safetensors")

    assert str(caught.value) == (
        "m.safetensors: the load puts 3.00 GB on cuda:0 and 1.00 GB is free there now: device_map='auto' (CLI: "
        "--device-map auto) spreads the model over the GPUs and host memory, and a narrower dtype needs less")


def test_a_device_map_without_a_model_is_a_usage_error_for_the_plan_as_for_the_load(tmp_path):
    path = write_plain("pt", tmp_path / "m.pt")

    planned = run_cli("plan", path, "--device-map", "auto")
    loaded = run_cli(path, "--device-map", "auto")

    assert planned.returncode == loaded.returncode == 2
    assert planned.stderr.splitlines()[-1] == loaded.stderr.splitlines()[-1]
    assert "--model" in planned.stderr.splitlines()[-1]
