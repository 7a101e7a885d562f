"""The plain path's tensor records (materialize.checkpoint.plainrecords) give the same infos as the meta tensors
they stand in for, and stand aside (a meta tensor, torch's checks) wherever torch might decide otherwise."""

from __future__ import annotations

import collections
import io
import pickle
import pickletools
import zipfile
from pathlib import Path

import pytest
import torch

import materialize as mz
from materialize.checkpoint import pickle_budget, plainrecords, torchpickle, torchzip
from materialize.checkpoint.plainrecords import PlainTensor, plain_layout


def _views() -> dict:
    torch.manual_seed(0)
    base = torch.randn(6, 8)
    shared = torch.arange(24, dtype=torch.int32)
    return {
        "f32": torch.randn(3, 4), "f16": torch.randn(5).half(), "bf16": torch.randn(2, 3).bfloat16(),
        "f64": torch.randn(2, dtype=torch.float64), "i64": torch.arange(7), "i8": torch.arange(4, dtype=torch.int8),
        "u8": torch.arange(3, dtype=torch.uint8), "bool": torch.tensor([True, False]), "c64": torch.randn(2, dtype=torch.complex64),
        "f8": torch.zeros(4, dtype=torch.float8_e4m3fn), "u16": torch.zeros(3, dtype=torch.uint16),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 5), "ones": torch.zeros(1, 1, 3),
        "transposed": base.t(), "sliced": base[1:4, 2:7], "stepped": base[::2, 1::3], "expanded": torch.zeros(3, 1).expand(3, 4),
        "column": base[:, 3], "offset": base.view(-1)[5:17], "unit-dims": base[2:3, :].unsqueeze(0),
        "shared-a": shared[:12], "shared-b": shared.view(4, 6)[1:, ::2], "shared-whole": shared,
        "param": torch.nn.Parameter(torch.randn(3, 2)), "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "grad": torch.randn(2, 2).requires_grad_(), "int-param": torch.nn.Parameter(torch.arange(3), requires_grad=False),
        "param-view": torch.nn.Parameter(base[:, 1:3]),
    }


def _saved_objects() -> dict[str, object]:
    views = _views()
    ordered = collections.OrderedDict(views)
    ordered._metadata = {"": {"version": 1}}  # what nn.Module.state_dict() carries
    return {
        "flat": views,
        "ordered": ordered,
        "nested": {"model": {"enc": dict(list(views.items())[:10]), "dec": dict(list(views.items())[10:])}, "step": 3,
                   "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}}},
        "big-int-keys": {2**40 + k: value for k, value in enumerate(views.values())},
        "tied": {"a": views["f32"], "b": views["f32"], "c": views["shared-b"]},
        "v3": {"w": torch.randn(2, 2)},  # saved as below with _rebuild_tensor_v3 where torch writes it
        "extra-state": {"w": torch.randn(2), "block._extra_state": {"t": torch.ones(2), "n": 3}},
    }


def _reader_onto_meta(patched, *, records: bool) -> None:
    """The torch-free reader of plain pickles stood aside; without ``records``, meta tensors alone."""
    patched.setattr(torchzip, "plain_payload", lambda *args: None)
    if not records:
        patched.setattr(torchpickle, "plain_tensor", lambda *args: None)


def _infos(path: Path, monkeypatch, *, records: bool) -> dict:
    """The reader onto meta's infos (the torch-free reader of plain pickles stood aside), with records or without."""
    with monkeypatch.context() as patched:
        _reader_onto_meta(patched, records=records)
        with mz.open_checkpoint(path) as ckpt:
            return dict(ckpt.tensors), dict(ckpt.extra_states), ckpt.state_dict_key


@pytest.mark.parametrize("case", list(_saved_objects()))
@pytest.mark.parametrize("protocol", [2, 4])
def test_records_give_the_infos_meta_tensors_give(tmp_path, monkeypatch, case, protocol):
    path = tmp_path / f"{case}.pt"
    torch.save(_saved_objects()[case], path, pickle_protocol=protocol)
    made = []
    real = plainrecords._record
    monkeypatch.setattr(plainrecords, "_record", lambda fields: made.append(fields) or real(fields))

    with_records = _infos(path, monkeypatch, records=True)
    assert made  # the records were used
    without = _infos(path, monkeypatch, records=False)

    assert with_records[0] == without[0]
    assert list(with_records[0]) == list(without[0])  # the same order too
    assert with_records[2] == without[2]
    assert repr(with_records[1]) == repr(without[1])  # any tensor in an extra state is torch's, as before
    with mz.open_checkpoint(path) as ckpt:  # the torch-free reader, where it reads the file, alike
        assert (dict(ckpt.tensors), ckpt.state_dict_key) == (with_records[0], with_records[2])
        assert repr(dict(ckpt.extra_states)) == repr(with_records[1])


def test_the_infos_of_records_are_torch_loads_layouts(tmp_path):
    path = tmp_path / "views.pt"
    views = _views()
    torch.save(views, path)
    loaded = torch.load(path, weights_only=True)
    with mz.open_checkpoint(path) as ckpt:
        for name, tensor in loaded.items():
            info = ckpt.tensors[name]
            assert info.shape == tuple(tensor.shape), name
            assert (info.stride or tensor.stride()) == tensor.stride(), name
            assert info.dtype == tensor.dtype, name
    tensors, _ = mz.load_tensors(path)
    for name, tensor in loaded.items():
        assert torch.equal(tensors[name], tensor), name


def _meta(offset, size, stride, dtype=torch.float32) -> torch.Tensor:
    return torch.empty((0,), dtype=dtype, device="meta").set_(
        torch.UntypedStorage(0, device="meta"), offset, size, stride)


@pytest.mark.parametrize("offset, size, stride", [
    (0, (), ()), (3, (4,), (1,)), (0, (2, 3), (3, 1)), (0, (3, 2), (1, 3)), (1, (1, 5), (99, 1)), (0, (5, 1), (1, 7)),
    (0, (0, 4), (4, 1)), (0, (4, 0), (9, 3)), (0, (3, 4), (0, 1)), (0, (2, 2, 2), (4, 1, 2)), (7, (1,), (0,)),
    (0, (2, 1, 2), (2, 5, 1)), (0, (2**31, 3), (3, 1)), (2**40, (2, 2), (2**20, 1)),
])
def test_a_layout_in_the_records_domain_is_torchs(offset, size, stride):
    numel, contiguous, extent = plain_layout(offset, size, stride, 4)
    tensor = _meta(offset, size, stride)
    assert numel == tensor.numel() and contiguous == tensor.is_contiguous()
    expected = 0 if numel == 0 else sum((n - 1) * s for n, s in zip(size, stride)) + 1
    assert extent == expected


@pytest.mark.parametrize("offset, size, stride", [
    (-1, (2,), (1,)), (0, (-2,), (1,)), (0, (2,), (-1,)), (0, [2], [1]), (0, (2,), [1]), (True, (2,), (1,)),
    (0, (True,), (1,)), (0, (2.0,), (1,)), (0, (2, 3), (1,)), (0, (2**62,), (1,)), (0, (2,), (2**62,)),
    (0, (2**31, 2**31), (1, 1)), (2**62, (1,), (1,)), (2**61, (2,), (2**60,)), (0, (2**40, 2**40), (0, 0)),
    ("0", (2,), (1,)), (0, torch.Size([2]), (1,)),
])
def test_a_layout_outside_the_records_domain_is_left_to_torch(offset, size, stride):
    assert plain_layout(offset, size, stride, 4) is None


def _storage() -> plainrecords.PlainStorage:
    return plainrecords.plain_storage("0", 64, torch.float32, {})


@pytest.mark.parametrize("dtype, requires_grad", [
    (torch.qint8, False), (torch.complex32, False), (torch.int64, True), ("float32", False), (torch.float32, 1),
    (torch.float32, None),
])
def test_a_dtype_or_gradient_flag_outside_the_domain_is_left_to_torch(dtype, requires_grad):
    assert plainrecords.plain_tensor(_storage(), 0, (2,), (1,), dtype, requires_grad) is None


def test_a_record_refuses_what_a_file_could_do_to_it():
    record = plainrecords.plain_tensor(_storage(), 0, (2, 2), (2, 1), torch.float32, False)
    assert isinstance(record, PlainTensor)
    storage = record.fields[0]
    for attempt in (lambda: setattr(record, "fields", None), lambda: record.__setstate__((None, {"fields": None})),
                    lambda: bool(record), lambda: iter(record), lambda: setattr(storage, "fields", None),
                    lambda: storage.__setstate__({}), lambda: iter(storage)):
        with pytest.raises((AttributeError, TypeError)):
            attempt()
    assert repr(record) == repr(_meta(0, (2, 2), (2, 1)))
    assert record.with_grad(1) is None and record.with_grad(True).fields[9]


def _pickle_of(build: bytes) -> bytes:
    """``{"w": tensor}`` as torch.save pickles it, with ``build`` (opcodes that leave the stack as it was) after it."""
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as opened:
        data = opened.read(next(n for n in opened.namelist() if n.endswith("data.pkl")))
    assert data.endswith(pickle.SETITEM + pickle.STOP)
    return data[:-1] + build + pickle.STOP


def _zip_with(path: Path, data: bytes) -> Path:
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as source, zipfile.ZipFile(path, "w") as target:
        for record in source.infolist():
            target.writestr(record, data if record.filename.endswith("/data.pkl") else source.read(record))
    return path


@pytest.mark.parametrize("state", [pickle.NONE, pickle.NONE + pickle.NONE + pickle.TUPLE2, pickle.EMPTY_DICT])
def test_a_build_on_a_tensor_reads_as_without_records(tmp_path, monkeypatch, state):
    # BUILD with an empty state leaves a slotted object as it was; on a tensor it calls Tensor.__setstate__.
    stored = [arg for op, arg, _ in pickletools.genops(_pickle_of(b"")) if op.name in ("BINPUT", "LONG_BINPUT")]
    fetch = pickle.BINGET + bytes([stored[-1]])  # the last one stored: the rebuilt tensor
    path = _zip_with(tmp_path / "built.pt", _pickle_of(fetch + state + pickle.BUILD + pickle.POP))
    outcomes = []
    for records in (True, False):
        with monkeypatch.context() as patched:
            if not records:  # meta tensors alone: neither records nor the torch-free reader
                _reader_onto_meta(patched, records=False)
            try:
                with mz.open_checkpoint(path) as ckpt:
                    outcomes.append(("read", dict(ckpt.tensors)))
            except mz.MaterializeError as error:
                outcomes.append(("refused", str(error)))
    assert outcomes[0] == outcomes[1]


# The budget scan's record fast path (pickle_budget._tensor_record): the same counts as the general path.

def _state_pickle(obj: object, protocol: int = 2) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_protocol=protocol)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as opened:
        return opened.read(next(n for n in opened.namelist() if n.endswith("data.pkl")))


def _scans(data: bytes, limit: int = 10**9) -> tuple:
    """The scan's result with the record fast path, and without it; how many records it took."""
    taken = []
    real = pickle_budget._tensor_record

    def counted(*args):
        found = real(*args)
        taken.append(found is not None)
        return found

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(pickle_budget, "_tensor_record", counted)
        fast = pickle_budget._scan(data, limit)
        patched.setattr(pickle_budget, "_tensor_record", lambda *args: None)
        general = pickle_budget._scan(data, limit)
    return fast, general, sum(taken)


def _many(count: int = 400) -> dict:
    """Enough tensors that the memo passes 256 entries (the fast path's stores), of every layout kind."""
    state: dict = {}
    while len(state) < count:  # fresh tensors each round: the pickler stores a tensor met again by reference
        state.update((f"layer{len(state) + i}.{name}", tensor) for i, (name, tensor) in enumerate(_views().items()))
    return state


@pytest.mark.parametrize("case", list(_saved_objects()) + ["many"])
def test_the_scans_record_fast_path_counts_as_the_general_path(case):
    obj = _many() if case == "many" else _saved_objects()[case]
    fast, general, taken = _scans(_state_pickle(obj))
    assert fast == general
    if case == "many":
        assert taken > 300


def test_the_scan_of_a_long_layout_and_a_shared_key_counts_as_the_general_path():
    shared = torch.zeros(2, 3, 4, 5, 6)
    state = {f"t{i}": shared[i % 2] if i % 2 else torch.zeros(i % 7, 1, 2, 3, 1) for i in range(600)}
    fast, general, taken = _scans(_state_pickle(state))
    assert fast == general and taken > 500


def test_a_pickle_that_fetches_a_records_stores_again_counts_as_the_general_path():
    # Every stored index fetched back and changed (APPEND, SETITEM, BUILD): the general path's stale recount.
    data = _state_pickle(_many(300))
    stores = [arg for op, arg, _ in pickletools.genops(data) if op.name == "LONG_BINPUT"]
    tail = b"".join(pickle.LONG_BINGET + index.to_bytes(4, "little") + change + pickle.POP
                    for index, change in zip(stores[-60:], [pickle.NONE + pickle.APPEND, pickle.NONE + pickle.NONE
                                                            + pickle.SETITEM, pickle.EMPTY_DICT + pickle.BUILD] * 20))
    hostile = data[:-2] + tail + data[-2:]  # before the final SETITEMS and STOP
    fast, general, taken = _scans(hostile)
    assert fast == general and taken > 200


def test_records_with_bytes_changed_are_counted_as_the_general_path():
    # Memo indices pointed elsewhere (at containers, at missing entries, past the pickle), opcodes swapped, lengths
    # changed: wherever a change lands, the fast path counts as the general path or leaves the record to it.
    import random

    data = bytearray(_state_pickle(_many(320)))
    start = len(data) // 2
    rng = random.Random(7)
    for trial in range(300):
        mutated = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 3))):
            at = rng.randrange(start, len(data) - 1)
            mutated[at] = rng.choice((rng.randrange(256), 0x68, 0x6A, 0x72, 0x74, 0x85, 0x87, 0x28, 0x29, 0x4B, 0x4A,
                                      0x00, 0x01, 0xFF, mutated[at] ^ 1))
        fast, general, _ = _scans(bytes(mutated), limit=2**20 + 100)
        assert fast == general, trial


def _rewritten(source: Path, path: Path, edit) -> Path:
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(path, "w") as target:
        for record in archive.infolist():
            data = edit(record.filename, archive.read(record))
            if data is not None:
                target.writestr(record, data)
    return path


@pytest.mark.parametrize("edit", [
    lambda name, data: None if name.endswith("/data/1") else data,  # a storage record missing
    lambda name, data: data[:3] if name.endswith("/data/1") else data,  # shorter than the storage it holds
    lambda name, data: data[:-4] if name.endswith("/data/0") else data,  # shorter than a view into it needs
], ids=["missing", "short", "short-for-a-view"])
def test_a_bad_storage_record_is_refused_as_without_records(tmp_path, monkeypatch, edit):
    base = torch.arange(12.0)
    torch.save({"view": base[2:10].view(2, 4), "other": torch.ones(3), "whole": base}, tmp_path / "genuine.pt")
    path = _rewritten(tmp_path / "genuine.pt", tmp_path / "bad.pt", edit)
    errors = []
    for records in (True, False):
        with monkeypatch.context() as patched:
            if not records:  # meta tensors alone: neither records nor the torch-free reader
                _reader_onto_meta(patched, records=False)
            with pytest.raises(mz.MaterializeError) as caught:
                mz.open_checkpoint(path)
            errors.append(str(caught.value))
    assert errors[0] == errors[1]
    assert "bad.pt" in errors[0]


def test_the_records_dtypes_are_made_by_torch_as_records_assume():
    import warnings

    for dtype in plainrecords._RECORD_DTYPES:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning torch gives for the meta tensor would be lost with the record
            tensor = torch.empty((0,), dtype=dtype, device="meta")
        assert tensor.layout == torch.strided and not tensor.is_quantized, dtype
        torch.nn.Parameter(tensor, requires_grad=False)
        if dtype in plainrecords._GRAD_DTYPES:
            torch.empty((0,), dtype=dtype, device="meta").requires_grad = True
            torch.nn.Parameter(torch.empty((0,), dtype=dtype, device="meta"), requires_grad=True)
        else:
            with pytest.raises(RuntimeError):
                torch.empty((0,), dtype=dtype, device="meta").requires_grad = True


@pytest.mark.parametrize("plain", [True, False])
@pytest.mark.parametrize("offset", [1 << 32, 1 << 62])  # (the second outside the records' domain: a meta tensor)
def test_an_empty_view_past_its_storage_is_said_to_start_inside_the_file(tmp_path, monkeypatch, plain, offset):
    # torch's set_ lets an empty view start anywhere past its storage (it reads nothing); its info says where
    # its storage ends, an offset inside the file, as every tensor's is (inspect --json shows it).
    weight = torch.arange(16, dtype=torch.uint8)
    far = torch.empty(0, dtype=torch.uint8).set_(weight.untyped_storage(), offset, (0,))
    path = tmp_path / "empty-far.pt"
    torch.save({"w": weight, "far": far}, path)
    if not plain:  # the reader onto meta: the same infos
        monkeypatch.setattr(torchzip, "plain_payload", lambda *args: None)
    size = path.stat().st_size
    with mz.open_checkpoint(path) as ckpt:
        info = ckpt.tensors["far"]
        assert info.numel == 0 and ckpt.tensors["w"].offset + 16 == info.offset <= size
    described = {entry["name"]: entry for entry in mz.inspect(path)["tensors"]}
    assert described["far"]["offset"] == info.offset
    loaded = torch.load(path, weights_only=True)
    tensors, _ = mz.load_tensors(path)
    assert tensors["far"].shape == loaded["far"].shape == (0,) and torch.equal(tensors["w"], loaded["w"])
