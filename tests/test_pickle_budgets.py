"""Tiny hostile pickles that would hang a load or take gigabytes are refused before anything is built, naming the
file and the limit; values a file marks as lazy views (conjugate, negative bit, a layout set after the rebuild)
come out as torch.load's or are refused.

The loads that used to hang or allocate run in one child process with a time limit, so a regression fails
the test instead of stopping the suite; the child reports each refusal and its own peak memory.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch

import materialize as mz
from materialize.checkpoint import pickle_budget

from corpus import (
    PROTO2, doubling_lists_filled_late, doubling_tuples, long_get, nested_lists, pickled_text, with_layout_set_by_build,
)

def _state_dict_pickle(extra_key: bytes, extra_value: bytes) -> bytes:
    """A genuine ``torch.save({"w": ...})`` pickle with one more item set in its dict."""
    genuine = _data_pkl(_genuine_zip())
    assert genuine.endswith(pickle.SETITEM + pickle.STOP)
    return genuine[:-1] + extra_key + extra_value + pickle.SETITEM + pickle.STOP


def _genuine_zip() -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(6.0).view(2, 3)}, buffer)
    return buffer.getvalue()


def _data_pkl(archive: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        return opened.read(next(name for name in opened.namelist() if name.endswith("/data.pkl")))


def _torch_file(path: Path, data_pkl: bytes, *, compress_pickle: bool = False) -> Path:
    with zipfile.ZipFile(io.BytesIO(_genuine_zip())) as source, zipfile.ZipFile(path, "w") as target:
        for record in source.infolist():
            is_pickle = record.filename.endswith("/data.pkl")
            record.compress_type = zipfile.ZIP_DEFLATED if is_pickle and compress_pickle else zipfile.ZIP_STORED
            target.writestr(record, data_pkl if is_pickle else source.read(record))
    return path


# Each writes one hostile file into a folder and returns its path; the child process loads them all.
def _hash_of_a_shared_key(folder: Path) -> Path:  # hashed by the unpickler itself, while it sets the item
    return _torch_file(folder / "key.pt", _state_dict_pickle(doubling_tuples(90), pickle.NONE))


def _walk_of_a_shared_value(folder: Path) -> Path:
    return _torch_file(folder / "value.pt", _state_dict_pickle(pickled_text("junk"), doubling_tuples(90)))


def _lists_filled_late(folder: Path) -> Path:
    return _torch_file(folder / "late.pt", _state_dict_pickle(pickled_text("junk"), doubling_lists_filled_late(90)))


def _shared_persistent_id(folder: Path) -> Path:  # printed in an error message
    return _torch_file(folder / "persid.pt", PROTO2 + doubling_tuples(90) + pickle.BINPERSID + pickle.STOP)


def _deep_nesting(folder: Path) -> Path:  # recursive walks, reprs and comparisons overflow the stack
    return _torch_file(folder / "deep.pt", _state_dict_pickle(pickled_text("junk"), nested_lists(50_000)))


def _bytearray_of_a_count(folder: Path) -> Path:  # 1 KB asking for 3 GB
    call = pickle.GLOBAL + b"builtins\nbytearray\n" + pickle.BININT + struct.pack("<i", 3_000_000_000 // 2) \
        + pickle.TUPLE1 + pickle.REDUCE
    return _torch_file(folder / "bytearray.pt", _state_dict_pickle(pickled_text("junk"), call))


def _tensor_of_a_count(folder: Path) -> Path:  # torch's reader would make a 6 GB float tensor
    call = pickle.GLOBAL + b"torch\nFloatTensor\n" + pickle.BININT + struct.pack("<i", 1_500_000_000) \
        + pickle.TUPLE1 + pickle.REDUCE
    return _torch_file(folder / "tensor.pt", _state_dict_pickle(pickled_text("junk"), call))


def _compressed_pickle(folder: Path) -> Path:  # a few KB inflating to far more
    padding = pickled_text("x" * 4_000_000) + pickle.POP
    genuine = _data_pkl(_genuine_zip())
    return _torch_file(folder / "deflated.pt", genuine[:2] + padding + genuine[2:], compress_pickle=True)


def _dcp_metadata(folder: Path, name: str = "dcp") -> Path:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import warnings

    checkpoint = folder / name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a single-process save warns that no process group exists
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(checkpoint))
    (checkpoint / ".metadata").write_bytes(PROTO2 + pickle.EMPTY_DICT + doubling_tuples(90) + pickle.NONE
                                           + pickle.SETITEM + pickle.STOP)
    return checkpoint


def _legacy_magic_number(folder: Path) -> Path:  # the legacy format's leading plain-data pickles
    path = folder / "legacy.pt"
    path.write_bytes(PROTO2 + pickle.EMPTY_DICT + doubling_tuples(90) + pickle.NONE + pickle.SETITEM + pickle.STOP)
    return path


def _flooded_dict(count: int, key: Callable[[int], bytes] = lambda k: _long(k * (2**61 - 1))) -> bytes:
    """A dict of ``count`` keys that all hash alike: the C unpickler builds it in quadratic time."""
    return pickle.EMPTY_DICT + pickle.MARK + b"".join(key(k) + pickle.NONE for k in range(1, count + 1)) + pickle.SETITEMS


def _long(value: int) -> bytes:
    encoded = pickle.encode_long(value)
    return pickle.LONG1 + bytes([len(encoded)]) + encoded


def _hash_flooded_state_dict(folder: Path) -> Path:  # 2.4 MB
    return _torch_file(folder / "flooded.pt", _state_dict_pickle(pickled_text("junk"), _flooded_dict(200_000)))


def _hash_flooded_tuple_keys(folder: Path) -> Path:  # a tuple's hash mixes its items' hashes: equal items, equal hashes
    key = lambda k: pickle.BININT1 + b"\x01" + _long(k * (2**61 - 1)) + pickle.TUPLE2  # noqa: E731
    return _torch_file(folder / "tuples.pt", _state_dict_pickle(pickled_text("junk"), _flooded_dict(100_000, key)))


def _hash_flooded_set(folder: Path) -> Path:
    items = b"".join(_long(k * (2**61 - 1)) for k in range(1, 100_001))
    flooded = pickle.EMPTY_SET + pickle.MARK + items + pickle.ADDITEMS
    return _torch_file(folder / "set.pt", _state_dict_pickle(pickled_text("junk"), flooded))


def _hash_flooded_ordered_dict_call(folder: Path) -> Path:  # OrderedDict([(k, None), ...]) hashes in the call
    pairs = b"".join(_long(k * (2**61 - 1)) + pickle.NONE + pickle.TUPLE2 + pickle.APPEND for k in range(1, 100_001))
    call = pickle.GLOBAL + b"collections\nOrderedDict\n" + pickle.EMPTY_LIST + pairs + pickle.TUPLE1 + pickle.REDUCE
    return _torch_file(folder / "ordered.pt", _state_dict_pickle(pickled_text("junk"), call))


def _hash_flooded_dcp_metadata(folder: Path) -> Path:
    checkpoint = _dcp_metadata(folder, name="dcp-flooded")
    (checkpoint / ".metadata").write_bytes(PROTO2 + _flooded_dict(200_000) + pickle.STOP)
    return checkpoint


def _hash_flooded_legacy_pickle(folder: Path) -> Path:  # under the 1 MiB cap on a legacy file's leading pickles
    path = folder / "legacy-flooded.pt"
    path.write_bytes(PROTO2 + _flooded_dict(80_000) + pickle.STOP)
    assert path.stat().st_size < 1 << 20
    return path


HOSTILE = {
    "hash of a shared key": (_hash_of_a_shared_key, "objects"),
    "walk of a shared value": (_walk_of_a_shared_value, "objects"),
    "lists filled after they were shared": (_lists_filled_late, "objects"),
    "shared persistent id": (_shared_persistent_id, "objects"),
    "nesting 50,000 deep": (_deep_nesting, "deep"),
    "bytearray of a count": (_bytearray_of_a_count, "builtins.bytearray with a count"),
    "tensor of a count": (_tensor_of_a_count, "torch.FloatTensor with a count"),
    "compressed data.pkl": (_compressed_pickle, "compressed"),
    "DCP metadata": (_dcp_metadata, "objects"),
    "legacy leading pickle": (_legacy_magic_number, "objects"),
    "hash-flooded state dict": (_hash_flooded_state_dict, "hash alike"),
    "hash-flooded tuple keys": (_hash_flooded_tuple_keys, "hash alike"),
    "hash-flooded set": (_hash_flooded_set, "hash alike"),
    "hash-flooded OrderedDict call": (_hash_flooded_ordered_dict_call, "hash alike"),
    "hash-flooded DCP metadata": (_hash_flooded_dcp_metadata, "hash alike"),
    "hash-flooded legacy pickle": (_hash_flooded_legacy_pickle, "hash alike"),
}

_CHILD = textwrap.dedent("""
    import json, resource, sys
    import materialize as mz
    results = {}
    for name, path in json.loads(sys.argv[1]).items():
        try:
            mz.load_tensors(path)
            results[name] = ["loaded", ""]
        except Exception as error:
            results[name] = [type(error).__name__, str(error), isinstance(error, mz.MaterializeError)]
    results["peak kB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("hostile")
    paths = {name: str(write(folder)) for name, (write, _) in HOSTILE.items()}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(paths)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    outcomes = json.loads(done.stdout.splitlines()[-1])
    outcomes["paths"] = paths
    return outcomes


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_tiny_hostile_pickle_is_refused_naming_the_file_and_the_limit(outcomes, case):
    kind, message, is_ours = outcomes[case]

    assert is_ours, f"{kind}: {message}"
    assert Path(outcomes["paths"][case]).name in message
    assert HOSTILE[case][1] in message
    assert len(message) < 400  # the file's objects are not printed whole


def test_the_refusals_took_no_memory_the_files_asked_for(outcomes):
    assert outcomes["peak kB"] < 1_500_000  # ~0.5 GB of it is torch itself; the files asked for 3 and 6 GB


def test_the_limits_are_stated_where_refusals_name_them():
    assert pickle_budget.MAX_DEPTH == 200 and pickle_budget.OBJECTS_PER_BYTE == 16
    reliability = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    assert "200" in reliability and "16 per byte" in reliability


def test_keys_whose_hash_is_not_chosen_by_the_file_load_however_many(tmp_path):
    # An optimizer's state is keyed by parameter index, a DCP's storage by (name, offsets): small integers and
    # tuples of them, which the flood bound leaves alone; a few keys of any kind pass too.
    state = {"w": torch.arange(3.0), "steps": {k: None for k in range(20_000)},
             "offsets": {("layer", k, 2 * k): None for k in range(20_000)},
             "by_rate": {0.1 * k: None for k in range(100)}, "big": {2**40 + k: None for k in range(100)}}
    torch.save(state, tmp_path / "keys.pt")

    tensors, _ = mz.load_tensors(tmp_path / "keys.pt")

    assert list(tensors) == ["w"] and torch.equal(tensors["w"], torch.arange(3.0))


def test_the_flood_bound_counts_only_where_the_unpickler_hashes():
    big_ints = PROTO2 + pickle.EMPTY_LIST + pickle.MARK + _long(2**61 - 1) * 50_000 + pickle.APPENDS + pickle.STOP
    floats_as_values = PROTO2 + _flooded_dict(50_000, key=lambda k: pickled_text(str(k))).replace(
        pickle.NONE, pickle.BINFLOAT + struct.pack(">d", 0.5)) + pickle.STOP

    for data in (big_ints, floats_as_values):
        pickle_budget.check_budget(data, path="x.pt", what="data.pkl")  # lists and values are never hashed
    with pytest.raises(mz.MaterializeError, match=r"x\.pt.*8,192.*hash alike"):
        pickle_budget.check_budget(PROTO2 + _flooded_dict(pickle_budget.MAX_CHOSEN_HASHES + 1) + pickle.STOP,
                                   path="x.pt", what="data.pkl")
    pickle_budget.check_budget(PROTO2 + _flooded_dict(pickle_budget.MAX_CHOSEN_HASHES) + pickle.STOP,
                               path="x.pt", what="data.pkl")


def test_a_structure_just_inside_the_depth_limit_loads_as_torch_load(tmp_path):
    # Nested dicts read as dotted names: ``a.a.a....w``, 150 levels down.
    state: dict = {"w": torch.arange(3.0)}
    for _ in range(150):
        state = {"a": state}
    torch.save(state, tmp_path / "nested.pt")

    tensors, _ = mz.load_tensors(tmp_path / "nested.pt")

    assert list(tensors) == ["a." * 150 + "w"]
    assert torch.equal(tensors["a." * 150 + "w"], torch.arange(3.0))


def test_a_state_dict_that_holds_itself_and_shares_tensors_loads_as_torch_load(tmp_path):
    shared = torch.randn(4, 4)
    state: dict = {"embed.weight": shared, "head.weight": shared, "norm.weight": torch.ones(4)}
    state["self"] = state  # a cycle: counted once, as a walk that remembers what it saw meets it
    torch.save(state, tmp_path / "cyclic.pt")

    tensors, _ = mz.load_tensors(tmp_path / "cyclic.pt")
    expected = torch.load(tmp_path / "cyclic.pt", weights_only=True)

    for name in ("embed.weight", "head.weight", "norm.weight"):
        assert torch.equal(tensors[name], expected[name])


@pytest.mark.parametrize("view, bit", [(lambda x: x.conj(), "conjugate"), (lambda x: x._neg_view(), "negative")])
def test_a_tensor_saved_as_a_lazy_conjugate_or_negative_view_is_refused_naming_it(tmp_path, view, bit):
    # torch.load gives the resolved values; the stored bytes are the unresolved ones.
    original = torch.randn(3, dtype=torch.complex64)
    torch.save({"ok": torch.ones(2), "lazy": view(original)}, tmp_path / "lazy.pt")
    assert not torch.equal(torch.load(tmp_path / "lazy.pt", weights_only=True)["lazy"].resolve_conj().resolve_neg(),
                           original)

    with pytest.raises(mz.MaterializeError, match=rf"lazy.pt.*lazy.*{bit} bit.*resolve_"):
        mz.load_tensors(tmp_path / "lazy.pt")


@pytest.mark.parametrize("stride", [-1, 1], ids=["negative", "positive"])
def test_a_layout_set_after_the_rebuild_loads_as_torch_load_or_is_refused(tmp_path, stride):
    layout = pickle.BININT1 + b"\x01" + pickle.BININT1 + b"\x02" + pickle.TUPLE1 \
        + pickle.BININT + struct.pack("<i", stride) + pickle.TUPLE1  # offset 1, size (2,), stride (stride,)
    path = _torch_file(tmp_path / "build.pt", with_layout_set_by_build(layout))

    try:
        expected = torch.load(path, weights_only=True)
    except Exception:  # torch refuses the negative stride
        with pytest.raises(mz.MaterializeError, match="build.pt.*negative"):
            mz.load_tensors(path)
        assert stride < 0
        return
    tensors, _ = mz.load_tensors(path)
    assert expected["w"].shape == (2,) and torch.equal(tensors["w"], expected["w"])


def test_instance_attributes_a_file_sets_on_its_ordered_dict_change_nothing_read(tmp_path):
    # BUILD on an OrderedDict sets instance attributes, as torch's reader does too; ``items`` among them
    # must not replace the dict's own items when the state dict is read.
    genuine = _data_pkl(_genuine_zip())
    ordered = (PROTO2 + pickle.GLOBAL + b"collections\nOrderedDict\n" + pickle.EMPTY_TUPLE + pickle.REDUCE
               + pickle.EMPTY_DICT + pickle.MARK + pickled_text("items") + pickle.BININT1 + b"\x05" + pickled_text("get") + pickle.NONE
               + pickled_text("keys") + pickle.NONE + pickle.SETITEMS + pickle.BUILD)
    path = _torch_file(tmp_path / "attrs.pt", ordered + genuine[genuine.index(pickled_text("w")):])
    expected = torch.load(path, weights_only=True)
    assert expected.items == 5

    tensors, _ = mz.load_tensors(path)

    assert list(tensors) == ["w"] and torch.equal(tensors["w"], expected["w"])


def test_a_genuine_bytearray_beside_the_weights_still_loads(tmp_path):
    torch.save({"w": torch.arange(3.0), "blob": bytearray(b"\x00\x01abc")}, tmp_path / "blob.pt")

    tensors, _ = mz.load_tensors(tmp_path / "blob.pt")

    assert torch.equal(tensors["w"], torch.arange(3.0))


def test_the_scan_accepts_what_torch_save_writes_and_counts_a_shared_chain_exactly():
    state = collections.OrderedDict((f"layer.{i}.weight", torch.zeros(2)) for i in range(100))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    pickle_budget.check_budget(_data_pkl(buffer.getvalue()), path="genuine.pt", what="data.pkl")

    objects, depth, _, _ = pickle_budget._scan(PROTO2 + doubling_tuples(10, first=0) + pickle.STOP, limit=10**9)
    assert (objects, depth) == (2**11 - 1, 10)  # the innermost None counts one, nests none
    late_objects, late_depth, _, _ = pickle_budget._scan(PROTO2 + doubling_lists_filled_late(10, first=0) + pickle.STOP, limit=10**9)
    assert (late_objects, late_depth) == (2**11 - 1, 11)
