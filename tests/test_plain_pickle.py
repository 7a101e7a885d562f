"""The torch-free reader of plain pickles (materialize.checkpoint.plainpickle) gives what the reader onto meta
gives, or declines: over a family of state dicts torch itself saves, over damaged copies of their pickles, and
through the CLI, which then imports no torch."""

from __future__ import annotations

import collections
import io
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import materialize as mz
from materialize.checkpoint import pickle_budget, plainpickle, torchzip
from materialize.checkpoint.layouts import GRAD_DTYPE_NAMES, RECORD_DTYPE_SIZES

ROOT = Path(__file__).resolve().parent.parent


def _opened(path: Path, *, plain: bool, state_dict_key: str | None = None) -> tuple:
    """What opening ``path`` gives, field by field, or the error it raises (its type and words); with ``plain``
    False, the reader onto meta alone."""
    saved = torchzip.plain_payload
    if not plain:
        torchzip.plain_payload = lambda *args: None
    try:
        with mz.open_checkpoint(path, state_dict_key=state_dict_key) as ckpt:
            return ("opened", ckpt.format, ckpt.tensors, ckpt.state_dict_key, ckpt.metadata, ckpt.extra_states,
                    ckpt.shards, ckpt.module)
    except Exception as error:  # noqa: BLE001  (the outcome compared: the same error, or the same checkpoint)
        return ("refused", type(error), str(error))
    finally:
        torchzip.plain_payload = saved


def _pickle_of(path: Path) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(next(name for name in archive.namelist() if name.endswith("/data.pkl")))


def _declines(path: Path, state_dict_key: str | None = None) -> bool:
    return plainpickle.plain_payload(path, _pickle_of(path), state_dict_key) is None


def _same_either_way(path: Path, state_dict_key: str | None = None) -> tuple:
    ours = _opened(path, plain=True, state_dict_key=state_dict_key)
    theirs = _opened(path, plain=False, state_dict_key=state_dict_key)
    assert ours == theirs
    return ours


# The family: every dtype torch names and can save, 0-d to 4-d, views, offsets, ties, parameters, nesting.
def _dtypes() -> list[torch.dtype]:
    found = []
    for dtype in sorted({value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str):
        try:
            torch.save(torch.empty(2, 3, dtype=dtype)[:, 1:], io.BytesIO())
        except Exception:  # noqa: BLE001  (one torch cannot make or save: quantized, sub-byte)
            continue
        found.append(dtype)
    return found


DTYPES = _dtypes()
SEEDS = range(120)


def _tensor(rng: random.Random, dtype: torch.dtype) -> torch.Tensor:
    shape = [rng.choice([0, 1, 2, 3, 5]) for _ in range(rng.randint(0, 4))]
    base = torch.empty(shape, dtype=dtype)  # the values are never read
    kind = rng.choice(["plain", "plain", "transposed", "sliced", "stepped", "offset", "expanded"])
    try:
        return _view(base, kind)
    except (RuntimeError, NotImplementedError):  # a view this dtype has no kernel for
        return base


def _view(base: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "transposed" and base.dim() >= 2:
        return base.transpose(0, base.dim() - 1)
    if kind == "sliced" and base.dim() >= 1 and base.shape[0] > 1:
        return base[1:]
    if kind == "stepped" and base.dim() >= 1:
        return base[::2]
    if kind == "offset" and base.numel() > 2:
        return base.reshape(-1)[1:-1]
    if kind == "expanded" and base.dim() >= 1 and base.shape[-1] == 1:
        return base.expand(*base.shape[:-1], 3)
    return base


def _state(rng: random.Random) -> Any:
    """A state dict, or a checkpoint holding one; a quarter of them with dtypes of every kind torch saves, the
    rest with those most checkpoints hold (outside the records' domain, the plain reader declines)."""
    entries: dict[str, Any] = collections.OrderedDict() if rng.random() < 0.7 else {}
    common = [dtype for dtype in DTYPES if str(dtype).removeprefix("torch.") in RECORD_DTYPE_SIZES]
    dtypes = DTYPES if rng.random() < 0.25 else common
    for index in range(rng.randint(0, 12)):
        dtype = rng.choice(dtypes)
        tensor = _tensor(rng, dtype)
        roll = rng.random()
        if roll < 0.15 and entries:  # a tie: the same tensor twice
            tensor = entries[rng.choice(list(entries))]
        elif roll < 0.3 and tensor.numel() and tensor.is_contiguous():  # a second view of one storage
            entries[f"view{index}"] = tensor.reshape(-1)[: max(1, tensor.numel() // 2)]
        elif roll < 0.45 and isinstance(tensor, torch.Tensor) and tensor.dim():
            grad = rng.random() < 0.5 and (dtype.is_floating_point or dtype.is_complex)
            try:
                tensor = torch.nn.Parameter(tensor, requires_grad=grad)
            except RuntimeError:  # a dtype without gradients after all
                tensor = torch.nn.Parameter(tensor, requires_grad=False)
        entries[f"layer{index % 3}.w{index}"] = tensor
    if isinstance(entries, collections.OrderedDict) and rng.random() < 0.5:
        entries._metadata = collections.OrderedDict([("", {"version": 1}), ("layer0", {"version": 2})])
    if rng.random() < 0.15:
        entries["block._extra_state"] = rng.choice([{"step": 3, "name": "x", "ratio": 0.5}, [1, 2, (3, None)],
                                                    torch.zeros(2), {"nested": {"deep": [0.25]}}])
    shape = rng.random()
    if shape < 0.15:
        return {"model": entries, "epoch": rng.randint(0, 9), "optimizer": {"lr": 0.1, "state": {}}}
    if shape < 0.25:
        return {"state_dict": entries, "state_dict_ema": entries}  # two copies: refused, naming both
    if shape < 0.35:
        return {"encoder": entries, "decoder": {"head": torch.zeros(2)}, "step": 10**12}
    return entries


@pytest.mark.parametrize("seed", SEEDS)
def test_a_generated_state_dict_reads_alike_or_the_plain_reader_declines(tmp_path, seed):
    rng = random.Random(seed)
    state = _state(rng)
    protocol = rng.choice([2, 3, 4, 5])
    path = tmp_path / "state.pt"
    torch.save(state, path, pickle_protocol=protocol)
    _same_either_way(path)
    if isinstance(state, dict) and "model" in state:
        _same_either_way(path, state_dict_key="model")
        _same_either_way(path, state_dict_key="missing")


def test_most_of_the_family_is_read_by_the_plain_reader(tmp_path):
    """Else the comparisons above would pass by declining."""
    read = 0
    for seed in SEEDS:
        rng = random.Random(seed)
        state = _state(rng)
        path = tmp_path / f"{seed}.pt"
        torch.save(state, path, pickle_protocol=rng.choice([2, 3, 4, 5]))
        read += not _declines(path)
    assert read >= len(SEEDS) // 2


@pytest.mark.parametrize("seed", range(12))
def test_an_empty_view_anywhere_past_its_storage_reads_as_torch_reads_it(tmp_path, seed):
    # torch's set_ lets an empty tensor start at any offset (it reads nothing): a slice of a (2, 0) tensor
    # starts past its storage's 0 bytes. Both readers take it as torch.load does; a view that holds an
    # element past its storage is still refused.
    rng = random.Random(seed)
    state = {}
    for index in range(6):
        shape = [rng.choice([0, 1, 2, 3]) for _ in range(rng.randint(1, 3))]
        shape[rng.randrange(len(shape))] = 0
        storage = torch.arange(rng.choice([0, 1, 4]), dtype=rng.choice([torch.float32, torch.bfloat16, torch.int8]))
        offset = rng.choice([0, 1, 3, 10**6])
        state[f"empty.{index}"] = storage.as_strided(shape, [1] * len(shape), offset)
    state["full"] = torch.arange(6.0)[2:]
    path = tmp_path / "empties.pt"
    torch.save(state, path, pickle_protocol=2)  # (torch's own weights-only reader takes no other protocol)
    expected = torch.load(path, weights_only=True)

    opened = _same_either_way(path)
    assert opened[0] == "opened"
    assert {name: (info.shape, info.dtype) for name, info in opened[2].items()} == \
        {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in expected.items()}
    loaded, _ = mz.load_tensors(path, mmap=bool(seed % 2))
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].shape == tensor.shape and loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def test_a_view_holding_an_element_past_its_storage_is_refused_by_both_readers(tmp_path):
    path = tmp_path / "past.pt"
    torch.save({"w": torch.ones(4)}, path)
    with zipfile.ZipFile(path) as archive:  # the record of 'w' cut to 8 bytes: its 4 elements no longer fit
        entries = {info.filename: archive.read(info) for info in archive.infolist()}
    record = next(name for name in entries if name.endswith("/data/0"))
    entries[record] = entries[record][:8]
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)

    outcome = _same_either_way(path)
    assert outcome[0] == "refused" and "'w'" in outcome[2] and "16 expected" in outcome[2]


def _models() -> dict[str, Callable[[], torch.nn.Module]]:
    return {
        "linear": lambda: torch.nn.Linear(4, 3),
        "conv-bn": lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()),
        "transformer": lambda: torch.nn.TransformerEncoderLayer(8, 2, 16),
        "embedding-lstm": lambda: torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LSTM(4, 4)),
        "wide": lambda: torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(200)]),  # past 256 memo entries
    }


@pytest.mark.parametrize("protocol", [2, None, 4, 5])
@pytest.mark.parametrize("name", sorted(_models()))
def test_a_real_models_state_dict_is_read_without_torch(tmp_path, name, protocol):
    torch.manual_seed(0)
    model = _models()[name]()
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path, **({} if protocol is None else {"pickle_protocol": protocol}))
    assert not _declines(path)
    opened = _same_either_way(path)
    assert opened[0] == "opened" and list(opened[2]) == list(model.state_dict())


def test_a_training_checkpoint_and_parameters_are_read_without_torch(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(100)])
    state = {name: torch.nn.Parameter(tensor, requires_grad=index % 2 == 0)
             for index, (name, tensor) in enumerate(model.state_dict().items())}
    path = tmp_path / "train.pt"
    torch.save({"model": state, "epoch": 3, "best": 0.5, "args": ["--lr", 0.1]}, path)
    assert not _declines(path)
    assert _same_either_way(path)[3] == "model"


def test_the_fast_paths_take_a_large_state_dict(tmp_path, monkeypatch):
    """Past 256 memo entries, entries are taken by the run's pattern, not opcode by opcode."""
    state = collections.OrderedDict((f"layer{index}.weight", torch.zeros(2, 3)) for index in range(400))
    state["tied"] = state["layer7.weight"]
    path = tmp_path / "large.pt"
    torch.save(state, path)
    made = []
    real = plainpickle._Reader._entry_pattern
    monkeypatch.setattr(plainpickle._Reader, "_entry_pattern", lambda self, at: made.append(at) or real(self, at))
    assert not _declines(path)
    assert made
    _same_either_way(path)


def test_the_record_dtypes_are_torchs_own():
    for name, itemsize in RECORD_DTYPE_SIZES.items():
        dtype = getattr(torch, name)
        assert dtype.itemsize == itemsize and (dtype.is_floating_point or dtype.is_complex) == (name in GRAD_DTYPE_NAMES)
    for class_name, dtype_name in plainpickle._STORAGE_CLASSES.items():
        assert getattr(torch, class_name).dtype == getattr(torch, dtype_name)


def _with_pickle(source: Path, target: Path, data: bytes) -> Path:
    """A copy of the zip ``source`` with its ``data.pkl`` replaced by ``data``."""
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as written:
        for name in archive.namelist():
            written.writestr(name, data if name.endswith("/data.pkl") else archive.read(name))
    return target


def _mutated(data: bytes, rng: random.Random) -> bytes:
    at = rng.randrange(2, len(data))
    how = rng.choice(["flip", "flip", "byte", "cut", "drop", "insert"])
    if how == "flip":
        return data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]
    if how == "byte":
        return data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
    if how == "cut":
        return data[:at]
    if how == "drop":
        return data[:at] + data[at + 1:]
    return data[:at] + bytes([rng.randrange(256)]) + data[at:]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    small = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).state_dict()
    large = collections.OrderedDict((f"block{index}.weight", torch.zeros(2, index % 4 + 1)) for index in range(60))
    large["block0.bias"] = large["block3.weight"][1:]
    paths = []
    for name, state, protocol in (("small", small, 2), ("large", large, 2), ("proto4", small, 4),
                                  ("nested", {"model": small, "epoch": 1}, 2)):
        path = folder / f"{name}.pt"
        torch.save(state, path, pickle_protocol=protocol)
        paths.append(path)
    return paths


@pytest.mark.parametrize("seed", range(300))
def test_a_damaged_pickle_reads_alike_or_the_plain_reader_declines(tmp_path, sources, seed):
    rng = random.Random(seed)
    source = sources[seed % len(sources)]
    data = _mutated(_pickle_of(source), rng)
    path = _with_pickle(source, tmp_path / "damaged.pt", data)
    plainpickle.plain_payload(path, data, None)  # never raises: declines
    _same_either_way(path)


@pytest.fixture(scope="module")
def many_entries(tmp_path_factory) -> tuple[Path, int]:
    """A state dict of 1,050 entries (past the memo's first 256, across the pickler's batches of 1,000), of a few
    shapes, parameters, a tie and a view: most of its pickle is read by the runs' fast path; and where that
    path starts."""
    path = tmp_path_factory.mktemp("many") / "many.pt"
    state = collections.OrderedDict()
    for index in range(1050):
        tensor = torch.zeros(index % 3 + 1, 4)
        state[f"layers.{index // 3}.w{index % 3}"] = torch.nn.Parameter(tensor) if index % 7 == 0 else tensor
    state["tied"] = state["layers.5.w1"]
    state["view"] = state["layers.9.w2"][1:]
    torch.save(state, path)
    data = _pickle_of(path)
    return path, data.index(b"layers.90.w0")  # far past the memo's first 256 entries


@pytest.mark.parametrize("seed", range(100))
def test_a_damaged_run_of_entries_reads_alike_or_the_plain_reader_declines(tmp_path, many_entries, seed, monkeypatch):
    # The damaged-pickle family above holds too few entries for the runs' fast path (_Reader._entries): here each
    # damage lands in its runs, past the memo's first 256 entries, and the reader must still decline or agree.
    source, runs_start = many_entries
    rng = random.Random(seed)
    data = _pickle_of(source)
    at = rng.randrange(runs_start, len(data) - 40)
    damaged = _mutated(data[at:], rng)
    path = _with_pickle(source, tmp_path / "damaged.pt", data[:at] + damaged)
    taken = []
    real = plainpickle._Reader._entries
    monkeypatch.setattr(plainpickle._Reader, "_entries",
                        lambda self, pos: taken.append(len(self.memo)) or real(self, pos))
    plainpickle.plain_payload(path, data[:at] + damaged, None)  # never raises: declines
    assert taken  # the fast path read it (or what of it came before the damage)
    monkeypatch.setattr(plainpickle._Reader, "_entries", real)
    _same_either_way(path)


def test_records_fetched_past_the_budget_decline_and_the_budget_refuses_them(tmp_path):
    """A record fetched again and again walks past the objects a pickle's bytes allow: the plain reader counts
    each fetch at more than the budget counts it, and leaves the refusal to the reader onto meta."""
    tensor = torch.zeros([1] * 40)
    path = tmp_path / "fetched.pt"
    torch.save({"weight": tensor, "again": [tensor] * 20_000}, path)
    data = _pickle_of(path)
    reader = plainpickle._Reader(data)
    with pytest.raises(plainpickle._Decline):
        reader.read()
    assert reader.fetched_weight > pickle_budget.OBJECTS_PER_BYTE * len(data) + pickle_budget.OBJECTS_FLOOR - len(data)
    outcome = _same_either_way(path)
    assert outcome[0] == "refused" and outcome[1] is mz.BudgetError


def test_a_few_records_fetched_again_are_read(tmp_path):
    tensor = torch.zeros(2, 3)
    path = tmp_path / "tied.pt"
    torch.save({"weight": tensor, "tied": tensor, "also": [tensor] * 10}, path)
    assert not _declines(path)
    _same_either_way(path)


def _importtime_run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path)


def _imported(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_inspect_of_a_plain_torch_zip_imports_no_torch_and_lists_what_the_torch_path_lists(tmp_path):
    torch.manual_seed(0)
    state = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).state_dict()
    path = tmp_path / "model.pt"
    torch.save(state, path)
    result = _importtime_run("-m", "materialize_cli.main", "inspect", str(path), tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    imported = _imported(result.stderr)
    assert "torch" not in imported
    # nor what a local file's listing never uses: HTTP and TLS (streaming from the hub), tqdm (a load's bar)
    assert not {"http.client", "ssl", "tqdm"} & imported, {"http.client", "ssl", "tqdm"} & imported

    from materialize_cli.main import _inspect_lines

    saved = torchzip.plain_payload
    torchzip.plain_payload = lambda *args: None
    try:
        with mz.open_checkpoint(path) as ckpt:
            expected = list(_inspect_lines(ckpt))
    finally:
        torchzip.plain_payload = saved
    assert result.stdout.splitlines() == expected

    script = ("import json, sys, materialize as mz; described = mz.inspect(sys.argv[1]); "
              "print(json.dumps(described)); print('torch' in sys.modules)")
    described = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                               cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert described.returncode == 0, described.stderr[-2000:]
    listing, torch_imported = described.stdout.splitlines()
    assert torch_imported == "False"
    saved = torchzip.plain_payload
    torchzip.plain_payload = lambda *args: None
    try:
        import json

        assert json.loads(listing) == json.loads(json.dumps(mz.inspect(path)))
    finally:
        torchzip.plain_payload = saved
