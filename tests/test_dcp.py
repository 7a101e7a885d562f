"""torch.distributed.checkpoint (DCP) folders: read in place, chunks located in the data files, nothing run."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

import materialize as mz

from conftest import TINY, reference_model, run_ranks, tiny_skeleton
from fuzz_targets import raw_bytes
import preforked

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # a single-process save warns that no process group exists

CLI = str(Path(sys.executable).parent / "materialize")


def _save(state: dict, folder: Path) -> Path:
    dcp.save(state, checkpoint_id=str(folder))
    return folder


def test_a_training_save_loads_its_model_state_and_leaves_the_rest(tmp_path):
    source = reference_model()
    folder = _save({"model": source.state_dict(), "optim": {"lr": torch.tensor(0.1), "step": 3}, "epoch": 2}, tmp_path / "step-10")
    model = tiny_skeleton()

    report = mz.load(model, folder, check=True)

    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert report.format == "dcp" and report.unexpected == [] and report.missing == []
    tokens = torch.arange(9)[None] % TINY["vocab_size"]
    with torch.no_grad():
        assert torch.equal(model(tokens), source(tokens))


def test_a_flat_save_keeps_its_names_and_the_metadata_file_opens_its_folder(tmp_path):
    tensors = {"w": torch.randn(5, 3), "b": torch.arange(4, dtype=torch.int64), "s": torch.tensor(2.5, dtype=torch.bfloat16),
               "empty": torch.zeros(0, 3)}
    folder = _save(dict(tensors), tmp_path / "flat")

    loaded, report = mz.load_model(folder / ".metadata")

    assert loaded.keys() == tensors.keys()
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())


def test_optimizer_state_saved_beside_a_flat_model_state_is_left_out(tmp_path):
    source = reference_model()
    state = dict(source.state_dict())
    state["optimizer"] = {"state.model.norm.weight.exp_avg": torch.ones(TINY["hidden_size"]), "param_groups.lr": 0.1}
    state["lr_scheduler"] = {"last_epoch": torch.tensor(4)}
    folder = _save(state, tmp_path / "titan-step")
    model = tiny_skeleton()

    report = mz.load(model, folder)

    assert report.unexpected == [] and sorted(mz.open_checkpoint(folder)) == sorted(source.state_dict())
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def _rewrite_metadata(folder: Path, change) -> None:
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own file: read it with pickle itself
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def _split_into_rows(folder: Path, rows: list[tuple[int, str]], total: int) -> None:
    """Describe tensor 'w' ([total, 4]) as chunks of rows stored where the tensors named in ``rows`` were saved."""
    def change(metadata) -> None:
        entry = metadata.state_dict_metadata["w"]
        entry.size = torch.Size([total, 4])
        entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([row, 0]), sizes=torch.Size([4, 4])) for row, _ in rows]
        storage = {index.fqn: where for index, where in metadata.storage_data.items()}
        for row, stored in rows:
            metadata.storage_data[MetadataIndex("w", torch.Size([row, 0]))] = storage[stored]

    _rewrite_metadata(folder, change)


def test_chunks_of_rows_saved_by_several_ranks_are_one_tensor_each_read_into_its_rows(tmp_path):
    parts = {"a": torch.randn(4, 4), "b": torch.randn(4, 4), "w": torch.zeros(4, 4)}
    folder = _save(dict(parts), tmp_path / "rows")
    _split_into_rows(folder, [(4, "b"), (0, "a")], total=8)

    loaded, report = mz.load_model(folder, dtype="fp64")

    assert torch.equal(loaded["w"], torch.cat([parts["a"], parts["b"]]).double())
    assert report.bytes_read == (16 + 16 + 32) * 4


@pytest.mark.parametrize("rows, total, words", [
    ([(0, "a"), (2, "b")], 6, "overlap at row 2"),
    ([(0, "a"), (6, "b")], 10, "leave a gap at row 4"),
    ([(0, "a"), (4, "b")], 12, "cover 8 of its 12 rows"),
])
def test_chunks_that_do_not_tile_their_tensor_are_refused_naming_it(tmp_path, rows, total, words):
    folder = _save({"a": torch.randn(4, 4), "b": torch.randn(4, 4), "w": torch.zeros(4, 4)}, tmp_path / "bad")
    _split_into_rows(folder, rows, total)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(folder)

    assert "tensor 'w'" in str(caught.value) and words in str(caught.value)


def test_a_metadata_pickle_that_calls_anything_is_refused_and_nothing_runs(tmp_path):
    folder = _save({"w": torch.randn(2, 2)}, tmp_path / "evil")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))

    with pytest.raises(mz.UnsafeCheckpointError, match="system"):
        mz.open_checkpoint(folder)
    assert not marker.exists()


def test_every_metadata_byte_flipped_is_refused_naming_the_folder_or_reads_saved_values(tmp_path):
    tensors = {"w": torch.randn(5, 3), "b": torch.arange(4), "s": torch.tensor(2.5, dtype=torch.bfloat16)}
    folder = _save({"model": dict(tensors)}, tmp_path / "swept")
    metadata = folder / ".metadata"
    base = metadata.read_bytes()
    saved = {raw_bytes(t) for t in tensors.values()}
    accepted = refused = 0
    for position in range(len(base)):
        damaged = bytearray(base)
        damaged[position] ^= 0x01
        metadata.write_bytes(bytes(damaged))
        try:
            loaded, _ = mz.load_tensors(folder)
        except mz.MaterializeError as error:
            assert str(folder) in str(error), (position, error)
            refused += 1
            continue
        accepted += 1
        assert all(raw_bytes(t) in saved for t in loaded.values()), position
    assert accepted and refused


@pytest.mark.parametrize("damage, error, words", [
    ("truncate", mz.CheckpointError, "runs past the end of the file"),
    ("outside", mz.CheckpointError, "not a file of this folder"),
    ("transformed", mz.UnsupportedFormatError, "stored transformed (zstd)"),
    ("wrong dtype", mz.CheckpointError, "the metadata says [3, 4] float16"),
])
def test_a_damaged_folder_is_one_error_naming_the_tensor(tmp_path, damage, error, words):
    folder = _save({"other": torch.randn(8), "w": torch.randn(3, 4)}, tmp_path / "damaged")
    data = next(folder.glob("*.distcp"))

    def change(metadata) -> None:
        where = next(w for index, w in metadata.storage_data.items() if index.fqn == "w")
        if damage == "outside":
            where.relative_path = "../elsewhere.distcp"
        elif damage == "transformed":
            where.transform_descriptors = ["zstd"]
        elif damage == "wrong dtype":
            metadata.state_dict_metadata["w"].properties.dtype = torch.float16

    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
    else:
        _rewrite_metadata(folder, change)

    with pytest.raises(error) as caught:
        mz.open_checkpoint(folder)

    assert "'w'" in str(caught.value) and words in str(caught.value)


def test_the_cli_inspects_and_loads_a_folder_and_refuses_tensor_parallel_chunks_in_one_line(tmp_path):
    folder = _save({"model": {"w": torch.randn(3, 4)}}, tmp_path / "ok")

    inspected = preforked.run([CLI, "inspect", str(folder), "--json"], capture_output=True, text=True)
    loaded = preforked.run([CLI, str(folder), "--json"], capture_output=True, text=True)

    assert inspected.returncode == 0, inspected.stderr
    summary = json.loads(inspected.stdout)
    assert summary["format"] == "dcp" and [t["name"] for t in summary["tensors"]] == ["w"]
    assert loaded.returncode == 0, loaded.stderr and json.loads(loaded.stdout)["bytes_read"] == 48


def test_an_fsdp2_training_save_loads_into_a_plain_model_and_back_into_a_sharded_one(tmp_path):
    folder = tmp_path / "fsdp-step"
    run_ranks("save_fsdp", folder, tmp_path / "save")
    source = reference_model(tie=True)
    ckpt = mz.open_checkpoint(folder)
    assert len(ckpt["model.embed_tokens.weight"].pieces) == 2  # one chunk of rows per rank

    plain = tiny_skeleton(tie=True)
    report = mz.load(plain, ckpt, check=True)

    for name, value in source.state_dict().items():
        assert torch.equal(plain.state_dict()[name], value), name
    model_bytes = report.bytes_read
    ranks = run_ranks("fsdp", folder, tmp_path / "load")
    for rank in ranks:
        assert all(rank["equal"].values()) and rank["forward_equal"] and rank["tied"]
    assert sum(rank["bytes_read"] for rank in ranks) == model_bytes  # each rank read its own rows, nothing twice


def test_a_tensor_parallel_save_loads_whole_and_back_into_a_tensor_parallel_model_chunk_by_chunk(tmp_path):
    from sharded_worker import reference_mlp

    folder = tmp_path / "tp-step"
    run_ranks("save_tp", folder, tmp_path / "save")
    source = reference_mlp()
    ckpt = mz.open_checkpoint(folder)
    assert [piece.box for piece in ckpt["down.weight"].pieces] == [((0, 0), (10, 6)), ((0, 6), (10, 6))]

    loaded, report = mz.load_model(folder, check=True)

    for name, value in source.state_dict().items():
        assert torch.equal(loaded[name], value), name
    whole = report.bytes_read
    ranks = run_ranks("tp", folder, tmp_path / "load")
    for rank in ranks:
        assert all(rank["equal"].values()) and rank["forward_equal"]
    bias = source.down.bias.numel() * 4  # replicated: both ranks read it
    assert sum(rank["bytes_read"] for rank in ranks) == whole + bias  # each rank read its own chunks, nothing more


def _split_into_blocks(folder: Path, blocks: list[tuple[tuple[int, int], str]]) -> None:
    """Describe tensor 'w' ([4, 8]) as 4x4 blocks stored where the tensors named in ``blocks`` were saved."""
    def change(metadata) -> None:
        entry = metadata.state_dict_metadata["w"]
        entry.size = torch.Size([4, 8])
        entry.chunks = [ChunkStorageMetadata(offsets=torch.Size(at), sizes=torch.Size([4, 4])) for at, _ in blocks]
        storage = {index.fqn: where for index, where in metadata.storage_data.items()}
        for at, stored in blocks:
            metadata.storage_data[MetadataIndex("w", torch.Size(at))] = storage[stored]

    _rewrite_metadata(folder, change)


def test_blocks_cut_along_columns_are_read_into_their_places(tmp_path):
    parts = {"a": torch.randn(4, 4), "b": torch.randn(4, 4), "w": torch.zeros(4, 4)}
    folder = _save(dict(parts), tmp_path / "cols")
    _split_into_blocks(folder, [((0, 4), "b"), ((0, 0), "a")])

    loaded, report = mz.load_model(folder, dtype="bf16")

    assert torch.equal(loaded["w"], torch.cat([parts["a"], parts["b"]], dim=1).bfloat16())


@pytest.mark.parametrize("blocks, words", [
    ([((0, 0), "a"), ((0, 2), "b")], "overlap: [0:4, 0:4] and [0:4, 2:6]"),
    ([((0, 0), "a")], "cover 16 of its 32 elements"),
])
def test_blocks_that_do_not_tile_their_tensor_are_refused_naming_it(tmp_path, blocks, words):
    folder = _save({"a": torch.randn(4, 4), "b": torch.randn(4, 4), "w": torch.zeros(4, 4)}, tmp_path / "bad")
    _split_into_blocks(folder, blocks)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(folder)

    assert "tensor 'w'" in str(caught.value) and words in str(caught.value)


@pytest.mark.parametrize("moved", [".metadata", "__0_0.distcp"])
def test_a_metadata_or_chunk_file_symlinked_out_of_the_folder_is_refused_naming_the_link(tmp_path, moved):
    folder = _save({"w": torch.randn(3, 4)}, tmp_path / "linked")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (folder / moved).rename(elsewhere / moved)
    (folder / moved).symlink_to(elsewhere / moved)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(folder)
    done = preforked.run([CLI, "convert", str(folder), str(tmp_path / "out")], capture_output=True, text=True)

    message = str(caught.value)
    assert f"'{moved}'" in message and str(elsewhere / moved) in message and "outside the checkpoint folder" in message
    assert done.returncode == 1 and done.stdout == "" and not (tmp_path / "out").exists()
    assert done.stderr.count("\n") == 1 and f"'{moved}'" in done.stderr and "outside the checkpoint folder" in done.stderr


def test_a_chunk_file_symlinked_within_the_folder_still_loads(tmp_path):
    tensors = {"w": torch.randn(3, 4), "b": torch.arange(5)}
    folder = _save(dict(tensors), tmp_path / "inside")
    (folder / "data").mkdir()
    (folder / "__0_0.distcp").rename(folder / "data" / "__0_0.distcp")
    (folder / "__0_0.distcp").symlink_to("data/__0_0.distcp")

    loaded, _ = mz.load_model(folder)

    for name, value in tensors.items():
        assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize("relative", ["../elsewhere/__0_0.distcp", "ABSOLUTE"])
def test_a_chunk_path_leading_out_of_the_folder_is_refused_and_convert_writes_nothing(tmp_path, relative):
    folder = _save({"w": torch.randn(3, 4)}, tmp_path / "escaping")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "__0_0.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())  # a real chunk file, outside
    relative = str(elsewhere / "__0_0.distcp") if relative == "ABSOLUTE" else relative

    def change(metadata) -> None:
        for where in metadata.storage_data.values():
            where.relative_path = relative

    _rewrite_metadata(folder, change)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.convert(folder, tmp_path / "out")

    assert f"'{relative}'" in str(caught.value) and "not a file of this folder" in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "escaping"]


def test_a_strided_shard_of_a_tensor_saved_in_blocks_reads_each_box_from_its_block(tmp_path):
    # FSDP2 over tensor parallel may give a rank several boxes; each is cut from the DCP chunks it meets.
    from types import SimpleNamespace

    from torch.distributed.tensor.placement_types import _StridedShard

    from materialize.integrations.sharded import ShardSpec, boxes_of, local_runs, shard_region
    from materialize.io.engine import Job, stream

    parts = {"a": torch.randn(4, 4), "b": torch.randn(4, 4), "w": torch.zeros(4, 4)}
    folder = _save(dict(parts), tmp_path / "cols")
    _split_into_blocks(folder, [((0, 0), "a"), ((0, 4), "b")])
    whole = torch.cat([parts["a"], parts["b"]], dim=1)
    placements = (_StridedShard(1, split_factor=2),)
    with mz.open_checkpoint(folder) as ckpt:
        for rank in range(2):
            runs = local_runs((4, 8), (2,), (rank,), placements)
            spec = ShardSpec(SimpleNamespace(device_type="cpu"), placements, boxes_of(runs), (4, 4), (4, 8), (8, 1))
            dest = torch.full((4, 4), float("nan"))

            stream([Job(dest, shard_region(ckpt["w"], spec))], ckpt.files, staging_factory=None)

            columns = [2 * rank, 2 * rank + 1, 4 + 2 * rank, 5 + 2 * rank]  # two from each block
            assert len(spec.boxes) == 2 and torch.equal(dest, whole[:, columns])
