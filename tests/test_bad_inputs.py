"""Malformed checkpoints end in a typed MaterializeError that names the file and tensor.

Every bad file here is built for real in ``tmp_path``: real safetensors and
torch files are written, then their bytes or headers are corrupted.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import materialize as mz
from materialize.errors import summarize_names

from conftest import write_torch
from test_cli import materialize_command

CLI = str(Path(sys.executable).parent / "materialize")

# ---------------------------------------------------------------- helpers


class TinyNet(nn.Module):
    """A module saved whole with ``torch.save(model)``; importable as this test module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("scale", torch.arange(3, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


class RunsShellCommand:
    """Pickles to a call of ``os.system``: unpickling it would run the command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def write_raw_safetensors(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    """A safetensors file from a header (dict, or raw JSON bytes) and a data region."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode("utf-8")
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def f32(shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def write_real_safetensors(path: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    if tensors is None:
        tensors = {"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 3)}
    save_file(tensors, str(path))
    return path


def write_index(folder: Path, weight_map: dict[str, str], name: str = "model.safetensors.index.json") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    index = folder / name
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}), encoding="utf-8")
    return index


def rewrite_torch_zip(path: Path, edit, compression: int = zipfile.ZIP_STORED) -> Path:
    """Rewrite a ``torch.save`` zip; ``edit(record, data)`` returns new bytes, or None to drop it."""
    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, archive.read(info.filename)) for info in archive.infolist()]
    prefix = records[0][0].split("/", 1)[0]
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        for filename, data in records:
            new = edit(filename[len(prefix) + 1:], data)
            if new is not None:
                archive.writestr(filename, new)
    return path


def saved_torch_file(path: Path) -> Path:
    torch.save({"weight": torch.arange(16, dtype=torch.float32)}, path)
    return path


def small_model() -> nn.Module:
    with mz.meta_init():
        return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def small_model_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).state_dict().items()}


def assert_on_meta(model: nn.Module) -> None:
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_named_pipe_is_refused_at_once_rather_than_waited_on(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)  # opening it to read would block until some writer came

    done = subprocess.run([materialize_command(), "inspect", str(fifo)], capture_output=True, text=True, timeout=120)

    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == f"Error: {fifo}: is not a regular file (a pipe, socket or device): a checkpoint is " \
        "read at offsets within a file; save the stream to a file first"


# ---------------------------------------------------------------- safetensors: the prefix


@pytest.mark.parametrize("content", [b"", b"\x01", b"\x01\x02\x03\x04\x05\x06\x07"], ids=["0B", "1B", "7B"])
def test_safetensors_file_under_8_bytes_names_the_file(tmp_path, content):
    path = tmp_path / "short.safetensors"
    path.write_bytes(content)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "too short" in str(caught.value)


def test_header_length_past_end_of_file_names_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 4096) + b'{"a": {}}')

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "4096" in str(caught.value)


def test_git_lfs_pointer_is_explained_as_lfs(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
        "size 12345\n"
    )

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "LFS" in str(caught.value)


def test_header_length_over_100mb_cap_is_refused_before_reading(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 200 * 1024 * 1024) + b'{"a": {}}')

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "limit" in str(caught.value)


# ---------------------------------------------------------------- safetensors: the header JSON


def test_header_with_invalid_utf8_names_the_file(tmp_path):
    path = write_raw_safetensors(tmp_path / "model.safetensors", b'{"a\xff\xfe": {}}')

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "UTF-8" in str(caught.value)


def test_header_with_invalid_json_names_the_file(tmp_path):
    path = write_raw_safetensors(tmp_path / "model.safetensors", b'{"a": {"dtype": "F32", "shape": [1],')

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "JSON" in str(caught.value)


def test_header_that_is_a_json_list_names_the_file(tmp_path):
    path = write_raw_safetensors(tmp_path / "model.safetensors", b'[{"dtype": "F32", "shape": [1]}]    ')

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "list" in str(caught.value)


def test_unknown_dtype_names_the_file_and_tensor(tmp_path):
    header = {"weight": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}
    path = write_raw_safetensors(tmp_path / "model.safetensors", header, bytes(8))

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    message = str(caught.value)
    assert str(path) in message
    assert "'weight'" in message
    assert "F99" in message


def test_duplicate_tensor_key_in_header_names_the_tensor(tmp_path):
    raw = (
        b'{"twice": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
        b'"twice": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}'
    )
    path = write_raw_safetensors(tmp_path / "model.safetensors", raw, bytes(8))

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "'twice'" in str(caught.value)
    assert caught.value.tensor == "twice"


class _Twice(Exception):
    pass


def _first_duplicate(raw: bytes) -> "str | None":
    """The key json meets twice in one object first (inner objects close first), None if none: the oracle."""
    def pairs_hook(pairs: list) -> dict:
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise _Twice(key)
            seen.add(key)
        return dict(pairs)

    try:
        json.loads(raw, object_pairs_hook=pairs_hook)
    except _Twice as twice:
        return twice.args[0]
    return None


@pytest.mark.parametrize("seed", range(60))
def test_a_key_twice_anywhere_in_a_header_is_refused_and_no_other_header_is(tmp_path, seed):
    # Headers built key by key in every spelling a header may use (escaped keys, colons in names and values,
    # spaces before colons, objects nested in an entry or in the metadata), a key sometimes written twice at
    # some level: refused, naming the key, exactly where json meets a key twice.
    import random

    rng = random.Random(seed)

    def key(text: str) -> str:
        return json.dumps(text, ensure_ascii=rng.random() < 0.5) if rng.random() < 0.7 else \
            '"' + "".join(f"\\u{ord(c):04x}" for c in text) + '"'

    def obj(pairs: list[tuple[str, str]]) -> str:
        if pairs and rng.random() < 0.15:
            pairs = pairs + [rng.choice(pairs)]  # a key twice
        rng.shuffle(pairs)
        colon = rng.choice((":", " :", ": "))
        return "{" + ", ".join(f"{key(k)}{colon}{v}" for k, v in pairs) + "}"

    count = rng.randrange(1, 6)
    entries, data = [], b""
    for index in range(count):
        fields = [("dtype", '"F32"'), ("shape", "[2]"), ("data_offsets", f"[{8 * index}, {8 * index + 8}]")]
        if rng.random() < 0.2:
            fields.append(("extra", obj([("a", "1"), ("b", '"x:y"')])))
        name = rng.choice(("w", "layer:0.w", "naïve", "e.1")) + f".{index}"
        entries.append((name, obj(fields)))
        data += struct.pack("<2f", index, -index)
    if rng.random() < 0.4:
        entries.append(("__metadata__", obj([("format", '"pt"'), ("note", '"a: b"')])))
    raw = obj(entries).encode("utf-8")
    path = write_raw_safetensors(tmp_path / "model.safetensors", raw, data)
    duplicate = _first_duplicate(raw)

    if duplicate is None:
        tensors, _ = mz.load_tensors(path)
        assert sorted(tensors) == sorted(k for k, _ in entries if k != "__metadata__")
    else:
        with pytest.raises(mz.CheckpointError, match="twice") as caught:
            mz.open_checkpoint(path)
        assert caught.value.tensor == duplicate
        assert str(path) in str(caught.value)


@pytest.mark.parametrize(
    ("header", "data_size", "bad_tensor", "words"),
    [
        pytest.param({"a": f32([4], 0, 16), "b": f32([4], 8, 24)}, 24, "b", "overlap", id="overlapping"),
        pytest.param({"a": f32([4], 16, 0)}, 16, "a", "reversed", id="reversed"),
        pytest.param({"a": f32([4], 0, 16), "b": f32([4], 16, 32)}, 20, "b", "past the data region", id="out-of-range"),
        pytest.param({"a": f32([4], 0, 16), "b": f32([4], 24, 40)}, 40, "b", "unaccounted", id="gap"),
        pytest.param({"a": f32([4], 0, 12)}, 12, "a", "needs 16", id="bytes-not-dtype-x-shape"),
        pytest.param({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4, "a", "shape", id="negative-dim"),
        pytest.param({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]}}, 4, "a", "data_offsets", id="float-offsets"),
        pytest.param({"a": "not an object"}, 0, "a", "not an object", id="entry-not-object"),
    ],
)
def test_bad_offsets_and_sizes_name_the_file_and_tensor(tmp_path, header, data_size, bad_tensor, words):
    path = write_raw_safetensors(tmp_path / "model.safetensors", header, bytes(data_size))

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    message = str(caught.value)
    assert str(path) in message
    assert f"'{bad_tensor}'" in message
    assert caught.value.tensor == bad_tensor
    assert words in message


def test_trailing_bytes_after_the_last_tensor_name_the_file(tmp_path):
    path = write_raw_safetensors(tmp_path / "model.safetensors", {"a": f32([4], 0, 16)}, bytes(24))

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "8 trailing bytes" in str(caught.value)


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param({"format": 1}, id="int-value"),
        pytest.param({"format": None}, id="null-value"),
        pytest.param(["pt"], id="list"),
        pytest.param("pt", id="string"),
        pytest.param("", id="empty-string"),
        pytest.param([], id="empty-list"),
        pytest.param(0, id="zero"),
    ],
)
def test_metadata_that_is_not_a_string_map_names_the_file(tmp_path, metadata):
    header = {"__metadata__": metadata, "a": f32([1], 0, 4)}
    path = write_raw_safetensors(tmp_path / "model.safetensors", header, bytes(4))

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "__metadata__" in str(caught.value)


def test_real_safetensors_cut_short_is_rejected_on_open_naming_the_last_tensor(tmp_path):
    path = write_real_safetensors(tmp_path / "model.safetensors", {"first": torch.ones(8), "last": torch.ones(8)})
    path.write_bytes(path.read_bytes()[:-5])

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "'last'" in str(caught.value)
    assert "truncated" in str(caught.value)


# ---------------------------------------------------------------- errors that appear only while reading bytes


def _truncate_after_open(path: Path) -> mz.Checkpoint:
    """Open ``path``, then cut the file a few bytes into its last tensor's data."""
    ckpt = mz.open_checkpoint(path)
    last_start = max(info.offset for info in ckpt.values())
    with open(path, "r+b") as handle:
        handle.truncate(last_start + 6)
    return ckpt


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_file_shrinking_after_open_fails_load_tensors_naming_file_and_tensor(tmp_path, fmt):
    tensors = {"only": torch.arange(64, dtype=torch.float32)}
    if fmt == "safetensors":
        path = write_real_safetensors(tmp_path / "model.safetensors", tensors)
    else:
        path = tmp_path / "model.pt"
        torch.save(tensors, path)
    ckpt = _truncate_after_open(path)

    with ckpt, pytest.raises(mz.CheckpointError) as caught:
        mz.load_tensors(ckpt)

    assert str(path) in str(caught.value)
    assert "'only'" in str(caught.value)


def test_failed_read_mid_load_leaves_the_model_as_it_was(tmp_path):
    path = write_real_safetensors(tmp_path / "model.safetensors", small_model_state())
    model = small_model()
    before = {name: param for name, param in model.named_parameters()}
    ckpt = _truncate_after_open(path)

    with ckpt, pytest.raises(mz.CheckpointError) as caught:
        mz.load(model, ckpt)

    assert str(path) in str(caught.value)
    assert_on_meta(model)
    assert all(param is before[name] for name, param in model.named_parameters())


def test_load_by_path_of_a_corrupt_file_raises_before_touching_the_model(tmp_path):
    path = write_real_safetensors(tmp_path / "model.safetensors", small_model_state())
    path.write_bytes(path.read_bytes()[:-3])
    model = small_model()

    with pytest.raises(mz.CheckpointError) as caught:
        mz.load(model, path)

    assert str(path) in str(caught.value)
    assert_on_meta(model)


# ---------------------------------------------------------------- sharded indexes


def test_index_naming_missing_shards_lists_every_missing_shard(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    write_real_safetensors(folder / "model-00001-of-00003.safetensors", {"a": torch.ones(2)})
    index = write_index(
        folder,
        {
            "a": "model-00001-of-00003.safetensors",
            "b": "model-00002-of-00003.safetensors",
            "c": "model-00003-of-00003.safetensors",
        },
    )

    with pytest.raises(mz.CheckpointNotFoundError) as caught:
        mz.open_checkpoint(index)

    message = str(caught.value)
    assert str(index) in message
    assert "model-00002-of-00003.safetensors" in message
    assert "model-00003-of-00003.safetensors" in message
    assert "model-00001-of-00003.safetensors" not in message
    assert isinstance(caught.value, FileNotFoundError)


def test_index_mapping_a_tensor_to_a_shard_that_lacks_it_names_the_tensor(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    write_real_safetensors(folder / "s1.safetensors", {"a": torch.ones(2)})
    write_real_safetensors(folder / "s2.safetensors", {"b": torch.ones(2)})
    index = write_index(folder, {"a": "s1.safetensors", "b": "s2.safetensors", "ghost": "s2.safetensors"})

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(index)

    message = str(caught.value)
    assert str(index) in message
    assert "ghost" in message
    assert "s2.safetensors" in message


def test_shard_holding_a_tensor_the_index_does_not_name_names_the_tensor(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    write_real_safetensors(folder / "s1.safetensors", {"a": torch.ones(2), "stowaway": torch.zeros(3)})
    index = write_index(folder, {"a": "s1.safetensors"})

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(index)

    assert str(index) in str(caught.value)
    assert "'stowaway'" in str(caught.value)
    assert caught.value.tensor == "stowaway"


@pytest.mark.parametrize("style", ["dotdot", "absolute", "symlink"])
def test_shard_path_leaving_the_checkpoint_folder_is_refused(tmp_path, style):
    outside = write_real_safetensors(tmp_path / "outside.safetensors", {"a": torch.ones(2)})
    folder = tmp_path / "ckpt"
    shard = {"dotdot": "../outside.safetensors", "absolute": str(outside), "symlink": "linked.safetensors"}[style]
    index = write_index(folder, {"a": shard})
    if style == "symlink":
        (folder / "linked.safetensors").symlink_to(outside)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(index)

    assert str(index) in str(caught.value)
    assert "outside" in str(caught.value)


@pytest.mark.parametrize("repo", ["models--org--name", "not-a-hub-repo"])
def test_shard_symlinked_to_a_blob_as_in_the_hugging_face_cache_is_accepted(tmp_path, repo):
    blobs = tmp_path / repo / "blobs"
    blobs.mkdir(parents=True)
    write_real_safetensors(blobs / "3f2a9c", {"a": torch.ones(2)})
    snapshot = tmp_path / repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "model-00001-of-00001.safetensors").symlink_to(Path("../../blobs/3f2a9c"))
    index = write_index(snapshot, {"a": "model-00001-of-00001.safetensors"})

    if not repo.startswith("models--"):  # blobs/ is trusted only in the cache's own layout
        with pytest.raises(mz.CheckpointError, match="outside the checkpoint folder"):
            mz.open_checkpoint(index)
        return
    with mz.open_checkpoint(index) as ckpt:
        names = list(ckpt)

    assert names == ["a"]


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"])
def test_the_checkpoint_a_folder_holds_symlinked_out_of_it_is_refused_naming_the_link(tmp_path, name):
    outside = write_real_safetensors(tmp_path / "outside.safetensors")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / name).symlink_to(outside)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(folder)
    done = subprocess.run([CLI, "inspect", str(folder)], capture_output=True, text=True)

    message = str(caught.value)
    assert f"'{name}'" in message and str(outside) in message and "outside the checkpoint folder" in message
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and f"'{name}'" in done.stderr


def test_the_checkpoint_a_folder_holds_symlinked_within_it_loads(tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "weights").mkdir(parents=True)
    write_real_safetensors(folder / "weights" / "v1.safetensors", {"a": torch.arange(3.0)})
    (folder / "model.safetensors").symlink_to("weights/v1.safetensors")

    tensors, _ = mz.load_tensors(folder)

    assert torch.equal(tensors["a"], torch.arange(3.0))


def test_a_subfolder_of_a_hugging_face_cache_snapshot_reads_its_files_from_the_blobs(tmp_path):
    repo = tmp_path / "models--org--pipeline"
    (repo / "blobs").mkdir(parents=True)
    write_real_safetensors(repo / "blobs" / "9e1d", {"a": torch.ones(2)})
    unet = repo / "snapshots" / "abc123" / "unet"  # a diffusers pipeline: one checkpoint per component folder
    unet.mkdir(parents=True)
    (unet / "diffusion_pytorch_model.safetensors").symlink_to("../../../blobs/9e1d")

    with mz.open_checkpoint(unet) as ckpt:
        assert list(ckpt) == ["a"]


def test_a_config_json_symlinked_out_of_the_folder_is_refused_before_it_is_read(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text('{"model_type": "llama"}')
    folder = tmp_path / "ckpt"
    folder.mkdir()
    write_real_safetensors(folder / "model.safetensors")
    (folder / "config.json").symlink_to(secret)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.load_model(folder)

    assert "'config.json'" in str(caught.value) and str(secret) in str(caught.value)
    assert "outside the checkpoint folder" in str(caught.value)


def test_a_shard_that_is_a_symlink_loop_is_an_error_not_a_crash(tmp_path):
    folder = tmp_path / "ckpt"
    index = write_index(folder, {"a": "loop.safetensors"})
    (folder / "loop.safetensors").symlink_to("loop2.safetensors")
    (folder / "loop2.safetensors").symlink_to("loop.safetensors")

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(index)

    assert "loop.safetensors" in str(caught.value)


def test_a_folder_without_a_checkpoint_is_described_without_reading_files_linked_out_of_it(tmp_path):
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "weights.gguf").symlink_to(outside)
    (folder / "model.gguf").write_bytes(outside.read_bytes())

    with pytest.raises(mz.CheckpointNotFoundError) as caught:
        mz.open_checkpoint(folder)

    message = str(caught.value)
    assert "model.gguf: a GGUF file" in message  # read: it is the folder's own
    assert "weights.gguf" in message and "weights.gguf: a GGUF" not in message


def _index_rule(weight_map: dict[str, str], held: dict[str, set[str]]) -> Optional[str]:
    """What a sharded checkpoint's index and its shards must agree on (names listed as errors list them), said one shard at a time in the index's
    order of them: the names it maps to a shard that the shard lacks, else the first the shard holds that the
    index maps elsewhere or not at all; None where they agree."""
    for shard in dict.fromkeys(weight_map.values()):
        expected = {name for name, owner in weight_map.items() if owner == shard}
        absent = sorted(expected - held[shard])
        if absent:
            return f"index maps {summarize_names(absent)} to {shard}, which does not hold it"
        for name in sorted(held[shard] - expected):
            owner = weight_map.get(name)
            return f"shard {shard} holds tensor '{name}' but " + (
                f"the index maps it to {owner}" if owner else "the index does not name it")
    return None


def test_every_way_shards_can_disagree_with_their_index_is_refused_as_the_rule_says(tmp_path):
    """Generated: each of two names held by no shard, either or both, and mapped by the index to either shard
    or left out (128 checkpoints whose index names anything): the open succeeds exactly where shards and
    index agree, and otherwise names the fault the rule finds first."""
    import itertools

    names, shards = ("a", "b"), ("s1.safetensors", "s2.safetensors")
    holdings = [set(), {shards[0]}, {shards[1]}, set(shards)]
    owners = [None, *shards]
    checked = refused = 0
    for case, (held_by, mapped) in enumerate(itertools.product(itertools.product(holdings, repeat=2),
                                                                itertools.product(owners, repeat=2))):
        weight_map = {name: owner for name, owner in zip(names, mapped) if owner is not None}
        if not weight_map:
            continue
        folder = tmp_path / str(case)
        held = {shard: {name for name, where in zip(names, held_by) if shard in where} for shard in shards}
        folder.mkdir()
        for shard in shards:
            save_file({name: torch.full((2,), float(index)) for index, name in enumerate(names) if name in held[shard]},
                      str(folder / shard))
        index = write_index(folder, weight_map)
        expected = _index_rule(weight_map, held)
        if expected is None:
            with mz.open_checkpoint(index) as ckpt:
                assert sorted(ckpt.keys()) == sorted(weight_map) and list(ckpt.keys()) == list(weight_map)
                assert all(ckpt[name].path.name == owner for name, owner in weight_map.items())
        else:
            with pytest.raises(mz.CheckpointError) as caught:
                mz.open_checkpoint(index)
            assert expected in str(caught.value), (weight_map, held)
            refused += 1
        checked += 1
    assert checked == 128 and 0 < refused < checked


def test_shard_index_that_is_not_json_names_the_index(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    index = folder / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "s1.safetensors",', encoding="utf-8")

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(index)

    assert str(index) in str(caught.value)
    assert "JSON" in str(caught.value)


def test_shard_index_without_weight_map_names_the_index(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weights": {"a": "s1.safetensors"}}), encoding="utf-8")

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(index)

    assert str(index) in str(caught.value)
    assert "weight_map" in str(caught.value)


def test_an_index_that_is_the_bare_name_to_file_map_loads_as_accelerate_reads_it(tmp_path):
    # accelerate's load_checkpoint_in_model takes {"name": "file"} without "weight_map" around it.
    from safetensors.torch import save_file

    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a": torch.arange(3.0)}, str(folder / "s1.safetensors"))
    save_file({"b": torch.ones(2, 2)}, str(folder / "s2.safetensors"))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"b": "s2.safetensors", "a": "s1.safetensors"}), encoding="utf-8")
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(3))
    model.b = torch.nn.Parameter(torch.zeros(2, 2))

    report = mz.load(model, index)

    assert sorted(report.loaded) == ["a", "b"]
    assert torch.equal(model.a, torch.arange(3.0)) and torch.equal(model.b, torch.ones(2, 2))


def test_corrupt_shard_behind_an_index_names_the_shard_file(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shard = write_real_safetensors(folder / "s1.safetensors", {"a": torch.ones(4), "b": torch.ones(4)})
    shard.write_bytes(shard.read_bytes()[:-4])
    index = write_index(folder, {"a": "s1.safetensors", "b": "s1.safetensors"})

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(index)

    assert str(shard) in str(caught.value)
    assert "'b'" in str(caught.value)


# ---------------------------------------------------------------- torch zip files and pickles


def test_pickle_that_would_run_a_shell_command_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.ones(2), "payload": RunsShellCommand(f"touch {marker}")}, path)

    with pytest.raises(mz.UnsafeCheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "system" in str(caught.value)
    assert not marker.exists()


@pytest.mark.parametrize("entry", ["load_tensors", "load_model", "load"])
def test_code_executing_pickle_is_refused_by_every_loading_entry_point(tmp_path, entry):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"0.weight": torch.ones(3, 4), "payload": RunsShellCommand(f"touch {marker}")}, path)
    calls = {
        "load_tensors": lambda: mz.load_tensors(path),
        "load_model": lambda: mz.load_model(path),
        "load": lambda: mz.load(small_model(), path),
    }

    with pytest.raises(mz.UnsafeCheckpointError) as caught:
        calls[entry]()

    assert str(path) in str(caught.value)
    assert not marker.exists()


def test_pickled_module_opens_and_loads_with_trust_pickle(tmp_path):
    torch.manual_seed(0)
    source = TinyNet()
    path = tmp_path / "whole_model.pt"
    torch.save(source, path)

    with mz.open_checkpoint(path, trust_pickle=True) as ckpt:
        opened_module = ckpt.module
        opened_names = set(ckpt)
    model, report = mz.load_model(path, trust_pickle=True)

    assert isinstance(opened_module, TinyNet)
    assert opened_names == {"fc.weight", "fc.bias", "scale"}
    assert isinstance(model, TinyNet)
    assert set(report.loaded) == {"fc.weight", "fc.bias", "scale"}
    for name, expected in source.state_dict().items():
        actual = model.state_dict()[name]
        assert actual.device.type == "cpu"
        assert torch.equal(actual, expected), name


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_archive_is_unsupported(tmp_path):
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), str(path))

    with pytest.raises(mz.UnsupportedFormatError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "TorchScript" in str(caught.value)


@pytest.mark.filterwarnings("ignore::UserWarning")  # a single-process save warns that no process group exists
def test_one_data_file_of_a_distributed_checkpoint_says_to_open_its_folder(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "step-100"
    dcp.save({"w": torch.randn(4, 4)}, checkpoint_id=str(folder))
    shard = next(folder.glob("*.distcp"))

    with pytest.raises(mz.UnsupportedFormatError) as caught:
        mz.open_checkpoint(shard)

    message = str(caught.value)
    assert message.startswith(f"{shard}: ") and "(DCP) folder; open the folder, " + str(folder) in message
    assert "\n" not in message


@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_truncated_torch_zip_names_the_file(tmp_path, keep):
    path = tmp_path / "model.pt"
    torch.save({"weight": torch.arange(256, dtype=torch.float32)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "zip" in str(caught.value)


def test_zip_without_data_pkl_names_the_file(tmp_path):
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/version", "3\n")
        archive.writestr("archive/data/0", bytes(16))

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "data.pkl" in str(caught.value)


def _gzip_of(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data)


def _tar_of(path: Path) -> bytes:
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(path, arcname=path.name)
    return buffer.getvalue()


@pytest.mark.parametrize("name, content, words", [
    ("model.gguf", lambda saved: b"GGUF\x03\x00\x00\x00" + bytes(64), "is a GGUF file (llama.cpp's format)"),
    ("model.pt.gz", lambda saved: _gzip_of(saved.read_bytes()), "is gzip-compressed data, not a PyTorch checkpoint: decompress it"),
    ("model.tar", _tar_of, "is a tar archive, not a PyTorch checkpoint: extract it first"),
    ("weights.npy", lambda saved: b"\x93NUMPY\x01\x00" + bytes(64), "is a numpy array file (.npy)"),
    ("model.h5", lambda saved: b"\x89HDF\r\n\x1a\n" + bytes(64), "is an HDF5 file"),
    ("model.onnx", lambda saved: b"\x08\x07\x12\x07pytorch" + bytes(64), "is an ONNX model"),
])
def test_files_of_other_formats_are_named_for_what_they_are(tmp_path, name, content, words):
    saved = write_torch({"w": torch.ones(3)}, tmp_path / "saved.pt")
    path = tmp_path / name
    path.write_bytes(content(saved))

    with pytest.raises(mz.UnsupportedFormatError) as caught:
        mz.open_checkpoint(path)
    done = subprocess.run([CLI, "inspect", str(path)], capture_output=True, text=True)

    assert str(caught.value).startswith(f"{path}: {words}")
    assert done.returncode == 1 and done.stderr.startswith(f"Error: {path}: {words}")
    assert "run 'materialize inspect'" not in done.stderr


@pytest.mark.parametrize("names, words", [
    (["a.npy", "b.npy"], "it holds numpy arrays (an .npz file"),
    (["notes.txt", "logs/run.txt"], "it holds logs/run.txt, notes.txt"),
])
def test_a_zip_that_is_not_a_torch_file_says_what_it_holds(tmp_path, names, words):
    path = tmp_path / "model.ckpt"
    with zipfile.ZipFile(path, "w") as archive:
        for name in names:
            archive.writestr(name, b"x")

    with pytest.raises(mz.UnsupportedFormatError) as caught:
        mz.open_checkpoint(path)

    assert str(caught.value).startswith(f"{path}: is a zip archive without a data.pkl record, so not a torch.save file: ")
    assert words in str(caught.value)


def test_a_safetensors_header_whose_length_starts_like_gzip_is_still_safetensors(tmp_path):
    values = torch.arange(6, dtype=torch.float32)
    header = json.dumps({"w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}}).encode()
    length = 0x088B1F  # little-endian 1f 8b 08: gzip's magic
    path = write_raw_safetensors(tmp_path / "big-header.safetensors", header + b" " * (length - len(header)),
                                 values.numpy().tobytes())

    tensors, _ = mz.load_tensors(path)

    assert path.read_bytes()[:3] == b"\x1f\x8b\x08" and torch.equal(tensors["w"], values)


def test_zip_whose_data_pkl_is_garbage_names_the_file(tmp_path):
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", b"this is not a pickle at all")
        archive.writestr("archive/version", "3\n")

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "data.pkl" in str(caught.value)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        pytest.param(lambda name, data: None if name == "data/0" else data, "missing from the zip", id="record-missing"),
        pytest.param(lambda name, data: data[:8] if name == "data/0" else data, "holds 8 bytes", id="record-short"),
    ],
)
def test_torch_zip_with_a_bad_storage_record_names_file_and_tensor(tmp_path, edit, words):
    path = rewrite_torch_zip(saved_torch_file(tmp_path / "model.pt"), edit)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    message = str(caught.value)
    assert str(path) in message
    assert "'weight'" in message
    assert words in message


def test_torch_zip_with_compressed_records_names_the_file(tmp_path):
    path = rewrite_torch_zip(saved_torch_file(tmp_path / "model.pt"), lambda name, data: data, zipfile.ZIP_DEFLATED)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "compressed" in str(caught.value)


def test_big_endian_torch_zip_is_unsupported(tmp_path):
    path = rewrite_torch_zip(
        saved_torch_file(tmp_path / "model.pt"), lambda name, data: b"big" if name == "byteorder" else data
    )

    with pytest.raises(mz.UnsupportedFormatError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value)
    assert "big-endian" in str(caught.value)


def test_code_executing_pickle_as_a_shard_is_refused_naming_the_shard(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shard = folder / "pytorch_model-00001-of-00001.bin"
    torch.save({"a": torch.ones(2), "payload": RunsShellCommand(f"touch {marker}")}, shard)
    index = write_index(folder, {"a": shard.name}, name="pytorch_model.bin.index.json")

    with pytest.raises(mz.UnsafeCheckpointError) as caught:
        mz.open_checkpoint(folder)

    assert str(shard) in str(caught.value)
    assert not marker.exists()
    assert index.exists()


# ---------------------------------------------------------------- the file system


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_raises_access_error_naming_the_file(tmp_path):
    path = write_real_safetensors(tmp_path / "model.safetensors")
    path.chmod(0)
    try:
        with pytest.raises(mz.CheckpointAccessError) as caught:
            mz.open_checkpoint(path)
    finally:
        path.chmod(0o644)

    assert str(path) in str(caught.value)
    assert isinstance(caught.value, PermissionError)


# Imported before dropping root: the interpreter's own files may be unreadable to nobody.
_AS_NOBODY = """
import os, sys
import materialize_cli.main as cli, materialize as mz, materialize.api, materialize.loading
import materialize.checkpoint.safetensors, materialize.report, materialize_cli._errors
os.setgroups([]); os.setgid(65534); os.setuid(65534)
cli.main(sys.argv[1:], prog_name="materialize")
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root, to drop to the user nobody")
def test_cli_run_by_another_user_reports_the_real_permission_error():
    """As root, chmod means nothing: a CLI that drops to nobody meets the real EACCES."""
    import shutil
    import subprocess
    import sys
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="materialize-perm-"))  # pytest's tmp_path is private to root
    try:
        folder.chmod(0o755)
        if any(not parent.stat().st_mode & 0o001 for parent in folder.parents):
            pytest.skip(f"{folder.parent} is not searchable by other users")
        path = write_real_safetensors(folder / "model.safetensors")
        path.chmod(0)
        result = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(path)], capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(folder)

    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.stderr
    assert str(path) in lines[0] and "Permission denied" in lines[0]
    assert result.stdout == ""


def test_nonexistent_path_raises_not_found_which_is_a_file_not_found_error(tmp_path):
    path = tmp_path / "nowhere" / "model.safetensors"

    with pytest.raises(mz.CheckpointNotFoundError) as caught:
        mz.open_checkpoint(path)

    assert isinstance(caught.value, FileNotFoundError)
    assert str(path) in str(caught.value)


def test_empty_folder_raises_not_found_naming_the_folder(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()

    with pytest.raises(mz.CheckpointNotFoundError) as caught:
        mz.open_checkpoint(folder)

    assert str(caught.value) == f"{folder}: holds no safetensors, torch checkpoint or shard index (no files at all)"


def test_a_folder_of_other_formats_says_what_it_holds(tmp_path):
    folder = tmp_path / "tf-repo"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tf_model.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(64))

    with pytest.raises(mz.CheckpointNotFoundError) as caught:
        mz.open_checkpoint(folder)

    assert str(caught.value) == (f"{folder}: holds no safetensors, torch checkpoint or shard index (it has "
                                 "config.json, tf_model.h5: an HDF5 file (Keras or TensorFlow .h5 weights))")


def test_a_pipeline_folder_names_the_subfolders_that_hold_its_checkpoints(tmp_path):
    folder = tmp_path / "pipeline"
    (folder / "scheduler").mkdir(parents=True)
    (folder / "scheduler" / "scheduler_config.json").write_text("{}")
    for component, name in (("vae", "diffusion_pytorch_model.safetensors"), ("unet", "diffusion_pytorch_model.safetensors"),
                            ("text_encoder", "pytorch_model.bin")):
        (folder / component).mkdir()
        state = small_model_state()
        if name.endswith(".bin"):
            torch.save(state, folder / component / name)
        else:
            write_real_safetensors(folder / component / name, state)
    (folder / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')

    with pytest.raises(mz.CheckpointNotFoundError) as caught:
        mz.open_checkpoint(folder)

    assert str(caught.value) == (f"{folder}: holds no safetensors, torch checkpoint or shard index (it has "
                                 "model_index.json); a diffusers pipeline: its subfolders text_encoder, unet, vae hold "
                                 "checkpoints: pass one of them")
    tensors, _ = mz.load_tensors(folder / "unet")  # as the message says
    assert all(torch.equal(tensors[name], value) for name, value in small_model_state().items())


# ---------------------------------------------------------------- strict loads: model and checkpoint disagree


def test_strict_load_with_missing_and_unexpected_tensors_names_every_one(tmp_path):
    state = small_model_state()
    state = {"0.weight": state["0.weight"], "0.bias": state["0.bias"], "extra.weight": torch.ones(2), "extra.bias": torch.ones(1)}
    path = write_real_safetensors(tmp_path / "model.safetensors", state)
    model = small_model()

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)

    message = str(caught.value)
    assert str(path) in message
    for name in ("1.weight", "1.bias", "extra.weight", "extra.bias"):
        assert name in message
    assert sorted(caught.value.missing) == ["1.bias", "1.weight"]
    assert sorted(caught.value.unexpected) == ["extra.bias", "extra.weight"]
    assert_on_meta(model)


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path):
    state = small_model_state()
    state["0.weight"] = torch.ones(5, 4)
    path = write_real_safetensors(tmp_path / "model.safetensors", state)
    model = small_model()

    with pytest.raises(mz.ShapeMismatchError) as caught:
        mz.load(model, path)

    message = str(caught.value)
    assert str(path) in message
    assert "0.weight" in message
    assert "[3, 4]" in message
    assert "[5, 4]" in message
    assert caught.value.mismatched == ["0.weight"]
    assert_on_meta(model)


def test_strict_load_of_a_torch_state_dict_with_extra_key_names_it(tmp_path):
    state = small_model_state()
    state["surplus"] = torch.zeros(1)
    path = tmp_path / "model.pt"
    torch.save(state, path)
    model = small_model()

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)

    assert str(path) in str(caught.value)
    assert "surplus" in str(caught.value)
    assert caught.value.unexpected == ["surplus"]
    assert_on_meta(model)


def test_a_permission_error_reports_the_real_errno_even_as_root(tmp_path, monkeypatch):
    # chmod cannot stop root, so the refusal is simulated where the file is opened.
    path = write_real_safetensors(tmp_path / "model.safetensors")
    real_open = os.open

    def refuse(file, flags, *args, **kwargs):
        if Path(file) == path:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)

    with pytest.raises(mz.CheckpointAccessError) as caught:
        mz.open_checkpoint(path)

    assert str(path) in str(caught.value) and "Permission denied" in str(caught.value)
    assert not isinstance(caught.value, FileNotFoundError)


@pytest.mark.parametrize("shape, fits", [
    ([2**31, 2**31 - 1], True),  # 2**62 - 2**31 elements: below the bound checked dimension by dimension
    ([2**31, 2**31], True),  # 2**62: checked dimension by dimension, and fits
    ([0, 2**63], False),  # no element, but a dimension torch cannot describe
    ([2**32, 2**32], False),  # 2**64 elements
])
def test_shapes_past_what_torch_can_describe_are_refused_naming_the_tensor(tmp_path, shape, fits):
    header = {"big": {"dtype": "U8", "shape": shape, "data_offsets": [0, 0]}}
    path = write_raw_safetensors(tmp_path / "huge.safetensors", header)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    message = str(caught.value)
    assert message.startswith(f"{path}: tensor 'big': ")
    if fits:  # described, but its bytes are not in the file
        assert "needs" in message
    else:
        assert "larger than any tensor can be" in message
