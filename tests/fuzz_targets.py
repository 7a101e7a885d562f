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
    """Every TensorInfo is a real tensor whose bytes lie inside its file, and that file inside ``folder``."""
    for name, info in ckpt.items():
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
            assert raw_bytes(tensor) == raw_bytes(want), f"{name}: bytes differ from torch.load's"


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


# ---------------------------------------------------------------- the registry the runner and tests use


@dataclass(frozen=True)
class FuzzCase:
    name: str
    target: Callable[[bytes], None]
    inputs: st.SearchStrategy[bytes]


CASES = [
    FuzzCase("safetensors_raw", safetensors_header, raw_safetensors),
    FuzzCase("safetensors_structured", safetensors_header, structured_safetensors()),
    FuzzCase("shard_index_raw", shard_index, raw_index),
    FuzzCase("shard_index_structured", shard_index, structured_index()),
    FuzzCase("torch_zip_bytes", torch_zip, mutated_torch_bytes()),
    FuzzCase("torch_zip_records", torch_zip, torch_zip_records()),
]
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
# Empty: the sixteen found by the first fuzz runs are fixed and their tests now pass.
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
