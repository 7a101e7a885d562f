"""DTensor models (FSDP2, tensor parallel): each rank reads exactly its own shard of every tensor."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import materialize as mz
from materialize.checkpoint import TensorInfo
from materialize.checkpoint.targets import Deinterleave, StackSlot
from materialize.io.engine import Job, stream
from materialize.integrations.sharded import region
from materialize.planning.stacking import deinterleave, stack

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


def test_a_sharded_parameters_short_way_through_the_allocation_makes_the_general_ways_model(tmp_path):
    from sharded_worker import reference_mlp

    path = write_safetensors(saved_state(reference_model(tie=True)), tmp_path / "model.safetensors")
    write_safetensors(reference_mlp().state_dict(), tmp_path / "mlp.safetensors")

    ranks = run_ranks("short_way", path, tmp_path / "run")

    for rank in ranks:
        for kind in ("fsdp", "tp"):
            seen = rank[kind]
            assert seen["short_way_taken"] == seen["parameters"]  # every one (a tie counts once)
            assert seen["facts_differ"] == [] and seen["values_equal"] and seen["own_memory"]
            assert seen["reports_equal"] and seen["marked"]


def test_the_docs_fsdp2_resume_recipe_restores_the_optimizer_state_it_saved(tmp_path):
    folder = tmp_path / "job"
    folder.mkdir()

    ranks = run_ranks("resume_recipe", folder, tmp_path)

    for rank in ranks:
        assert rank["sharded"] and rank["params_equal"]
        assert rank["state_names"] == ["exp_avg", "exp_avg_sq", "step"] and rank["steps"] == [2.0]
        assert rank["state_equal"] and rank["param_groups_equal"] and rank["lr"] == [1e-2]  # the saved rate, not 3e-4
        assert rank["stepped_equal"]
    assert (folder / "checkpoints" / "step-100" / ".metadata").is_file()


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
        # The report says its sizes are this rank's, not the model's.
        assert rank["rank_share"] and "model size (this rank's share)" in rank["text"]
        assert "bytes read (by this rank)" in rank["text"]


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
        return ShardSpec(SimpleNamespace(device_type=mesh_type), (), (), (2,), (4,), (1,), local_device=local)

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


# --- _StridedShard: FSDP2 over tensor parallel on the same dimension (torchtitan's 2-D layout) ---------------------


def _torch_split(whole: torch.Tensor, mesh_shape, coordinate, placements) -> torch.Tensor:
    """What torch's own placements give the rank at ``coordinate`` (distribute_tensor's split, no communication).

    Torch 2.7 splits a ``_StridedShard`` only where its sizes divide evenly (an AssertionError else).
    """
    for mesh_dim, placement in enumerate(placements):
        if not placement.is_replicate():
            chunks, _ = placement._split_tensor(whole, mesh_shape[mesh_dim], with_padding=False, contiguous=False)
            whole = chunks[coordinate[mesh_dim]]
    return whole


def _placements(text: str) -> list:
    from sharded_worker import _placements as parse

    return parse(text)


def test_a_ranks_indices_under_strided_placements_are_torchs_own_split():
    import itertools
    import random

    from materialize.integrations.sharded import boxes_of, local_runs

    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        shape = tuple(rng.randint(0, 13) for _ in range(rng.randint(1, 3)))
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        words = [rng.choice(["R", f"S{rng.randrange(len(shape))}", f"SS{rng.randrange(len(shape))}/{rng.randint(1, 4)}"])
                 for _ in mesh]
        placements = _placements(" ".join(words))
        whole = torch.arange(math.prod(shape)).view(shape)
        coordinates = list(itertools.product(*(range(n) for n in mesh)))
        try:
            splits = [_torch_split(whole, mesh, coordinate, placements) for coordinate in coordinates]
        except AssertionError:  # an older torch has no meaning for these uneven sizes (the lock's has)
            continue
        checked += 1
        for coordinate, expected in zip(coordinates, splits):
            runs = local_runs(shape, mesh, coordinate, placements)
            got = torch.full(tuple(sum(n for _, n in dim) for dim in runs), -1)
            for box in boxes_of(runs):
                got[box.local] = whole[box.whole]
            assert torch.equal(got, expected), (shape, mesh, words, coordinate)
    assert checked > 200


def test_fsdp2_over_tensor_parallel_is_read_where_placements_and_fsdp2s_cut_agree_and_refused_where_not():
    # FSDP2 cuts its chunk of the model-parallel chunk; DTensor's placements read left to right. Wherever the
    # refusal rule lets a layout through, both give every rank the same rows; where they differ for some rank,
    # the rule refuses. Layouts: FSDP2 and HSDP over tensor parallel, FSDP2 over expert and tensor parallel.
    import itertools

    from materialize.integrations.sharded import ambiguous_split, local_runs
    from sharded_worker import _fsdp2_cut

    let_through = refused = 0
    for rows in range(0, 40):
        for mesh, words in [((2, 2), "SS0/2 S0"), ((3, 2), "SS0/2 S0"), ((2, 4), "SS0/4 S0"), ((2, 2, 2), "R SS0/2 S0"),
                            ((2, 2, 2), "SS0/4 S0 S0"), ((3, 2, 3), "SS0/6 S0 S0")]:
            placements = _placements(words)
            whole = torch.arange(rows)
            agree = all(  # local_runs is torch's split (the test above)
                torch.equal(_fsdp2_cut(whole, placements, mesh, c),
                            torch.cat([whole[s:s + n] for s, n in local_runs((rows,), mesh, c, placements)[0]]
                                      or [whole[:0]]))
                for c in itertools.product(*(range(n) for n in mesh)))
            if ambiguous_split((rows,), mesh, placements) is None:
                assert agree, (rows, mesh, words)
                let_through += 1
            else:
                refused += 1
    assert let_through > 0 and refused > 0


@pytest.mark.parametrize("form", ["safetensors", "torch transposed view", "stacked experts"])
@pytest.mark.parametrize("mesh, words", [
    ((2, 2), "SS0/2 S0"),  # torchtitan's colwise weights: one box
    ((2, 2), "SS0/3 R"),  # rows in runs
    ((3, 2), "R SS1/2"),  # columns in runs: strided reads
    ((2, 2, 2), "SS0/2 SS1/2 S0"),  # runs along two dimensions: four boxes
])
def test_each_box_of_a_strided_shard_is_read_into_its_place(tmp_path, form, mesh, words):
    import itertools
    from types import SimpleNamespace

    from materialize.integrations.sharded import ShardSpec, boxes_of, local_runs, shard_region

    torch.manual_seed(0)
    if form == "stacked experts":
        experts = {f"e{e}.{w}": torch.randn(3, 12) for e in range(2) for w in ("gate", "up")}
        path = write_safetensors(experts, tmp_path / "experts.safetensors")
        whole = torch.cat([torch.cat([experts[f"e{e}.gate"], experts[f"e{e}.up"]]) for e in range(2)])  # [12, 12]
    else:
        whole = torch.randn(12, 12)
        path = tmp_path / "m.pt"
        if form == "safetensors":
            path = write_safetensors({"w": whole}, tmp_path / "m.safetensors")
        else:
            torch.save({"w": whole.t().contiguous().t()}, path)  # a column-major save: a strided view in the file
    placements = _placements(words)
    with mz.open_checkpoint(path) as ckpt:
        if form == "stacked experts":
            source = stack("w", [(StackSlot("w", 0, 2 * e + g, new_dim=False), ckpt[f"e{e}.{w}"])
                                 for e in range(2) for g, w in enumerate(("gate", "up"))])
        else:
            source = ckpt["w"]
        for coordinate in itertools.product(*(range(n) for n in mesh)):
            runs = local_runs((12, 12), mesh, coordinate, placements)
            local_shape = tuple(sum(n for _, n in dim) for dim in runs)
            spec = ShardSpec(SimpleNamespace(device_type="cpu"), tuple(placements), boxes_of(runs), local_shape,
                             (12, 12), (12, 1))
            part = shard_region(source, spec)
            dest = torch.full(local_shape, float("nan"))
            stream([Job(dest, part)], ckpt.files, staging_factory=lambda device: pytest.fail("no staging on CPU"))

            assert torch.equal(dest, _torch_split(whole, mesh, coordinate, placements)), coordinate
            assert part.read_nbytes <= max(1, len(spec.boxes)) * whole.numel() * 4  # a box reads at most its span


def test_a_replayed_strided_shard_takes_each_of_its_boxes():
    import itertools
    from types import SimpleNamespace

    from materialize.integrations.sharded import ShardSpec, boxes_of, local_runs
    from materialize.io.replay import shard_box

    values = torch.randn(8, 9)
    mesh, placements = (2, 3), _placements("SS0/2 SS1/3")
    most_boxes = 0
    for coordinate in itertools.product(range(2), range(3)):
        runs = local_runs((8, 9), mesh, coordinate, placements)
        local = torch.full(tuple(sum(n for _, n in dim) for dim in runs), float("nan"))
        spec = ShardSpec(SimpleNamespace(device_type="cpu"), tuple(placements), boxes_of(runs), tuple(local.shape),
                         (8, 9), (9, 1))
        most_boxes = max(most_boxes, len(spec.boxes))
        shard_box(local, spec)(values)
        assert torch.equal(local, _torch_split(values, mesh, coordinate, placements)), coordinate
    assert most_boxes == 6  # two runs of rows by three of columns


def test_torchtitans_2d_layout_loads_on_4_ranks_as_its_own_path_makes_it_and_trains_the_same(tmp_path):
    state = saved_state(reference_model(tie=False))
    write_safetensors(state, tmp_path / "model.safetensors")
    torch.save(state, tmp_path / "model.pt")

    ranks = run_ranks("tp_fsdp", tmp_path, tmp_path / "run", world=4)

    colwise = ("embed_tokens", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
    for rank in ranks:
        for name, placements in rank["placements"].items():
            expected = (["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"] if any(c in name for c in colwise)
                        else ["Shard(dim=0)", "Shard(dim=1)"] if "o_proj" in name or "down_proj" in name
                        else ["Shard(dim=0)"])
            assert placements == expected, name
        for kind in ("safetensors", "torch", "dcp"):
            loaded = rank[kind]
            # Each local shard as to_empty + set_model_state_dict makes it, bit for bit, and whole as the file.
            assert loaded["equal"].keys() == state.keys() and all(loaded["equal"].values()), (kind, loaded["equal"])
            assert loaded["whole_equal"] and loaded["loaded"] == len(state), kind
            assert loaded["collectives"] == [], kind  # nothing communicated: every rank read its own bytes
        assert all(rank["dcp_load_equal"].values())  # torchtitan's DCP path makes the same model
        assert rank["probe"]  # the collective counter above sees a gather
        assert rank["losses"] == rank["reference_losses"] and all(rank["trained_equal"].values())

        # Bytes: whole rows are read as the rank's share (DCP: every tensor is); a row-wise tensor's columns
        # are read as the span of its rows.
        whole_rows = sum(s["local_bytes"] for n, s in rank["shares"].items() if rank["placements"][n][-1] != "Shard(dim=1)")
        spans = sum(((s["local_shape"][0] - 1) * s["shape"][1] + s["local_shape"][1]) * 4
                    for n, s in rank["shares"].items() if rank["placements"][n][-1] == "Shard(dim=1)")
        share = sum(s["local_bytes"] for s in rank["shares"].values())
        assert rank["dcp"]["bytes_read"] == share  # its chunks are cut as the shards are: exactly the rank's part
        for kind in ("safetensors", "torch"):
            assert share <= rank[kind]["bytes_read"] <= 1.1 * whole_rows + spans, kind


def test_strided_layouts_on_8_ranks_uneven_hand_made_tied_and_stacked_load_as_torch_places_them(tmp_path):
    from safetensors.torch import save_file

    from sharded_worker import OddMLP, UnevenTP

    torch.manual_seed(2)
    save_file(OddMLP().state_dict(), str(tmp_path / "odd.safetensors"))
    save_file(OddMLP(even=True).state_dict(), str(tmp_path / "even.safetensors"))
    save_file(UnevenTP().state_dict(), str(tmp_path / "uneven.safetensors"))
    zoo = {"w": torch.randn(12, 6), "v": torch.randn(7, 12), "a": torch.randn(16, 4)}
    zoo["b"] = zoo["a"].clone()
    zoo.update({f"experts.{e}.gate": torch.randn(3, 4) for e in range(3)})
    zoo.update({f"experts.{e}.up": torch.randn(5, 4) for e in range(3)})
    zoo.update({"fused.0.part": torch.randn(5, 4), "fused.1.part": torch.randn(3, 4)})
    save_file(zoo, str(tmp_path / "zoo.safetensors"))

    ranks = run_ranks("strided_zoo", tmp_path, tmp_path / "run", world=8)

    local_shapes = []
    # Older torch's fully_shard refuses uneven shards of tensor-parallel tensors (2.7.1 does); the lock's makes them.
    even_only = ranks[0]["even_only"]
    old_torch = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
    assert old_torch or not even_only
    for rank in ranks:
        assert rank["even_only"] == even_only
        odd = rank["odd"]  # HSDP over tensor parallel, FSDP2's shards uneven (where this torch makes them)
        assert odd["placements"]["up.weight"] == ["Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
        assert all(odd["local_equal"].values()) and odd["collectives"] == []
        assert odd["trains"] or old_torch  # torch 2.7's HSDP cannot average gradients over gloo
        if odd["trains"]:
            assert odd["losses"][0] == pytest.approx(odd["losses"][1], rel=1e-6) and all(odd["trained_close"].values())
        local_shapes.append(odd["local_shapes"]["up.weight"])
        assert all(rank["odd_materialized"].values())  # recorded, then materialized: eager construction's values

        uneven = rank["uneven"]  # tensor parallel over 13 rows: refused on every rank, both tensors named
        if even_only:
            assert uneven is None
            continue
        assert uneven["error"] == "ShardingError" and uneven["left_as_was"]
        assert "2 DTensor(s)" in uneven["message"] and "'up.weight', 'up.bias' (_StridedShard(dim=0, sf=2)" in uneven["message"]
        assert uneven["message"].endswith("load the model before sharding it")
        assert all(uneven["loaded_then_sharded"].values())  # the remedy it gives works

        made = rank["zoo"]  # several boxes per rank, a tie, stacked experts, a fused tensor
        assert all(count == 2 for count in made["boxes"].values()) and all(made["local_equal"].values()) and made["tied"]
        assert rank["mismatched_local"] == (
            f"{tmp_path / 'zoo.safetensors'}: tensor 'w': is a DTensor placed [Shard(dim=0), Replicate(), Replicate()] "
            "whose local shape is [5, 6] on this rank, where the placements give [6, 6]: this torch shards in a way "
            "not understood here; load the model before sharding it")
    assert sorted({tuple(s) for s in local_shapes}) == ([(2, 16)] if even_only else [(2, 16), (3, 16)])
