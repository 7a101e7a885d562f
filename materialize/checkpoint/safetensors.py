"""The safetensors header: read it, validate every field, trust nothing.

Layout: 8-byte little-endian header length N, N bytes of JSON, then the data
region. Each entry gives dtype, shape and ``data_offsets`` [begin, end)
relative to the data region.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from ..errors import CheckpointError
from ..sources.fileio import Positional
from .base import TensorInfo, make_info

# The format's own reference reader caps headers at 100 MB; a larger length
# is refused before any allocation.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_LFS_POINTER_PREFIX = b"version https://git-lfs"

# The format's dtype codes, as torch names and element sizes.
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "C64": ("complex64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "F8_E8M0": ("float8_e8m0fnu", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1), "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),  # ROCm's float8 variants
}


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result = dict(pairs)  # called for every JSON object of the header: the common case stays at C speed
    if len(result) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return result


class _DuplicateKey(Exception):
    pass


def _loads_once_each(raw: bytes, text: str) -> object:
    """The header's JSON, refused (:class:`_DuplicateKey`) where any object lists a key twice.

    A hook that sees every object's pairs costs a call per tensor, so a
    header is first parsed without it, and kept where its colons prove it
    holds no duplicate: every key is followed by a colon (UTF-8 writes no
    other character with its byte), so where the keys parsed, the top level's
    and its entries', are as many as the colons in the text, no colon stands
    for a key lost to a duplicate (or for a deeper key, or one inside a
    string). Anything else (a name with a colon in it, nested objects, a
    number of many digits, a file that does not parse) is parsed again with
    the hook, which gives the exact error.
    """
    if not _has_long_number(raw):
        try:
            header = json.loads(text)
        except (ValueError, RecursionError):
            header = None
        if type(header) is dict and raw.count(b":") == len(header) + sum(
                [len(entry) for entry in header.values() if type(entry) is dict]):
            return header
        long_numbers = {}
    else:  # the hook costs a call per number, so only headers holding a long run of digits pay it
        long_numbers = {"parse_int": _bounded_int}
    return json.loads(text, object_pairs_hook=_reject_duplicates, **long_numbers)


# No field of a header needs more digits: offsets are below 2**64 (20 digits), dimensions below 2**63. A longer
# number is kept as a marker, not converted: json converts digit strings in quadratic time, so a header of thousands
# of numbers of thousands of digits would take minutes before any entry is checked.
MAX_DIGITS = 20
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= byte <= 0x39 else byte for byte in range(256))


def _has_long_number(raw: bytes) -> bool:
    """Whether the header holds a run of more than :data:`MAX_DIGITS` ASCII digits (UTF-8 spells them as
    themselves, and no other character with their bytes). Every digit made ``0``, a substring search: a
    regular expression tried at every digit cost a microsecond a tensor."""
    return b"0" * (MAX_DIGITS + 1) in raw.translate(_DIGITS_AS_ZERO)


class _Huge:
    """A number of more than :data:`MAX_DIGITS` digits in a header, left unconverted."""

    __slots__ = ("digits", "negative")

    def __init__(self, text: str) -> None:
        self.negative = text.startswith("-")
        self.digits = len(text) - self.negative

    def __repr__(self) -> str:
        return f"<{'-' if self.negative else ''}{self.digits} digits>"


def _bounded_int(text: str) -> "int | _Huge":
    return int(text) if len(text) <= MAX_DIGITS else _Huge(text)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header; no tensor data is read."""
    with Positional(path) as source:
        file_size = source.size
        prefix = source.pread(8, 0)
        if prefix.startswith(_LFS_POINTER_PREFIX[:8]) and source.pread(64, 0).startswith(_LFS_POINTER_PREFIX):
            raise CheckpointError(
                "is a Git LFS pointer, not the weights; run 'git lfs pull' in its repository", path=path
            )
        if len(prefix) < 8:
            raise CheckpointError(f"too short for safetensors ({file_size} bytes, need at least 8)", path=path)
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt or not safetensors)",
                path=path,
            )
        if 8 + header_len > file_size:
            raise CheckpointError(
                f"header length {header_len} runs past the end of the file ({file_size} bytes; truncated?)",
                path=path,
            )
        raw = source.pread(header_len, 8)
    if len(raw) != header_len:
        raise CheckpointError("file shrank while its header was read", path=path)
    return _parse_header(path, raw, data_start=8 + header_len, file_size=file_size)


def _parse_header(path: Path, raw: bytes, *, data_start: int, file_size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"header is not valid UTF-8 (byte {exc.start})", path=path) from None
    try:
        header = _loads_once_each(raw, text)
    except _DuplicateKey as dup:
        raise CheckpointError("header lists the tensor twice", path=path, tensor=str(dup.args[0])) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"header is not valid JSON ({exc.msg} at char {exc.pos})", path=path) from None
    except (RecursionError, ValueError) as exc:  # nesting past the recursion limit; integers past 4300 digits
        raise CheckpointError(f"header JSON cannot be parsed safely: {type(exc).__name__}", path=path) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"header is a JSON {type(header).__name__}, not an object", path=path)

    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError("__metadata__ must map strings to strings", path=path)

    data_size = file_size - data_start
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        info, begin, end = _parse_entry(path, name, entry, data_start, data_size)
        tensors[name] = info
        spans.append((begin, end, name))
    _check_layout(path, spans, data_size)
    return tensors, metadata


def _parse_entry(path: Path, name: str, entry: object, data_start: int, data_size: int) -> tuple[TensorInfo, int, int]:
    # Checked inline, with no generator or closure per entry: a header of 18,000 tensors is parsed per load.
    if type(entry) is not dict:
        raise CheckpointError("header entry is not an object", path=path, tensor=name)
    dtype_name = entry.get("dtype")
    known = SAFETENSORS_DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if known is None:
        raise CheckpointError(f"unknown or unsupported dtype {dtype_name!r}", path=path, tensor=name)
    shape = entry.get("shape")
    numel = _numel_of_shape(shape)
    if numel is None:
        raise CheckpointError(f"shape must be a list of non-negative integers, got {_short(shape)}", path=path, tensor=name)
    if numel < 0:
        raise CheckpointError(f"shape {_short(shape)} is larger than any tensor can be (dimensions past 2**63)",
                              path=path, tensor=name)
    offsets = entry.get("data_offsets")
    if type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int \
            or offsets[0] < 0 or offsets[1] < 0:
        if type(offsets) is list and len(offsets) == 2 and any(type(o) is _Huge and not o.negative for o in offsets) \
                and all(type(o) is _Huge or type(o) is int and o >= 0 for o in offsets):
            raise CheckpointError(f"data_offsets {_short(offsets)} run past the data region's {data_size} bytes",
                                  path=path, tensor=name)
        raise CheckpointError(f"data_offsets must be two non-negative integers, got {_short(offsets)}", path=path,
                              tensor=name)
    begin, end = offsets
    torch_name, itemsize = known
    if begin > end:
        raise CheckpointError(f"data_offsets are reversed ({begin} > {end})", path=path, tensor=name)
    if end > data_size:
        raise CheckpointError(f"data_offsets end at {end}, past the data region's {data_size} bytes (truncated?)",
                              path=path, tensor=name)
    expected = numel * itemsize
    if end - begin != expected:
        raise CheckpointError(f"holds {end - begin} bytes but {dtype_name} x {shape} needs {expected}", path=path, tensor=name)
    return make_info(name, torch_name, itemsize, tuple(shape), path, data_start + begin, numel=numel), begin, end


_DIMENSION_LIMIT = 2**63


def _numel_of_shape(shape: object) -> "int | None":
    """The element count of a shape that is a list of non-negative ints, else None; -1 where torch cannot
    describe the shape (a dimension, or the strides the dimensions multiply into, at 2**63 or past it).

    Nothing is multiplied past 2**63: the product of thousands of huge dimensions, a step at a time, would be
    quadratic in the header's size. Every dimension is still checked, so the verdict is the one
    :func:`~.base.shape_fits_int64` gives.
    """
    if type(shape) is not list:
        return None
    numel = extent = 1
    fits = True
    for dim in shape:
        if type(dim) is int:
            if dim < 0:
                return None
            if fits:
                numel *= dim
                extent *= dim or 1
                fits = dim < _DIMENSION_LIMIT and extent < _DIMENSION_LIMIT
        elif type(dim) is _Huge and not dim.negative:
            fits = False
        else:
            return None
    return numel if fits else -1


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_layout(path: Path, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """Tensors must tile the data region: no overlap, no gap, no trailing bytes."""
    position = 0
    for begin, end, name in sorted(spans):
        if begin < position:
            raise CheckpointError(f"bytes [{begin}, {end}) overlap the previous tensor's", path=path, tensor=name)
        if begin > position:
            raise CheckpointError(f"{begin - position} unaccounted bytes before this tensor", path=path, tensor=name)
        position = end
    if position != data_size:
        raise CheckpointError(
            f"{data_size - position} trailing bytes after the last tensor (corrupt or wrong header)", path=path
        )
