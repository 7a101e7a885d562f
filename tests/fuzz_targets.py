"""Fuzz targets for the checkpoint readers, and the hypothesis strategies that feed them.

Every target takes the bytes of one input file, writes them into a temporary
folder of its own and opens them the way a user would. The contract checked
is the one DESIGN.md states for bad input: opening and loading either succeed
or raise a ``MaterializeError`` subclass; any other exception (``TypeError``,
``RuntimeError``, ``OverflowError`` ...) is a bug, and so is a successful
open whose ``TensorInfo`` points outside its file, or a load that returns
other bytes than the file holds.

Because every input is plain bytes, a failing input saved to a file is a
reproducer by itself: ``TARGETS[name](path.read_bytes())``.

Used by ``tests/test_fuzz_short.py`` (a few hundred examples, part of
``make test``) and by ``python -m fuzz.run --seconds N`` (the long run).
"""

from __future__ import annotations

import functools
import io
import json
import math
import pickle
import pickletools
import struct
import tempfile
import traceback
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from hypothesis import strategies as st
from safetensors.torch import save_file

import materialize as mz

# ---------------------------------------------------------------- invariants shared by the targets


def _file_size(path: Path) -> int:
    return path.stat().st_size


def _check_infos_inside(ckpt: mz.Checkpoint, *, folder: Path | None = None) -> None:
    """Every TensorInfo is a real tensor whose bytes lie inside its file, and that file inside ``folder``.

    A tensor assembled from pieces (DCP chunks) is checked piece by piece.
    """
    for name, info in ckpt.items():
        pieces = getattr(info, "pieces", None)
        for one in [piece.info for piece in pieces] if pieces else [info]:
            _check_info_inside(name, one, folder)


def _check_info_inside(name: str, info: Any, folder: Path | None) -> None:
    size = _file_size(Path(info.path))
    assert all(d >= 0 for d in info.shape), f"{name}: negative dimension in shape {info.shape}"
    assert info.stride is None or all(s >= 0 for s in info.stride), f"{name}: negative stride {info.stride}"
    assert info.offset >= 0, f"{name}: negative offset {info.offset}"
    if info.numel and info.stride is not None:
        # The span read must cover the last element the strides reach.
        reach = (sum((d - 1) * s for d, s in zip(info.shape, info.stride)) + 1) * info.itemsize
        assert info.read_nbytes >= reach, f"{name}: reads {info.read_nbytes} bytes, elements reach {reach}"
    assert info.read_nbytes >= 0, f"{name}: negative byte count {info.read_nbytes}"
    assert info.offset + info.read_nbytes <= size, (
        f"{name}: bytes [{info.offset}, {info.offset + info.read_nbytes}) outside {info.path} ({size} bytes)"
    )
    if folder is not None:
        real = Path(info.path).resolve()
        assert real.is_relative_to(folder.resolve()), f"{name}: {info.path} resolves to {real}, outside {folder}"


def _load_both_ways(path: Path) -> list[dict[str, torch.Tensor]]:
    """``load_tensors`` with reads and with mmap; each must succeed or raise a MaterializeError.

    Returns the results that succeeded, so callers can compare their bytes.
    """
    loaded = []
    for mmap in (False, True):
        try:
            tensors, _report = mz.load_tensors(path, mmap=mmap)
        except mz.MaterializeError:
            continue
        loaded.append(tensors)
    return loaded


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sweep_flipped_bytes(base: bytes, positions: Iterable[int], path: Path) -> None:
    """Flip each byte of a torch file in turn: we refuse it (naming the file) or read what torch.load reads.

    Never a file torch.load refuses (locations aside: both read to the CPU),
    but one: a flip in the name of a class called with plain values (the
    ``OrderedDict`` of a tensor's hooks) makes a class torch does not know,
    which we keep as an inert stand-in (see materialize.checkpoint.standins);
    then what we read must be every tensor of the undamaged file, unchanged.
    The sweep must see both outcomes.
    """
    path.write_bytes(base)
    undamaged = torch.load(path, weights_only=True, map_location="cpu")
    accepted = refused = 0
    for position in positions:
        damaged = bytearray(base)
        damaged[position] ^= 0x01
        path.write_bytes(bytes(damaged))
        try:
            ours = mz.load_tensors(path)[0]
        except mz.MaterializeError as error:
            assert str(path) in str(error), (position, error)
            refused += 1
            continue
        try:
            theirs = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as error:
            assert "Unsupported global" in str(error), f"byte {position}: we loaded a file torch.load refuses: {error}"
            theirs = undamaged
            assert ours.keys() == undamaged.keys(), position
        accepted += 1
        for name, tensor in ours.items():
            want = theirs[name]
            assert (tensor.dtype, tensor.shape) == (want.dtype, want.shape), (position, name)
            assert raw_bytes(tensor) == raw_bytes(want), (position, name)
    assert accepted and refused  # the sweep exercised both outcomes


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements as they lie in memory, whatever its dtype and strides.

    Viewed as the integer type of the same size first (allowed at any
    stride), so that copying cannot touch the bits: a float copy could in
    principle quiet a NaN, and a bool copy turns the byte 2 into 1.
    """
    as_int = tensor.view(_SAME_SIZE_INT[tensor.element_size()])
    flat = torch.empty(tensor.numel(), dtype=as_int.dtype)  # fresh and 1-D: .view(uint8) needs stride 1
    flat.copy_(as_int.reshape(-1))
    return flat.view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------- target: safetensors file


def safetensors_header(data: bytes) -> None:
    """``data`` is a whole ``.safetensors`` file."""
    with tempfile.TemporaryDirectory(prefix="fuzz-st-") as tmp:
        path = Path(tmp) / "model.safetensors"
        path.write_bytes(data)
        try:
            ckpt = mz.open_checkpoint(path)
        except mz.MaterializeError:
            return
        with ckpt:
            _check_infos_inside(ckpt)
            if len(data) >= 8:
                # No tensor may start inside the 8-byte prefix or the JSON header itself.
                data_start = 8 + struct.unpack("<Q", data[:8])[0]
                for name, info in ckpt.items():
                    assert info.offset >= data_start, f"{name}: offset {info.offset} inside the header"
            infos = dict(ckpt.items())
        for tensors in _load_both_ways(path):
            assert set(tensors) == set(infos)
            for name, tensor in tensors.items():
                info = infos[name]
                assert tensor.dtype == info.dtype and tuple(tensor.shape) == info.shape, name
                assert raw_bytes(tensor) == data[info.offset: info.offset + info.nbytes], name


# Strategies: raw bytes, and the same bytes behind a length prefix that fits,
# so that the JSON parser is reached more than once in 2**64 tries.
def _with_length_prefix(header: bytes, rest: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + rest


raw_safetensors = st.one_of(
    st.binary(max_size=256),
    st.builds(_with_length_prefix, st.binary(max_size=200), st.binary(max_size=64)),
    st.builds(lambda b: b"{" + b, st.binary(max_size=64)).map(lambda h: _with_length_prefix(h, b"")),
)

VALID_ST_DTYPES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "C64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
}
INVALID_ST_DTYPES = ["F99", "f32", "", "float32", "F32 ", "C128", "F4", "I128", "__metadata__", "BOOL\u0000"]


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """Pick a strategy with integer weights, then draw from it.

    (``st.one_of`` cannot weight: it merges repeated and nested branches.)
    """
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(pool).flatmap(lambda strategy: strategy)


# Any JSON value, small: what a hostile header can hold where a field belongs.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


class RawJson(str):
    """JSON text written as it is: what ``json.dumps`` would never produce."""


# Text a JSON parser must survive: nesting deeper than Python's recursion
# limit, integers longer than Python's int-from-string digit limit (4300),
# non-standard constants, huge exponents.
hostile_json = st.sampled_from([
    RawJson("[" * 100_000 + "]" * 100_000),
    RawJson('{"x":' * 50_000 + "0" + "}" * 50_000),
    RawJson("9" * 5_000),
    RawJson("[" + "1" * 4_400 + "]"),
    RawJson("[0, " + "7" * 4_301 + "]"),
    RawJson("NaN"), RawJson("[Infinity]"), RawJson("[-Infinity, 1]"), RawJson("1e999"), RawJson("[1e999]"),
    RawJson("[1.0, 2]"), RawJson("[-0]"), RawJson('"\\ud800"'),
])


def to_json(value: Any) -> str:
    if isinstance(value, RawJson):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{to_json(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


# Dimensions: mostly small, sometimes the values a validator must refuse or survive.
_small_shapes = st.lists(st.integers(0, 4), max_size=4)
_hostile_dims = st.one_of(
    st.integers(-3, -1),
    st.sampled_from([2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, 2**70]),
    st.integers(5, 2**80),
    st.booleans(),
    st.floats(allow_nan=True),
    st.sampled_from(["1", None]),
)
_shapes = weighted(
    (20, _small_shapes),
    # A zero beside a huge dimension: zero bytes, so no offset check can refuse it.
    (3, st.lists(st.sampled_from([0, 0, 1, 3, 2**31, 2**62, 2**63 - 1, 2**63, 2**64 + 1]), min_size=2, max_size=4)),
    (3, st.lists(st.integers(0, 4) | _hostile_dims, min_size=1, max_size=4)),
    (1, st.lists(st.just(1), min_size=60, max_size=80)),  # past torch's dimension limits
    (1, st.lists(st.just(0), min_size=60, max_size=80)),
    (1, json_values),
    (1, hostile_json),
)
_tensor_names = weighted(
    (4, st.sampled_from(["a", "b", "weight", "layer.0.bias", "model.embed_tokens.weight"])),
    (1, st.sampled_from(["", " ", "__metadata__ ", "a/../b", "\u0000", "é", "\ud800"])),
    (2, st.text(max_size=10)),
)
_dtypes = weighted(
    (16, st.sampled_from(sorted(VALID_ST_DTYPES))),
    (1, st.sampled_from(INVALID_ST_DTYPES)),
    (1, json_values),
)
_offsets = st.one_of(
    st.lists(st.one_of(st.integers(-5, 300), st.integers(-(2**70), 2**70)), max_size=3),
    json_values,
    hostile_json,
)


@dataclass
class _Entry:
    name: str
    dtype: Any = None
    shape: Any = None
    offsets_mode: str = "tiled"  # "tiled" (laid end to end, as a writer would), "shifted" or "random"
    offsets: Any = None
    shift: tuple[int, int] = (0, 0)
    extra_keys: dict | None = None
    as_value: Any = None  # not None: the entry is this JSON value instead of an object


@st.composite
def _entries(draw: st.DrawFn) -> _Entry:
    # Fields are drawn only where they are used: generation is most of a fuzz example's cost.
    entry = _Entry(name=draw(_tensor_names))
    kind = draw(st.sampled_from(["object"] * 28 + ["json", "hostile"]))
    if kind != "object":
        entry.as_value = draw(json_values if kind == "json" else hostile_json)
        return entry
    entry.dtype = draw(_dtypes)
    entry.shape = draw(_shapes)
    entry.offsets_mode = draw(st.sampled_from(["tiled"] * 8 + ["shifted", "random"]))
    if entry.offsets_mode == "random":
        entry.offsets = draw(_offsets)
    elif entry.offsets_mode == "shifted":
        entry.shift = draw(st.tuples(st.integers(-9, 9), st.integers(-9, 9)))
    if draw(st.sampled_from([False] * 9 + [True])):
        entry.extra_keys = draw(st.dictionaries(st.sampled_from(["extra", "dtype ", "offset"]), json_values, max_size=1))
    return entry


def _nbytes(dtype: Any, shape: Any) -> int | None:
    """The byte size a well-formed entry would need, or None when the entry is not well formed."""
    if not isinstance(dtype, str) or dtype not in VALID_ST_DTYPES or not isinstance(shape, list):
        return None
    if not all(type(d) is int and d >= 0 for d in shape):
        return None
    size = math.prod(shape) * VALID_ST_DTYPES[dtype]
    return size if size <= 4096 else None


@st.composite
def structured_safetensors(draw: st.DrawFn) -> bytes:
    """A file with a plausible header: entries laid end to end, most of them valid, a few perturbed.

    Mostly-valid files matter: an entry is only checked after the ones
    before it pass, and only a file that opens reaches ``load_tensors``.
    """
    # Duplicate names are one defect among many: in one file out of ten.
    unique = draw(st.sampled_from([True] * 9 + [False]))
    entries = draw(st.lists(_entries(), max_size=5, unique_by=(lambda e: e.name) if unique else None))
    pairs: list[tuple[str, Any]] = []
    position = 0
    for entry in entries:
        if entry.as_value is not None:
            pairs.append((entry.name, entry.as_value))
            continue
        size = _nbytes(entry.dtype, entry.shape)
        if entry.offsets_mode == "random":
            offsets = entry.offsets
        else:
            size = size if size is not None else 4  # an entry broken elsewhere still takes some bytes
            offsets = [position, position + size]
            position += size
            if entry.offsets_mode == "shifted":
                offsets = [offsets[0] + entry.shift[0], offsets[1] + entry.shift[1]]
        body = {"dtype": entry.dtype, "shape": entry.shape, "data_offsets": offsets, **(entry.extra_keys or {})}
        pairs.append((entry.name, body))
    metadata = draw(weighted(
        (10, st.none()),
        (8, st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)),
        (1, json_values),
        (1, hostile_json),
    ))
    if metadata is not None:
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", metadata))
    # The object is written by hand so that duplicate names and raw JSON reach the parser.
    header = "{" + ",".join(f"{to_json(name)}:{to_json(value)}" for name, value in pairs) + "}"
    header_bytes = header.encode("utf-8", "surrogatepass") + b" " * draw(st.integers(0, 7))
    data_size = max(0, position + draw(weighted((12, st.just(0)), (1, st.sampled_from([-1, 1, -4, 8])))))
    data = draw(st.binary(min_size=data_size, max_size=data_size))
    prefix = len(header_bytes)
    if draw(st.sampled_from([False] * 19 + [True])):
        prefix = draw(st.integers(0, 2**64 - 1))
    return struct.pack("<Q", prefix) + header_bytes + data


# ---------------------------------------------------------------- target: shard index

# The folder every shard_index example runs in:
#   root/outside.safetensors          a valid file outside the checkpoint folder
#   root/ckpt/s1.safetensors          tensors a, b
#   root/ckpt/s2.safetensors          tensor c
#   root/ckpt/shard.bin               torch file, tensor d
#   root/ckpt/sub/                    a folder, where a shard file is expected
#   root/ckpt/link_in.safetensors  -> s2.safetensors (inside: allowed)
#   root/ckpt/link_out.safetensors -> ../outside.safetensors (refused)
#   root/ckpt/model.safetensors.index.json   the fuzz data
# ROOT_MARKER in the data is replaced by root's absolute path (JSON-escaped),
# so absolute shard paths to real files can be expressed in saved inputs.
ROOT_MARKER = b"@ROOT@"
REAL_SHARDS = ["s1.safetensors", "s2.safetensors", "shard.bin", "link_in.safetensors"]


@functools.cache
def _shard_files() -> dict[str, bytes]:
    """The fixture files' bytes, made once per process with the real writers."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_file({"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.float16)}, str(folder / "s1"))
        save_file({"c": torch.tensor([1, -2, 3], dtype=torch.int64)}, str(folder / "s2"))
        save_file({"z": torch.zeros(2)}, str(folder / "outside"))
        torch.save({"d": torch.arange(6, dtype=torch.int16).reshape(2, 3)}, folder / "shard")
        return {
            "s1.safetensors": (folder / "s1").read_bytes(),
            "s2.safetensors": (folder / "s2").read_bytes(),
            "shard.bin": (folder / "shard").read_bytes(),
            "outside.safetensors": (folder / "outside").read_bytes(),
        }


def shard_index(data: bytes) -> None:
    """``data`` is the content of ``model.safetensors.index.json`` beside a few real shards."""
    files = _shard_files()
    with tempfile.TemporaryDirectory(prefix="fuzz-index-") as tmp:
        root = Path(tmp).resolve()
        folder = root / "ckpt"
        folder.mkdir()
        (root / "outside.safetensors").write_bytes(files["outside.safetensors"])
        for name in ("s1.safetensors", "s2.safetensors", "shard.bin"):
            (folder / name).write_bytes(files[name])
        (folder / "sub").mkdir()
        (folder / "link_in.safetensors").symlink_to("s2.safetensors")
        (folder / "link_out.safetensors").symlink_to(root / "outside.safetensors")
        index = folder / "model.safetensors.index.json"
        index.write_bytes(data.replace(ROOT_MARKER, json.dumps(str(root))[1:-1].encode()))
        try:
            ckpt = mz.open_checkpoint(index)
        except mz.MaterializeError:
            return
        with ckpt:
            _check_infos_inside(ckpt, folder=folder)
            for shard in ckpt.shards:
                assert shard.resolve().is_relative_to(folder), f"shard {shard} outside {folder}"
            names = set(ckpt)
        for tensors in _load_both_ways(index):
            assert set(tensors) == names


_weight_map_values = weighted(
    (8, st.sampled_from(REAL_SHARDS)),
    (6, st.sampled_from([
        "../outside.safetensors", "../ckpt/s1.safetensors", "@ROOT@/outside.safetensors",
        "@ROOT@/ckpt/s1.safetensors", "/etc/passwd", "missing.safetensors", "sub", "sub/../s1.safetensors",
        "./s1.safetensors", "s1.safetensors/", "link_out.safetensors", "", " ", "s1.safetensors\u0000",
        "model.safetensors.index.json", ".", "..", "//s1.safetensors", "~/s1.safetensors",
        "link_in.safetensors/../s1.safetensors", "s1.safetensors/x", "x" * 300 + ".safetensors",
        "sub/" + "y" * 256, "@ROOT@/ckpt/" + "z" * 4000,
    ])),
    (2, st.text(max_size=12)),
    (2, json_values),
    (1, hostile_json),
)
_weight_map_keys = st.one_of(st.sampled_from(["a", "b", "c", "d", "z", "ghost"]), st.text(max_size=6))


@st.composite
def structured_index(draw: st.DrawFn) -> bytes:
    """An index document shaped like Hugging Face's, with hostile values where it counts."""
    weight_map = draw(weighted(
        (6, st.dictionaries(_weight_map_keys, _weight_map_values, max_size=6)),
        # Correct maps, so that the success path is exercised too.
        (1, st.just({"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors", "d": "shard.bin"})),
        (1, st.just({"c": "link_in.safetensors"})),
        (1, json_values),
        (1, hostile_json),
    ))
    document: Any = {"weight_map": weight_map}
    if draw(st.booleans()):
        document["metadata"] = draw(st.one_of(st.just({"total_size": 0}), json_values, hostile_json))
    if draw(st.sampled_from([False] * 9 + [True])):
        document = draw(json_values | hostile_json)
    text = to_json(document).encode("utf-8", "surrogatepass")
    if draw(st.sampled_from([False] * 9 + [True])):  # a cut-off document
        text = text[: draw(st.integers(0, len(text)))]
    return text


raw_index = st.one_of(st.binary(max_size=200), st.text(max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass")))


# ---------------------------------------------------------------- target: torch zip file


def torch_zip(data: bytes) -> None:
    """``data`` is a whole ``.pt`` file (a mutated ``torch.save`` zip)."""
    with tempfile.TemporaryDirectory(prefix="fuzz-pt-") as tmp:
        path = Path(tmp) / "model.pt"
        path.write_bytes(data)
        try:
            ckpt = mz.open_checkpoint(path)
        except mz.MaterializeError:
            return
        with ckpt:
            _check_infos_inside(ckpt)
            infos = dict(ckpt.items())
        loaded = _load_both_ways(path)
        for tensors in loaded:
            assert set(tensors) == set(infos)
            for name, tensor in tensors.items():
                assert tensor.dtype == infos[name].dtype and tuple(tensor.shape) == infos[name].shape, name
        if loaded:
            _compare_with_torch_load(path, loaded)


def _compare_with_torch_load(path: Path, loaded: list[dict[str, torch.Tensor]]) -> None:
    """Where torch itself reads the same file as a flat state dict, the values must agree."""
    try:
        reference = torch.load(path, weights_only=True, map_location="cpu")
    except Exception:
        return  # torch refuses what we accepted: stricter is not wrong, and not our bug
    if not isinstance(reference, dict) or not all(isinstance(v, torch.Tensor) for v in reference.values()):
        return
    reference = {str(k): v for k, v in reference.items()}
    for tensors in loaded:
        if set(tensors) != set(reference):
            return
        for name, tensor in tensors.items():
            want = reference[name]
            assert (tensor.dtype, tuple(tensor.shape)) == (want.dtype, tuple(want.shape)), name
            if tensor.numel() > _MAX_COPIED_ELEMENTS:  # an expanded view, as torch.load gives it: too big to copy
                assert (tensor.stride(), tensor.storage_offset()) == (want.stride(), want.storage_offset()), name
                assert _span_bytes(tensor) == _span_bytes(want), f"{name}: bytes differ from torch.load's"
                continue
            assert raw_bytes(tensor) == raw_bytes(want), f"{name}: bytes differ from torch.load's"


_MAX_COPIED_ELEMENTS = 1 << 24


def _span_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of the storage a view covers, from its first element to its last."""
    last = tensor.storage_offset() + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    size = tensor.element_size()
    whole = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return whole[tensor.storage_offset() * size:(last + 1) * size].numpy().tobytes()


@functools.cache
def torch_base_file() -> bytes:
    """A small real ``torch.save`` file: shared storage, a strided view, a scalar, an empty tensor."""
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {
        "weight": weight,
        "row": weight[1],  # a view at an offset in weight's storage
        "weight_t": weight.t(),  # a transposed (non-contiguous) view of the same storage
        "half": torch.tensor([1.5, -0.0, float("inf")], dtype=torch.bfloat16),
        "step": torch.tensor(7),
        "empty": torch.empty(0, 3),
        "mask": torch.tensor([True, False]),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


# One mutation: (kind, position, value). Positions are taken modulo the
# current length, so any integer is a valid position.
_mutations = st.tuples(
    st.sampled_from(["flip", "set", "insert", "delete", "truncate"]),
    st.integers(0, 2**16),
    st.integers(0, 255),
    st.binary(min_size=1, max_size=8),
)


def _mutate(data: bytes, mutations: list[tuple[str, int, int, bytes]]) -> bytes:
    buf = bytearray(data)
    for kind, position, value, chunk in mutations:
        if not buf and kind != "insert":
            continue
        at = position % (len(buf) + (1 if kind == "insert" else 0))
        if kind == "flip":
            buf[at] ^= 1 << (value % 8)
        elif kind == "set":
            buf[at] = value
        elif kind == "insert":
            buf[at:at] = chunk
        elif kind == "delete":
            del buf[at: at + 1 + value % 16]
        else:
            del buf[at:]
    return bytes(buf)


@st.composite
def mutated_torch_bytes(draw: st.DrawFn) -> bytes:
    """The base file with a few byte-level mutations, half of them aimed at the zip's structures."""
    base = torch_base_file()
    with zipfile.ZipFile(io.BytesIO(base)) as archive:
        infos = archive.infolist()
        central = base.rfind(b"PK\x01\x02", 0, base.rfind(b"PK\x05\x06"))
    # Interesting positions: local headers, the central directory, the end record.
    hot = [info.header_offset + k for info in infos for k in range(30)] + list(range(max(central - 600, 0), len(base)))
    mutations = draw(st.lists(_mutations, min_size=1, max_size=4))
    aimed = draw(st.lists(st.sampled_from(hot), min_size=len(mutations), max_size=len(mutations)))
    use_aim = draw(st.lists(st.booleans(), min_size=len(mutations), max_size=len(mutations)))
    mutations = [(k, a if aim else p, v, c) for (k, p, v, c), a, aim in zip(mutations, aimed, use_aim)]
    return _mutate(base, mutations)


# Integers a pickled tensor is made of (sizes, strides, storage offset, numel):
# small ones, and the edges of int32/int64 and beyond.
_pickle_ints = st.one_of(
    st.integers(-2, 70),
    st.sampled_from([2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, -(2**31), -(2**63), -(2**64)]),
)
_INT_OPCODES = {"BININT1", "BININT2", "BININT", "LONG1"}


def _pickle_int_sites(pkl: bytes) -> list[tuple[int, int]]:
    """(position, length) of every integer opcode with its argument in a pickle."""
    sites = []
    ops = list(pickletools.genops(pkl))
    for (opcode, _arg, pos), following in zip(ops, ops[1:] + [(None, None, len(pkl))]):
        if opcode.name in _INT_OPCODES:
            sites.append((pos, following[2] - pos))
    return sites


def _pickled_int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])  # BININT1
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)  # BININT
    encoded = pickle.encode_long(value)
    return b"\x8a" + bytes([len(encoded)]) + encoded  # LONG1


def _replace_pickle_ints(pkl: bytes, edits: list[tuple[int, int]]) -> bytes:
    """Give a few integer opcodes new values; the pickle stays well formed."""
    sites = _pickle_int_sites(pkl)
    if not sites:
        return pkl
    chosen = {sites[index % len(sites)]: value for index, value in edits}
    for (pos, length), value in sorted(chosen.items(), reverse=True):  # from the end: positions stay valid
        pkl = pkl[:pos] + _pickled_int(value) + pkl[pos + length:]
    return pkl


@st.composite
def torch_zip_records(draw: st.DrawFn) -> bytes:
    """The base file re-zipped with its records edited: data.pkl's integers or bytes, records dropped or resized.

    Byte flips inside a torch file mostly hit the zip's CRC checks; rewriting
    the zip with fresh CRCs gets mutated pickles to the unpickler, and
    rewriting the pickle's integers (sizes, strides, offsets, numel) keeps it
    well formed so that the tensor checks behind it are reached.
    """
    with zipfile.ZipFile(io.BytesIO(torch_base_file())) as archive:
        records = [(info.filename, archive.read(info.filename)) for info in archive.infolist()]
    prefix = records[0][0].split("/", 1)[0]
    renames = [f"{prefix}/data/9", f"{prefix}/data/0", f"{prefix}/data/1", f"{prefix}/code/x", "other/data.pkl"]
    edited = []
    for filename, content in records:
        if filename.endswith("/data.pkl"):
            action = draw(st.sampled_from(["ints"] * 6 + ["bytes"] * 2 + ["keep", "drop", "rename"]))
        else:
            action = draw(st.sampled_from(["keep"] * 40 + ["bytes", "drop", "grow", "shrink", "rename"]))
        if action == "drop":
            continue
        if action == "ints":
            edits = draw(st.lists(st.tuples(st.integers(0, 255), _pickle_ints), min_size=1, max_size=3))
            content = _replace_pickle_ints(content, edits)
        elif action == "bytes":
            content = _mutate(content, draw(st.lists(_mutations, min_size=1, max_size=3)))
        elif action == "grow":
            content += draw(st.binary(min_size=1, max_size=16))
        elif action == "shrink":
            content = content[: draw(st.integers(0, max(len(content) - 1, 0)))]
        elif action == "rename":
            filename = draw(st.sampled_from(renames))
        edited.append((filename, content))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate names a rename can make
        with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
            for filename, content in edited:
                archive.writestr(filename, content)
    return buffer.getvalue()


# ---------------------------------------------------------------- targets: pickles rewritten opcode by opcode
#
# The pickle is read into a list of opcodes, edited, and written again: it
# stays well formed (every opcode the unpickler meets is complete, the stack
# balances, every memo GET names an object memoized before it), so the
# inputs reach the unpickler's classes, calls and BUILDs and the checks behind
# them, not its parse errors. An opcode is ``(name, argument)`` as
# pickletools names them; ``("RAW", (bytes, label))`` is a ready-made value
# (a deep nesting, an expansion chain) written as it is.

Op = tuple[str, Any]

_OPCODES = {opcode.name: opcode for opcode in pickletools.opcodes}


def _encode_long(value: int, width: str) -> bytes:
    encoded = pickle.encode_long(value)
    return struct.pack(width, len(encoded)) + encoded


def _encode_text(value: Any, encoding: str, width: str) -> bytes:
    raw = value if isinstance(value, bytes) else value.encode(encoding, "surrogatepass")
    return struct.pack(width, len(raw)) + raw


_ARGUMENTS: dict[str, Callable[[Any], bytes]] = {
    "uint1": lambda v: struct.pack("<B", v),
    "uint2": lambda v: struct.pack("<H", v),
    "int4": lambda v: struct.pack("<i", v),
    "uint4": lambda v: struct.pack("<I", v),
    "uint8": lambda v: struct.pack("<Q", v),
    "float8": lambda v: struct.pack(">d", v),
    "long1": lambda v: _encode_long(v, "<B"),
    "long4": lambda v: _encode_long(v, "<i"),
    "unicodestring1": lambda v: _encode_text(v, "utf-8", "<B"),
    "unicodestring4": lambda v: _encode_text(v, "utf-8", "<I"),
    "unicodestring8": lambda v: _encode_text(v, "utf-8", "<Q"),
    "bytes1": lambda v: _encode_text(v, "latin-1", "<B"),
    "bytes4": lambda v: _encode_text(v, "latin-1", "<I"),
    "bytes8": lambda v: _encode_text(v, "latin-1", "<Q"),
    "bytearray8": lambda v: _encode_text(bytes(v), "latin-1", "<Q"),
    "string1": lambda v: _encode_text(v, "latin-1", "<B"),
    "string4": lambda v: _encode_text(v, "latin-1", "<i"),
    "stringnl_noescape_pair": lambda v: "\n".join(v.split(" ", 1)).encode("utf-8") + b"\n",
}


def pickle_ops(pkl: bytes) -> list[Op]:
    """A pickle's opcodes, FRAMEs dropped and MEMOIZEs written as the BINPUTs they mean, so opcodes can move freely."""
    ops: list[Op] = []
    memo: set[int] = set()
    for opcode, arg, _position in pickletools.genops(pkl):
        if opcode.name == "FRAME":
            continue
        if opcode.name == "MEMOIZE":
            arg = len(memo)
            ops.extend(_put(arg))
            memo.add(arg)
            continue
        if opcode.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo.add(arg)
        ops.append((opcode.name, arg))
    return ops


def encode_ops(ops: list[Op]) -> bytes:
    out = bytearray()
    for name, arg in ops:
        if name == "RAW":
            out += arg[0]
            continue
        opcode = _OPCODES[name]
        out += opcode.code.encode("latin-1")
        if opcode.arg is not None:
            out += _ARGUMENTS[opcode.arg.name](arg)
    return bytes(out)


# Values, as opcodes.


def _int(value: int) -> list[Op]:
    if 0 <= value < 256:
        return [("BININT1", value)]
    if 0 <= value < 65536:
        return [("BININT2", value)]
    if -(2**31) <= value < 2**31:
        return [("BININT", value)]
    return [("LONG1", value)]


def _str(value: str) -> list[Op]:
    return [("BINUNICODE", value)]


def _get(index: int) -> list[Op]:
    return [("BINGET", index)] if index < 256 else [("LONG_BINGET", index)]


def _put(index: int) -> list[Op]:
    return [("BINPUT", index)] if index < 256 else [("LONG_BINPUT", index)]


def _tuple(items: list[list[Op]]) -> list[Op]:
    flat = [op for item in items for op in item]
    if not items:
        return [("EMPTY_TUPLE", None)]
    if len(items) <= 3:
        return flat + [(f"TUPLE{len(items)}", None)]
    return [("MARK", None)] + flat + [("TUPLE", None)]


def _list(items: list[list[Op]]) -> list[Op]:
    if not items:
        return [("EMPTY_LIST", None)]
    return [("EMPTY_LIST", None), ("MARK", None)] + [op for item in items for op in item] + [("APPENDS", None)]


def _dict(pairs: list[tuple[list[Op], list[Op]]]) -> list[Op]:
    if not pairs:
        return [("EMPTY_DICT", None)]
    return [("EMPTY_DICT", None), ("MARK", None)] + [op for k, v in pairs for op in k + v] + [("SETITEMS", None)]


def _call(module: str, name: str, args: list[list[Op]]) -> list[Op]:
    return [("GLOBAL", f"{module} {name}")] + _tuple(args) + [("REDUCE", None)]


@dataclass
class _Value:
    start: int  # the first opcode of the value; it ends where it is recorded
    label: str  # "global:<module>.<name>", "call:<callee>", "new:<class>", "str:<text>", "dict", "persid", ...
    items: list[tuple[int, int]] | None = None  # a tuple's elements, as (start, end) spans


@dataclass
class _Analysis:
    values: dict[int, _Value]  # end -> the value completed by that opcode
    puts: list[tuple[int, int]]  # (position, memo index) of each PUT
    memo_labels: dict[int, str]
    fresh: int  # the first memo index nothing uses

    def memoized_before(self, position: int) -> list[int]:
        return sorted({index for at, index in self.puts if at < position})

    def puts_in(self, start: int, end: int) -> list[int]:
        return [index for at, index in self.puts if start <= at <= end]

    def after_puts(self, end: int, ops: list[Op]) -> int:
        """The position just past ``end`` and the PUTs that memoize its value."""
        position = end + 1
        while position < len(ops) and ops[position][0] in ("BINPUT", "LONG_BINPUT", "PUT"):
            position += 1
        return position

    def spans(self, *, prefix: str = "") -> list[tuple[int, int]]:
        return [(value.start, end) for end, value in self.values.items() if value.label.startswith(prefix)]


_MARK_BUILDERS = {"TUPLE": "tuple", "LIST": "list", "DICT": "dict", "FROZENSET": "frozenset", "OBJ": "obj", "INST": "inst"}
_MARK_FILLERS = {"APPENDS", "SETITEMS", "ADDITEMS"}
_FAR_MEMO = 2**15  # memo indices from here up are _m_huge_memo_index's; fresh ones are taken below


@dataclass
class _Mark:
    position: int


def _analyze(ops: list[Op]) -> _Analysis:
    """Run the opcodes on a stack of value descriptions: where each value starts and ends, and what it is."""
    stack: list[Any] = []
    values: dict[int, _Value] = {}
    puts: list[tuple[int, int]] = []
    memo_labels: dict[int, str] = {}
    fresh = 0

    def done(end: int, value: _Value) -> None:
        values[end] = value
        stack.append(value)

    for position, (name, arg) in enumerate(ops):
        if name == "RAW":
            fresh = max(fresh, arg[2])
            done(position, _Value(position, arg[1]))
            continue
        if name in ("BINPUT", "LONG_BINPUT", "PUT"):
            puts.append((position, arg))
            memo_labels[arg] = stack[-1].label if stack and isinstance(stack[-1], _Value) else "?"
            if arg < _FAR_MEMO:
                fresh = max(fresh, arg + 1)
            continue
        if name in ("BINGET", "LONG_BINGET", "GET"):
            done(position, _Value(position, memo_labels.get(arg, "?")))
            continue
        if name == "MARK":
            stack.append(_Mark(position))
            continue
        if name in _MARK_BUILDERS or name in _MARK_FILLERS or name == "POP_MARK":
            items = []
            while not isinstance(stack[-1], _Mark):
                items.append(stack.pop())
            mark = stack.pop()
            items.reverse()
            if name in _MARK_FILLERS:
                container = stack.pop()
                done(position, _Value(container.start, container.label))
            elif name != "POP_MARK":  # each element runs up to the next one's start (its PUTs included)
                ends = [item.start - 1 for item in items[1:]] + [position - 1]
                done(position, _Value(mark.position, _MARK_BUILDERS[name], [(i.start, e) for i, e in zip(items, ends)]))
            continue
        opcode = _OPCODES[name]
        popped = [stack.pop() for _ in opcode.stack_before][::-1]
        if not opcode.stack_after:
            continue
        start = popped[0].start if popped else position
        if name == "GLOBAL":
            label = "global:" + arg.replace(" ", ".")
        elif name == "STACK_GLOBAL":
            label = "global:" + ".".join(v.label.removeprefix("str:") for v in popped)
        elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
            label = ("call:" if name == "REDUCE" else "new:") + popped[0].label.removeprefix("global:")
        elif name in ("BUILD", "APPEND", "SETITEM"):
            label = popped[0].label
        elif isinstance(arg, str) and "unicode" in opcode.arg.name:
            label = "str:" + arg
        elif name.startswith("TUPLE"):
            label = "tuple"
        elif name == "BINPERSID":
            label = "persid"
        elif name in ("EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_SET"):
            label = name.removeprefix("EMPTY_").lower()
        else:
            label = name.lower()
        items = None
        if name.startswith("TUPLE") and popped:
            ends = [p.start for p in popped[1:]] + [position]
            items = [(p.start, e - 1) for p, e in zip(popped, ends)]
        for _ in opcode.stack_after:
            done(position, _Value(start, label, items))
    return _Analysis(values, puts, memo_labels, fresh)


def _replace(ops: list[Op], analysis: _Analysis, start: int, end: int, new: list[Op]) -> list[Op]:
    """``ops[start:end+1]`` replaced by ``new``; the memo indices the old value's opcodes set now name the new value."""
    remember = [op for index in analysis.puts_in(start, end) for op in _put(index)]
    return ops[:start] + new + remember + ops[end + 1:]


class _Fresh:
    """Memo indices nothing in the pickle uses yet."""

    def __init__(self, first: int) -> None:
        self.next = first

    def __call__(self) -> int:
        self.next += 1
        return self.next - 1


# Hostile values. Each is a list of opcodes that pushes exactly one value.

_HOSTILE_INTS = [0, 1, 2, 3, -1, -2, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, -(2**31), -(2**63), -(2**64),
                 2**100]


def _chain(kind: str, depth: int, fresh: _Fresh) -> list[Op]:
    """A value whose level n holds level n-1 twice: 2**depth elements when walked, hashed or printed; a few bytes here.

    Tuples are built in place ((t, t) from t and a memo GET of it); lists and
    dicts, which pickle fills after creating them, as the list of all levels.
    """
    if kind == "tuple":
        ops: list[Op] = [("EMPTY_TUPLE", None)]
        for _ in range(depth):
            index = fresh()
            ops += _put(index) + _get(index) + [("TUPLE2", None)]
        return ops
    levels: list[Op] = []
    previous = fresh()
    levels += _int(7) + _put(previous)
    for level in range(depth):
        index = fresh()
        shape = kind if kind != "mixed" else ("list", "dict", "tuple")[level % 3]
        if shape == "list":
            levels += _list([_get(previous), _get(previous)])
        elif shape == "dict":
            levels += _dict([(_str("a"), _get(previous)), (_str("b"), _get(previous))])
        else:
            levels += _get(previous) + _get(previous) + [("TUPLE2", None)]
        levels += _put(index)
        previous = index
    return [("EMPTY_LIST", None), ("MARK", None)] + levels + [("APPENDS", None)]


def _deep(kind: str, depth: int) -> Op:
    """A container nested ``depth`` levels deep, as one ready-made value."""
    if kind == "tuple":
        raw = pickle.EMPTY_TUPLE + pickle.TUPLE1 * depth
    elif kind == "list":
        raw = pickle.EMPTY_LIST * (depth + 1) + pickle.APPEND * depth
    elif kind == "dict":
        key = encode_ops(_str("k"))
        raw = (pickle.EMPTY_DICT + key) * depth + pickle.EMPTY_DICT + pickle.SETITEM * depth
    else:  # lists and tuples in turn, [([([...],)],)]: each level's list made first, then each wrapped and appended
        raw = pickle.EMPTY_LIST * (depth // 2 + 1) + (pickle.TUPLE1 + pickle.APPEND) * (depth // 2)
    return ("RAW", (raw, f"deep-{kind}", 0))


_CHAIN_DEPTHS = st.sampled_from([2, 5, 12, 20, 26, 32, 48, 64])
_DEEP_DEPTHS = st.sampled_from([20, 300, 999, 1001, 3000, 20_000, 100_000])


@dataclass(frozen=True)
class _Flavour:
    """What one kind of pickle holds: the globals its reader allows, and names its objects take."""

    calls: Callable[[st.DrawFn, "_Context"], list[Op]]
    attributes: tuple[str, ...]
    keys: tuple[str, ...]


@dataclass
class _Context:
    ops: list[Op]
    analysis: _Analysis
    fresh: _Fresh
    flavour: _Flavour
    position: int  # where the value being made will stand: only memo entries made before it may be named

    def memoized(self) -> list[int]:
        return self.analysis.memoized_before(self.position)


def _hostile_value(draw: st.DrawFn, context: _Context, *, hashable: bool = False) -> list[Op]:
    kinds = ["chain", "deep", "small", "call", "get"] if not hashable else ["chain", "deep", "small", "get"]
    kind = draw(st.sampled_from(kinds))
    if kind == "chain":
        return _chain("tuple" if hashable else draw(st.sampled_from(["tuple", "list", "dict", "mixed"])),
                      draw(_CHAIN_DEPTHS), context.fresh)
    if kind == "deep":
        return [_deep("tuple" if hashable else draw(st.sampled_from(["tuple", "list", "dict", "mixed"])),
                      draw(_DEEP_DEPTHS))]
    if kind == "get" and context.memoized():
        return _get(draw(st.sampled_from(context.memoized())))
    if kind == "call":
        return context.flavour.calls(draw, context)
    return draw(st.sampled_from([
        _int(draw(st.sampled_from(_HOSTILE_INTS))), [("NONE", None)], [("NEWTRUE", None)], _str(""),
        _str("x" * 300), [("BINFLOAT", float("nan"))], _tuple([]), _list([]) if not hashable else _tuple([_int(1)]),
    ]))


def _hostile_ints(draw: st.DrawFn, context: _Context) -> list[Op]:
    """A size or stride: a tuple of hostile integers, or something that is not one at all."""
    if draw(st.sampled_from([True, True, True, False])):
        return _tuple([_int(v) for v in draw(st.lists(st.sampled_from(_HOSTILE_INTS), max_size=4))])
    return _hostile_value(draw, context)


def _state(draw: st.DrawFn, context: _Context) -> list[Op]:
    """The state a BUILD gives an object: a dict of attributes, a (dict, slots) pair, or anything."""
    attributes = lambda: _dict([(_str(draw(st.sampled_from(context.flavour.attributes))), _hostile_value(draw, context))
                                for _ in range(draw(st.integers(1, 2)))])
    kind = draw(st.sampled_from(["dict", "dict", "slots", "pair", "value"]))
    if kind == "dict":
        return attributes()
    if kind == "slots":
        return _tuple([[("NONE", None)], attributes()])
    if kind == "pair":
        return _tuple([attributes(), attributes()])
    return _hostile_value(draw, context)


def _torch_calls(draw: st.DrawFn, context: _Context) -> list[Op]:
    """A call of a global torch's readers allow, with arguments it was never meant to get."""
    value = lambda: _hostile_value(draw, context)
    huge = lambda: _int(draw(st.sampled_from([2**31, 2**33, 2**40, 2**62, 2**63 - 1, -1, 10**6])))
    tensors = [i for i in context.memoized() if context.analysis.memo_labels.get(i, "").startswith("call:torch._utils")]
    tensor = lambda: _get(draw(st.sampled_from(tensors))) if tensors else value()
    pairs = lambda: _list([_tuple([_hostile_value(draw, context, hashable=True), value()])])
    calls = {
        "bytearray": lambda: _call("builtins", "bytearray", [huge()]),
        "bytearray_of": lambda: _call("builtins", "bytearray", [value()]),
        "set": lambda: _call("builtins", "set", [_list([_hostile_value(draw, context, hashable=True)])]),
        "complex": lambda: _call("builtins", "complex", [draw(st.sampled_from([_str("1e999999j"), _str("nan+infj"), huge()]))]),
        "ordered_dict": lambda: _call("collections", "OrderedDict", [draw(st.sampled_from([pairs(), value()]))]),
        "counter": lambda: _call("collections", "Counter", [value()]),
        "size": lambda: _call("torch", "Size", [_hostile_ints(draw, context)]),
        "device": lambda: _call("torch", "device", [_str(draw(st.sampled_from(["cuda", "meta", "cpu", "xla:1"]))), huge()]),
        "encode": lambda: _call("_codecs", "encode", [_str("ab" * draw(st.sampled_from([1, 1000]))),
                                                     _str(draw(st.sampled_from(["latin1", "rot13", "zlib_codec", "hex", "utf-16"])))]),
        "parameter": lambda: _call("torch._utils", "_rebuild_parameter", [tensor(), [("NEWTRUE", None)], value()]),
        "parameter_with_state": lambda: _call("torch._utils", "_rebuild_parameter_with_state",
                                              [tensor(), [("NEWFALSE", None)], _call("collections", "OrderedDict", []),
                                               _state(draw, context)]),
    }
    return calls[draw(st.sampled_from(sorted(calls)))]()


_TORCH_FLAVOUR = _Flavour(
    calls=_torch_calls,
    attributes=("__dict__", "__class__", "dtype", "shape", "requires_grad", "_backward_hooks", "__setstate__", "grad",
                "__call__", "_metadata", "data", "x"),
    keys=("weight", "row", "extra", "model", "state_dict", "module", "_metadata", ""),
)


# The mutations: each takes the opcodes and returns them edited (or unchanged, where it finds no place to act).


def _m_build_after_global(draw: st.DrawFn, context: _Context) -> list[Op]:
    """A BUILD right after a global: its attributes set (a class, a function, a storage kind, a dtype)."""
    spans = context.analysis.spans(prefix="global:")
    if not spans:
        return context.ops
    _start, end = draw(st.sampled_from(spans))
    at = context.analysis.after_puts(end, context.ops)
    context.position = at
    return context.ops[:at] + _state(draw, context) + [("BUILD", None)] + context.ops[at:]


_REBUILT = ("call:torch._utils._rebuild", "new:torch.distributed.checkpoint")


def _m_build_after_object(draw: st.DrawFn, context: _Context) -> list[Op]:
    """A BUILD on a rebuilt tensor (torch: ``set_`` with the state's storage, offset, size and stride) or a record."""
    spans = [span for prefix in _REBUILT for span in context.analysis.spans(prefix=prefix)]
    if not spans:
        return context.ops
    start, end = draw(st.sampled_from(spans))
    at = context.analysis.after_puts(end, context.ops)
    context.position = at
    ops = context.ops
    kind = draw(st.sampled_from(["set", "set", "state", "legacy", "empty"]))
    storages = [e for e, v in context.analysis.values.items() if start <= v.start and e <= end and v.label == "persid"]
    if kind == "set" and storages:
        storage_index = context.fresh()
        hostile = lambda: _int(draw(st.sampled_from(_HOSTILE_INTS)))
        state = _tuple([_get(storage_index), hostile(), _hostile_ints(draw, context), _hostile_ints(draw, context)])
        ops = ops[:at] + state + [("BUILD", None)] + ops[at:]
        persid = storages[0]
        return ops[:persid + 1] + _put(storage_index) + ops[persid + 1:]  # the storage memoized, for the state's GET
    if kind == "legacy":  # what Tensor.__setstate__ takes: (requires_grad, unused, backward hooks)
        state = _tuple([[("NEWTRUE", None)], [("NONE", None)], _hostile_value(draw, context)])
    elif kind == "empty":
        state = _tuple([])
    else:
        state = _state(draw, context)
    return ops[:at] + state + [("BUILD", None)] + ops[at:]


def _m_shared_reference(draw: st.DrawFn, context: _Context) -> list[Op]:
    """A value replaced by a memo GET of an object memoized before it (maybe one still being built: a cycle)."""
    spans = context.analysis.spans()
    start, end = draw(st.sampled_from(spans))
    earlier = context.analysis.memoized_before(start)
    if not earlier:
        return context.ops
    return _replace(context.ops, context.analysis, start, end, _get(draw(st.sampled_from(earlier))))


def _m_replace_value(draw: st.DrawFn, context: _Context) -> list[Op]:
    """A value replaced by a hostile one: an expansion chain, a deep nesting, a hostile call, a shared reference."""
    start, end = draw(st.sampled_from(context.analysis.spans()))
    context.position = start
    return _replace(context.ops, context.analysis, start, end, _hostile_value(draw, context))


def _m_add_item(draw: st.DrawFn, context: _Context) -> list[Op]:
    """One more item in a dict (its key maybe a chain or a deep tuple) or one more element of a list."""
    fillers = [end for end, value in context.analysis.values.items()
               if context.ops[end][0] in ("SETITEMS", "SETITEM", "APPENDS", "APPEND")]
    if not fillers:
        return context.ops
    end = draw(st.sampled_from(fillers))
    at = end + 1
    context.position = at
    if context.ops[end][0] in ("APPENDS", "APPEND"):
        new = _hostile_value(draw, context) + [("APPEND", None)]
    else:
        key = draw(st.sampled_from(["name", "name", "hostile"]))
        key_ops = (_str(draw(st.sampled_from(context.flavour.keys))) if key == "name"
                   else _hostile_value(draw, context, hashable=True))
        new = key_ops + _hostile_value(draw, context) + [("SETITEM", None)]
    return context.ops[:at] + new + context.ops[at:]


def _m_tensor_arguments(draw: st.DrawFn, context: _Context) -> list[Op]:
    """One argument of a tensor rebuild replaced (negative strides, huge sizes, hooks), or a metadata dict added."""
    rebuilds = [(end, value) for end, value in context.analysis.values.items() if value.label.startswith(_REBUILT[0])]
    if not rebuilds:
        return context.ops
    end, _value = draw(st.sampled_from(rebuilds))
    args_end = end - 1  # REDUCE's opcode follows its arguments' tuple (and the PUTs that memoize it)
    while context.ops[args_end][0] in ("BINPUT", "LONG_BINPUT", "PUT"):
        args_end -= 1
    args = context.analysis.values.get(args_end)
    if args is None or not args.items:
        return context.ops
    context.position = args.start
    if draw(st.sampled_from([False, False, True])):
        metadata = draw(st.sampled_from([
            [("neg", True)], [("conj", True)], [("neg", True), ("conj", True)], [("neg", 1)], [("bogus", True)], [],
        ]))
        value = _dict([(_str(k), [("NEWTRUE", None)] if v is True else _int(v)) for k, v in metadata])
        if draw(st.booleans()):
            value = _hostile_value(draw, context)
        if context.ops[args_end][0] != "TUPLE":
            return context.ops
        return context.ops[:args_end] + value + context.ops[args_end:]  # a seventh argument: metadata
    number = draw(st.integers(0, len(args.items) - 1))
    start, stop = args.items[number]
    if number in (2, 3):  # size, stride
        new = _hostile_ints(draw, context)
    elif number == 1:  # storage offset
        new = _int(draw(st.sampled_from(_HOSTILE_INTS)))
    else:
        new = _hostile_value(draw, context)
    return _replace(context.ops, context.analysis, start, stop, new)


def _m_integer(draw: st.DrawFn, context: _Context) -> list[Op]:
    """An integer (a size, an offset, a length) given a hostile value."""
    ints = [end for end, value in context.analysis.values.items() if context.ops[end][0] in _INT_OPCODES]
    if not ints:
        return context.ops
    end = draw(st.sampled_from(ints))
    return _replace(context.ops, context.analysis, end, end, _int(draw(st.sampled_from(_HOSTILE_INTS))))


def _m_huge_memo_index(draw: st.DrawFn, context: _Context) -> list[Op]:
    """A memo index moved far up (its PUT and GETs alike): C's unpickler grows its memo table to match (16 bytes an index)."""
    if not context.analysis.puts:
        return context.ops
    _at, old = draw(st.sampled_from(context.analysis.puts))
    new = draw(st.sampled_from([_FAR_MEMO, 2**24, 2**27, 2**31 - 1, 2**32 - 1]))
    out = []
    for name, arg in context.ops:
        if name in ("BINPUT", "LONG_BINPUT") and arg == old:
            out += _put(new)
        elif name in ("BINGET", "LONG_BINGET") and arg == old:
            out += _get(new)
        else:
            out.append((name, arg))
    return out


_TORCH_MUTATIONS = weighted(
    (2, st.just(_m_build_after_global)),
    (3, st.just(_m_build_after_object)),
    (3, st.just(_m_shared_reference)),
    (3, st.just(_m_replace_value)),
    (3, st.just(_m_add_item)),
    (4, st.just(_m_tensor_arguments)),
    (1, st.just(_m_integer)),
    (1, st.just(_m_huge_memo_index)),
)


def _mutated_ops(draw: st.DrawFn, base: list[Op], flavour: _Flavour, mutations: st.SearchStrategy) -> list[Op]:
    ops = base
    for _ in range(draw(st.integers(1, 3))):
        analysis = _analyze(ops)
        context = _Context(ops, analysis, _Fresh(analysis.fresh), flavour, position=len(ops))
        ops = draw(mutations)(draw, context)
    return ops


@functools.cache
def _torch_records() -> tuple[tuple[str, bytes], ...]:
    with zipfile.ZipFile(io.BytesIO(torch_base_file())) as archive:
        return tuple((info.filename, archive.read(info.filename)) for info in archive.infolist())


@functools.cache
def _torch_base_ops() -> tuple[Op, ...]:
    (pkl,) = [content for filename, content in _torch_records() if filename.endswith("/data.pkl")]
    return tuple(pickle_ops(pkl))


def torch_file_with_pickle(pkl: bytes) -> bytes:
    """The base file with ``pkl`` as its data.pkl, re-zipped (fresh CRCs) as torch_zip_records does.

    Each record dated 1980-01-01, so the same pickle always makes the same file (and the same saved name).
    """
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for filename, content in _torch_records():
            archive.writestr(zipfile.ZipInfo(filename), pkl if filename.endswith("/data.pkl") else content)
    return buffer.getvalue()


@st.composite
def torch_pickle_opcodes(draw: st.DrawFn) -> bytes:
    """The base file whose data.pkl had a few opcode-level edits: BUILDs, shared references, expansion chains,
    deep nesting, hostile calls of the globals the readers allow, rebuilt tensors' arguments."""
    ops = _mutated_ops(draw, list(_torch_base_ops()), _TORCH_FLAVOUR, _TORCH_MUTATIONS)
    return torch_file_with_pickle(encode_ops(ops))


# ---------------------------------------------------------------- target: DCP metadata pickle


@functools.cache
def _dcp_files() -> dict[str, bytes]:
    """A genuine single-process ``dcp.save`` folder's files: a nested model state dict and training state beside it."""
    import torch.distributed.checkpoint as dcp

    state = {
        "model": {
            "embed.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "norm.bias": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
            "counts": torch.tensor([1, 2, 3], dtype=torch.int64),
            "empty": torch.zeros(0, 2),
        },
        "optim": {"lr": torch.tensor(0.1), "step": 3},
        "epoch": 2,
    }
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: dcp.save warns, then saves as one process
        dcp.save(state, checkpoint_id=tmp)
        return {path.name: path.read_bytes() for path in Path(tmp).iterdir()}


def dcp_metadata(data: bytes) -> None:
    """``data`` is the ``.metadata`` of a DCP folder whose data files are genuine; beside the folder, a data file outside it."""
    files = _dcp_files()
    with tempfile.TemporaryDirectory(prefix="fuzz-dcp-") as tmp:
        root = Path(tmp).resolve()
        folder = root / "ckpt"
        folder.mkdir()
        for name, content in files.items():
            (folder / name).write_bytes(data if name == ".metadata" else content)
            if name != ".metadata":
                (root / name).write_bytes(content)  # the same chunks, outside: a relative path must never reach them
        try:
            ckpt = mz.open_checkpoint(folder)
        except mz.MaterializeError:
            return
        with ckpt:
            _check_infos_inside(ckpt, folder=folder)
            infos = dict(ckpt.items())
        for tensors in _load_both_ways(folder):
            assert set(tensors) == set(infos)
            for name, tensor in tensors.items():
                assert tensor.dtype == infos[name].dtype and tuple(tensor.shape) == infos[name].shape, name


def _dcp_calls(draw: st.DrawFn, context: _Context) -> list[Op]:
    """A call of a global the DCP metadata reader allows, with arguments it was never meant to get."""
    value = lambda: _hostile_value(draw, context)
    module = "torch.distributed.checkpoint.metadata"
    record = draw(st.sampled_from(["Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                   "MetadataIndex", "TensorProperties", "StorageMeta"]))
    calls = {
        "size": lambda: _call("torch", "Size", [_hostile_ints(draw, context)]),
        "layout": lambda: _call("torch.serialization", "_get_layout", [draw(st.sampled_from([_str("torch.strided"), value()]))]),
        "path": lambda: _call("pathlib", draw(st.sampled_from(["PosixPath", "PurePosixPath", "WindowsPath"])),
                              [_str(draw(st.sampled_from(["..", "/etc", "../__0_0.distcp", "/", "x" * 5000]))), value()]),
        "ordered_dict": lambda: _call("collections", "OrderedDict", [value()]),
        "memory_format": lambda: _call(module, "_MEM_FORMAT_ENCODING", [value()]),
        "record_new": lambda: [("GLOBAL", f"{module} {record}")] + _tuple([value()]) + [("NEWOBJ", None)],
        "record_call": lambda: _call(module, record, [value()]),
        "storage_info": lambda: [("GLOBAL", "torch.distributed.checkpoint.filesystem _StorageInfo"), ("EMPTY_TUPLE", None),
                                 ("NEWOBJ", None)] + _state(draw, context) + [("BUILD", None)],
    }
    return calls[draw(st.sampled_from(sorted(calls)))]()


_DCP_FLAVOUR = _Flavour(
    calls=_dcp_calls,
    attributes=("state_dict_metadata", "storage_data", "planner_data", "storage_meta", "size", "chunks", "properties",
                "dtype", "offsets", "sizes", "fqn", "offset", "index", "relative_path", "length", "transform_descriptors",
                "__dict__", "__class__", "__setstate__"),
    keys=("model.embed.weight", "model.counts", "optim.step", "epoch", "", "model"),
)

_DCP_MUTATIONS = weighted(
    (1, st.just(_m_build_after_global)),
    (2, st.just(_m_build_after_object)),
    (3, st.just(_m_shared_reference)),
    (3, st.just(_m_replace_value)),
    (3, st.just(_m_add_item)),
    (3, st.just(_m_integer)),
    (1, st.just(_m_huge_memo_index)),
)


@functools.cache
def _dcp_base_ops() -> tuple[Op, ...]:
    return tuple(pickle_ops(_dcp_files()[".metadata"]))


@st.composite
def dcp_pickle_opcodes(draw: st.DrawFn) -> bytes:
    """A genuine DCP ``.metadata`` with a few opcode-level edits, as torch_pickle_opcodes makes them."""
    return encode_ops(_mutated_ops(draw, list(_dcp_base_ops()), _DCP_FLAVOUR, _DCP_MUTATIONS))


# ---------------------------------------------------------------- targets: algorithmic complexity
#
# Inputs made to be expensive rather than malformed: hash-flooded dicts and
# sets in every pickle the readers unpickle, zips of very many records, DCP
# tensors cut into very many chunks, safetensors headers with enormous
# numbers, long names and many tensors, deeply nested JSON, indexes of many
# entries. Each is up to a few MB, and the runner gives each input time and
# memory in proportion to its size (fuzz/run.py, "Limits in proportion to the
# input"): a reader linear in its input gets through with a wide margin, one
# whose cost grows with the square of a count does not. Every input goes
# through the public path a user takes: open, list, what ``materialize
# inspect`` prints, one load.
#
# Generation draws a handful of numbers and builds the bulk from them in a
# loop: hypothesis records every choice it makes, and a choice per key would
# cost more than the load. Each case's ``seeds`` hold the known expensive
# inputs of its classes, which every run tries first (fuzz/run.py).

_HASH_PRIME = 2**61 - 1  # CPython hashes an int as itself modulo this prime: every multiple hashes to 0


def _long1(value: int) -> bytes:
    encoded = pickle.encode_long(value)
    return b"\x8a" + bytes([len(encoded)]) + encoded


def _binunicode(text: str) -> bytes:
    raw = text.encode("utf-8")
    return b"X" + struct.pack("<I", len(raw)) + raw


# Keys that all hash alike (so a dict or set of them probes every earlier one
# on each insertion), or plain many keys. Each maker returns the opcodes of
# key number ``i`` (from 1). Floats can share a hash only in groups of 33
# (m * 2**(61 j) hashes as m), so they test the many-keys path more than the
# flood.
_FLOOD_KEYS: dict[str, Callable[[int], bytes]] = {
    "int": lambda i: _long1(i * _HASH_PRIME),
    "tuple": lambda i: _long1(i * _HASH_PRIME) + pickle.TUPLE1,
    "pair": lambda i: _long1(i * _HASH_PRIME) + _long1(-i * _HASH_PRIME) + pickle.TUPLE2,
    "frozenset": lambda i: pickle.MARK + _long1(i * _HASH_PRIME) + pickle.FROZENSET,
    "float": lambda i: pickle.BINFLOAT + struct.pack(">d", (i // 33 + 1) * 2.0 ** (61 * (i % 33 - 16))),
    "str": lambda i: _binunicode(f"k{i}"),
}


def _flood_items(key: str, count: int, value: bytes) -> bytes:
    make = _FLOOD_KEYS[key]
    return b"".join(make(i) + value for i in range(1, count + 1))


def _flood_keys_only(key: str, count: int) -> bytes:
    make = _FLOOD_KEYS[key]
    return b"".join(make(i) for i in range(1, count + 1))


def flood_container(container: str, key: str, count: int) -> bytes:
    """The opcodes of one container holding ``count`` keys of kind ``key`` (values None), as the container's
    own opcodes build it: SETITEMS on an empty dict, DICT, ADDITEMS on an empty set, FROZENSET, an
    OrderedDict (called, then filled), ``builtins.set`` of a list."""
    if container == "setitems":
        return pickle.EMPTY_DICT + pickle.MARK + _flood_items(key, count, pickle.NONE) + pickle.SETITEMS
    if container == "dict":
        return pickle.MARK + _flood_items(key, count, pickle.NONE) + pickle.DICT
    if container == "additems":
        return pickle.EMPTY_SET + pickle.MARK + _flood_keys_only(key, count) + pickle.ADDITEMS
    if container == "frozenset":
        return pickle.MARK + _flood_keys_only(key, count) + pickle.FROZENSET
    if container == "ordered_dict":
        return (b"ccollections\nOrderedDict\n" + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.MARK
                + _flood_items(key, count, pickle.NONE) + pickle.SETITEMS)
    if container == "set_call":
        return (b"cbuiltins\nset\n" + pickle.EMPTY_LIST + pickle.MARK + _flood_keys_only(key, count)
                + pickle.APPENDS + pickle.TUPLE1 + pickle.REDUCE)
    raise ValueError(container)


FLOOD_CONTAINERS = ("setitems", "dict", "additems", "frozenset", "ordered_dict", "set_call")


@dataclass(frozen=True)
class Flood:
    """One expensive pickle edit: ``count`` keys of kind ``key`` put into the pickle's first dict.

    ``place`` is "value" (the first dict gets one more entry, whose value is
    a ``container`` of the keys), "keys" (the keys go into the first dict
    itself, by SETITEMS) or "deep" (the entry's value is a list or dict
    nested ``count`` deep: refused by the budget scan, which must not take
    long over it either).
    """

    place: str
    container: str
    key: str
    count: int


def _flood_bytes(flood: Flood, tensor_memo: int | None) -> bytes:
    if flood.place == "keys":
        # Many string keys naming one tensor each (ties: one storage), where the pickle has a tensor to name.
        value = (encode_ops(_get(tensor_memo)) if flood.key == "str" and tensor_memo is not None else pickle.NONE)
        return pickle.MARK + _flood_items(flood.key, flood.count, value) + pickle.SETITEMS
    if flood.place == "deep":
        raw, _label, _fresh = _deep(flood.container if flood.container in ("list", "dict", "tuple") else "mixed",
                                    flood.count)[1]
        return _binunicode("flood") + raw + pickle.SETITEM
    return _binunicode("flood") + flood_container(flood.container, flood.key, flood.count) + pickle.SETITEM


def flooded_pickle(base_ops: Iterable[Op], flood: Flood) -> bytes:
    """``base_ops`` encoded again with ``flood`` put into its first dict, right after the dict is made
    (and memoized), before anything else fills it."""
    ops = list(base_ops)
    analysis = _analyze(ops)
    tensors = [index for index, label in analysis.memo_labels.items() if label.startswith("call:torch._utils._rebuild")]
    at = next(position for position, (name, _arg) in enumerate(ops) if name == "EMPTY_DICT")
    at = analysis.after_puts(at, ops)
    raw = _flood_bytes(flood, min(tensors) if tensors else None)
    return encode_ops(ops[:at] + [("RAW", (raw, "flood", 0))] + ops[at:])


_PLACES = weighted((6, st.just("value")), (3, st.just("keys")), (1, st.just("deep")))
_FLOOD_KEY_KINDS = weighted((6, st.just("int")), (2, st.just("tuple")), (1, st.just("pair")), (2, st.just("frozenset")),
                            (1, st.just("float")), (2, st.just("str")))
# Mostly large enough that a quadratic reader shows (a flood of 100,000 keys is 10^10 probes), some small.
_FLOOD_COUNTS = weighted((1, st.integers(1, 2_000)), (2, st.integers(2_000, 60_000)), (4, st.integers(60_000, 250_000)))
_DEEP_COUNTS = st.sampled_from([201, 5_000, 100_000, 1_000_000])


@st.composite
def floods(draw: st.DrawFn, *, max_count: int = 250_000) -> Flood:
    place = draw(_PLACES)
    if place == "deep":
        return Flood("deep", draw(st.sampled_from(["list", "dict", "tuple", "mixed"])), "", draw(_DEEP_COUNTS))
    count = min(draw(_FLOOD_COUNTS), max_count)
    container = draw(st.sampled_from(FLOOD_CONTAINERS)) if place == "value" else "setitems"
    return Flood(place, container, draw(_FLOOD_KEY_KINDS), count)


def _open_list_inspect_load(path: Path, *, folder: Path | None = None) -> None:
    """What a user does with a checkpoint: open it (headers, index, pickle), list it, ``materialize inspect``
    it, load it once. Each step either works or raises a MaterializeError; a load that fails cleanly is fine."""
    from materialize_cli._output import json_text
    from materialize_cli.main import _inspect_lines  # the inspect command's text form; mz.inspect, its JSON

    try:
        ckpt = mz.open_checkpoint(path)
    except mz.MaterializeError:
        return
    with ckpt:
        _check_infos_inside(ckpt, folder=folder)
        for _ in _inspect_lines(ckpt):
            pass
        json_text(mz.inspect(ckpt), about=str(path))
    try:
        mz.load_tensors(path)
    except mz.MaterializeError:
        pass


# Pickles: a torch zip's data.pkl, a DCP .metadata, a legacy torch file's system description.


def cx_torch_zip(data: bytes) -> None:
    """``data`` is a whole ``.pt`` file (a zip); torch.load is not asked to compare: its cost is not ours."""
    _open_list_inspect_load_file(data, "model.pt")


def _open_list_inspect_load_file(data: bytes, name: str) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-cx-") as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        _open_list_inspect_load(path)


@st.composite
def torch_pickle_floods(draw: st.DrawFn) -> bytes:
    return torch_file_with_pickle(flooded_pickle(_torch_base_ops(), draw(floods())))


def cx_dcp(data: bytes) -> None:
    """``data`` is the ``.metadata`` of a DCP folder whose one data file holds the chunk blobs of _dcp_blobs
    (and the genuine save's data files beside it, for the genuine metadata the floods are made from)."""
    blobs, _where = _dcp_blobs()
    with tempfile.TemporaryDirectory(prefix="fuzz-cx-dcp-") as tmp:
        folder = Path(tmp).resolve() / "ckpt"
        folder.mkdir()
        for name, content in _dcp_files().items():
            if name != ".metadata":
                (folder / name).write_bytes(content)
        (folder / _BLOB_FILE).write_bytes(blobs)
        (folder / ".metadata").write_bytes(data)
        _open_list_inspect_load(folder, folder=folder)


@st.composite
def dcp_pickle_floods(draw: st.DrawFn) -> bytes:
    return flooded_pickle(_dcp_base_ops(), draw(floods()))


@functools.cache
def _legacy_parts() -> tuple[bytes, tuple[Op, ...], bytes]:
    """A legacy (pre-zip) torch file cut around its third pickle, the system description: (before, its
    opcodes, after)."""
    buffer = io.BytesIO()
    torch.save({"weight": torch.arange(6, dtype=torch.float32), "bias": torch.ones(2)}, buffer,
               _use_new_zipfile_serialization=False)
    data = buffer.getvalue()
    stream = io.BytesIO(data)
    bounds = []
    for _ in range(3):
        start = stream.tell()
        for opcode, _arg, _position in pickletools.genops(stream):
            if opcode.name == "STOP":
                break
        bounds.append((start, stream.tell()))
    start, end = bounds[2]
    return data[:start], tuple(pickle_ops(data[start:end])), data[end:]


def cx_legacy(data: bytes) -> None:
    """``data`` is a whole legacy torch file."""
    cx_torch_zip(data)


@st.composite
def legacy_system_floods(draw: st.DrawFn) -> bytes:
    before, ops, after = _legacy_parts()
    # The reader refuses a system description over 1 MB before unpickling it: most floods stay under.
    flood = draw(floods(max_count=draw(st.sampled_from([70_000, 70_000, 70_000, 250_000]))))
    return before + flooded_pickle(ops, flood) + after


# Zips of many tiny records, some names twice.


def zip_of_records(records: list[tuple[str, bytes]]) -> bytes:
    """A stored (uncompressed) zip of ``records``, written directly: zipfile.writestr takes a second per
    ten thousand records, and refuses nothing (duplicate names included). Zip64 end records past 65,535."""
    local, central = [], []
    offset = 0
    for name, content in records:
        raw = name.encode("utf-8")
        crc = zlib.crc32(content)
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, len(content), len(content),
                             len(raw), 0) + raw
        central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 20, 0, 0, 0, 0x21, crc, len(content),
                                   len(content), len(raw), 0, 0, 0, 0, 0, offset) + raw)
        local.append(header + content)
        offset += len(header) + len(content)
    directory = b"".join(central)
    count = len(records)
    end = b""
    if count >= 0xFFFF or offset >= 0xFFFFFFFF:
        end += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, len(directory), offset)
        end += struct.pack("<IIQI", 0x07064B50, 0, offset + len(directory), 1)
        end += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    else:
        end += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, len(directory), offset, 0)
    return b"".join(local) + directory + end


def many_records_file(count: int, duplicates: int, *, where: str = "end", extra_dir: str = "extra") -> bytes:
    """The base torch file's records, then ``count`` one-byte records, ``duplicates`` of them named again
    (at the end of the directory, or spread through it)."""
    records = list(_torch_records())
    prefix = records[0][0].split("/", 1)[0]
    extra = [(f"{prefix}/{extra_dir}/{i}", b"x") for i in range(count)]
    if duplicates:
        step = max(1, count // duplicates)
        again = [extra[(i * step) % count] for i in range(duplicates)] if count else [records[-1]] * duplicates
        extra = extra + again if where == "end" else [r for pair in zip(extra, again) for r in pair] + extra[len(again):]
    return zip_of_records(records + extra)


@st.composite
def many_record_zips(draw: st.DrawFn) -> bytes:
    count = draw(weighted((1, st.integers(0, 2_000)), (2, st.integers(2_000, 40_000)), (3, st.integers(40_000, 160_000))))
    duplicates = draw(weighted((2, st.just(0)), (3, st.just(1)), (1, st.integers(2, 5_000))))
    return many_records_file(count, duplicates, where=draw(st.sampled_from(["end", "spread"])),
                             extra_dir=draw(st.sampled_from(["extra", "data", "code/__torch__"])))


# DCP tensors cut into many chunks.

_BLOB_FILE = "__9_0.distcp"
_BLOB_SHAPES = ((1,), (1, 1), (2,), (1, 2), (1, 1, 1))


@functools.cache
def _dcp_blobs() -> tuple[bytes, dict[tuple[int, ...], tuple[int, int]]]:
    """One data file holding a torch.save blob per shape of _BLOB_SHAPES (float32), as DCP writes chunks;
    and each shape's (offset, length) in it. Every chunk of a kind points at the same blob."""
    out = io.BytesIO()
    where = {}
    for shape in _BLOB_SHAPES:
        start = out.tell()
        torch.save(torch.ones(shape), out)
        where[shape] = (start, out.tell() - start)
    return out.getvalue(), where


@dataclass(frozen=True)
class Chunking:
    """A tensor of ``shape`` in chunks of one element (or a row of two), ``count`` of them.

    ``layout``: "rows" (1-D, in order), "shuffled" (1-D, any order), "blocks"
    (2-D, every chunk 1x1), "cube" (3-D); ``defect``: "" (they tile it),
    "overlap" (one chunk twice, at the end), "gap" (one missing), "outside"
    (one past the shape, at the end).
    """

    layout: str
    count: int
    defect: str = ""
    seed: int = 0


def chunked_metadata(chunking: Chunking) -> bytes:
    """A DCP ``.metadata`` of one float32 tensor 'w' made of ``chunking``, pickled from torch's own classes."""
    import random

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    _blobs, where = _dcp_blobs()
    n = max(chunking.count, 1)
    if chunking.layout in ("rows", "shuffled"):
        shape, size = (n,), (1,)
        offsets = [(i,) for i in range(n)]
    elif chunking.layout == "blocks":
        columns = max(1, int(math.sqrt(n)))
        n = (n // columns) * columns or columns
        shape, size = (n // columns, columns), (1, 1)
        offsets = [(i // columns, i % columns) for i in range(n)]
    else:
        side = max(1, round(n ** (1 / 3)))
        shape, size = (side, side, side), (1, 1, 1)
        offsets = [(i, j, k) for i in range(side) for j in range(side) for k in range(side)]
    if chunking.layout == "shuffled":
        random.Random(chunking.seed).shuffle(offsets)
    if chunking.defect == "overlap":
        offsets.append(offsets[-1])
    elif chunking.defect == "gap" and len(offsets) > 1:
        del offsets[len(offsets) // 2]
    elif chunking.defect == "outside":
        offsets.append(tuple(d for d in shape))
    start, length = where[size]
    chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(size)) for o in offsets]
    storage = {MetadataIndex("w", torch.Size(o)): _StorageInfo(_BLOB_FILE, start, length) for o in offsets}
    metadata = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)},
        storage_data=storage,
    )
    return pickle.dumps(metadata)


@st.composite
def chunked_dcp(draw: st.DrawFn) -> bytes:
    chunking = Chunking(
        draw(st.sampled_from(["rows", "shuffled", "blocks", "blocks", "cube"])),
        draw(weighted((1, st.integers(1, 500)), (2, st.integers(500, 8_000)), (3, st.integers(8_000, 25_000)))),
        draw(st.sampled_from(["", "", "", "overlap", "gap", "outside"])),
        draw(st.integers(0, 2**16)),
    )
    return chunked_metadata(chunking)


# safetensors headers: enormous numbers, long names, many tensors, deep nesting.


def safetensors_of(entries: list[tuple[str, str]], data: bytes = b"", metadata: str = "") -> bytes:
    """A file whose header is ``{name: entry-JSON, ...}`` written as given (no parse, no re-encoding)."""
    body = ",".join(f"{json.dumps(name)}:{entry}" for name, entry in entries)
    if metadata:
        body = f'"__metadata__":{metadata}' + ("," + body if body else "")
    header = ("{" + body + "}").encode("utf-8")
    return struct.pack("<Q", len(header)) + header + data


def tiled_u8(names: list[str]) -> bytes:
    """A valid file: one U8 tensor of one byte per name, laid end to end."""
    entries = [(name, f'{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}') for i, name in enumerate(names)]
    return safetensors_of(entries, bytes(range(256)) * (len(names) // 256) + bytes(range(len(names) % 256)))


def huge_dims_file(dims: int, digits: int, *, zero_last: bool = True) -> bytes:
    """One tensor of ``dims`` dimensions of ``digits`` digits each (under Python's 4,300-digit limit); a zero
    dimension last makes it empty, so no byte count can refuse it before the dimensions are looked at."""
    dim = "9" * digits
    shape = ",".join([dim] * dims + (["0"] if zero_last else []))
    return safetensors_of([("a", f'{{"dtype":"F32","shape":[{shape}],"data_offsets":[0,0]}}')])


@st.composite
def expensive_safetensors(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["dims", "dims", "offsets", "long_name", "long_name", "many", "deep", "metadata",
                                 "long_value"]))
    if kind == "dims":
        digits = draw(st.sampled_from([1, 19, 20, 300, 4_000, 4_299]))
        dims = draw(st.integers(1, max(1, 4_000_000 // (digits + 1))))
        return huge_dims_file(min(dims, 1_000_000), digits, zero_last=draw(st.booleans()))
    if kind == "offsets":
        count = draw(st.integers(1, 1_000))
        digits = draw(st.sampled_from([19, 20, 1_000, 4_000]))
        big = "9" * digits
        return safetensors_of([(f"t{i}", f'{{"dtype":"U8","shape":[0],"data_offsets":[{big},{big}]}}')
                               for i in range(count)])
    if kind == "long_name":
        length = draw(st.sampled_from([1_000, 100_000, 1_000_000, 4_000_000]))
        others = draw(st.integers(0, 5_000))
        long_name = draw(st.sampled_from(["n", "é", "\u4e00"])) * (length // 3)
        names = [f"t{i}" for i in range(others)]
        names.insert(draw(st.integers(0, others)), long_name)
        return tiled_u8(names)
    if kind == "many":
        count = draw(st.integers(1, 120_000))
        width = draw(st.sampled_from([1, 8, 40]))
        return tiled_u8([f"{i:0{width}d}" for i in range(count)])
    if kind == "deep":
        depth = draw(st.sampled_from([1_000, 100_000, 2_000_000]))
        where = draw(st.sampled_from(["shape", "metadata", "entry"]))
        deep = draw(st.sampled_from(["[" * depth + "]" * depth, '{"x":' * depth + "0" + "}" * depth]))
        if where == "metadata":
            return safetensors_of([], metadata=deep)
        if where == "shape":
            return safetensors_of([("a", f'{{"dtype":"F32","shape":{deep},"data_offsets":[0,0]}}')])
        return safetensors_of([("a", deep)])
    if kind == "metadata":
        count = draw(st.integers(1, 150_000))
        return safetensors_of([], metadata="{" + ",".join(f'"m{i}":"v"' for i in range(count)) + "}")
    length = draw(st.sampled_from([100_000, 4_000_000]))  # one very long string or number where a field is
    value = draw(st.sampled_from(['"' + "x" * length + '"', "1." + "1" * length, "1e" + "9" * length]))
    return safetensors_of([("a", f'{{"dtype":{value},"shape":[],"data_offsets":[0,0]}}')])


def cx_safetensors(data: bytes) -> None:
    """``data`` is a whole ``.safetensors`` file."""
    _open_list_inspect_load_file(data, "model.safetensors")


# JSON documents: a shard index of many entries or long names, a config.json, deeply nested either.


@st.composite
def expensive_indexes(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["many", "many", "many_shards", "long_name", "long_shard", "deep", "metadata"]))
    if kind in ("many", "many_shards"):
        count = draw(st.integers(1, 100_000))
        real = draw(st.booleans())  # names a shard holds after the first: refused, naming the first few
        shard = (lambda i: f"missing-{i}.safetensors") if kind == "many_shards" else (lambda i: "s1.safetensors")
        entries = {"a": "s1.safetensors", "b": "s1.safetensors"} if real else {}
        entries.update({f"layer.{i}.weight": shard(i) for i in range(count)})
        return json.dumps({"weight_map": entries}).encode()
    if kind == "long_name":
        length = draw(st.sampled_from([1_000, 1_000_000, 4_000_000]))
        return json.dumps({"weight_map": {"a": "s1.safetensors", "x" * length: "s1.safetensors"}}).encode()
    if kind == "long_shard":
        length = draw(st.sampled_from([255, 256, 4_096, 1_000_000]))
        return json.dumps({"weight_map": {"a": "s" * length + ".safetensors", "b": "sub/" * (length // 4)}}).encode()
    if kind == "deep":
        depth = draw(st.sampled_from([1_000, 100_000, 2_000_000]))
        return ('{"weight_map": {"a": "s1.safetensors"}, "metadata": ' + "[" * depth + "]" * depth + "}").encode()
    count = draw(st.integers(1, 150_000))
    return json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"},
                       "metadata": {f"m{i}": i for i in range(count)}}).encode()


def cx_config(data: bytes) -> None:
    """``data`` is the ``config.json`` of a folder beside a small model.safetensors: a plan without a model
    reads it (to tell a transformers config from another library's), and plans the plain load when it is not one."""
    files = _shard_files()
    with tempfile.TemporaryDirectory(prefix="fuzz-cx-config-") as tmp:
        folder = Path(tmp).resolve()
        (folder / "model.safetensors").write_bytes(files["s1.safetensors"])
        (folder / "config.json").write_bytes(data)
        try:
            mz.plan(None, folder)
        except mz.MaterializeError:
            pass


@st.composite
def expensive_configs(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["deep_list", "deep_dict", "many", "long"]))
    size = draw(st.sampled_from([1_000, 100_000, 1_000_000]))
    if kind == "deep_list":
        return ('{"hidden_size": ' + "[" * size + "]" * size + "}").encode()
    if kind == "deep_dict":
        return ('{"x":' * size + "0" + "}" * size).encode()
    if kind == "many":
        return json.dumps({f"k{i}": i for i in range(size)}).encode()
    return json.dumps({"name": "x" * size * 4}).encode()


# Known expensive inputs, per case: each run tries these before drawing (fuzz/run.py). Made when tried.


def _known_expensive() -> dict[str, list[Callable[[], bytes]]]:
    return {
        "cx_torch_pickle": [
            # Hash-flooded containers: the unpickler builds them in quadratic time (10^10 probes here).
            lambda: torch_file_with_pickle(flooded_pickle(_torch_base_ops(), Flood("value", "setitems", "int", 200_000))),
            lambda: torch_file_with_pickle(flooded_pickle(_torch_base_ops(), Flood("value", "frozenset", "tuple", 150_000))),
            lambda: torch_file_with_pickle(flooded_pickle(_torch_base_ops(), Flood("keys", "setitems", "int", 200_000))),
            # Many string keys, each naming the same tensor: linear, and must stay so.
            lambda: torch_file_with_pickle(flooded_pickle(_torch_base_ops(), Flood("keys", "setitems", "str", 100_000))),
        ],
        "cx_dcp_pickle": [
            lambda: flooded_pickle(_dcp_base_ops(), Flood("value", "additems", "int", 200_000)),
            lambda: flooded_pickle(_dcp_base_ops(), Flood("value", "ordered_dict", "frozenset", 120_000)),
        ],
        "cx_legacy_pickle": [
            lambda: _legacy_parts()[0] + flooded_pickle(_legacy_parts()[1], Flood("value", "dict", "int", 70_000))
                    + _legacy_parts()[2],
        ],
        "cx_torch_records": [
            # 150,000 one-byte records, one name twice: a count of each name over all names.
            lambda: many_records_file(150_000, 1),
            lambda: many_records_file(150_000, 0),
        ],
        "cx_dcp_chunks": [
            # 20,000 1x1 chunks: each compared with every other for overlap.
            lambda: chunked_metadata(Chunking("blocks", 20_000)),
            lambda: chunked_metadata(Chunking("shuffled", 20_000, seed=1)),
        ],
        "cx_safetensors": [
            # Dimensions multiplied together before any is checked against int64: a 4-million-digit product.
            lambda: huge_dims_file(900, 4_000),
            # A 4 MB name beside 4,000 tensors: inspect pads every row to the longest name.
            lambda: tiled_u8(["n" * 4_000_000] + [f"t{i}" for i in range(4_000)]),
            lambda: tiled_u8([f"{i:08d}" for i in range(100_000)]),
        ],
        "cx_shard_index": [
            lambda: json.dumps({"weight_map": {f"layer.{i}.weight": f"missing-{i}.safetensors" for i in range(50_000)}}).encode(),
            lambda: json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors",
                                               **{f"layer.{i}.weight": "s1.safetensors" for i in range(100_000)}}}).encode(),
        ],
        "cx_config": [
            lambda: ('{"hidden_size": ' + "[" * 100_000 + "]" * 100_000 + "}").encode(),
        ],
    }


# ---------------------------------------------------------------- the registry the runner and tests use


@dataclass(frozen=True)
class FuzzCase:
    name: str
    target: Callable[[bytes], None]
    inputs: st.SearchStrategy[bytes]
    seeds: tuple[Callable[[], bytes], ...] = ()  # known inputs, tried before any is drawn (each made when tried)


CASES = [
    FuzzCase("safetensors_raw", safetensors_header, raw_safetensors),
    FuzzCase("safetensors_structured", safetensors_header, structured_safetensors()),
    FuzzCase("shard_index_raw", shard_index, raw_index),
    FuzzCase("shard_index_structured", shard_index, structured_index()),
    FuzzCase("torch_zip_bytes", torch_zip, mutated_torch_bytes()),
    FuzzCase("torch_zip_records", torch_zip, torch_zip_records()),
    FuzzCase("torch_pickle_ops", torch_zip, torch_pickle_opcodes()),
    FuzzCase("dcp_pickle_ops", dcp_metadata, dcp_pickle_opcodes()),
]
_SEEDS = _known_expensive()
COMPLEXITY_CASES = [
    FuzzCase(name, target, inputs, tuple(_SEEDS[name]))
    for name, target, inputs in [
        ("cx_torch_pickle", cx_torch_zip, torch_pickle_floods()),
        ("cx_dcp_pickle", cx_dcp, dcp_pickle_floods()),
        ("cx_legacy_pickle", cx_legacy, legacy_system_floods()),
        ("cx_torch_records", cx_torch_zip, many_record_zips()),
        ("cx_dcp_chunks", cx_dcp, chunked_dcp()),
        ("cx_safetensors", cx_safetensors, expensive_safetensors()),
        ("cx_shard_index", shard_index, expensive_indexes()),
        ("cx_config", cx_config, expensive_configs()),
    ]
]
CASES += COMPLEXITY_CASES
TARGETS = {case.name: case.target for case in CASES}


# ---------------------------------------------------------------- bugs found, not yet fixed
#
# Each is reproduced by an xfail(strict=True) test in tests/test_fuzz_short.py.
# The short fuzz runs tolerate exactly these failures, so that they keep
# catching new ones; the long run (fuzz/run.py) reports them, tagged. When a
# bug is fixed its test XPASSes and fails: remove the xfail and the entry here.


@dataclass(frozen=True)
class KnownBug:
    test: str  # the test in tests/test_fuzz_short.py that reproduces it
    types: tuple[type[BaseException], ...]
    file: str = ""  # the library file and function the exception escapes from,
    function: str = ""
    line_contains: str = ""  # and a piece of that source line (line numbers move);
    message_contains: str = ""  # or, for a broken invariant of a target (no library frame), its message


# Failures the library is known to have, each pinned by an xfail test in test_fuzz_short.py.
# (The sixteen found by the first fuzz runs are fixed and their tests now pass.)
KNOWN_BUGS: list[KnownBug] = []

_PACKAGE = Path(mz.__file__).resolve().parent


def known_bug(exc: BaseException) -> KnownBug | None:
    """The known bug ``exc`` is an instance of, judged by its type and where it left the library."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve().is_relative_to(_PACKAGE)]
    for bug in KNOWN_BUGS:
        if not isinstance(exc, bug.types):
            continue
        if bug.message_contains:
            if not frames and bug.message_contains in str(exc):
                return bug
        elif (
            frames
            and Path(frames[-1].filename).name == bug.file
            and frames[-1].name == bug.function
            and bug.line_contains in (frames[-1].line or "")
        ):
            return bug
    return None
