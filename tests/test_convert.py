"""convert: any checkpoint to safetensors, bounded memory, all or nothing at the destination."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import materialize as mz
from materialize import conversion as convert_module
from materialize.io.peak import PeakMemory

from conftest import write_safetensors, write_sharded, write_torch
from test_cli import assert_one_error_line, run_cli
from test_hf import _save, _tiny


def torch_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(6, 4)
    return {
        "embed": base,
        "head": base,  # a tie: one storage, two names
        "rows": base[2:],
        "transposed": base.t(),  # non-contiguous
        "half": torch.randn(5, 3).bfloat16(),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }


def leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_a_torch_file_becomes_one_safetensors_file_with_the_same_values(tmp_path):
    state = torch_state()
    src = write_torch(state, tmp_path / "model.pt")
    dst = tmp_path / "model.safetensors"

    report = mz.convert(src, dst)

    written = load_file(str(dst))  # the format's own reader
    assert set(written) == set(state)
    for name, value in state.items():
        assert written[name].dtype == value.dtype and torch.equal(written[name], value.contiguous()), name
    with safe_open(str(dst), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    assert report.tensors == len(state) and report.files == [str(dst)]
    assert report.bytes_written == sum(v.numel() * v.element_size() for v in state.values())
    assert leftovers(tmp_path, {"model.pt", "model.safetensors"}) == []


def test_a_cast_converts_floating_tensors_only(tmp_path):
    state = torch_state()
    src = write_torch(state, tmp_path / "model.pt")

    mz.convert(src, tmp_path / "out.safetensors", dtype="bf16")

    written = load_file(str(tmp_path / "out.safetensors"))
    for name, value in state.items():
        want = value.bfloat16() if value.is_floating_point() else value
        assert written[name].dtype == want.dtype and torch.equal(written[name], want.contiguous()), name


def test_a_folder_output_is_sharded_with_an_index_past_the_shard_size(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "BATCH_BYTES", 1000)  # many batches per shard
    torch.manual_seed(1)
    state = {f"layer{i}.weight": torch.randn(40, 10) for i in range(7)}
    src = write_sharded(state, tmp_path / "src", shards=2)

    report = mz.convert(src, tmp_path / "out", shard_size=4000)

    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 4 and shards[0] == "model-00001-of-00004.safetensors"
    assert all((out / s).stat().st_size <= 4000 + 1000 for s in shards)  # data within the limit, plus a header
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in state.values())
    assert sorted(index["weight_map"]) == sorted(state)
    tensors, _ = mz.load_tensors(out)
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name
    assert report.files == [str(out / s) for s in shards]


def test_a_small_folder_output_is_one_model_safetensors(tmp_path):
    src = write_safetensors({"w": torch.ones(3)}, tmp_path / "m.safetensors")

    mz.convert(src, tmp_path / "out")

    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def test_a_converted_folder_s_config_says_the_dtype_written_so_from_pretrained_loads_it_so(tmp_path):
    # The config was copied as it was ("dtype": "float32"): transformers then loaded the bf16 folder in fp32.
    transformers = pytest.importorskip("transformers")
    model, _ = _tiny("gpt2")
    src = _save(model, tmp_path / "fp32", as_bin=False, dtype=torch.float32)
    config = json.loads((src / "config.json").read_text())
    config["extra_settings"] = {"dtype": "float32", "note": "nested configs (text_config, say) have it too"}
    (src / "config.json").write_text(json.dumps(config))

    mz.convert(src, tmp_path / "bf16", dtype="bf16")
    mz.convert(src, tmp_path / "same")

    written = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert written["extra_settings"]["dtype"] == "bfloat16"
    assert written.get("dtype", written.get("torch_dtype")) == "bfloat16"
    assert (tmp_path / "same" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert {p.dtype for p in reloaded.parameters()} == {torch.bfloat16}


def test_a_hugging_face_bin_folder_becomes_a_safetensors_folder_that_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, inputs = _tiny("gpt2")
    src = _save(model, tmp_path / "bin", as_bin=True, dtype=torch.float32)

    report = mz.convert(src, tmp_path / "st", shard_size="60KB")

    assert "config.json" in report.copied
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "st").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, model.eval()(**inputs).logits)


def test_an_overflowing_cast_fails_naming_the_tensor_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "BATCH_BYTES", 16)  # the bad tensor comes after a batch was written
    src = write_safetensors({"fine": torch.ones(8), "huge": torch.full((4,), 1e6)}, tmp_path / "m.safetensors")

    for dst in (tmp_path / "out.safetensors", tmp_path / "out"):
        with pytest.raises(mz.CastOverflowError) as caught:
            mz.convert(src, dst, dtype="fp16", shard_size=16)
        assert "'huge'" in str(caught.value)
        assert leftovers(tmp_path, {"m.safetensors"}) == []


def test_an_existing_destination_is_refused_unless_overwrite(tmp_path):
    src = write_safetensors({"w": torch.arange(3.0)}, tmp_path / "m.safetensors")
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"precious")

    with pytest.raises(mz.OutputError) as caught:
        mz.convert(src, dst)
    assert str(dst) in str(caught.value) and dst.read_bytes() == b"precious"

    mz.convert(src, dst, overwrite=True)
    assert torch.equal(load_file(str(dst))["w"], torch.arange(3.0))


def test_memory_stays_near_one_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "BATCH_BYTES", 8 * 1024 * 1024)
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(24)}  # 96 MiB of 4 MiB tensors
    src = write_safetensors(state, tmp_path / "m.safetensors")
    del state

    with PeakMemory() as memory:
        mz.convert(src, tmp_path / "out.safetensors")

    assert memory.host_growth < 40 * 1024 * 1024, memory.host_growth  # 8 MiB batches, not 96 MiB


def test_cli_converts_and_reports_json(tmp_path):
    state = torch_state()
    src = write_torch(state, tmp_path / "model.pt")
    dst = tmp_path / "model.safetensors"

    result = run_cli("convert", src, dst, "--json")

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tensors"] == len(state) and report["destination"] == str(dst)
    assert set(load_file(str(dst))) == set(state)


def test_cli_convert_error_is_one_line_and_writes_nothing(tmp_path):
    src = write_safetensors({"huge": torch.full((4,), 1e6)}, tmp_path / "m.safetensors")

    result = run_cli("convert", src, tmp_path / "out.safetensors", "--dtype", "fp16")

    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and "'huge'" in lines[0]
    assert leftovers(tmp_path, {"m.safetensors"}) == []


# ---------------------------------------------------------------- hostile sources

def all_files(root: Path) -> set[Path]:
    return {path for path in root.rglob("*") if not path.is_dir() or path.is_symlink()}


def model_folder(folder: Path) -> Path:
    """A small Hugging Face-style folder: weights, a config and a tokenizer file."""
    folder.mkdir(parents=True)
    write_safetensors({"w": torch.arange(6.0)}, folder / "model.safetensors")
    (folder / "config.json").write_text('{"model_type": "none"}')
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    return folder


def test_a_companion_file_symlinked_out_of_the_source_folder_is_refused_naming_it(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    src = model_folder(tmp_path / "src")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    before = all_files(tmp_path)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.convert(src, tmp_path / "out")
    result = run_cli("convert", src, tmp_path / "out")

    message = str(caught.value)
    assert "'tokenizer.json'" in message and str(secret) in message and "outside the checkpoint folder" in message
    line = assert_one_error_line(result, "'tokenizer.json'")
    assert str(secret) in line and "outside the checkpoint folder" in line
    assert all_files(tmp_path) == before  # refused before anything was written


def test_companion_files_symlinked_inside_the_folder_or_to_hub_cache_blobs_are_copied(tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / ("0" * 40)
    model_folder(tmp_path / "files")
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, file in enumerate(sorted((tmp_path / "files").iterdir())):  # as huggingface_hub stores a snapshot
        (repo / "blobs" / f"{number:064x}").write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(f"../../blobs/{number:064x}")
    (snapshot / "extra").mkdir()
    (snapshot / "extra" / "vocab.txt").write_text("a\nb\n")
    (snapshot / "vocab.txt").symlink_to("extra/vocab.txt")  # a link that stays in the folder

    report = mz.convert(snapshot, tmp_path / "out")

    out = tmp_path / "out"
    assert report.copied == ["config.json", "tokenizer.json", "vocab.txt"]
    for name in report.copied:
        assert not (out / name).is_symlink() and (out / name).read_bytes() == (snapshot / name).read_bytes(), name
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], torch.arange(6.0))


def test_a_companion_name_that_is_no_file_name_in_the_output_is_refused_before_anything_is_written(tmp_path):
    src = model_folder(tmp_path / "src")
    (src / "..\\..\\evil.json").write_text("{}")  # a legal POSIX name; a Windows path that climbs out
    before = all_files(tmp_path)

    with pytest.raises(mz.OutputError) as caught:
        mz.convert(src, tmp_path / "out")

    assert "'..\\\\..\\\\evil.json'" in str(caught.value) and "output folder" in str(caught.value)
    assert all_files(tmp_path) == before


@pytest.mark.parametrize("name, written", [
    ("config.json", "config.json"),
    ("../../escape.json", "escape.json"),
    ("/etc/passwd", "passwd"),
    ("sub/dir/tokenizer.json", "tokenizer.json"),
])
def test_an_output_name_is_reduced_to_its_base_name_inside_the_destination(tmp_path, name, written):
    assert convert_module._output_path(tmp_path, name) == tmp_path / written


@pytest.mark.parametrize("name", ["", ".", "..", "x/..", "a/", "a\\b", "..\\x", "a\0b"])
def test_an_output_name_that_is_empty_dot_or_holds_a_separator_or_nul_is_refused(tmp_path, name):
    with pytest.raises(mz.OutputError) as caught:
        convert_module._output_path(tmp_path, name)

    assert repr(name) in str(caught.value)


def test_an_output_path_that_resolves_out_of_the_destination_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").symlink_to(tmp_path / "elsewhere.json")  # never there by construction: checked all the same

    with pytest.raises(mz.OutputError) as caught:
        convert_module._output_path(out, "config.json")

    assert "outside the output folder" in str(caught.value)


def test_shard_names_from_the_source_never_become_output_paths(tmp_path):
    torch.manual_seed(2)
    state = {f"layer{i}.weight": torch.randn(10, 10) for i in range(3)}
    src = tmp_path / "src"
    (src / "deep" / "er").mkdir(parents=True)
    weight_map = {}
    for number, (name, value) in enumerate(state.items()):
        shard = f"./deep/er/{number}.safetensors" if number else "deep/part.safetensors"
        write_safetensors({name: value}, src / shard)
        weight_map[name] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    before = all_files(tmp_path)

    report = mz.convert(src, tmp_path / "out", shard_size=500)

    out = tmp_path / "out"
    assert all_files(tmp_path) - before == all_files(out)
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    assert report.copied == []


@pytest.mark.parametrize("shard", ["../outside.safetensors", "ABSOLUTE", "link.safetensors"])
def test_a_source_index_naming_a_shard_out_of_its_folder_is_refused_and_nothing_is_written(tmp_path, shard):
    outside = write_safetensors({"w": torch.ones(3)}, tmp_path / "outside.safetensors")
    src = tmp_path / "src"
    src.mkdir()
    if shard == "link.safetensors":
        (src / shard).symlink_to(outside)
    shard = str(outside) if shard == "ABSOLUTE" else shard
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    before = all_files(tmp_path)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.convert(src, tmp_path / "out")

    assert "outside the checkpoint folder" in str(caught.value)
    assert all_files(tmp_path) == before


def expanded_file(path: Path, rows: int) -> Path:
    """A torch file whose tensor 'w' is 4 stored floats repeated over ``rows`` rows (a stride of 0)."""
    return write_torch({"w": torch.arange(4.0).expand(rows, 4), "b": torch.ones(3)}, path)


def test_a_view_expanding_its_storage_past_the_limit_is_refused_before_anything_is_written(tmp_path):
    src = write_torch({"w": torch.zeros(1).expand(400_000_000)}, tmp_path / "bomb.pt")  # 1.6 GB from 4 bytes
    assert src.stat().st_size < 2000

    with PeakMemory() as memory, pytest.raises(mz.ExpansionError) as caught:
        mz.convert(src, tmp_path / "out.safetensors")

    message = str(caught.value)
    assert caught.value.path == str(src) and caught.value.tensor == "w"
    assert "400,000,000x" in message and "limit of 16x" in message and "--allow-expansion" in message
    assert memory.host_growth < 64 * 1024 * 1024
    assert leftovers(tmp_path, {"bomb.pt"}) == []


def test_ties_and_views_of_one_storage_are_not_expansion(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "EXPANSION_ALLOWANCE", 0)  # any expanded tensor at all is refused
    base = torch.randn(64, 32)
    state = {"embed": base, "lm_head": base, "rows": base[8:40], "transposed": base.t(), "column": base[:, 3],
             "every_other": base[::2]}
    src = write_torch(state, tmp_path / "tied.pt")

    mz.convert(src, tmp_path / "out.safetensors", dtype="fp64")  # a widening cast is no expansion either

    written = load_file(str(tmp_path / "out.safetensors"))
    for name, value in state.items():
        assert torch.equal(written[name], value.double()), name


def test_small_expanded_tensors_pass_until_what_they_add_reaches_the_allowance(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "EXPANSION_ALLOWANCE", 10_000)
    state = {f"mask{i}": torch.ones(1).expand(1000) for i in range(4)}  # 4000 bytes each from 4 stored
    src = write_torch(state, tmp_path / "masks.pt")

    with pytest.raises(mz.ExpansionError) as caught:
        mz.convert(src, tmp_path / "out.safetensors")
    first_two = write_torch({n: state[n] for n in ("mask0", "mask1")}, tmp_path / "two.pt")
    mz.convert(first_two, tmp_path / "two.safetensors")

    assert caught.value.tensor == "mask2"  # 3 x (4000 - 16 x 4) bytes passes 10,000
    assert torch.equal(load_file(str(tmp_path / "two.safetensors"))["mask1"], torch.ones(1000))


def test_cli_refuses_an_expanding_view_and_its_hint_writes_it_in_full(tmp_path):
    src = expanded_file(tmp_path / "expanded.pt", rows=1_200_000)  # 19.2 MB from 16 bytes
    dst = tmp_path / "out.safetensors"

    refused = run_cli("convert", src, dst)
    line = assert_one_error_line(refused, "'w'")
    flag = next(word for word in line.replace(")", " ").split() if word.startswith("--allow-"))
    assert str(src) in line and "1,200,000x" in line and not dst.exists()
    allowed = run_cli("convert", src, dst, flag, "--json")

    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["bytes_written"] == 1_200_000 * 16 + 12
    assert torch.equal(load_file(str(dst))["w"], torch.arange(4.0).expand(1_200_000, 4))


# ---------------------------------------------------------------- an existing destination

def contents(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones too) by relative path, with its bytes; folders as None."""
    return {path.relative_to(root).as_posix(): None if path.is_dir() else path.read_bytes() for path in root.rglob("*")}


def user_files(folder: Path) -> dict[str, bytes]:
    """What a user keeps in a converted folder beside its checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("how this model was trained")
    (folder / "eval").mkdir()
    (folder / "eval" / "results.json").write_text('{"accuracy": 0.9}')
    (folder / "eval" / "model.safetensors").write_bytes(b"not a conversion's: in a subfolder")
    write_safetensors({"probe": torch.zeros(2)}, folder / "other.safetensors")
    (folder / "model-00001-of-00003.safetensors.bak").write_bytes(b"a backup, not a shard")
    return {name: data for name, data in contents(folder).items() if name != "model.safetensors"}


def states(seed: int, count: int = 6) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(10, 10) for i in range(count)}


def test_overwrite_into_a_folder_replaces_only_what_a_conversion_writes(tmp_path):
    src = model_folder(tmp_path / "src")
    out = tmp_path / "out"
    kept = user_files(out)
    write_safetensors({"old": torch.ones(1)}, out / "model.safetensors")
    (out / "config.json").write_text('{"old": true}')

    report = mz.convert(src, out, overwrite=True)

    assert {name: data for name, data in contents(out).items() if name in kept} == kept
    assert sorted(contents(out)) == sorted([*kept, "model.safetensors", "config.json", "tokenizer.json"])
    assert load_file(str(out / "model.safetensors")).keys() == {"w"}
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert report.copied == ["config.json", "tokenizer.json"] and report.removed == []


@pytest.mark.parametrize("before, after", [
    (3, 2),  # another shard count: the third old shard would stay beside the new index
    (3, 1),  # sharded, then one file: the old index would still be read first
    (1, 2),  # one file, then sharded: the loader would find the old model.safetensors beside the new index
])
def test_overwrite_removes_an_earlier_conversion_s_shards_and_index_it_does_not_write_again(tmp_path, before, after):
    out = tmp_path / "out"
    kept = user_files(out)
    old, new = states(1), states(2)
    shard = 10 * 10 * 4 * len(old)  # bytes of all tensors: one shard
    mz.convert(write_safetensors(old, tmp_path / "old.safetensors"), out, overwrite=True, shard_size=-(-shard // before))
    old_outputs = {name for name in contents(out) if name not in kept}

    report = mz.convert(write_safetensors(new, tmp_path / "new.safetensors"), out, overwrite=True,
                        shard_size=-(-shard // after))

    written = {Path(file).name for file in report.files} | ({"model.safetensors.index.json"} if after > 1 else set())
    assert len(report.files) == after and sorted(contents(out)) == sorted([*kept, *written])
    assert sorted(report.removed) == sorted(old_outputs - written) != []
    assert {name: data for name, data in contents(out).items() if name in kept} == kept
    tensors, _ = mz.load_tensors(out)
    assert tensors.keys() == new.keys() and all(torch.equal(tensors[name], new[name]) for name in new)


def test_an_existing_folder_without_overwrite_is_refused_naming_the_flag_and_what_it_would_replace(tmp_path):
    src = model_folder(tmp_path / "src")
    out = tmp_path / "out"
    kept = user_files(out)

    with pytest.raises(mz.OutputError) as caught:
        mz.convert(src, out)
    message = str(caught.value)
    assert contents(out) == kept
    assert message.startswith(f"{out}: already exists") and "overwrite=True" in message and "--overwrite" in message
    assert all(word in message for word in ("model.safetensors", "shards", "index", "config", "keeping every other file"))
    mz.convert(src, out, overwrite=True)  # the hint, followed

    assert {name: data for name, data in contents(out).items() if name in kept} == kept
    assert load_file(str(out / "model.safetensors")).keys() == {"w"}


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_where_a_folder_is_meant_is_refused_never_made_a_folder(tmp_path, overwrite):
    src = write_safetensors({"w": torch.arange(3.0)}, tmp_path / "m.safetensors")
    dst = tmp_path / "out"
    dst.write_bytes(b"precious")

    with pytest.raises(mz.OutputError) as caught:
        mz.convert(src, dst, overwrite=overwrite)
    mz.convert(src, tmp_path / "out.safetensors")  # the hint: a .safetensors file, to write one file

    assert str(caught.value).startswith(f"{dst}: is a file, and a destination not ending in .safetensors is a folder")
    assert dst.read_bytes() == b"precious"
    assert leftovers(tmp_path, {"m.safetensors", "out", "out.safetensors"}) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_where_a_safetensors_file_is_meant_is_refused_never_replaced(tmp_path, overwrite):
    src = write_safetensors({"w": torch.arange(3.0)}, tmp_path / "m.safetensors")
    dst = tmp_path / "out.safetensors"
    kept = user_files(dst)

    with pytest.raises(mz.OutputError) as caught:
        mz.convert(src, dst, overwrite=overwrite)

    assert str(caught.value).startswith(f"{dst}: is a folder, and a destination ending in .safetensors is one file")
    assert contents(dst) == kept


def test_a_failing_conversion_leaves_the_earlier_folder_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "out"
    user_files(out)
    mz.convert(write_safetensors(states(1), tmp_path / "old.safetensors"), out, overwrite=True, shard_size=1000)
    before = contents(out)
    monkeypatch.setattr(convert_module, "BATCH_BYTES", 16)  # the bad tensor comes after a shard was written
    bad = write_safetensors({"fine": torch.ones(8), "huge": torch.full((4,), 1e6)}, tmp_path / "bad.safetensors")

    with pytest.raises(mz.CastOverflowError) as caught:
        mz.convert(bad, out, overwrite=True, dtype="fp16", shard_size=16)

    assert caught.value.tensor == "huge"
    assert contents(out) == before  # no new shard, no hidden folder left, every old file as it was


def test_a_failure_while_the_files_are_moved_puts_every_file_back(tmp_path, monkeypatch):
    src = model_folder(tmp_path / "src")
    write_safetensors(states(2), src / "model.safetensors")
    out = tmp_path / "out"
    user_files(out)
    mz.convert(write_safetensors(states(1), tmp_path / "old.safetensors"), out, overwrite=True, shard_size=1000)
    (out / "config.json").write_text('{"old": true}')
    before = contents(out)
    replace = os.replace

    def interrupted_at_the_index(source, target):
        if Path(target).name == "model.safetensors.index.json" and ".materialize-partial-" in str(source):
            raise KeyboardInterrupt  # Ctrl-C after the new shards and config.json took their places
        replace(source, target)

    monkeypatch.setattr(os, "replace", interrupted_at_the_index)
    with pytest.raises(KeyboardInterrupt):
        mz.convert(src, out, overwrite=True, shard_size=1000)

    assert contents(out) == before


def test_a_name_the_conversion_writes_held_by_a_folder_is_refused_before_anything_is_written(tmp_path):
    src = model_folder(tmp_path / "src")
    out = tmp_path / "out"
    kept = user_files(out)
    (out / "tokenizer.json").mkdir()
    (out / "tokenizer.json" / "inside.txt").write_text("a folder of the user's")
    kept = contents(out)

    with pytest.raises(mz.OutputError) as caught:
        mz.convert(src, out, overwrite=True)

    assert str(caught.value).startswith(f"{out}: holds 'tokenizer.json', a folder, where the conversion writes a file")
    assert contents(out) == kept


def test_overwrite_replaces_a_safetensors_file_in_one_rename_and_a_symlink_not_its_target(tmp_path):
    src = write_safetensors({"w": torch.arange(3.0)}, tmp_path / "m.safetensors")
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(b"what the link leads to")
    dst = tmp_path / "out.safetensors"
    dst.symlink_to(elsewhere)

    mz.convert(src, dst, overwrite=True)

    assert not dst.is_symlink() and torch.equal(load_file(str(dst))["w"], torch.arange(3.0))
    assert elsewhere.read_bytes() == b"what the link leads to"


def test_cli_overwrite_into_a_folder_keeps_the_user_s_files_and_its_refusal_names_the_flag(tmp_path):
    src = model_folder(tmp_path / "src")
    out = tmp_path / "out"
    kept = user_files(out)
    mz.convert(write_safetensors(states(1), tmp_path / "old.safetensors"), out, overwrite=True, shard_size=1000)

    refused = run_cli("convert", src, out)
    line = assert_one_error_line(refused, str(out))
    flag = next(word for word in line.replace(")", " ").split() if word.startswith("--"))
    converted = run_cli("convert", src, out, flag, "--json")

    assert flag == "--overwrite" and "keeping every other file" in line
    assert converted.returncode == 0, converted.stderr
    report = json.loads(converted.stdout)
    assert report["removed"] == ["model.safetensors.index.json", *(f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3))]
    assert {name: data for name, data in contents(out).items() if name in kept} == kept
    assert sorted(name for name in contents(out) if name not in kept) == ["config.json", "model.safetensors",
                                                                          "tokenizer.json"]


@pytest.mark.parametrize("dst, there", [("out", "a file"), ("out.safetensors", "a folder")])
def test_cli_refuses_to_turn_a_file_into_a_folder_or_a_folder_into_a_file(tmp_path, dst, there):
    src = write_safetensors({"w": torch.arange(3.0)}, tmp_path / "m.safetensors")
    target = tmp_path / dst
    if there == "a file":
        target.write_bytes(b"precious")
    else:
        user_files(target)
    before = contents(tmp_path)

    refused = run_cli("convert", src, target, "--overwrite")

    assert_one_error_line(refused, f"{target}: is {there}, and a destination")
    assert contents(tmp_path) == before


@pytest.mark.parametrize("merging", [False, True], ids=["new folder", "merged into"])
def test_what_a_conversion_killed_midway_left_is_cleared_by_the_next_and_nothing_else_is(tmp_path, merging):
    """A real conversion, slowed by a proxy in front of its source URL, killed (SIGKILL) once its staging exists:
    the next conversion to that destination removes it, and keeps another host's and a live process's."""
    import signal
    import subprocess
    import time

    from test_cli import materialize_command
    from tests.remote_servers import FaultProxy, RangeServer

    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(256, 256) for i in range(8)}  # 2 MiB: 20 s through the proxy's 100 KB/s
    (tmp_path / "www").mkdir()
    write_safetensors(state, tmp_path / "www" / "model.safetensors")
    out = tmp_path / "out"
    if merging:
        mz.convert(write_safetensors({"old": torch.zeros(3)}, tmp_path / "old.safetensors"), out)
    where, prefix = (out, ".materialize-partial-") if merging else (tmp_path, ".out.partial-")
    with RangeServer(tmp_path / "www") as server, FaultProxy(server.url, rate=100_000) as slow:
        killed = subprocess.Popen([materialize_command(), "convert", f"{slow.url}/model.safetensors", str(out),
                                   *(["--overwrite"] if merging else [])],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not [p for p in where.iterdir() if p.name.startswith(prefix)] and time.monotonic() < deadline:
                time.sleep(0.05)
            killed.send_signal(signal.SIGKILL)
        finally:
            killed.wait()
    assert killed.returncode == -signal.SIGKILL
    (left,) = [p for p in where.iterdir() if p.name.startswith(prefix)]
    host, pid = left.name[len(prefix):].split("-")[:2]
    assert pid == str(killed.pid)
    others = [where / f"{prefix}{host}x-{killed.pid}-kept", where / f"{prefix}{host}-{os.getpid()}-kept"]
    for other in others:  # another host's; a live process's (this one)
        other.mkdir()
        (other / "part").write_bytes(b"x")

    converted = run_cli("convert", tmp_path / "www" / "model.safetensors", out, "--json",
                        *(["--overwrite"] if merging else []))

    assert converted.returncode == 0, converted.stderr
    assert json.loads(converted.stdout)["cleared"] == [str(left)]
    assert not left.exists() and all((other / "part").exists() for other in others)
    assert sorted(p.name for p in where.iterdir() if p.name.startswith(prefix)) == sorted(o.name for o in others)
    got = load_file(out / "model.safetensors")
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


@pytest.mark.parametrize("merging", [False, True], ids=["new file", "merged into"])
def test_a_killed_conversions_staging_that_cannot_be_removed_is_named_and_the_conversion_goes_on(
        tmp_path, monkeypatch, merging):
    """The sweep of killed stagings is housekeeping: one it cannot remove (immutable, a mount inside it; here
    its removal refused) is left, named in a warning, and not reported cleared; once removed by hand, as
    the warning says, the next conversion has nothing to say."""
    import errno
    import shutil
    import subprocess
    import sys
    import warnings

    from materialize.io import destination

    state = {"w": torch.arange(6.0).reshape(2, 3)}
    src = write_safetensors(state, tmp_path / "m.safetensors")
    out = tmp_path / ("out" if merging else "out.safetensors")
    if merging:
        mz.convert(write_safetensors({"old": torch.zeros(3)}, tmp_path / "old.safetensors"), out)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)  # a process id no process has now
    where, prefix = (out, destination.MERGE_STAGING) if merging else (tmp_path, f".{out.name}.partial-")
    stuck = where / f"{prefix}{destination._HOST}-{dead}"  # a folder merged into stages a folder, else a file
    part = stuck / "model.safetensors" if merging else stuck
    if merging:
        stuck.mkdir()
    part.write_bytes(b"x" * 64)
    removing, unlinking = shutil.rmtree, Path.unlink

    def refused(path, *args, **kwargs):
        if Path(path) == stuck:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(path))
        return (removing if merging else unlinking)(path, *args, **kwargs)

    if merging:
        monkeypatch.setattr(destination.shutil, "rmtree", refused)
    else:
        monkeypatch.setattr(Path, "unlink", refused)
    with pytest.warns(mz.ConvertWarning) as warned:
        report = mz.convert(src, out, overwrite=merging)

    assert [str(w.message) for w in warned] == [
        f"{stuck}: a killed conversion's staging cannot be removed (Operation not permitted); it is left as it is: "
        "remove it by hand"]
    assert report.cleared == [] and part.read_bytes() == b"x" * 64
    got = load_file(out / "model.safetensors" if merging else out)
    assert got.keys() == state.keys() and torch.equal(got["w"], state["w"])
    monkeypatch.undo()
    removing(stuck) if merging else stuck.unlink()  # by hand, as the warning says
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = mz.convert(src, out, overwrite=True)
    assert again.cleared == [] and not stuck.exists()
