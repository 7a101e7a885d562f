"""DTensor models (FSDP2, tensor parallel): each rank reads exactly its own shard of every tensor."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import materialize as mz
from materialize.checkpoint import TensorInfo
from materialize.io.engine import Job, stream
from materialize.integrations.sharded import region
from materialize.planning.stacking import Deinterleave, StackSlot, deinterleave, stack

from conftest import reference_model, run_ranks, saved_state, write_safetensors

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")

def _read(ckpt: mz.Checkpoint, info: TensorInfo) -> torch.Tensor:
    dest = torch.empty(info.shape, dtype=info.dtype)
    stream([Job(dest, info)], ckpt.files, staging_factory=lambda device: pytest.fail("no staging on CPU"))
    return dest


@pytest.mark.parametrize("shape, offsets, sizes, contiguous", [
    ((8, 6), (2, 0), (3, 6), True),  # FSDP2's Shard(0): a range of rows is one run of the file
    ((8, 6), (0, 3), (8, 3), False),  # row-wise parallel Shard(1): every row's right half
    ((4, 6, 5), (0, 2, 0), (4, 2, 5), False),  # a middle dimension
    ((4, 6, 5), (1, 3, 2), (2, 2, 3), False),  # two mesh dimensions sharding two dimensions
    ((1, 6, 5), (0, 2, 0), (1, 3, 5), True),  # a leading dimension of one: still one run
    ((8, 6), (8, 0), (0, 6), True),  # an empty shard (more ranks than rows)
])
def test_a_box_of_a_checkpoint_tensor_reads_those_values(tmp_path, shape, offsets, sizes, contiguous):
    value = torch.randn(shape)
    path = write_safetensors({"before": torch.ones(3), "w": value}, tmp_path / "m.safetensors")
    box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))

    with mz.open_checkpoint(path) as ckpt:
        part = region(ckpt["w"], offsets, sizes)
        assert part.contiguous == contiguous and part.name == "w" and part.shape == sizes
        assert part.read_nbytes <= ckpt["w"].nbytes
        assert torch.equal(_read(ckpt, part), value[box])


def test_a_box_of_a_strided_view_in_a_torch_file_reads_those_values(tmp_path):
    base = torch.randn(6, 8)
    path = tmp_path / "m.pt"
    torch.save({"t": base.t(), "base": base}, path)  # one storage, 't' a transposed view of it

    with mz.open_checkpoint(path) as ckpt:
        assert not ckpt["t"].contiguous
        part = region(ckpt["t"], (4, 0), (4, 6))

        assert torch.equal(_read(ckpt, part), base.t()[4:8])


def test_a_rearranged_source_cannot_be_sharded_and_the_error_names_it(tmp_path):
    path = write_safetensors({"w": torch.randn(8, 6)}, tmp_path / "m.safetensors")
    with mz.open_checkpoint(path) as ckpt:
        rearranged = deinterleave(ckpt["w"], Deinterleave(dim=0))

        with pytest.raises(mz.ShardingError, match="tensor 'w'.*rearranged"):
            region(rearranged, (0, 0), (4, 6))


def _piece_info(name: str, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo(name=name, dtype_name="float32", itemsize=4, shape=shape, path=Path("x.safetensors"), offset=0)


def test_rows_of_a_stacked_tensor_keep_the_pieces_within_and_cut_the_one_crossing():
    parts = [(StackSlot("fused", 0, group, new_dim=False), _piece_info(f"p{group}", (rows, 4)))
             for group, rows in enumerate((5, 3))]
    fused = stack("fused", parts)

    first, second = region(fused, (0, 0), (4, 4)), region(fused, (4, 0), (4, 4))

    assert [(p.info.name, p.info.shape, p.info.offset, p.box) for p in first.pieces] == [
        ("p0", (4, 4), 0, ((0, 0), (4, 4)))]
    assert [(p.info.name, p.info.shape, p.info.offset, p.box) for p in second.pieces] == [
        ("p0", (1, 4), 4 * 4 * 4, ((0, 0), (1, 4))), ("p1", (3, 4), 0, ((1, 0), (3, 4)))]


def test_experts_stacked_gate_and_up_sharded_along_any_dimension_read_those_values(tmp_path):
    experts = {f"e{e}.{w}": torch.randn(3, 4) for e in range(2) for w in ("gate", "up")}
    path = write_safetensors(experts, tmp_path / "experts.safetensors")
    whole = torch.stack([torch.cat([experts[f"e{e}.gate"], experts[f"e{e}.up"]]) for e in range(2)])  # [2, 6, 4]
    with mz.open_checkpoint(path) as ckpt:
        gate_up = stack("gate_up", [(StackSlot("gate_up", e, g), ckpt[f"e{e}.{w}"])
                                    for e in range(2) for g, w in enumerate(("gate", "up"))])
        for offsets, sizes in [((1, 0, 0), (1, 6, 4)), ((0, 2, 0), (2, 3, 4)), ((0, 0, 1), (2, 6, 2))]:
            part = region(gate_up, offsets, sizes)
            dest = torch.full(sizes, float("nan"))
            stream([Job(dest, part)], ckpt.files, staging_factory=lambda device: pytest.fail("no staging on CPU"))

            assert torch.equal(dest, whole[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]), offsets


@pytest.mark.parametrize("start, numel, shape, box", [
    (24, 12, (3, 6, 4), ((1, 0, 0), (1, 3, 4))),  # expert 1's gate rows
    (36, 12, (3, 6, 4), ((1, 3, 0), (1, 3, 4))),  # its up rows
    (20, 12, (8, 4), ((5, 0), (3, 4))),
    (0, 96, (4, 6, 4), ((0, 0, 0), (4, 6, 4))),
    (20, 8, (8, 6), None),  # crosses a row boundary without covering whole rows
])
def test_a_run_of_a_stacked_tensor_is_placed_as_its_block(start, numel, shape, box):
    from materialize.integrations.sharded import _run_as_box

    assert _run_as_box(start, numel, shape) == box
def test_fsdp2_model_sharded_on_meta_loads_each_rank_its_rows_and_trains(tmp_path):
    source = reference_model(tie=True)
    state = saved_state(source)
    path = write_safetensors(state, tmp_path / "model.safetensors")

    ranks = run_ranks("fsdp", path, tmp_path)

    for rank in ranks:
        assert all(rank["equal"].values()) and rank["equal"].keys() == {n for n, _ in source.named_parameters()}
        assert all(p == ["Shard(dim=0)"] for p in rank["placements"].values())
        assert rank["forward_equal"] and rank["tied"] and rank["trained_finite"]
    # Every byte of the checkpoint was read by exactly one rank: none read a whole tensor.
    assert sum(rank["bytes_read"] for rank in ranks) == sum(t.numel() * t.element_size() for t in state.values())


def test_fsdp2_blocks_wrapped_for_activation_checkpointing_load_a_plain_checkpoint(tmp_path):
    source = reference_model(tie=True)
    state = saved_state(source)
    path = write_safetensors(state, tmp_path / "model.safetensors")

    ranks = run_ranks("fsdp_wrapped", path, tmp_path)

    wrapped = {re.sub(r"(layers\.\d+)\.", r"\1._checkpoint_wrapped_module.", n) for n, _ in source.named_parameters()}
    for rank in ranks:
        assert rank["equal"].keys() == wrapped and all(rank["equal"].values())
        assert rank["forward_equal"] and rank["grads"]
    assert sum(rank["bytes_read"] for rank in ranks) == sum(t.numel() * t.element_size() for t in state.values())


def test_fsdp2_mixed_precision_keeps_its_fp32_master_weights_from_a_bf16_checkpoint(tmp_path):
    from sharded_worker import reference_mlp

    path = write_safetensors({k: v.to(torch.bfloat16) for k, v in reference_mlp().state_dict().items()},
                             tmp_path / "bf16.safetensors")

    ranks = run_ranks("fsdp_mixed", path, tmp_path)

    for rank in ranks:
        assert rank["dtypes"] == ["torch.float32"] and all(rank["equal"].values()) and rank["stepped"]


def test_tensor_parallel_model_reads_column_and_row_shards_with_a_cast(tmp_path):
    from sharded_worker import reference_mlp

    state = reference_mlp().state_dict()
    path = tmp_path / "mlp.pt"
    torch.save(state, path)

    ranks = run_ranks("tp", path, tmp_path)

    whole = sum(t.numel() * t.element_size() for t in state.values())
    for rank in ranks:
        assert all(rank["equal"].values()) and rank["forward_equal"]
        assert rank["placements"]["down.weight"] == ["Shard(dim=1)"] and rank["placements"]["down.bias"] == ["Replicate()"]
        assert rank["bytes_read"] < whole


def test_stacked_and_concatenated_tensors_shard_by_rows_across_their_pieces(tmp_path):
    torch.manual_seed(3)
    tensors = {f"experts.{e}.{w}": torch.randn(3, 4) + 10 * e for e in range(3) for w in ("gate", "up")}
    tensors.update({"fused.0.part": torch.randn(5, 4), "fused.1.part": torch.randn(3, 4)})
    path = tmp_path / "stacked.safetensors"
    save_file(tensors, path)

    ranks = run_ranks("stacked", path, tmp_path)

    assert all(all(rank["equal"].values()) for rank in ranks)
    assert [rank["local_rows"] for rank in ranks] == [{"gate_up": 2, "fused": 4}, {"gate_up": 1, "fused": 4}]
    assert sum(rank["bytes_read"] for rank in ranks) == sum(t.numel() * 4 for t in tensors.values())


def test_a_partial_dtensor_is_refused_naming_it_and_the_model_is_left_as_it_was(tmp_path):
    from sharded_worker import reference_mlp

    path = tmp_path / "mlp.pt"
    torch.save(reference_mlp().state_dict(), path)

    ranks = run_ranks("partial", path, tmp_path)

    for rank in ranks:
        assert rank["error"] == "ShardingError" and rank["left_as_was"]
        assert rank["message"].startswith(f"{path}: 2 DTensor(s)") and "Partial" in rank["message"]
        assert "'up.weight'" in rank["message"] and "'down.weight'" in rank["message"]  # every one, not the first


def test_a_sharded_tie_the_checkpoint_holds_apart_is_refused_on_every_rank_naming_it(tmp_path):
    state = saved_state(reference_model(tie=False))  # a head of its own: differs in every rank's rows
    path = write_safetensors(state, tmp_path / "own_head.safetensors")

    ranks = run_ranks("fsdp_own_head", path, tmp_path)

    for rank in ranks:
        assert rank["error"] == "ShardingError" and rank["left_as_was"], rank
        assert rank["message"].startswith(f"{path}: ") and "'model.embed_tokens.weight'" in rank["message"]
        assert "lm_head.weight" in rank["message"] and "different values" in rank["message"]


def test_a_sharded_tie_differing_in_one_ranks_rows_only_is_refused_on_every_rank(tmp_path):
    state = saved_state(reference_model(tie=True))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    state["lm_head.weight"][-1] += 1  # the last rank's rows differ; the first rank's are equal
    path = write_safetensors(state, tmp_path / "last_row_differs.safetensors")

    ranks = run_ranks("fsdp_own_head", path, tmp_path)

    for rank in ranks:  # the first rank going on alone would hang at its next collective
        assert rank["error"] == "ShardingError" and rank["left_as_was"], rank
        assert "lm_head.weight" in rank["message"] and "different values" in rank["message"]


def test_a_real_shard_is_filled_where_it_lives_not_on_the_current_device():
    # A rank that never called torch.cuda.set_device has current device 0; its real shard on GPU 1 stays there.
    from types import SimpleNamespace

    from materialize.integrations.sharded import ShardSpec

    def spec(mesh_type: str, local: torch.device) -> ShardSpec:
        return ShardSpec(SimpleNamespace(device_type=mesh_type), (), (0,), (2,), (4,), (1,), local_device=local)

    assert spec("cuda", torch.device("cuda", 1)).device == torch.device("cuda", 1)  # no CUDA call made
    assert spec("cpu", torch.device("meta")).device == torch.device("cpu")  # on meta: the mesh's device


def test_fsdp2_over_a_recorded_model_replays_each_rank_its_rows_of_a_missing_tensor(tmp_path):
    # Without a recording, each rank would initialize its shard from the same random state (one block
    # repeated); replayed, each rank holds its rows of what eager construction made.
    source = reference_model(tie=False)
    state = saved_state(source)
    del state["lm_head.weight"]
    path = write_safetensors(state, tmp_path / "model.safetensors")

    ranks = run_ranks("fsdp_replayed", path, tmp_path)

    for rank in ranks:
        assert rank["equal"].keys() == {n for n, _ in source.named_parameters()} and all(rank["equal"].values()), rank
        assert "lm_head.weight" in rank["replayed"]
        assert rank["head_local_rows"][0] == source.lm_head.weight.shape[0] // 2
    assert sum(rank["bytes_read"] for rank in ranks) == sum(t.numel() * t.element_size() for t in state.values())


def test_a_recorded_model_made_tensor_parallel_materializes_each_rank_its_columns_and_rows(tmp_path):
    from sharded_worker import reference_mlp

    ranks = run_ranks("tp_materialized", tmp_path / "unused", tmp_path)

    source = reference_mlp()
    for rank in ranks:
        assert rank["equal"].keys() == {n for n, _ in source.named_parameters()} and all(rank["equal"].values()), rank
        assert rank["placements"]["up.weight"] == ["Shard(dim=0)"] and rank["placements"]["down.weight"] == ["Shard(dim=1)"]
        assert rank["local_shapes"]["up.weight"] == [6, 16] and rank["local_shapes"]["down.weight"] == [10, 6]
