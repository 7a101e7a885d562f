"""Stacked and cut sources: checkpoint tensors that are blocks of a model tensor, or model tensors that are runs of one."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

import materialize as mz
from materialize.checkpoint import TensorInfo
from materialize.checkpoint.targets import Chunks, Deinterleave, Rearranged, StackSlot, Transposed
from materialize.loading import execute
from materialize.options import PlanOptions, ReadOptions
from materialize.planning.plan import make_plan
from materialize.planning.stacking import cut, deinterleave, stack, transpose

from conftest import write_safetensors

FILE = Path("experts.safetensors")


def _info(name: str, shape: tuple[int, ...], dtype: str = "float32", offset: int = 0) -> TensorInfo:
    return TensorInfo(name=name, dtype_name=dtype, itemsize=torch.finfo(getattr(torch, dtype)).bits // 8,
                      shape=shape, path=FILE, offset=offset)


def test_blocks_are_laid_out_expert_by_expert_groups_in_order():
    slots = [(StackSlot("up", index, group), _info(f"e{index}.g{group}", (2 + group, 3)))
             for index in (1, 0) for group in (1, 0)]

    stacked = stack("up", slots)

    assert stacked.shape == (2, 5, 3)
    assert [(p.info.name, p.start) for p in stacked.pieces] == [("e0.g0", 0), ("e0.g1", 6), ("e1.g0", 15), ("e1.g1", 21)]
    assert stacked.read_nbytes == 2 * 5 * 3 * 4


@pytest.mark.parametrize("slots, words", [
    ([(StackSlot("t", 0, 0), _info("a", (2, 3))), (StackSlot("t", 2, 0), _info("c", (2, 3)))], "lacks number 1"),
    ([(StackSlot("t", 0, 0), _info("a", (2, 3))), (StackSlot("t", 0, 0), _info("b", (2, 3)))], "same place as 'a'"),
    ([(StackSlot("t", 0, 0), _info("a", (2, 3))), (StackSlot("t", 1, 0), _info("b", (2, 4)))], "'a', stacked into 't'"),
    ([(StackSlot("t", 0, 0), _info("a", (2, 3))), (StackSlot("t", 1, 0), _info("b", (2, 3), "bfloat16"))], "bfloat16"),
    ([(StackSlot("t", 0, 0), _info("a", (2, 3))), (StackSlot("t", 0, 1), _info("b", (2, 4)))], "cannot be concatenated"),
    ([(StackSlot("t", 0, 0, ".x.*.up"), _info("a", (2, 3))), (StackSlot("t", 0, 1, ".x.*.gate"), _info("b", (2, 3))),
      (StackSlot("t", 1, 0, ".x.*.up"), _info("c", (2, 3)))], "number 1 of '.x.*.gate'"),
])
def test_pieces_that_do_not_fit_together_are_refused_naming_one(slots, words):
    with pytest.raises(mz.CheckpointError) as caught:
        stack("t", slots)

    assert words in str(caught.value) and str(FILE) in str(caught.value)


def test_a_key_map_can_stack_tensors_of_a_real_file_into_a_plain_model(tmp_path):
    experts = {f"experts.{e}.{w}": torch.randn(3, 4) + 10 * e for e in range(3) for w in ("gate", "up")}
    path = write_safetensors(experts, tmp_path / "experts.safetensors")
    model = torch.nn.Module()
    model.register_parameter("gate_up", torch.nn.Parameter(torch.empty(3, 6, 4, device="meta")))

    def to_slot(name: str) -> StackSlot:
        _, number, which = name.split(".")
        return StackSlot("gate_up", int(number), ("gate", "up").index(which))

    with mz.open_checkpoint(path) as ckpt:
        plan = make_plan(model, ckpt, PlanOptions(device=torch.device("cpu"), key_map=to_slot))
        report = execute(plan, ckpt, ReadOptions(check=True))

    for e in range(3):
        assert torch.equal(model.gate_up[e], torch.cat([experts[f"experts.{e}.gate"], experts[f"experts.{e}.up"]]))
    assert report.bytes_read == 3 * 2 * 3 * 4 * 4


def test_concatenated_without_a_new_dimension_the_groups_follow_each_other():
    slots = [(StackSlot("conv", 0, group, new_dim=False), _info(f"g{group}", (2 + group, 3))) for group in (2, 0, 1)]

    stacked = stack("conv", slots)

    assert stacked.shape == (9, 3)
    assert [(p.info.name, p.start) for p in stacked.pieces] == [("g0", 0), ("g1", 6), ("g2", 15)]


@pytest.mark.parametrize("total, parts", [(7, 3), (6, 3), (2, 3), (0, 2), (5, 1)])
def test_chunks_are_cut_as_torch_chunk_cuts(total, parts):
    info = _info("qkv", (total, 4), offset=100)
    targets = tuple(f"t{i}" for i in range(parts))
    expected = torch.arange(total * 4).view(total, 4).chunk(parts) if total else [torch.empty(0, 4)] * parts

    pieces = cut(info, Chunks(targets))

    assert [target for target, _ in pieces] == list(targets[: len(expected)])
    first = 0
    for (_, piece), reference in zip(pieces, expected):
        assert piece.shape == tuple(reference.shape)
        assert piece.offset == 100 + first * 4 * 4
        assert piece.name == f"qkv[{first}:{first + len(reference)}]"
        first += len(reference)


def test_rows_given_per_target_cut_unevenly():
    pieces = cut(_info("qkv", (8, 2)), Chunks(("q", "k", "v"), rows=(4, 2, 2)))

    assert [(t, p.name, p.shape, p.offset) for t, p in pieces] == [
        ("q", "qkv[0:4]", (4, 2), 0), ("k", "qkv[4:6]", (2, 2), 32), ("v", "qkv[6:8]", (2, 2), 48)]


@pytest.mark.parametrize("info, chunks, words", [
    (_info("qkv", (8, 2)), Chunks(("q", "k"), rows=(4, 2)), "has 8 rows, but 'q', 'k' take 4 + 2"),
    (_info("scale", ()), Chunks(("a", "b")), "is a scalar and cannot be cut into 'a', 'b'"),
    (TensorInfo(name="qkv", dtype_name="float32", itemsize=4, shape=(4, 4), path=FILE, offset=0, stride=(1, 4),
                span_nbytes=64), Chunks(("a", "b")), "is a strided view"),
])
def test_what_cannot_be_cut_is_refused_naming_the_tensor(info, chunks, words):
    with pytest.raises(mz.CheckpointError) as caught:
        cut(info, chunks)

    assert words in str(caught.value) and info.name in str(caught.value) and str(FILE) in str(caught.value)


def _fused_model() -> torch.nn.Module:
    model = torch.nn.Module()
    for name, rows in (("q", 4), ("k", 2), ("v", 2)):
        model.register_parameter(name, torch.nn.Parameter(torch.empty(rows, 3, device="meta")))
    return model


@pytest.mark.parametrize("how", [{}, {"mmap": True}, {"dtype": torch.float64}])
def test_a_key_map_can_cut_a_fused_tensor_of_a_real_file_into_a_plain_model(tmp_path, how):
    fused = torch.randn(8, 3)
    path = write_safetensors({"qkv": fused, "extra": torch.randn(5)}, tmp_path / "fused.safetensors")
    model = _fused_model()

    def key_map(name: str):
        return Chunks(("q", "k", "v"), rows=(4, 2, 2)) if name == "qkv" else name

    report = mz.load(model, path, key_map=key_map, strict=False, check=not how.get("mmap"), **how)

    for name, rows in (("q", slice(0, 4)), ("k", slice(4, 6)), ("v", slice(6, 8))):
        assert torch.equal(getattr(model, name), fused[rows].to(getattr(model, name).dtype)), name
    assert report.unexpected == ["extra"]
    assert sorted(report.mapped) == (["k", "q", "v"] if how.get("mmap") else [])


def test_a_fused_tensor_that_is_too_short_is_one_error_naming_it(tmp_path):
    path = write_safetensors({"qkv": torch.randn(6, 3)}, tmp_path / "fused.safetensors")

    with pytest.raises(mz.CheckpointError) as caught:
        mz.load(_fused_model(), path, key_map=lambda name: Chunks(("q", "k", "v"), rows=(4, 2, 2)))

    assert "qkv" in str(caught.value)
    assert "has 6 rows, but 'q', 'k', 'v' take 4 + 2 + 2" in str(caught.value) and str(path) in str(caught.value)


def test_a_transposed_source_is_a_strided_view_of_the_same_bytes():
    info = _info("experts", (4, 3, 5), offset=64)

    swapped = transpose(info, Transposed("t", 1, 2))

    reference = torch.empty(4, 3, 5).transpose(1, 2)
    assert swapped.shape == tuple(reference.shape) and swapped.stride == reference.stride()
    assert swapped.offset == 64 and swapped.span_nbytes == info.nbytes and not swapped.contiguous
    assert transpose(info, Transposed("t", 1, 2, unless_shape=(4, 3, 5))) is info  # already the model's layout


@pytest.mark.parametrize("info, swap, words", [
    (_info("w", (3, 5)), Transposed("t", 0, 2), "has 2 dimensions and cannot have 0 and 2 swapped"),
    (TensorInfo(name="w", dtype_name="float32", itemsize=4, shape=(4, 4), path=FILE, offset=0, stride=(1, 4),
                span_nbytes=64), Transposed("t", 0, 1), "is a strided view"),
])
def test_what_cannot_be_transposed_is_refused_naming_it(info, swap, words):
    with pytest.raises(mz.CheckpointError) as caught:
        transpose(info, swap)

    assert words in str(caught.value) and "'w'" in str(caught.value)


@pytest.mark.parametrize("dtype", [None, torch.float64])
def test_a_key_map_can_transpose_a_real_files_tensor_block_by_block(tmp_path, monkeypatch, dtype):
    from materialize.io import engine

    saved = torch.randn(5, 7, 3)
    path = write_safetensors({"experts": saved}, tmp_path / "t.safetensors")
    model = torch.nn.Module()
    model.register_parameter("experts", torch.nn.Parameter(torch.empty(5, 3, 7, device="meta")))
    monkeypatch.setattr(engine, "STRIDED_BLOCK_BYTES", 100)  # one expert (84 bytes) per block

    seen = []

    mz.load(model, path, key_map=lambda name: Transposed(name, 1, 2), dtype=dtype, check=True,
            progress=lambda done, total: seen.append((done, total)))

    assert torch.equal(model.experts, saved.transpose(1, 2).to(model.experts.dtype))
    assert len(seen) >= 5 and seen[-1] == (saved.numel() * 4, saved.numel() * 4)  # a block at a time, to the end


def _interleaved(tensor: torch.Tensor, dim: int, inverse: bool) -> torch.Tensor:
    """transformers' Interleave, written out: split ``dim`` in two, swap, reshape back."""
    shape = list(tensor.shape)
    size = shape[dim]
    shape[dim:dim + 1] = [2, size // 2] if inverse else [size // 2, 2]
    return tensor.reshape(shape).transpose(dim, dim + 1).reshape(tensor.shape)


def _rope_permuted(tensor: torch.Tensor, heads: int, inverse: bool) -> torch.Tensor:
    """transformers' PermuteForRope, written out: per head, interleaved rotary pairs to halves."""
    rows = tensor.shape[0]
    head = (2, rows // heads // 2) if inverse else (rows // heads // 2, 2)
    return tensor.reshape(heads, *head, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def _one_parameter_model(shape: tuple[int, ...]) -> torch.nn.Module:
    model = torch.nn.Module()
    model.register_parameter("w", torch.nn.Parameter(torch.empty(shape, device="meta")))
    return model


@pytest.mark.parametrize("rows_from", [1, None], ids=["rows-scattered", "rows-as-built"])
@pytest.mark.parametrize("how", [{}, {"dtype": torch.float64}, {"mmap": True}, {"direct_io": True}])
@pytest.mark.parametrize("shape, rearrange", [
    ((6, 8, 5), Deinterleave(dim=1)),  # Inkling's experts: gate and up rows interleaved
    ((6, 8, 5), Deinterleave(dim=1, inverse=True)),
    ((12, 5), Deinterleave(dim=0)),
    ((3, 4, 10), Deinterleave(dim=-1)),
    ((24, 7), Deinterleave(dim=0, groups=3, ranks=(1, 2))),  # RoPE pairs of 3 heads
    ((24, 7), Deinterleave(dim=0, groups=3, inverse=True, ranks=(1, 2))),
    ((24,), Deinterleave(dim=0, groups=3, ranks=(1, 2))),  # a bias
    ((2, 24, 7), Deinterleave(dim=0, groups=2, ranks=(1, 2))),  # a rank it leaves alone
])
def test_a_rearranged_tensor_of_a_real_file_equals_the_conversion(tmp_path, monkeypatch, shape, rearrange, how,
                                                                  rows_from):
    from materialize.io import engine
    from materialize.io import scatter

    saved = torch.randn(shape)
    if rearrange.groups > 1:
        expected = saved if saved.dim() not in rearrange.ranks else _rope_permuted(saved, rearrange.groups, rearrange.inverse)
    else:
        expected = _interleaved(saved, rearrange.dim % saved.dim(), rearrange.inverse)
    path = write_safetensors({"fused": saved}, tmp_path / "r.safetensors")
    model = _one_parameter_model(shape)
    monkeypatch.setattr(engine, "STRIDED_BLOCK_BYTES", 64)  # many blocks
    if rows_from is not None:
        monkeypatch.setattr(scatter, "MIN_ROW_BYTES", rows_from)  # rows of any length read into place
    scattered = []
    monkeypatch.setattr(engine, "row_scatter", lambda *args: scattered.append(scatter.row_scatter(*args)) or scattered[-1])

    mz.load(model, path, key_map=lambda name: Rearranged("w", rearrange), check=True, **how)

    assert model.w.shape == saved.shape and model.w.is_contiguous()
    assert torch.equal(model.w, expected.to(model.w.dtype))
    moves = not torch.equal(expected, saved)
    if rows_from is not None and moves and not how:  # a cast, or O_DIRECT's bounce buffer, reads in blocks
        assert any(found is not None for found in scattered)


@pytest.mark.parametrize("dim", [0, 1])
def test_interleaved_halves_cut_from_a_real_file_equal_interleave_then_chunk(tmp_path, dim):
    saved = torch.randn(6, 10)
    gate, up = torch.chunk(_interleaved(saved, dim, inverse=False), 2, dim=dim)
    path = write_safetensors({"w13": saved}, tmp_path / "h.safetensors")
    model = torch.nn.Module()
    for name, part in (("gate", gate), ("up", up)):
        model.register_parameter(name, torch.nn.Parameter(torch.empty(part.shape, device="meta")))

    mz.load(model, path, key_map=lambda name: Chunks(("gate", "up"), interleaved=Deinterleave(dim=dim)), check=True)

    assert torch.equal(model.gate, gate) and torch.equal(model.up, up)


def test_parts_of_a_cut_are_each_rearranged_or_not(tmp_path):
    heads = 2
    fused = torch.randn(3 * 8, 5)  # q, k and v of 8 rows each
    q, k, v = torch.chunk(fused, 3)
    path = write_safetensors({"wqkv": fused}, tmp_path / "qkv.safetensors")
    model = torch.nn.Module()
    for name in "qkv":
        model.register_parameter(name, torch.nn.Parameter(torch.empty(8, 5, device="meta")))
    rope = Deinterleave(groups=heads, ranks=(1, 2))

    mz.load(model, path, key_map=lambda name: Chunks(("q", "k", "v"), rearrange=(rope, rope, None)))

    assert torch.equal(model.q, _rope_permuted(q, heads, False)) and torch.equal(model.k, _rope_permuted(k, heads, False))
    assert torch.equal(model.v, v)


@pytest.mark.parametrize("info, how, words", [
    (_info("w", (10, 3)), Deinterleave(dim=0, groups=3), "has 10 elements along dimension 0, which cannot be rearranged as pairs in 3 blocks"),
    (_info("w", (7, 3)), Deinterleave(dim=0), "has 7 elements along dimension 0"),
    (_info("w", (4, 3)), Deinterleave(dim=2), "has 2 dimensions and cannot be rearranged along dimension 2"),
])
def test_what_cannot_be_rearranged_is_refused_naming_it(info, how, words):
    with pytest.raises(mz.CheckpointError) as caught:
        deinterleave(info, how)

    assert words in str(caught.value) and "'w'" in str(caught.value) and str(FILE) in str(caught.value)


def test_a_rearranged_source_reads_the_same_bytes_under_another_shape():
    info = _info("w", (4, 6), offset=128)

    rearranged = deinterleave(info, Deinterleave(dim=1))

    assert rearranged.shape == (4, 6) and rearranged.view_shape == (4, 1, 2, 3)
    assert rearranged.offset == 128 and rearranged.read_nbytes == info.nbytes and not rearranged.contiguous
    assert deinterleave(_info("w", (4, 2)), Deinterleave(dim=1)) == _info("w", (4, 2))  # one pair: nothing moves


@pytest.mark.parametrize("shape", [(3, 4, 5), (4, 5)])
def test_tensors_concatenated_along_their_second_dimension_are_read_row_by_row(tmp_path, shape):
    gate, up = torch.randn(shape), torch.randn(shape)
    joined = torch.cat([gate, up], dim=1)
    path = write_safetensors({"gate": gate, "up": up}, tmp_path / "g.safetensors")
    model = _one_parameter_model(tuple(joined.shape))

    def key_map(name: str) -> StackSlot:
        return StackSlot("w", 0, ["gate", "up"].index(name), pattern=name, new_dim=False, along_rows=True)

    report = mz.load(model, path, key_map=key_map, dtype=torch.float64, check=True)

    assert torch.equal(model.w, joined.double())
    assert report.loaded == ["w"]


def test_a_vector_cannot_be_concatenated_along_its_second_dimension(tmp_path):
    path = write_safetensors({"gate": torch.randn(4), "up": torch.randn(4)}, tmp_path / "v.safetensors")
    slot = StackSlot("w", 0, 0, new_dim=False, along_rows=True)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.load(_one_parameter_model((8,)), path, key_map=lambda name: slot)

    assert "cannot be concatenated into 'w' along its second dimension: it is of shape [4]" in str(caught.value)
    assert str(path) in str(caught.value)


def test_strided_views_of_a_torch_file_are_read_exactly_block_by_block(tmp_path, monkeypatch):
    from materialize.io import engine

    from conftest import write_torch

    big = torch.randn(16, 300)
    state = {"every_other_row": big[::2], "expanded": torch.arange(300.0).expand(4, 300), "transposed": big.t()}
    path = write_torch(state, tmp_path / "views.pt")
    model = torch.nn.Module()
    for name, value in state.items():
        model.register_parameter(name, torch.nn.Parameter(torch.empty(value.shape, device="meta")))
    monkeypatch.setattr(engine, "STRIDED_BLOCK_BYTES", 4096)  # several blocks per view, over the threads

    report = mz.load(model, path, check=True)

    assert sorted(report.loaded) == sorted(state)
    for name, value in state.items():
        assert torch.equal(getattr(model, name), value), name


def _interleaved_rows_checkpoint(tmp_path) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """Rows of 4 KB interleaved in pairs: read into place row by row (see materialize.io.scatter)."""
    saved = torch.randn(2, 16, 1024)
    return write_safetensors({"fused": saved}, tmp_path / "rows.safetensors"), saved, _interleaved(saved, 1, False)


def test_rows_read_into_place_resume_where_a_read_stops_inside_a_row(tmp_path, monkeypatch):
    from materialize.sources import fileio

    path, saved, expected = _interleaved_rows_checkpoint(tmp_path)
    calls = []

    def preadv_cut_short(fd: int, iovecs: int, count: int, position: int) -> int:
        calls.append(count)  # fills at most 1000 bytes of the first row asked for
        address, length = ctypes.c_int64.from_address(iovecs).value, ctypes.c_int64.from_address(iovecs + 8).value
        return os.preadv(fd, [fileio._memory_view(address, min(length, 1000), fileio._PyBUF_WRITE)], position)

    monkeypatch.setattr(fileio, "_preadv", preadv_cut_short)
    model = _one_parameter_model(tuple(saved.shape))

    mz.load(model, path, key_map=lambda name: Rearranged("w", Deinterleave(dim=1)), check=True)

    assert torch.equal(model.w, expected)
    assert len(calls) == 32  # one short read per row, the rest of each row read on its own


def test_a_file_truncated_under_rows_read_into_place_names_the_tensor(tmp_path):
    path, saved, _ = _interleaved_rows_checkpoint(tmp_path)
    model = _one_parameter_model(tuple(saved.shape))

    with mz.open_checkpoint(path) as ckpt:
        os.truncate(path, path.stat().st_size - 5000)
        with pytest.raises(mz.CheckpointError) as caught:
            mz.load(model, ckpt, key_map=lambda name: Rearranged("w", Deinterleave(dim=1)))

    assert str(caught.value).startswith(f"{path}: tensor 'fused': file ends at byte")
    assert model.w.is_meta
