"""Small CPU tensors carved from a load's arena (materialize.io.arena), and the short way a plain parameter
takes through a load (loading._allocated): each tensor is still a tensor of its own, as torch.empty
makes it, and the model is the one the general way makes."""

from __future__ import annotations

import errno
import multiprocessing
import weakref
from pathlib import Path

import pytest
import safetensors.torch as sft
import torch
from torch import nn

import materialize as mz
import materialize.io.arena as arena_module
import materialize.io.engine as engine
import materialize.loading as loading
from materialize.io.arena import MAX_TENSOR_BYTES, MIRRORED_GAP_BYTES, HostArena

from conftest import general_way_only
from test_differential import SCENARIOS, build_way, compare_models, trained_state, write
from test_engine_paths import THP_MODE, _vma_flag


def _storage_facts(model: nn.Module) -> dict[str, tuple]:
    """What torch.empty's tensors have and a view of a shared block would not: per tensor."""
    facts = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if tensor.is_meta:
            continue
        facts[name] = (tensor._base is None, tensor.storage_offset(), tensor.untyped_storage().nbytes(),
                       tensor.untyped_storage().resizable(), tensor.stride(), type(tensor), tensor.requires_grad)
    return facts


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_short_way_makes_the_general_ways_model(name: str, fmt: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = SCENARIOS[name]
    if fmt not in scenario.formats:
        pytest.skip(f"{name} is not saved as {fmt}")
    path = write(trained_state(scenario.build, scenario.mutate, scenario.edit_file), tmp_path / f"model.{fmt}", fmt)
    short = build_way(scenario.build, "meta_init")
    short_error = _load_error(short, path)
    monkeypatch.setattr(loading, "_allocated", general_way_only)
    general = build_way(scenario.build, "meta_init")
    general_error = _load_error(general, path)
    assert short_error == general_error
    if short_error is None:
        assert compare_models(short, general) == []
        assert _storage_facts(short) == _storage_facts(general)


def test_the_zoo_takes_the_short_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above is of something: plain parameters of the zoo do take the short way."""
    offered, general = [], []
    allocated = loading._allocated

    def counted(entries, undo, arena, host, general_way, wants_grad):
        offered.extend(entries)
        return allocated(entries, undo, arena, host, lambda entry: general.append(entry) or general_way(entry),
                         wants_grad)

    monkeypatch.setattr(loading, "_allocated", counted)
    scenario = SCENARIOS["moduledict_modulelist_sequential"]
    path = write(trained_state(scenario.build), tmp_path / "model.safetensors", "safetensors")
    mz.load(build_way(scenario.build, "meta_init"), path)
    assert offered and not general


def _load_error(model: nn.Module, path: Path):
    try:
        mz.load(model, path)
    except Exception as error:  # the same refusal either way
        return type(error).__name__, str(error)
    return None


class Experts(nn.Module):
    def __init__(self, count: int = 300) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(16, 8, bias=False) for _ in range(count))
        self.big = nn.Linear(512, 256)  # over MAX_TENSOR_BYTES: torch.empty's as before


def _loaded_experts(tmp_path: Path) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    state = {name: torch.randn(t.shape) for name, t in Experts().state_dict().items()}
    path = tmp_path / "experts.safetensors"
    sft.save_file(state, path)
    with mz.meta_init():
        model = Experts()
    mz.load(model, path)
    return model, state


def test_each_small_tensor_has_its_own_storage(tmp_path: Path) -> None:
    model, state = _loaded_experts(tmp_path)
    spans = []
    for name, param in model.named_parameters():
        assert torch.equal(param, state[name]), name
        assert type(param) is nn.Parameter and param.requires_grad and param.is_leaf
        assert param._base is None and param.storage_offset() == 0
        assert param.untyped_storage().nbytes() == param.nbytes  # the tensor's bytes, nothing of its neighbours
        assert param.stride() == torch.empty(param.shape).stride()
        spans.append((param.data_ptr(), param.data_ptr() + param.nbytes))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no two overlap
    assert not model.big.weight.untyped_storage().nbytes() <= MAX_TENSOR_BYTES  # the large one is not carved


def test_carved_tensors_save_and_share_as_any(tmp_path: Path) -> None:
    model, state = _loaded_experts(tmp_path)
    saved = tmp_path / "again.safetensors"
    sft.save_file(model.state_dict(), saved)  # refuses tensors sharing memory: these do not
    assert all(torch.equal(value, state[name]) for name, value in sft.load_file(saved).items())
    torch.save(model.state_dict(), tmp_path / "again.pt")
    one = tmp_path / "one.pt"
    torch.save(model.experts[3].weight, one)  # one tensor saves its own bytes, not a block of them
    assert one.stat().st_size < 16 * 8 * 4 + 2048
    assert torch.equal(torch.load(one, weights_only=True), state["experts.3.weight"])
    weight = model.experts[5].weight
    weight.data.share_memory_()
    assert weight.is_shared() and torch.equal(weight, state["experts.5.weight"])
    weight.data.resize_(8, 16)  # within its bytes: as any tensor
    with pytest.raises(RuntimeError, match="not resizable"):  # a deliberate difference (docs: README)
        model.experts[6].weight.data.resize_(64, 64)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_a_cast_on_the_short_way_gives_parameters_that_train_as_eager_ones(fmt: str, tmp_path: Path) -> None:
    """A short-way parameter is its own read job and asks its gradient only once read (a cast writes it in
    place from reader threads, where autograd is on): after the load it is the leaf eager construction and
    load_state_dict make, and a training step runs on it."""
    state = {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in Experts(40).state_dict().items()}
    path = tmp_path / f"experts.{fmt}"
    sft.save_file(state, path) if fmt == "safetensors" else torch.save(state, path)
    with mz.meta_init():
        model = Experts(40)
    model.experts[2].weight.requires_grad_(False)  # a frozen one stays frozen
    mz.load(model, path, dtype=torch.float32)
    eager = Experts(40)
    eager.experts[2].weight.requires_grad_(False)
    eager.load_state_dict({name: value.float() for name, value in state.items()})
    for (name, ours), (_, theirs) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        assert type(ours) is type(theirs) is nn.Parameter, name
        assert (ours.dtype, ours.requires_grad, ours.is_leaf, ours.grad_fn, ours._base) == \
            (theirs.dtype, theirs.requires_grad, True, None, None), name
        assert torch.equal(ours, theirs), name
    loss = sum(expert(torch.ones(2, 16)).sum() for expert in model.experts)
    loss.backward()
    assert model.experts[2].weight.grad is None
    assert torch.equal(model.experts[3].weight.grad, torch.full((8, 16), 2.0))


def _write_in_child(model: nn.Module, queue) -> None:
    with torch.no_grad():
        model.experts[0].weight.fill_(7.0)
    queue.put(float(model.experts[0].weight.sum()))


def test_a_forked_child_writes_its_own_copy(tmp_path: Path) -> None:
    model, state = _loaded_experts(tmp_path)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_write_in_child, args=(model, queue))
    child.start()
    child_sum = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0 and child_sum == 7.0 * 16 * 8
    assert torch.equal(model.experts[0].weight, state["experts.0.weight"])  # private, as heap memory


def test_a_chunk_lives_as_long_as_its_last_tensor() -> None:
    arena = HostArena()
    first = arena.empty((4, 4), torch.float32, 16, 64)
    second = arena.empty((8,), torch.bfloat16, 8, 16)
    chunk = weakref.ref(arena._chunk)
    del arena
    first.fill_(1.0)
    del first
    assert chunk() is not None
    second.fill_(2.0)
    assert float(second.float().sum()) == 16.0
    del second
    assert chunk() is None


def test_carved_takes_what_carves_admits_and_nothing_else() -> None:
    arena = HostArena()
    for shape, dtype in [((4, 4), torch.float32), ((MAX_TENSOR_BYTES,), torch.uint8), ((3, 5), torch.bfloat16)]:
        numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
        nbytes = numel * dtype.itemsize
        assert HostArena.carves(nbytes, dtype)
        tensor, slack = arena.carved(shape, dtype, numel, nbytes)
        assert tensor is not None and slack == 0 and tuple(tensor.shape) == shape and tensor.dtype == dtype
        assert tensor.is_contiguous() and tensor._base is None and tensor.untyped_storage().nbytes() == nbytes
    refused = [((MAX_TENSOR_BYTES + 1,), torch.uint8, MAX_TENSOR_BYTES + 1), ((0,), torch.float32, 0),
               ((4,), torch.qint8, 4)]
    used = arena._used
    for shape, dtype, nbytes in refused:
        assert not HostArena.carves(nbytes, dtype)
        assert arena.carved(shape, dtype, shape[0], nbytes) == (None, 0)
    assert arena._used == used  # a refusal takes no room


def test_carved_mirrors_a_files_small_gaps_and_nothing_else() -> None:
    """A tensor whose bytes follow the last carved one's in the same file lies as far after it as in the file
    (its slack: no tensor's bytes), where that keeps it aligned and the gap is a header's, not more."""
    arena, path, other = HostArena(), Path("a.pt"), Path("b.pt")

    def carve(file: object, offset: int, nbytes: int = 256) -> tuple[int, int]:
        tensor, slack = arena.carved((nbytes,), torch.uint8, nbytes, nbytes, file, offset)
        return tensor.data_ptr(), slack

    first, _ = carve(path, 1000)
    second, slack = carve(path, 1000 + 256 + 64)  # a 64-byte header between, as a torch zip lays records out
    assert (second - first, slack) == (256 + 64, 64)
    third, slack = carve(path, 1000 + 2 * 256 + 64 + 96)  # 96 bytes would leave it misaligned: packed as usual
    assert (third - second, slack) == (256, 0)
    fourth, slack = carve(path, 1000 + 3 * 256 + 64 + 96 + MIRRORED_GAP_BYTES + 64)  # a gap past a header's
    assert (fourth - third, slack) == (256, 0)
    fifth, slack = carve(other, 1000 + 4 * 256 + 64 + 96 + MIRRORED_GAP_BYTES + 128)  # another file
    assert (fifth - fourth, slack) == (256, 0)
    between = arena.empty((8,), torch.uint8, 8, 8)  # anything placed in between ends the chain
    sixth, slack = carve(other, 1000 + 5 * 256 + 64 + 96 + MIRRORED_GAP_BYTES + 128 + 64)
    assert slack == 0 and sixth - between.data_ptr() == 64
    seventh, slack = carve(None, 0)  # no file said: never mirrored, and no chain after it
    assert slack == 0 and carve(None, 256 + 64)[1] == 0


def test_tensors_start_aligned_and_chunks_follow() -> None:
    arena = HostArena()
    made = [arena.empty((3,), torch.uint8, 3, 3) for _ in range(5)]
    assert all(t.data_ptr() % arena_module.ALIGNMENT == 0 for t in made)
    big = MAX_TENSOR_BYTES
    many = [arena.empty((big,), torch.uint8, big, big) for _ in range(arena_module.CHUNK_BYTES // big + 1)]
    assert len({t.untyped_storage().nbytes() for t in many}) == 1
    for index, tensor in enumerate(many):
        tensor.fill_(index % 251)
    assert all(int(t[0]) == i % 251 and int(t[-1]) == i % 251 for i, t in enumerate(many))  # none overlap


def test_no_memory_for_a_chunk_names_the_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {name: torch.randn(t.shape) for name, t in Experts(4).state_dict().items()}
    path = tmp_path / "experts.safetensors"
    sft.save_file(state, path)
    with mz.meta_init():
        model = Experts(4)

    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(arena_module.mmap, "mmap", no_memory)
    with pytest.raises(mz.AllocationError) as caught:
        mz.load(model, path)
    assert caught.value.tensor is not None and caught.value.tensor in state
    assert "experts.safetensors" in str(caught.value) and "Cannot allocate memory" in str(caught.value)
    assert all(param.is_meta for param in model.parameters())  # nothing half-made stays in the model


@pytest.mark.skipif(not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(), reason="needs THP mode madvise")
@pytest.mark.parametrize("pay", [True, False])
def test_chunks_are_advised_huge_pages_where_they_pay(pay: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena_module.hostmem, "huge_pages_pay", lambda: pay)
    tensor = HostArena().empty((16,), torch.float32, 16, 64)
    assert _vma_flag(tensor.data_ptr(), "THPeligible") == ("1" if pay else "0")


class Rows(nn.Module):
    def __init__(self, count: int = 60) -> None:
        super().__init__()
        self.rows = nn.ParameterList(nn.Parameter(torch.zeros(16, 16)) for _ in range(count))


def _save_rows(state: dict[str, torch.Tensor], path: Path) -> None:
    # A torch zip puts a local header between each two tensors: read into the arena's slack, one view for both
    sft.save_file(state, path) if path.suffix == ".safetensors" else torch.save(state, path)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_file_cut_short_under_merged_reads_names_its_tensor(suffix: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors next to each other in the file and in the arena are read as one view; a file that ends inside one
    of them still names that one, not the first of the view."""
    state = {f"rows.{i}": torch.full((16, 16), float(i)) for i in range(60)}
    path = tmp_path / f"rows{suffix}"
    _save_rows(state, path)
    merges = []
    parts_of = engine._direct_parts
    monkeypatch.setattr(engine, "_direct_parts", lambda run, *flags: merges.append(parts_of(run, *flags)[2]) or
                        parts_of(run, *flags))
    with mz.open_checkpoint(path) as ckpt:
        victim = ckpt["rows.37"]
        with open(path, "r+b") as handle:  # rewritten while loading: cut inside rows.37
            handle.truncate(victim.offset + victim.nbytes // 2)
        with mz.meta_init():
            model = Rows()
        with pytest.raises(mz.CheckpointError) as caught:
            mz.load(model, ckpt)
    assert merges[0] is True  # the first read was of merged views
    assert caught.value.tensor == "rows.37" and "file ends" in str(caught.value)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_merged_reads_fill_every_tensor(suffix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {f"rows.{i}": torch.full((16, 16), float(i)) for i in range(60)}
    path = tmp_path / f"rows{suffix}"
    _save_rows(state, path)
    views = []
    parts_of = engine._direct_parts
    monkeypatch.setattr(engine, "_direct_parts", lambda run, *flags: views.append(
        sum(not isinstance(dest, int) for dest, _ in parts_of(run, *flags)[0])) or parts_of(run, *flags))
    with mz.meta_init():
        model = Rows()
    mz.load(model, path)
    assert all(torch.equal(model.rows[i], state[f"rows.{i}"]) for i in range(60))
    assert sum(views) < 60 / 10  # merged: a zip's headers read into the slack between, not a view each
    # each its own storage of exactly its bytes: the slack between them is no tensor's
    assert all(row._base is None and row.untyped_storage().nbytes() == 16 * 16 * 4 for row in model.rows)
    monkeypatch.setattr(engine, "_direct_parts", parts_of)
    report = mz.load(Rows(), path, check=True)  # counted per tensor: one view each, and every byte accounted
    assert len(report.loaded) == 60


def test_slack_is_read_into_only_where_the_files_hold_the_bytes_between() -> None:
    """A group's held chunks have only the tensors' bytes: their reads keep a view a tensor, the gap passed over."""
    from materialize.checkpoint.base import make_info
    from materialize.checkpoint.pieces import Job
    from materialize.io.groupread import _HeldFiles

    arena, path = HostArena(), Path("rows.pt")
    first, _ = arena.carved((64,), torch.uint8, 64, 64, path, 1000)
    second, slack = arena.carved((64,), torch.uint8, 64, 64, path, 1192)
    assert slack == 128 and second.data_ptr() - first.data_ptr() == 192
    run = [(Job(first, make_info("a", "uint8", 1, (64,), path, 1000)), 0, 64),
           (Job(second, make_info("b", "uint8", 1, (64,), path, 1192), slack), 0, 64)]
    across, _, merged = engine._direct_parts(run, True, True)
    assert merged and len(across) == 1 and len(across[0][0]) == 256  # both tensors and the header between
    apart, _, merged = engine._direct_parts(run, True, False)
    assert not merged and [(type(dest) is int, dest if type(dest) is int else len(dest)) for dest, _ in apart] == \
        [(False, 64), (True, 128), (False, 64)]
    assert _HeldFiles.reads_between is False  # the group's files say so

