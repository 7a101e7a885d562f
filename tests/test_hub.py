"""Hub repo ids: only the weights a load reads are fetched (a stand-in hub serves a folder written here)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors.torch import save_file

import materialize as mz
from materialize.integrations import hub
import preforked

REPO = "some-org/some-model"
CLI = str(Path(sys.executable).parent / "materialize")


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A fake hub: snapshot_download copies the remote files its patterns match, and records what it fetched."""
    remote = tmp_path / "remote"
    local = tmp_path / "cache" / f"models--{REPO.replace('/', '--')}" / "snapshots" / ("ab" * 20)
    remote.mkdir()
    local.mkdir(parents=True)
    fetched: list[str] = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        assert repo_id == REPO
        for file in sorted(remote.rglob("*")):
            name = file.relative_to(remote).as_posix()
            if file.is_file() and any(fnmatch.fnmatch(name, pattern) for pattern in allow_patterns):
                (local / name).parent.mkdir(parents=True, exist_ok=True)
                if not (local / name).exists():
                    shutil.copy(file, local / name)
                    fetched.append(name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return remote, fetched


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"a.weight": torch.randn(4, 3), "b.weight": torch.randn(5), "c.bias": torch.randn(2)}


def _write_sharded(remote: Path, state: dict[str, torch.Tensor]) -> None:
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for shard, members in shards.items():
        save_file({n: state[n] for n in members}, remote / shard)
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    (remote / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (remote / "config.json").write_text("{}")


def test_only_the_shards_an_index_names_are_fetched(served):
    remote, fetched = served
    state = _state()
    _write_sharded(remote, state)
    save_file(state, remote / "consolidated.safetensors")  # the same weights again, as Mistral's repos hold them
    (remote / "original").mkdir()
    torch.save(state, remote / "original" / "consolidated.00.pth")

    tensors, report = mz.load_tensors(hub.resolve(REPO))

    assert sorted(fetched) == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                               "model.safetensors.index.json"]
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name


def test_one_file_repos_fetch_that_file_and_torch_files_come_last(served):
    remote, fetched = served
    state = _state()
    save_file(state, remote / "model.safetensors")
    torch.save(state, remote / "pytorch_model.bin")

    tensors, _ = mz.load_tensors(hub.resolve(REPO))

    assert sorted(fetched) == ["model.safetensors"]
    assert torch.equal(tensors["a.weight"], state["a.weight"])


def test_a_torch_only_repo_fetches_its_index_and_shards(served):
    remote, fetched = served
    state = _state()
    torch.save({"a.weight": state["a.weight"]}, remote / "pytorch_model-00001-of-00002.bin")
    torch.save({n: state[n] for n in ("b.weight", "c.bias")}, remote / "pytorch_model-00002-of-00002.bin")
    weight_map = {"a.weight": "pytorch_model-00001-of-00002.bin", "b.weight": "pytorch_model-00002-of-00002.bin",
                  "c.bias": "pytorch_model-00002-of-00002.bin"}
    (remote / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.save(state, remote / "training_args.bin")

    tensors, _ = mz.load_tensors(hub.resolve(REPO))

    assert "training_args.bin" not in fetched
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name


def test_a_repo_in_no_known_layout_fetches_all_its_safetensors(served):
    remote, fetched = served
    state = _state()
    save_file(state, remote / "weights.safetensors")
    torch.save(state, remote / "weights.pt")

    folder = hub.resolve(REPO)

    assert fetched == ["weights.safetensors"] and (folder / "weights.safetensors").is_file()


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """A fake hub that lays files out as huggingface_hub's cache does: snapshot entries link to ../../blobs/<hash>."""
    remote = tmp_path / "remote"
    remote.mkdir()
    repo = tmp_path / "cache" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("c0ffee" * 6 + "c0ff")
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        for file in sorted(remote.iterdir()):
            if any(fnmatch.fnmatch(file.name, pattern) for pattern in allow_patterns) and not (snapshot / file.name).exists():
                blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
                shutil.copy(file, blob)
                (snapshot / file.name).symlink_to(f"../../blobs/{blob.name}")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return remote, snapshot


def test_a_cached_repo_whose_files_link_to_its_blobs_converts_with_its_companions(cached, tmp_path):
    remote, snapshot = cached
    state = _state()
    _write_sharded(remote, state)
    (remote / "tokenizer.json").write_text('{"version": "1.0"}')

    report = mz.convert(REPO, tmp_path / "out")

    out = tmp_path / "out"
    assert report.copied == ["config.json", "tokenizer.json"]
    for name in report.copied:
        assert (out / name).read_text() == (remote / name).read_text() and not (out / name).is_symlink(), name
    assert all((snapshot / name).is_symlink() for name in ("config.json", "model.safetensors.index.json"))
    converted, _ = mz.load_tensors(out)
    loaded, _ = mz.load_model(REPO)  # its config.json, a link to a blob, is read to decide what to build
    for name, value in state.items():
        assert torch.equal(converted[name], value) and torch.equal(loaded[name], value), name


def test_a_cached_snapshot_file_linking_out_of_its_repo_is_refused(cached, tmp_path):
    remote, snapshot = cached
    save_file(_state(), remote / "model.safetensors")
    secret = tmp_path / "cache" / "models--other--repo" / "blobs" / "0000"
    secret.parent.mkdir(parents=True)
    secret.write_text("{}")
    snapshot.joinpath("tokenizer.json").symlink_to(os.path.relpath(secret, snapshot))

    with pytest.raises(mz.CheckpointError) as caught:
        mz.convert(REPO, tmp_path / "out")

    assert "'tokenizer.json'" in str(caught.value) and str(secret) in str(caught.value)
    assert not (tmp_path / "out").exists()


def _offline_cache_with_outside(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A real huggingface_hub cache holding REPO, and a folder beside it holding other weights."""
    from conftest import hub_cache

    folder, outside = tmp_path / "repo", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    save_file(_state(), folder / "model.safetensors")
    save_file({"secret": torch.zeros(3)}, outside / "model.safetensors")
    cache = hub_cache(tmp_path, folder, REPO)
    return cache, cache / f"models--{REPO.replace('/', '--')}", outside


def _cli_offline(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return preforked.run([CLI, REPO, *args], capture_output=True, text=True, env=env, timeout=300)


def test_an_offline_repo_id_loads_from_a_real_cache(tmp_path):
    cache, _, _ = _offline_cache_with_outside(tmp_path)

    done = _cli_offline(cache, "--json")

    assert done.returncode == 0, done.stderr
    assert sorted(json.loads(done.stdout)["loaded"]) == sorted(_state())


@pytest.mark.parametrize("ref", ["../../../outside", "../../../outside\n"])
def test_a_cache_ref_leading_out_of_the_repo_is_refused_naming_it(tmp_path, ref):
    cache, repo, outside = _offline_cache_with_outside(tmp_path)
    (repo / "refs" / "main").write_text(ref)

    done = _cli_offline(cache, "--json")

    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "refs/main" in done.stderr and str(outside) in done.stderr, done.stderr


def test_a_cache_ref_that_is_a_fifo_is_refused_not_read(tmp_path):
    cache, repo, _ = _offline_cache_with_outside(tmp_path)
    (repo / "refs" / "main").unlink()
    os.mkfifo(repo / "refs" / "main")  # reading it would wait for a writer forever

    done = _cli_offline(cache)

    assert done.returncode == 1 and "refs/main" in done.stderr and "not a plain file" in done.stderr, done.stderr


def test_a_snapshot_that_links_out_of_the_repo_is_refused_naming_where_it_leads(tmp_path):
    cache, repo, outside = _offline_cache_with_outside(tmp_path)
    commit = (repo / "refs" / "main").read_text()
    shutil.rmtree(repo / "snapshots" / commit)
    (repo / "snapshots" / commit).symlink_to(outside, target_is_directory=True)

    done = _cli_offline(cache)

    assert done.returncode == 1 and str(outside) in done.stderr and "outside" in done.stderr, done.stderr


# ---------------------------------------------------------------- a local path that names nothing, or a repo id

ENTRY_POINTS = {
    "load_model": lambda source: mz.load_model(source),
    "open_checkpoint": lambda source: mz.open_checkpoint(source),
    "load_tensors": lambda source: mz.load_tensors(source),
    "plan": lambda source: mz.plan(torch.nn.Linear(3, 4), source),
    "convert": lambda source: mz.convert(source, "converted"),
}


@pytest.fixture
def beside_tiny_full(tmp_path, monkeypatch):
    """The working folder holds tiny/full/model.safetensors; the hub, if consulted, fails the test."""
    (tmp_path / "tiny" / "full").mkdir(parents=True)
    save_file(_state(), tmp_path / "tiny" / "full" / "model.safetensors")
    monkeypatch.chdir(tmp_path)

    def snapshot_download(repo_id, **_):
        raise AssertionError(f"the hub was consulted for {repo_id!r}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return tmp_path


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_missing_path_in_an_existing_folder_is_no_such_file_with_the_closest_name(beside_tiny_full, entry):
    with pytest.raises(mz.CheckpointNotFoundError) as caught:
        ENTRY_POINTS[entry]("tiny/ful")

    assert str(caught.value) == "tiny/ful: no such file or folder; did you mean tiny/full?"
    assert isinstance(caught.value, FileNotFoundError) and not (beside_tiny_full / "converted").exists()


def test_the_name_suggested_is_the_one_that_loads(beside_tiny_full):
    with pytest.raises(mz.CheckpointNotFoundError) as caught:
        mz.load_tensors("tny/full/model.safetensor")
    suggested = str(caught.value).rsplit("did you mean ", 1)[1].rstrip("?")

    tensors, _ = mz.load_tensors(suggested)

    assert suggested == "tiny/full/model.safetensors" and sorted(tensors) == sorted(_state())


@pytest.mark.parametrize("source", [
    "some-org/model.safetensors", "some-org/some-model.pt", "some-org/config.json",  # a file's suffix
    "./some-org/some-model", "../some-org/some-model",  # a path's start
])
def test_a_path_with_a_file_suffix_or_a_path_s_start_is_local_never_a_repo_id(beside_tiny_full, source):
    with pytest.raises(mz.CheckpointNotFoundError) as caught:
        mz.load_model(source)

    assert str(caught.value) == f"{Path(source)}: no such file or folder"  # as the path reads, ./ dropped
    assert not hub.looks_like_repo_id(source)


def test_a_repo_id_whose_org_is_a_local_folder_is_a_local_path(beside_tiny_full):
    (beside_tiny_full / "some-org").mkdir()

    with pytest.raises(mz.CheckpointNotFoundError) as caught:
        mz.load_model(REPO)

    assert str(caught.value) == f"{REPO}: no such file or folder"


def test_a_repo_id_with_no_local_folder_goes_to_the_hub(served, tmp_path, monkeypatch):
    remote, fetched = served
    save_file(_state(), remote / "model.safetensors")
    monkeypatch.chdir(tmp_path)  # which holds no some-org/

    tensors, _ = mz.load_model(REPO)

    assert fetched == ["model.safetensors"] and sorted(tensors) == sorted(_state())
    assert hub.looks_like_repo_id("Qwen/Qwen2.5-7B")  # a dot in a repo's name is no file suffix
    assert not any(map(hub.looks_like_repo_id, ["org/a--b", "org/name.git", "org/-name", "org/.name", "a/b/c"]))


def _cli_in(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI run in ``folder``, offline, with an empty hub cache: nothing can reach the network."""
    env = {**os.environ, "HF_HUB_CACHE": str(folder / "empty-cache"), "HF_HUB_OFFLINE": "1"}
    return preforked.run([CLI, *args], capture_output=True, text=True, env=env, cwd=folder, timeout=300)


@pytest.mark.parametrize("command", [[], ["inspect"], ["plan"], ["convert"]])
def test_cli_a_missing_path_in_an_existing_folder_is_one_line_naming_the_closest_name(tmp_path, command):
    (tmp_path / "tiny" / "full").mkdir(parents=True)
    save_file(_state(), tmp_path / "tiny" / "full" / "model.safetensors")
    destination = ["converted"] if command == ["convert"] else []

    done = _cli_in(tmp_path, *command, "tiny/ful", *destination)
    followed = _cli_in(tmp_path, *command, "tiny/full", *destination) if command != ["plan"] else None

    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert done.stderr == "Error: tiny/ful: no such file or folder; did you mean tiny/full?\n"
    assert followed is None or followed.returncode == 0, followed.stderr


def test_cli_a_repo_id_with_no_local_folder_is_looked_up_in_the_hub_cache(tmp_path):
    done = _cli_in(tmp_path, REPO)

    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"Error: {REPO}: not in the local Hugging Face cache"), done.stderr


def test_a_symlink_leading_nowhere_is_named_with_where_it_leads(tmp_path):
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")

    with pytest.raises(mz.CheckpointNotFoundError) as caught:
        mz.load_tensors(tmp_path / "model.safetensors")

    assert str(caught.value) == (f"{tmp_path / 'model.safetensors'}: is a symlink to {tmp_path / 'gone.safetensors'}, "
                                 "which does not exist")


def test_a_path_starting_with_a_tilde_is_suggested_expanded_where_that_exists(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    save_file(_state(), tmp_path / "models" / "model.safetensors")

    with pytest.raises(mz.CheckpointNotFoundError) as caught:
        mz.load_tensors("~/models/model.safetensors")  # the library, unlike a shell, does not expand ~
    suggested = str(caught.value).rsplit("did you mean ", 1)[1].rstrip("?")
    tensors, _ = mz.load_tensors(suggested)

    assert suggested == str(tmp_path / "models" / "model.safetensors") and sorted(tensors) == sorted(_state())


def test_inspect_takes_a_repo_id_as_a_load_does_in_the_cli_and_the_library(tmp_path):
    cache, _, _ = _offline_cache_with_outside(tmp_path)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    in_python = f"import json, materialize as mz; print(json.dumps(mz.inspect({REPO!r}, revision='main')))"

    printed = preforked.run([CLI, "inspect", REPO, "--revision", "main", "--json"], capture_output=True, text=True,
                             env=env, timeout=300)
    returned = subprocess.run([sys.executable, "-c", in_python], capture_output=True, text=True, env=env, timeout=300)

    assert printed.returncode == 0, printed.stderr
    assert returned.returncode == 0, returned.stderr
    summary = json.loads(printed.stdout)
    assert summary == json.loads(returned.stdout)
    assert Path(summary["path"]).is_relative_to(cache)
    assert sorted(t["name"] for t in summary["tensors"]) == sorted(_state())
