"""torch files carrying more than weights: classes torch refuses are read as inert stand-ins; calls never run."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import struct
import typing
import warnings
import zipfile
import json
import subprocess
import sys
from pathlib import Path, PureWindowsPath

import pytest
import torch
from torch import nn

import materialize as mz
import preforked

CLI = str(Path(sys.executable).parent / "materialize")
MARKER_ENV = "MATERIALIZE_TEST_MARKER"


class HyperParameters(dict):
    """A dict subclass, as trainers keep their hyper-parameters."""


class Tags(list):
    """A list subclass: pickled as a call-free object whose items are appended to it."""


@dataclasses.dataclass
class RunConfig:
    lr: float
    layers: list


class Loud:
    """Restoring it would leave a marker file: it must never be restored for real."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __setstate__(self, state: dict) -> None:
        Path(state["marker"]).touch()
        self.__dict__.update(state)


class LoudNet(nn.Module):
    def __init__(self, marker: Path) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.register_buffer("scale", torch.arange(3.0))
        self.register_buffer("cache", torch.ones(2), persistent=False)
        self.loud = Loud(marker)

    def __setstate__(self, state: dict) -> None:
        Path(state["loud"].marker).with_suffix(".module").touch()
        super().__setstate__(state)


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class NodeMetadata:
    """What OmegaConf keeps per config node: types as values, and a defaultdict cache."""

    ref_type: object
    object_type: object
    key_type: object
    cache: collections.defaultdict


class ConfigNode:
    """Pickles as OmegaConf's DictConfig does: NEWOBJ, then a state naming types; restoring it leaves a marker."""

    def __init__(self, content: dict, marker: Path) -> None:
        cache = collections.defaultdict(dict)
        cache["resolver"]["now"] = 1
        self.__dict__.update(_metadata=NodeMetadata(typing.Any, dict, int, cache), _content=content, marker=str(marker))

    def __setstate__(self, state: dict) -> None:
        Path(state["marker"]).touch()
        self.__dict__.update(state)


class Getter:
    def __reduce__(self):
        return getattr, (Path("."), "cwd")


class TouchesWhenCalled:
    """Pickles to a call of itself with a path: the real call would create the file."""

    def __init__(self, marker: str) -> None:
        Path(marker).touch()
        self.marker = marker

    def __reduce__(self):
        return TouchesWhenCalled, (self.marker,)


class BuiltFromTensor:
    """Pickles to a call given a tensor: the real call might build weights from it."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    def __reduce__(self):
        return BuiltFromTensor, (self.values,)


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3)}


def test_a_namespace_beside_the_state_dict_is_read_as_a_stand_in(tmp_path):
    weights = _weights()
    path = tmp_path / "research.pt"
    torch.save({"args": argparse.Namespace(lr=0.1, data=str(tmp_path)), "state_dict": weights, "epoch": 7}, path)

    allowed_before = set(map(repr, torch.serialization.get_safe_globals()))
    tensors, report = mz.load_tensors(path)

    assert tensors.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(tensors[name], value), name
    assert set(map(repr, torch.serialization.get_safe_globals())) == allowed_before  # nothing left allowed for the caller's torch.load


def test_trainer_hyper_parameters_dataclasses_and_restorers_never_run(tmp_path):
    weights = _weights()
    marker = tmp_path / "restored"
    path = tmp_path / "trainer.ckpt"
    hyper = HyperParameters(lr=0.1, nested=HyperParameters(depth=2), config=RunConfig(0.1, [1, 2]))
    torch.save({"state_dict": weights, "hyper_parameters": hyper, "callbacks": {"loud": Loud(marker)}}, path)
    model = nn.Module()
    model.fc = nn.Linear(4, 3, device="meta")

    report = mz.load(model, path)

    assert torch.equal(model.fc.weight, weights["fc.weight"]) and torch.equal(model.fc.bias, weights["fc.bias"])
    assert sorted(report.loaded) == ["fc.bias", "fc.weight"]
    assert not marker.exists()


def test_a_pickled_module_opens_without_trust_as_its_state_dict_and_its_code_never_runs(tmp_path):
    marker = tmp_path / "restored"
    source = LoudNet(marker)
    path = tmp_path / "whole.pt"
    torch.save(source, path)

    with mz.open_checkpoint(path) as ckpt:
        assert ckpt.module is None
        names = list(ckpt)
    with mz.meta_init():
        model = LoudNet(marker)
    mz.load(model, path)

    assert names == list(source.state_dict())  # "cache" is not persistent: not in the state dict
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert not marker.exists() and not marker.with_suffix(".module").exists()


def test_a_module_nested_under_model_is_found(tmp_path):
    source = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    path = tmp_path / "nested.pt"
    torch.save({"model": source, "optimizer": {"state": {}}, "step": 3}, path)

    tensors, _ = mz.load_tensors(path)

    assert tensors.keys() == source.state_dict().keys()
    for name, value in source.state_dict().items():
        assert torch.equal(tensors[name], value), name


def test_a_config_object_naming_builtin_types_a_defaultdict_and_paths_is_read_without_running_it(tmp_path):
    weights = _weights()
    marker = tmp_path / "restored"
    path = tmp_path / "hydra.ckpt"
    config = ConfigNode({"layers": [64, 128], "act": "relu", "float_types": [float, str, bool, list, tuple]}, marker)
    hyper = {"cfg": config, "out_dir": Path("/tmp/runs/7"), "data": PureWindowsPath("C:/data")}
    torch.save({"state_dict": weights, "hyper_parameters": hyper, "epoch": 3}, path)

    tensors, report = mz.load_tensors(path)

    assert sorted(report.loaded) == ["fc.bias", "fc.weight"]
    for name, value in weights.items():
        assert torch.equal(tensors[name], value), name
    assert not marker.exists()


def test_a_builtin_other_than_a_plain_type_is_refused_naming_it(tmp_path):
    path = tmp_path / "getattr.pt"
    torch.save({"state_dict": _weights(), "extra": Getter()}, path)

    with pytest.raises(mz.UnsafeCheckpointError, match=r"getattr.pt.*global 'getattr'"):
        mz.open_checkpoint(path)


def test_calls_given_plain_values_are_kept_as_stand_ins_and_never_run(tmp_path):
    weights = _weights()
    marker = tmp_path / "called"
    path = tmp_path / "enum.pt"
    torch.save({"state_dict": weights, "color": Color.RED, "hook": TouchesWhenCalled(str(marker))}, path)
    marker.unlink()  # made by building the object to save; only a call while loading would make it again

    allowed_before = set(map(repr, torch.serialization.get_safe_globals()))
    tensors, report = mz.load_tensors(path)

    assert sorted(report.loaded) == ["fc.bias", "fc.weight"]
    for name, value in weights.items():
        assert torch.equal(tensors[name], value), name
    assert not marker.exists()
    assert set(map(repr, torch.serialization.get_safe_globals())) == allowed_before


def test_a_call_given_a_tensor_is_refused_naming_it_and_loads_with_trust(tmp_path):
    weights = _weights()
    path = tmp_path / "built.pt"
    torch.save({"state_dict": weights, "scale": BuiltFromTensor(torch.ones(3))}, path)

    with pytest.raises(mz.UnsafeCheckpointError) as caught:
        mz.open_checkpoint(path)
    tensors, _ = mz.load_tensors(path, trust_pickle=True)

    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "test_standins.BuiltFromTensor" in message
    assert "trust_pickle" in message and "add_safe_globals" in message
    assert torch.equal(tensors["fc.weight"], weights["fc.weight"])


def test_a_class_the_caller_allows_is_built_by_its_call_without_trusting_the_file(tmp_path):
    weights = _weights()
    path = tmp_path / "enum.pt"
    torch.save({"state_dict": weights, "color": Color.RED}, path)

    with torch.serialization.safe_globals([Color]):
        tensors, report = mz.load_tensors(path)

    assert sorted(report.loaded) == ["fc.bias", "fc.weight"]
    for name, value in weights.items():
        assert torch.equal(tensors[name], value), name


def test_the_cli_loads_a_checkpoint_with_a_namespace(tmp_path):
    weights = _weights()
    path = tmp_path / "research.pt"
    torch.save({"args": argparse.Namespace(lr=0.1), "model": weights}, path)

    done = preforked.run([CLI, str(path), "--json"], capture_output=True, text=True)

    assert done.returncode == 0, done.stderr
    assert sorted(json.loads(done.stdout)["loaded"]) == ["fc.bias", "fc.weight"]


def test_numpy_numbers_beside_the_weights_load_and_numpy_weights_are_named(tmp_path):
    numpy = pytest.importorskip("numpy")
    weights = _weights()
    path = tmp_path / "metrics.pt"
    torch.save({"state_dict": weights, "best_acc1": numpy.float64(0.71), "epoch": numpy.int64(90)}, path)
    arrays = tmp_path / "arrays.pt"
    torch.save({"fc.weight": weights["fc.weight"], "fc.bias": weights["fc.bias"].numpy()}, arrays)

    tensors, _ = mz.load_tensors(path)
    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(arrays)

    assert torch.equal(tensors["fc.weight"], weights["fc.weight"])
    assert "numpy arrays" in str(caught.value) and "fc.bias" in str(caught.value) and str(arrays) in str(caught.value)


def test_plain_state_dicts_skip_torchs_python_unpickler_and_anything_else_takes_it(tmp_path, monkeypatch):
    from torch import _weights_only_unpickler

    torch.manual_seed(0)
    base = torch.randn(6, 4)
    plain = collections.OrderedDict(
        w=nn.Parameter(torch.randn(3, 4)), view=base[1:4, ::2], base=base,
        f8=torch.randn(5).to(torch.float8_e4m3fn), u16=torch.arange(7).to(torch.uint16), bf=torch.randn(2, dtype=torch.bfloat16),
    )
    torch.save({"state_dict": plain, "epoch": 3, "best": 0.5, "name": "run"}, tmp_path / "plain.pt")
    torch.save({"state_dict": _weights(), "args": argparse.Namespace(lr=0.1)}, tmp_path / "namespace.pt")
    slow_reads = []
    original = _weights_only_unpickler.Unpickler.load
    monkeypatch.setattr(_weights_only_unpickler.Unpickler, "load", lambda self: slow_reads.append(1) or original(self))

    tensors, _ = mz.load_tensors(tmp_path / "plain.pt")

    assert slow_reads == []
    for name, value in plain.items():
        assert tensors[name].dtype == value.dtype and torch.equal(tensors[name].double(), value.detach().double()), name
    assert tensors["view"].untyped_storage().data_ptr() == tensors["base"].untyped_storage().data_ptr()  # still one storage
    tensors, _ = mz.load_tensors(tmp_path / "namespace.pt")
    assert slow_reads and torch.equal(tensors["fc.weight"], _weights()["fc.weight"])


def test_shapes_devices_bytes_and_parameters_with_attributes_keep_the_fast_path(tmp_path, monkeypatch):
    from torch import _weights_only_unpickler

    torch.manual_seed(0)
    sharded = nn.Parameter(torch.randn(4, 3))
    sharded.tensor_model_parallel = True  # Megatron marks its parameters so: saved with their state
    state = {"layer.weight": sharded, "layer.bias": torch.randn(4)}
    extras = {"shape": torch.Size([4, 3]), "device": torch.device("cpu"), "blob": b"\x00\xffraw", "seen": {1, 2},
              "z": 1 + 2j, "buffer": bytearray(b"ab"), "counts": collections.Counter("aab")}
    for protocol in (2, 4):  # protocol 2 pickles bytes and sets as calls
        torch.save({"state_dict": state, **extras}, tmp_path / f"p{protocol}.pt", pickle_protocol=protocol)
    slow_reads = []
    original = _weights_only_unpickler.Unpickler.load
    monkeypatch.setattr(_weights_only_unpickler.Unpickler, "load", lambda self: slow_reads.append(1) or original(self))

    for protocol in (2, 4):
        tensors, _ = mz.load_tensors(tmp_path / f"p{protocol}.pt")

        assert slow_reads == [], protocol
        assert set(tensors) == set(state)
        for name, value in state.items():
            assert torch.equal(tensors[name], value.detach()), name


def test_a_list_subclass_is_refused_naming_its_class_unless_trusted(tmp_path):
    path = tmp_path / "tagged.pt"
    torch.save({"state_dict": _weights(), "tags": Tags(["best", "ema"])}, path)

    with pytest.raises(mz.UnsafeCheckpointError) as caught:
        mz.open_checkpoint(path)
    tensors, _ = mz.load_tensors(path, trust_pickle=True)

    message = str(caught.value)
    assert str(path) in message and "Tags', a list subclass" in message and "trust_pickle=True" in message
    assert torch.equal(tensors["fc.weight"], _weights()["fc.weight"])


def test_a_negative_stride_in_a_plain_state_dict_is_still_refused_naming_the_layout(tmp_path):
    path = tmp_path / "negative.pt"
    torch.save({"w": torch.arange(12.0).reshape(3, 4)}, path)
    with zipfile.ZipFile(path) as archive:
        records = {info.filename: archive.read(info) for info in archive.infolist()}
    pickled = next(name for name in records if name.endswith("data.pkl"))
    stride = b"K\x04K\x01\x86"  # (4, 1): two BININT1, TUPLE2
    assert records[pickled].count(stride) == 1
    records[pickled] = records[pickled].replace(stride, b"J" + struct.pack("<i", -4) + b"K\x01\x86")
    with zipfile.ZipFile(path, "w") as archive:  # stored, as torch writes it
        for name, data in records.items():
            archive.writestr(name, data)

    with pytest.raises(mz.CheckpointError, match=r"negative.pt.*negative size, stride or offset \(\[3, 4\], \[-4, 1\]"):
        mz.open_checkpoint(path)


class StartsProcess:
    """Pickles to a call of subprocess.Popen: a class, but of a module whose classes run things."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import subprocess

        return subprocess.Popen, (["touch", self.marker],)


def test_a_call_of_a_class_that_runs_things_is_refused_naming_it(tmp_path):
    marker = tmp_path / "started"
    path = tmp_path / "popen.pt"
    torch.save({"state_dict": _weights(), "hook": StartsProcess(str(marker))}, path)

    with pytest.raises(mz.UnsafeCheckpointError) as caught:
        mz.load_tensors(path)

    message = str(caught.value)  # named as the pickle names it (protocol 2 writes Python 2's 'commands.Popen')
    assert message.startswith(f"{path}: refused to unpickle a call of '") and "Popen'" in message
    assert not marker.exists()


def test_objects_in_a_protocol_3_pickle_load_without_torchs_protocol_warning(tmp_path):
    path = tmp_path / "p3.pt"
    torch.save({"state_dict": _weights(), "args": argparse.Namespace(lr=0.1)}, path, pickle_protocol=3)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's reader warns at a protocol other than its own
        tensors, _ = mz.load_tensors(path)

    assert torch.equal(tensors["fc.weight"], _weights()["fc.weight"])


@pytest.mark.parametrize("protocol", [4, 5])
def test_objects_in_a_protocol_4_or_5_pickle_are_refused_saying_so_unless_trusted(tmp_path, protocol):
    path = tmp_path / f"p{protocol}.pt"
    torch.save({"state_dict": _weights(), "args": argparse.Namespace(lr=0.1)}, path, pickle_protocol=protocol)

    with pytest.raises(mz.UnsupportedFormatError) as caught:
        mz.load_tensors(path)

    message = str(caught.value)
    assert f"pickle protocol {protocol}" in message and "trust_pickle" in message and f"p{protocol}.pt" in message
    tensors, _ = mz.load_tensors(path, trust_pickle=True)
    assert torch.equal(tensors["fc.weight"], _weights()["fc.weight"])


@pytest.mark.parametrize("how", [{"pickle_protocol": 2}, {"pickle_protocol": 5}, {"_use_new_zipfile_serialization": False}])
def test_quantized_tensors_are_refused_naming_them_with_no_warning(tmp_path, how):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates making them
        quantized = [torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8) for _ in range(3)]
    state = collections.OrderedDict([("fc.bias", torch.zeros(4)), ("fc.weight", quantized[0]),
                                     ("head.weight", quantized[1]), ("head.bias", quantized[2])])
    path = tmp_path / "quantized.pt"
    torch.save({"model": state, "epoch": 3}, path, **how)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(mz.UnsupportedFormatError) as caught:
            mz.open_checkpoint(path)

    message = str(caught.value)
    assert message.startswith(f"{path}: tensor 'fc.weight': is quantized (so are head.weight, head.bias)"), message
    assert "dequantize()" in message and "fc.bias" not in message
