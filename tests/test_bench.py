"""The benchmark harness runs end to end on a tiny config and verifies what it measures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

TINY_CONFIG = f"""
[model]
factory = "{ROOT / 'bench' / 'models' / 'transformer.py'}:DecoderLM"

[model.args]
vocab_size = 256
hidden_size = 64
num_layers = 2
num_heads = 4
intermediate_size = 128

[checkpoint]
dtype = "bf16"
shard_size = "100KB"
"""


def test_bench_measures_and_verifies_ours_and_the_limit_on_the_tiny_config(tmp_path):
    """The quick tier's run of the main bench: our load of each file form and one limit, warm and cold, each once
    (no warm-up), verified, with the forward pass; the test below runs every method."""
    config = tmp_path / "bench-tiny.toml"
    config.write_text(TINY_CONFIG)
    out = tmp_path / "results"

    subprocess.run([sys.executable, "-m", "bench.run", "--config", str(config), "--data", str(tmp_path / "data"),
                    "--runs", "1", "--no-warm-up", "--only", "ours,limit", "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True, text=True)

    rows = json.loads((out / "bench-tiny.json").read_text())["results"]
    assert {"ours, sharded safetensors", "ours, torch zip", "limit: all cores, fresh memory, sharded (cold)"} <= set(rows)
    for key, row in rows.items():
        assert "error" not in row and row["verified"], (key, row)
        assert row["forward_ok"] or not row["case"]["method"].startswith("ours"), key


@pytest.mark.long  # every method of the main bench; the test above runs ours and the limit
def test_bench_measures_and_verifies_every_selected_method(tmp_path):
    config = tmp_path / "bench-tiny.toml"
    config.write_text(TINY_CONFIG)
    out = tmp_path / "results"

    subprocess.run(
        [sys.executable, "-m", "bench.run", "--config", str(config), "--data", str(tmp_path / "data"),
         "--runs", "1", "--only", "ours,ours-mmap,ours-cast,ours-direct,limit,limit-mapped,limit-prefault,limit-fresh-fp32", "--out", str(out)],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )

    report = json.loads((out / "bench-tiny.json").read_text())
    rows = report["results"]
    assert {
        "ours, sharded safetensors", "ours, torch zip", "ours --mmap", "ours, bf16 -> fp32",
        "ours --direct-io, one safetensors (cold)", "limit: copy out of a mapping (read-ahead) (cold)",
        "limit: all cores, chunks prefaulted", "limit: fresh fp32 memory alone, all cores",
        "limit: all cores, fresh memory, sharded (cold)",
    } <= set(rows)
    for key, row in rows.items():
        assert "error" not in row, (key, row)
        assert row["verified"], key
        if row["case"]["method"].startswith("ours"):
            assert row["forward_ok"], key
    assert "| copy | ours, sharded safetensors |" in (out / "bench-tiny.md").read_text()
    if _has_matplotlib():
        assert (out / "bench-tiny.png").stat().st_size > 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("where", [
    # In the bench's own process: this bench measures no memory, and a fresh interpreter a method (what keeps the
    # bench's times apart) would be most of the test's time.
    "--in-process",
    # As make bench runs it, a process a method: the long tier's (the same methods and checks, slower)
    pytest.param("--one-process-each", marks=pytest.mark.long),
])
def test_the_rearranged_layouts_bench_verifies_every_method(where, tmp_path):
    out = tmp_path / "results"

    subprocess.run(
        [sys.executable, "-m", "bench.strided", "--data", str(tmp_path / "data"), "--shape", "4,6,10", "--runs", "1",
         "--no-warm-up", *([where] if where == "--in-process" else []), "--out", str(out)],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )

    rows = json.loads((out / "bench-strided.json").read_text())["results"]
    assert len(rows) == 5 and all(row["verified"] for row in rows.values()), rows
    assert "| ours, transposed experts |" in (out / "bench-strided.md").read_text()


def _run_on_the_tiny_config(module: str, tmp_path: Path, *options: str) -> Path:
    """Run ``python -m module`` once on the tiny config, no warm-up (every method still runs, once); the folder
    its results went to."""
    config = tmp_path / "bench-tiny.toml"
    config.write_text(TINY_CONFIG)
    out = tmp_path / "results"
    subprocess.run(
        [sys.executable, "-m", module, "--config", str(config), "--data", str(tmp_path / "data"), "--runs", "1",
         "--no-warm-up", "--out", str(out), *options],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )
    return out


def test_the_dcp_bench_saves_once_and_verifies_every_method(tmp_path):
    out = _run_on_the_tiny_config("bench.dcp", tmp_path)

    rows = json.loads((out / "bench-dcp.json").read_text())["results"]
    assert len(rows) == 4 and all(row["verified"] for row in rows.values()), rows
    assert (tmp_path / "data" / "bench-tiny" / "dcp" / ".metadata").is_file()
    assert "| ours, same dtype |" in (out / "bench-dcp.md").read_text()


def test_the_sharded_bench_runs_every_method_on_two_ranks_and_verifies_them(tmp_path):
    out = _run_on_the_tiny_config("bench.sharded", tmp_path)

    report = json.loads((out / "bench-sharded.json").read_text())
    assert report["world"] == 2 and len(report["results"]) == 3
    assert all(row["verified"] for row in report["results"].values()), report
    assert "| ours: every rank reads its own rows |" in (out / "bench-sharded.md").read_text()


@pytest.mark.long  # the sharded bench on more ranks and another layout than the two-rank test above
def test_the_sharded_bench_loads_torchtitans_2d_layout_on_four_ranks_by_every_method_and_verifies_them(tmp_path):
    out = _run_on_the_tiny_config("bench.sharded", tmp_path, "--layout", "2d")

    report = json.loads((out / "bench-sharded-2d.json").read_text())
    assert report["world"] == 4 and len(report["results"]) == 6
    assert all(row["verified"] for row in report["results"].values()), report
    rows = report["results"]
    alone, shared = rows["ours: every rank reads its own part, safetensors"], rows["ours, group=: each byte read by one rank, safetensors"]
    assert shared["storage_bytes"] < alone["storage_bytes"]  # the row-wise spans and the norms read once
    assert "| torch DCP: to_empty + dcp.load, a DCP save of the same 2-D layout |" in (out / "bench-sharded-2d.md").read_text()
    assert (tmp_path / "data" / "bench-tiny" / "dcp-2d-4" / ".metadata").is_file()  # the ranks wrote it, once
    assert not (tmp_path / "results" / "bench-sharded.json").exists()  # the 1-D table is its own run


@pytest.mark.long  # the sharded bench on four ranks, replicas: a larger case of the two-rank test above
def test_the_sharded_bench_loads_four_replicas_by_every_method_and_counts_the_bytes_from_storage(tmp_path):
    out = _run_on_the_tiny_config("bench.sharded", tmp_path, "--layout", "replicas")

    report = json.loads((out / "bench-sharded-replicas.json").read_text())
    rows = report["results"]
    assert report["world"] == 4 and len(rows) == 4 and all(row["verified"] for row in rows.values()), report
    file_bytes = rows["torch: rank 0 reads, set_model_state_dict broadcasts"]["storage_bytes"]
    assert rows["torch: every rank to_empty, load_file + load_state_dict"]["storage_bytes"] == 4 * file_bytes
    shared = rows["ours, group=: each byte read by one rank, sent to the others"]["storage_bytes"]
    assert shared == rows["ours: every rank reads all"]["storage_bytes"] // 4 and 0 < shared <= file_bytes
    assert "| storage GB |" in (out / "bench-sharded-replicas.md").read_text()


@pytest.mark.long  # the replicas bench again, its bytes from S3 (group reads from a URL: test_group_loads)
def test_the_sharded_bench_reads_four_replicas_from_a_loopback_s3_server_once_with_a_group(tmp_path):
    pytest.importorskip("moto")
    out = _run_on_the_tiny_config("bench.sharded", tmp_path, "--layout", "replicas", "--source", "s3")

    rows = json.loads((out / "bench-sharded-replicas-s3.json").read_text())["results"]
    assert len(rows) == 2 and all(row["verified"] for row in rows.values()), rows
    shared = rows["ours, group=: each byte read by one rank, sent to the others"]["storage_bytes"]
    assert shared * 4 == rows["ours: every rank reads all"]["storage_bytes"] and shared > 0


def test_the_deferred_bench_times_the_recording_and_eager_construction_of_the_models_of_the_zoo(tmp_path):
    # Seed 248 samples three small models (under this lock: MistralLarge4Model and mobilenet_v3_small timed,
    # VoxtralRealtimeTextModel skipped): transformers' classes and torchvision's builders, a model timed and a model
    # the zoo skips, in a second of construction (seed 2's swin3d_s alone took eleven).
    out = tmp_path / "results"

    subprocess.run([sys.executable, "-m", "bench.deferred_zoo", "--sample", "3", "--seed", "248", "--runs", "1",
                    "--out", str(out)], cwd=ROOT, check=True, capture_output=True, text=True)

    report = json.loads((out / "bench-deferred-zoo.json").read_text())
    timed = report["rows"]
    assert len(timed) + len(report["left_out"]) <= 3 and timed
    assert all(row["eager_s"] > 0 and row["recorded_s"] > 0 and "/deferred/" in row["case"] for row in timed)
    assert report["ratio_of_sums"] == sum(r["recorded_s"] for r in timed) / sum(r["eager_s"] for r in timed)
    assert report["meta_import_s"] > 0
    assert "recorded / eager" in (out / "bench-deferred-zoo.md").read_text()


def test_the_many_tensors_bench_verifies_every_method_of_one_form_and_times_each_phase(tmp_path):
    """The quick tier's run of the many-tensors bench: one group (one safetensors file), every method of it
    verified and each phase timed; the test below runs every group."""
    out = tmp_path / "results"

    subprocess.run([sys.executable, "-m", "bench.many", "--tensors", "300", "--hidden", "16", "--intermediate", "8",
                    "--runs", "1", "--no-warm-up", "--groups", "single", "--data", str(tmp_path / "data"),
                    "--out", str(out)], cwd=ROOT, check=True, capture_output=True, text=True)

    groups = json.loads((out / "bench-many.json").read_text())["results"]
    assert set(groups) == {"single"}
    rows = groups["single"]
    assert all(row["verified"] for row in rows.values()), rows
    assert set(rows["ours, meta_init model"]["phases"]) == {"open", "plan", "allocate", "read", "report"}
    assert rows["ours, deferred_init model"]["build_s"] > 0
    assert set(rows["floor: a bare Python loader, no checks (bench/floor.py)"]["phases"]) == {"open", "plan", "allocate",
                                                                                              "read"}


@pytest.mark.long  # every group of the bench above (FSDP2 ranks, cold files, the baseline's library in turns): minutes
def test_the_many_tensors_bench_verifies_every_method_of_every_form_and_times_each_phase(tmp_path):
    out = tmp_path / "results"

    subprocess.run([sys.executable, "-m", "bench.many", "--tensors", "300", "--hidden", "16", "--intermediate", "8",
                    "--runs", "1", "--no-warm-up", "--scaling-counts", "60,120", "--data", str(tmp_path / "data"),
                    "--baseline", str(ROOT), "--baseline-name", "same checkout", "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True, text=True)

    report = json.loads((out / "bench-many.json").read_text())
    assert report["tensors"] == 300
    groups = report["results"]
    assert set(groups) == {"single", "sharded", "torch", "cast", "fsdp2", "build", "scaling", "inspect", "cold"}
    assert list(groups["build"]) == ["mz.meta_init", "accelerate init_empty_weights", "torch: with torch.device('meta')",
                                     "mz.deferred_init", "mz.meta_init, same checkout"]
    assert all(row["build_s"] == row["load_s"] > 0 for row in groups["build"].values())
    assert [row["tensors"] for row in groups["scaling"].values()] == [60, 60, 60, 60, 120, 120, 120, 120]
    baseline = groups["single"]["ours, meta_init model, same checkout"]  # the library of --baseline, in turns
    assert baseline["verified"] and baseline["library"] == str(ROOT / "materialize")
    assert "materialize inspect, torch zip, same checkout" in groups["inspect"]
    assert list(groups["fsdp2"]) == ["ours: every rank reads its own rows",
                                     "torch: rank 0 load_file, set_model_state_dict broadcasts",
                                     "ours: every rank reads its own rows, same checkout"]
    cast = groups["cast"]  # bf16 -> fp32: ours, accelerate's, the floor, and ours on the baseline's library
    assert list(cast) == ["ours, meta_init model, bf16 -> fp32",
                          "accelerate load_checkpoint_and_dispatch, init_empty_weights model, bf16 -> fp32",
                          "limit: fresh fp32 memory alone, all cores", "ours, meta_init model, bf16 -> fp32, same checkout"]
    assert set(cast["ours, meta_init model, bf16 -> fp32"]["phases"]) == {"open", "plan", "allocate", "read", "report"}
    for group, rows in groups.items():
        for label, row in rows.items():
            assert row["verified"], (group, label, row)
    for form in ("single", "sharded", "torch"):
        ours = groups[form]["ours, meta_init model"]["phases"]
        assert set(ours) == {"open", "plan", "allocate", "read", "report"} and all(s >= 0 for s in ours.values())
        assert groups[form]["ours, deferred_init model"]["build_s"] > 0
    for form in ("single", "torch"):  # the floor, a bare loader trusting the file, verified as every method is
        floor = groups[form]["floor: a bare Python loader, no checks (bench/floor.py)"]
        assert set(floor["phases"]) == {"open", "plan", "allocate", "read"} and floor["verified"]
    assert groups["inspect"]["materialize inspect, torch zip"]["lines"] > 300  # a row a tensor, and a heading
    assert (tmp_path / "data" / "many-300-16x8" / "hf" / "model.safetensors.index.json").is_file()
    cold = groups["cold"]  # files evicted before each run; the baseline's library beside ours, torch's alone
    assert list(cold) == ["materialize inspect, torch zip", "materialize inspect, torch zip, same checkout",
                          "ours, meta_init model, torch zip", "ours, meta_init model, torch zip, same checkout",
                          "torch.load(mmap=True) + load_state_dict(assign=True), torch zip",
                          "ours, meta_init model, one safetensors file",
                          "ours, meta_init model, one safetensors file, same checkout"]
    assert cold["materialize inspect, torch zip"]["lines"] > 300
    assert set(cold["ours, meta_init model, torch zip"]["phases"]) == {"open", "plan", "allocate", "read", "report"}
    text = (out / "bench-many.md").read_text()
    assert "**Cold**" in text and "| ours, meta_init model, one safetensors file |" in text
    assert "| one safetensors file | ours, meta_init model |" in text and "**materialize inspect**" in text
    assert "**one safetensors file, bf16 -> fp32**" in text and "x accelerate |" in text
