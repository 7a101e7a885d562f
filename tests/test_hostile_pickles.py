"""A file can change nothing outside what its own load returns: pickle's BUILD on a global that the fast
(plain state-dict) unpickler hands out is refused, and the next file of the process loads as torch.load."""

from __future__ import annotations

import pickle
import pickletools
import struct
import zipfile
from pathlib import Path

import pytest
import torch

import materialize as mz
from materialize.checkpoint import torchpickle

GLOBALS = sorted(torchpickle._PLAIN_GLOBALS)


def _text(value: str) -> bytes:
    encoded = value.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(encoded)) + encoded


def _building(name: str, *, slots: bool) -> bytes:
    """A pickle that names ``name``, sets its ``dtype`` to float16 by BUILD (as a dict or as slot state), then
    returns an empty state dict."""
    module, _, attr = name.rpartition(".")
    state = pickle.EMPTY_DICT + _text("dtype") + pickle.GLOBAL + b"torch\nfloat16\n" + pickle.SETITEM
    if slots:
        state = pickle.NONE + state + pickle.TUPLE2
    return (pickle.PROTO + b"\x02" + pickle.GLOBAL + f"{module}\n{attr}\n".encode() + state + pickle.BUILD + pickle.POP
            + pickle.EMPTY_DICT + pickle.STOP)


def _with_data_pkl(template: Path, path: Path, data: bytes) -> Path:
    with zipfile.ZipFile(template) as source, zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as target:
        for record in source.infolist():
            target.writestr(record, data if record.filename.endswith("/data.pkl") else source.read(record))
    return path


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("genuine")
    torch.manual_seed(0)
    state = {"f32": torch.randn(4, 4), "f16": torch.randn(3).half(), "bf16": torch.randn(2, 2).bfloat16(),
             "i64": torch.arange(5), "u8": torch.arange(3, dtype=torch.uint8), "param": torch.nn.Parameter(torch.randn(2))}
    torch.save(state, folder / "genuine.pt")
    torch.save({}, folder / "empty.pt")
    return folder


@pytest.mark.parametrize("slots", [False, True], ids=["dict-state", "slot-state"])
@pytest.mark.parametrize("name", GLOBALS)
def test_build_on_a_global_is_refused_and_the_next_load_equals_torch_load(genuine, tmp_path, name, slots):
    hostile = _with_data_pkl(genuine / "empty.pt", tmp_path / "hostile.pt", _building(name, slots=slots))

    with pytest.raises(mz.MaterializeError, match="hostile.pt"):
        mz.load_tensors(hostile)

    expected = torch.load(genuine / "genuine.pt", weights_only=True)
    tensors, _ = mz.load_tensors(genuine / "genuine.pt")
    assert tensors.keys() == expected.keys()
    for key, value in expected.items():
        assert tensors[key].dtype == value.dtype, key
        assert torch.equal(tensors[key], value), key


def test_torch_refuses_the_same_build(genuine, tmp_path):
    # The refusal above is torch's own: its weights-only reader refuses BUILD on such a global too.
    hostile = _with_data_pkl(genuine / "empty.pt", tmp_path / "hostile.pt", _building("torch.FloatStorage", slots=False))

    with pytest.raises(pickle.UnpicklingError):
        torch.load(hostile, weights_only=True)


dcp = pytest.importorskip("torch.distributed.checkpoint")
from materialize.checkpoint import dcp as dcp_reader  # noqa: E402

DCP_GLOBALS = sorted(".".join(key) for key in dcp_reader._allowed_globals())


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory) -> Path:
    import warnings

    folder = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a single-process save warns that no process group exists
        dcp.save({"w": torch.arange(12.0).view(3, 4), "b": torch.ones(3, dtype=torch.bfloat16)}, checkpoint_id=str(folder))
    return folder


@pytest.mark.parametrize("slots", [False, True], ids=["dict-state", "slot-state"])
@pytest.mark.parametrize("name", DCP_GLOBALS)
def test_build_on_a_dcp_metadata_global_is_refused_and_changes_nothing(dcp_folder, tmp_path, name, slots):
    # A metadata pickle that set attributes on pathlib's path class made convert write outside its destination.
    import pathlib
    import shutil

    hostile = tmp_path / "hostile"
    shutil.copytree(dcp_folder, hostile)
    (hostile / ".metadata").write_bytes(_building(name, slots=slots))
    objects = [pathlib.PurePath, pathlib.Path, pathlib.PosixPath, pathlib.PurePosixPath,
               *(found for found in dcp_reader._allowed_globals().values() if hasattr(found, "__dict__"))]
    before = [dict(vars(found)) for found in objects]

    with pytest.raises(mz.MaterializeError, match="hostile"):
        mz.load_tensors(hostile)

    assert [dict(vars(found)) for found in objects] == before
    tensors, _ = mz.load_tensors(dcp_folder)
    assert torch.equal(tensors["w"], torch.arange(12.0).view(3, 4)) and tensors["b"].dtype == torch.bfloat16


@pytest.mark.parametrize("handed_out", [lambda: torchpickle._PLAIN_GLOBALS,
                                        lambda: {".".join(key): found for key, found in dcp_reader._allowed_globals().items()}],
                         ids=["state-dict-reader", "dcp-metadata-reader"])
def test_every_global_a_fast_reader_hands_out_refuses_attribute_writes(handed_out):
    changeable = []
    for name, found in handed_out().items():
        try:
            setattr(found, "dtype", torch.float16)
        except (AttributeError, TypeError):
            continue
        changeable.append(name)

    assert changeable == []


@pytest.mark.parametrize("slots", [False, True], ids=["dict-state", "slot-state"])
@pytest.mark.parametrize("name", ["argparse.Namespace", "pathlib.PosixPath", "collections.defaultdict", "builtins.set"])
def test_build_on_a_class_given_a_stand_in_or_let_through_as_inert_is_refused(genuine, tmp_path, name, slots):
    # These take torch's weights-only reader (stand-ins, inert plain types), whose BUILD takes instances only.
    import argparse
    import collections
    import pathlib

    hostile = _with_data_pkl(genuine / "empty.pt", tmp_path / "hostile.pt", _building(name, slots=slots))
    classes = (argparse.Namespace, pathlib.PosixPath, collections.defaultdict, set)
    before = [dict(vars(cls)) for cls in classes]

    with pytest.raises(mz.MaterializeError, match="hostile.pt"):
        mz.load_tensors(hostile)

    assert [dict(vars(cls)) for cls in classes] == before


# Every opcode whose argument carries an 8-byte length, as pickletools lists them (BINBYTES8, BINUNICODE8, BYTEARRAY8).
_EIGHT_BYTE_LENGTHS = [op for op in pickletools.opcodes if op.arg is not None and op.arg.n == pickletools.TAKEN_FROM_ARGUMENT8U]


@pytest.mark.parametrize("opcode", [op.code.encode("latin-1") for op in _EIGHT_BYTE_LENGTHS],
                         ids=[op.name for op in _EIGHT_BYTE_LENGTHS])
def test_an_argument_claiming_more_bytes_than_the_pickle_holds_is_refused_before_any_unpickler(
        genuine, tmp_path, capfd, opcode):
    # Python's C unpickler allocates the claimed length first; for BYTEARRAY8 CPython 3.11 then prints
    # "SystemError: deallocated bytearray object has exported buffers" (make fuzz found such a data.pkl).
    data = pickle.PROTO + b"\x02" + opcode + struct.pack("<Q", 7_598_807_758_542_761_827) + b"x" * 84
    path = _with_data_pkl(genuine / "genuine.pt", tmp_path / "claims.pt", data)

    with pytest.raises(mz.CheckpointError, match=r"claims\.pt.*data\.pkl is malformed: an argument claims "
                                                 r"7,598,807,758,542,761,827 bytes, more than the 95-byte pickle"):
        mz.open_checkpoint(path)
    assert "SystemError" not in capfd.readouterr().err
    assert mz.load_tensors(genuine / "genuine.pt")[0].keys() == torch.load(genuine / "genuine.pt").keys()
