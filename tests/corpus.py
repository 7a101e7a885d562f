"""The corpus of hostile inputs: every case a real file (or folder), written by this script.

``python tests/corpus.py OUT_DIR`` writes each case under ``OUT_DIR/<name>/``
and a ``manifest.json`` describing what it must produce; ``test_corpus.py``
runs every case through the library and the CLI. Each case names the error
class it must end in and words its one-line message must contain (the file
is always among them).
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import runpy
import sys
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

TINY_MODEL = f"{Path(__file__).resolve().parent.parent / 'bench' / 'models' / 'transformer.py'}:DecoderLM"
TINY_ARGS = {"vocab_size": 16, "hidden_size": 8, "num_layers": 1, "num_heads": 2, "intermediate_size": 8}


@dataclass
class Case:
    name: str
    target: str  # relative to the case folder
    error: str  # a class name in materialize
    words: list[str]
    load: dict = field(default_factory=dict)  # keyword arguments of materialize.load_model
    cli: list[str] = field(default_factory=list)
    marker: str = ""  # a file that must NOT exist afterwards: proof that no code ran


# ---------------------------------------------------------------- writers


def raw_safetensors(path: Path, header, data: bytes = b"", length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def f32(shape: list, begin, end) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def real_safetensors(path: Path, tensors: dict | None = None) -> dict:
    tensors = tensors if tensors is not None else {"a": torch.arange(4.0), "b": torch.ones(2, 3)}
    save_file(tensors, str(path))
    return tensors


def index(folder: Path, weight_map: dict) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def rewrite_zip(path: Path, edit: Callable[[dict], dict], compression: int = zipfile.ZIP_STORED) -> None:
    with zipfile.ZipFile(path) as archive:
        records = {info.filename: archive.read(info.filename) for info in archive.infolist()}
    records = edit(records)
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        for name, data in records.items():
            archive.writestr(name, data)


def record_info(path: Path, suffix: str) -> zipfile.ZipInfo:
    with zipfile.ZipFile(path) as archive:
        return next(info for info in archive.infolist() if info.filename.endswith(suffix))


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


class Gadget:
    """Pickles to a call that would run when unpickled."""

    def __init__(self, function, argument) -> None:
        self.function, self.argument = function, argument

    def __reduce__(self):
        return (self.function, (self.argument,))


def pickled_call(path: Path, function, argument) -> None:
    torch.save({"weight": torch.ones(2), "payload": Gadget(function, argument)}, path)


# ---------------------------------------------------------------- pickles by hand


PROTO2 = pickle.PROTO + b"\x02"


def long_put(index: int) -> bytes:
    return pickle.LONG_BINPUT + struct.pack("<I", index)


def long_get(index: int) -> bytes:
    return pickle.LONG_BINGET + struct.pack("<I", index)


def pickled_text(value: str) -> bytes:
    encoded = value.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(encoded)) + encoded


def doubling_tuples(levels: int, first: int = 1000) -> bytes:
    """Opcodes leaving one tuple on the stack that holds the one before it twice, ``levels`` times over:
    2**levels objects to whoever hashes, prints or walks it, from about 20 bytes a level."""
    out = pickle.NONE + long_put(first) + pickle.POP
    for level in range(levels):
        out += long_get(first + level) + long_get(first + level) + pickle.TUPLE2 + long_put(first + level + 1) + pickle.POP
    return out + long_get(first + levels)


def doubling_lists_filled_late(levels: int, first: int = 1000) -> bytes:
    """The same doubling with lists, each filled only after the list above it took it in (while it was empty)."""
    out = b""
    for level in range(levels + 1):
        out += pickle.EMPTY_LIST + long_put(first + level) + pickle.POP
    for level in range(levels, 0, -1):
        out += long_get(first + level) + pickle.MARK + long_get(first + level - 1) + long_get(first + level - 1) + pickle.APPENDS + pickle.POP
    return out + long_get(first + levels)


def nested_lists(depth: int) -> bytes:
    return pickle.EMPTY_LIST * depth + pickle.APPEND * (depth - 1)


def with_layout_set_by_build(layout: bytes) -> bytes:
    """``{"w": tensor}`` as torch.save writes it (storage record 0 of six floats), then a BUILD on the tensor
    that sets its layout anew: (its storage, ``layout``'s offset, size and stride)."""
    storage = (pickle.MARK + pickled_text("storage") + pickle.GLOBAL + b"torch\nFloatStorage\n" + pickled_text("0") + pickled_text("cpu")
               + pickle.BININT1 + b"\x06" + pickle.TUPLE + pickle.BINPERSID + long_put(50))
    rebuilt = (pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n" + pickle.MARK + storage + pickle.BININT1 + b"\x00"
               + pickle.BININT1 + b"\x02" + pickle.BININT1 + b"\x03" + pickle.TUPLE2 + pickle.BININT1 + b"\x03"
               + pickle.BININT1 + b"\x01" + pickle.TUPLE2 + pickle.NEWFALSE + pickle.GLOBAL + b"collections\nOrderedDict\n"
               + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.TUPLE + pickle.REDUCE)
    build = pickle.MARK + long_get(50) + layout + pickle.TUPLE + pickle.BUILD
    return PROTO2 + pickle.EMPTY_DICT + pickled_text("w") + rebuilt + build + pickle.SETITEM + pickle.STOP


def torch_file_with_item(path: Path, key: bytes, value: bytes) -> None:
    """``torch.save({"w": ...})``, its pickle given one more item, ``key`` and ``value`` as opcodes."""
    torch.save({"w": torch.ones(2)}, path)

    def add_item(pickled: bytes) -> bytes:
        assert pickled.endswith(pickle.SETITEM + pickle.STOP)
        return pickled[:-1] + key + value + pickle.SETITEM + pickle.STOP

    rewrite_zip(path, lambda r: {k: (add_item(v) if k.endswith("data.pkl") else v) for k, v in r.items()})


def call_with_count(module_and_name: str, count: int) -> bytes:
    module, name = module_and_name.rsplit(".", 1)
    return (pickle.GLOBAL + f"{module}\n{name}\n".encode() + pickle.BININT + struct.pack("<i", count)
            + pickle.TUPLE1 + pickle.REDUCE)


# ---------------------------------------------------------------- the cases


def build(root: Path) -> list[Case]:
    cases: list[Case] = []

    def case(name: str, target: str, error: str, words: list[str], **extra) -> Path:
        folder = root / name
        folder.mkdir(parents=True)
        cases.append(Case(name, target, error, words, **extra))
        return folder

    st = "model.safetensors"
    folder = case("st-under-8-bytes", st, "CheckpointError", ["too short"])
    (folder / st).write_bytes(b"\x01\x02\x03")
    folder = case("st-header-past-eof", st, "CheckpointError", ["past the end"])
    raw_safetensors(folder / st, {"a": f32([1], 0, 4)}, length=10_000)
    folder = case("st-git-lfs-pointer", st, "CheckpointError", ["Git LFS"])
    (folder / st).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    folder = case("st-header-over-cap", st, "CheckpointError", ["limit"])
    raw_safetensors(folder / st, b"{}", length=2**40)
    folder = case("st-invalid-utf8", st, "CheckpointError", ["UTF-8"])
    raw_safetensors(folder / st, b'{"a": "\xff\xfe"}')
    folder = case("st-invalid-json", st, "CheckpointError", ["not valid JSON"])
    raw_safetensors(folder / st, b'{"a": {"dtype": ')
    folder = case("st-header-not-object", st, "CheckpointError", ["not an object"])
    raw_safetensors(folder / st, b"[1, 2, 3]")
    folder = case("st-unknown-dtype", st, "CheckpointError", ["'a'", "dtype"])
    raw_safetensors(folder / st, {"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    folder = case("st-duplicate-key", st, "CheckpointError", ["'a'", "twice"])
    raw_safetensors(folder / st, b'{"a": ' + json.dumps(f32([1], 0, 4)).encode() + b', "a": ' + json.dumps(f32([1], 4, 8)).encode() + b"}", b"\0" * 8)
    folder = case("st-overlapping-offsets", st, "CheckpointError", ["overlap"])
    raw_safetensors(folder / st, {"a": f32([2], 0, 8), "b": f32([2], 4, 12)}, b"\0" * 12)
    folder = case("st-reversed-offsets", st, "CheckpointError", ["'a'", "reversed"])
    raw_safetensors(folder / st, {"a": f32([0], 4, 0)}, b"\0" * 4)
    folder = case("st-gap-between-tensors", st, "CheckpointError", ["'b'", "unaccounted"])
    raw_safetensors(folder / st, {"a": f32([1], 0, 4), "b": f32([1], 8, 12)}, b"\0" * 12)
    folder = case("st-offsets-out-of-range", st, "CheckpointError", ["'a'", "past the data"])
    raw_safetensors(folder / st, {"a": f32([4], 0, 16)}, b"\0" * 8)
    folder = case("st-trailing-bytes", st, "CheckpointError", ["trailing"])
    raw_safetensors(folder / st, {"a": f32([1], 0, 4)}, b"\0" * 12)
    folder = case("st-length-not-dtype-times-shape", st, "CheckpointError", ["'a'", "needs"])
    raw_safetensors(folder / st, {"a": f32([3], 0, 8)}, b"\0" * 8)
    folder = case("st-shape-product-overflow", st, "CheckpointError", ["'a'", "larger than any tensor"])
    raw_safetensors(folder / st, {"a": f32([2**40, 2**40, 2**40], 0, 4)}, b"\0" * 4)
    folder = case("st-negative-dimension", st, "CheckpointError", ["'a'", "shape"])
    raw_safetensors(folder / st, {"a": f32([-1], 0, 4)}, b"\0" * 4)
    folder = case("st-float-offsets", st, "CheckpointError", ["'a'", "data_offsets"])
    raw_safetensors(folder / st, {"a": f32([1], 0.0, 4.0)}, b"\0" * 4)
    folder = case("st-metadata-not-strings", st, "CheckpointError", ["__metadata__"])
    raw_safetensors(folder / st, {"__metadata__": {"format": 1}, "a": f32([1], 0, 4)}, b"\0" * 4)
    folder = case("st-bool-not-0-or-1", st, "CheckpointError", ["'m'", "0 and 1"])
    raw_safetensors(folder / st, {"m": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}}, b"\x01\x07")
    folder = case("st-truncated-data", st, "CheckpointError", ["past the data"])
    real_safetensors(folder / st)
    os.truncate(folder / st, (folder / st).stat().st_size - 5)

    idx = "model.safetensors.index.json"
    folder = case("shard-missing", idx, "CheckpointNotFoundError", ["missing shard", "s1.safetensors", "s2.safetensors"])
    index(folder, {"a": "s1.safetensors", "b": "s2.safetensors"})
    folder = case("shard-lacks-mapped-tensor", idx, "CheckpointError", ["zzz", "does not hold"])
    real_safetensors(folder / "s1.safetensors")
    index(folder, {"a": "s1.safetensors", "b": "s1.safetensors", "zzz": "s1.safetensors"})
    folder = case("shard-holds-unindexed-tensor", idx, "CheckpointError", ["'b'", "does not name"])
    real_safetensors(folder / "s1.safetensors")
    index(folder, {"a": "s1.safetensors"})
    folder = case("shard-tensor-in-two-shards", idx, "CheckpointError", ["'a'", "maps it to"])
    real_safetensors(folder / "s1.safetensors", {"a": torch.ones(1)})
    real_safetensors(folder / "s2.safetensors", {"a": torch.ones(1), "b": torch.ones(1)})
    index(folder, {"a": "s1.safetensors", "b": "s2.safetensors"})
    folder = case("shard-path-traversal", idx, "CheckpointError", ["outside the checkpoint folder"])
    real_safetensors(root / "outside.safetensors")
    index(folder, {"a": "../outside.safetensors"})
    folder = case("shard-absolute-path", idx, "CheckpointError", ["outside the checkpoint folder"])
    index(folder, {"a": str((root / "outside.safetensors").resolve())})
    folder = case("shard-symlink-escape", idx, "CheckpointError", ["symlink", "outside"])
    os.symlink(root / "outside.safetensors", folder / "s1.safetensors")
    index(folder, {"a": "s1.safetensors", "b": "s1.safetensors"})
    folder = case("index-invalid-json", idx, "CheckpointError", ["not valid JSON"])
    (folder / idx).write_text('{"weight_map": ')
    folder = case("index-without-weight-map", idx, "CheckpointError", ["weight_map"])
    (folder / idx).write_text('{"metadata": {}}')

    pt = "model.pt"
    folder = case("pt-os-system", pt, "UnsafeCheckpointError", ["system", "trust"], marker="pwned-os-system")
    pickled_call(folder / pt, os.system, f"touch {folder / 'pwned-os-system'}")
    folder = case("pt-eval", pt, "UnsafeCheckpointError", ["eval"], marker="pwned-eval")
    pickled_call(folder / pt, eval, f"open({str(folder / 'pwned-eval')!r}, 'w')")
    folder = case("pt-exec-via-builtins", pt, "UnsafeCheckpointError", ["exec"], marker="pwned-exec")
    pickled_call(folder / pt, exec, f"open({str(folder / 'pwned-exec')!r}, 'w')")
    folder = case("pt-runpy-run-path", pt, "UnsafeCheckpointError", ["runpy.run_path", "trust_pickle"], marker="pwned-runpy")
    (folder / "payload.py").write_text(f"open({str(folder / 'pwned-runpy')!r}, 'w')")
    pickled_call(folder / pt, runpy.run_path, str(folder / "payload.py"))
    folder = case("pt-pickled-module-with-a-call", pt, "UnsafeCheckpointError", ["runpy.run_path"], marker="pwned-in-module")
    (folder / "payload.py").write_text(f"open({str(folder / 'pwned-in-module')!r}, 'w')")
    module = nn.Linear(2, 2)
    module.hook = Gadget(runpy.run_path, str(folder / "payload.py"))
    torch.save(module, folder / pt)
    folder = case("pt-torchscript", pt, "UnsupportedFormatError", ["TorchScript"])
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), folder / pt)
    folder = case("pt-malformed-opcodes", pt, "CheckpointError", ["data.pkl"])
    torch.save({"w": torch.ones(2)}, folder / pt)
    rewrite_zip(folder / pt, lambda r: {k: (b"\x80\x02\xff\xfe\xfd" if k.endswith("data.pkl") else v) for k, v in r.items()})
    folder = case("pt-storage-record-too-short", pt, "CheckpointError", ["'w'", "32 expected"])
    torch.save({"w": torch.ones(8)}, folder / pt)
    rewrite_zip(folder / pt, lambda r: {k: (v[:-4] if "/data/" in k else v) for k, v in r.items()})
    folder = case("pt-missing-data-pkl", pt, "CheckpointError", ["data.pkl"])
    torch.save({"w": torch.ones(2)}, folder / pt)
    rewrite_zip(folder / pt, lambda r: {k: v for k, v in r.items() if not k.endswith("data.pkl")})
    folder = case("pt-missing-storage-record", pt, "CheckpointError", ["'w'", "missing"])
    torch.save({"w": torch.ones(2)}, folder / pt)
    rewrite_zip(folder / pt, lambda r: {k: v for k, v in r.items() if "/data/" not in k})
    folder = case("pt-truncated-zip", pt, "CheckpointError", ["zip"])
    torch.save({"w": torch.ones(1000)}, folder / pt)
    os.truncate(folder / pt, (folder / pt).stat().st_size // 2)
    folder = case("pt-legacy-truncated", pt, "CheckpointError", ["'b'", "truncated"])
    torch.save({"a": torch.ones(2), "b": torch.ones(1000)}, folder / pt, _use_new_zipfile_serialization=False)
    os.truncate(folder / pt, (folder / pt).stat().st_size - 100)
    folder = case("pt-legacy-os-system", pt, "UnsafeCheckpointError", ["system"], marker="pwned-legacy")
    torch.save({"weight": torch.ones(2), "payload": Gadget(os.system, f"touch {folder / 'pwned-legacy'}")}, folder / pt,
               _use_new_zipfile_serialization=False)
    folder = case("pt-compressed-records", pt, "CheckpointError", ["compressed"])
    torch.save({"w": torch.ones(64)}, folder / pt)
    rewrite_zip(folder / pt, lambda r: r, compression=zipfile.ZIP_DEFLATED)
    folder = case("pt-big-endian", pt, "UnsupportedFormatError", ["big-endian"])
    torch.save({"w": torch.ones(2)}, folder / pt)
    rewrite_zip(folder / pt, lambda r: {k: (b"big" if k.endswith("/byteorder") else v) for k, v in r.items()})
    folder = case("pt-duplicate-record", pt, "CheckpointError", ["more than once", "data/0"])
    torch.save({"w": torch.ones(4)}, folder / pt)
    with zipfile.ZipFile(folder / pt, "a") as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate name: that is the point
        prefix = archive.namelist()[0].split("/")[0]
        archive.writestr(f"{prefix}/data/0", b"\0" * 16)
    folder = case("pt-local-header-disagrees", pt, "CheckpointError", ["data/0", "disagrees with the central directory"])
    torch.save({"w": torch.ones(4)}, folder / pt)
    info = record_info(folder / pt, "/data/0")
    patch(folder / pt, info.header_offset + 30 + len(info.filename) - 1, b"9")  # data/0 -> data/9 in the local copy only
    folder = case("pt-end-record-count", pt, "CheckpointError", ["end record counts"])
    torch.save({"w": torch.ones(4)}, folder / pt)
    end_record = (folder / pt).read_bytes().rfind(b"PK\x05\x06")
    patch(folder / pt, end_record + 10, struct.pack("<H", 3))
    folder = case("pt-encrypted-record", pt, "CheckpointError", ["data/0", "encrypted"])
    torch.save({"w": torch.ones(4)}, folder / pt)
    info = record_info(folder / pt, "/data/0")
    with zipfile.ZipFile(folder / pt) as archive:
        start = archive.start_dir
    raw = (folder / pt).read_bytes()
    at = start
    while raw[at + 46: at + 46 + len(info.filename)] != info.filename.encode():
        at += 46 + sum(struct.unpack_from("<HHH", raw, at + 28))
    patch(folder / pt, at + 8, struct.pack("<H", struct.unpack_from("<H", raw, at + 8)[0] | 1))
    folder = case("pt-bool-not-0-or-1", pt, "CheckpointError", ["'mask'", "0 and 1"])
    torch.save({"mask": torch.tensor([True, False, True])}, folder / pt)
    rewrite_zip(folder / pt, lambda r: {k: (b"\x01\x00\x07" if "/data/" in k else v) for k, v in r.items()})
    junk = pickled_text("junk")
    folder = case("pt-shared-tuple-as-key", pt, "BudgetError", ["data.pkl", "objects", "16 per byte"])
    torch_file_with_item(folder / pt, doubling_tuples(100), pickle.NONE)  # hashed 2**100 times over, in C
    folder = case("pt-shared-tuple-as-value", pt, "BudgetError", ["data.pkl", "objects"])
    torch_file_with_item(folder / pt, junk, doubling_tuples(100))
    folder = case("pt-shared-lists-filled-late", pt, "BudgetError", ["data.pkl", "objects"])
    torch_file_with_item(folder / pt, junk, doubling_lists_filled_late(100))
    folder = case("pt-shared-persistent-id", pt, "BudgetError", ["data.pkl", "objects"])
    torch.save({"w": torch.ones(2)}, folder / pt)
    rewrite_zip(folder / pt, lambda r: {k: (PROTO2 + doubling_tuples(100) + pickle.BINPERSID + pickle.STOP
                                            if k.endswith("data.pkl") else v) for k, v in r.items()})
    folder = case("pt-shared-set-items", pt, "BudgetError", ["data.pkl", "objects"])
    torch_file_with_item(folder / pt, junk, pickle.GLOBAL + b"builtins\nset\n" + pickle.MARK + doubling_tuples(100)
                         + pickle.LIST + pickle.TUPLE1 + pickle.REDUCE)
    folder = case("pt-nested-100000-deep", pt, "BudgetError", ["data.pkl", "200 deep"])
    torch_file_with_item(folder / pt, junk, nested_lists(100_000))
    folder = case("pt-nested-dicts-300-deep", pt, "BudgetError", ["data.pkl", "200 deep"])
    torch_file_with_item(folder / pt, junk, (pickle.EMPTY_DICT + junk) * 300 + pickle.NONE + pickle.SETITEM * 300)
    folder = case("pt-bytearray-of-a-count", pt, "CheckpointError", ["bytearray", "count"])
    torch_file_with_item(folder / pt, junk, call_with_count("builtins.bytearray", 2_000_000_000))
    folder = case("pt-tensor-of-a-count", pt, "CheckpointError", ["torch.FloatTensor", "count"])
    torch_file_with_item(folder / pt, junk, call_with_count("torch.FloatTensor", 2_000_000_000))
    folder = case("pt-storage-of-a-count", pt, "CheckpointError", ["torch.UntypedStorage", "count"])
    torch_file_with_item(folder / pt, junk, call_with_count("torch.UntypedStorage", 2_000_000_000))
    folder = case("pt-compressed-data-pkl", pt, "CheckpointError", ["data.pkl", "compressed"])
    torch.save({"w": torch.ones(2)}, folder / pt)
    with zipfile.ZipFile(folder / pt) as archive:
        records = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(folder / pt, "w") as archive:
        for info, data in records:
            info.compress_type = zipfile.ZIP_DEFLATED if info.filename.endswith("data.pkl") else zipfile.ZIP_STORED
            archive.writestr(info, data)
    folder = case("pt-conjugate-bit", pt, "CheckpointError", ["'z'", "conjugate bit", "resolve_conj"])
    torch.save({"z": torch.tensor([1 + 2j, 3 - 1j]).conj()}, folder / pt)
    folder = case("pt-negative-bit", pt, "CheckpointError", ["'z'", "negative bit", "resolve_neg"])
    torch.save({"z": torch.tensor([1 + 2j, 3 - 1j])._neg_view()}, folder / pt)
    folder = case("pt-negative-stride-set-by-build", pt, "CheckpointError", ["negative"])
    torch.save({"w": torch.arange(6.0)}, folder / pt)
    negative = (pickle.BININT1 + b"\x05" + pickle.BININT1 + b"\x03" + pickle.TUPLE1 + pickle.BININT
                + struct.pack("<i", -1) + pickle.TUPLE1)
    rewrite_zip(folder / pt, lambda r: {k: (with_layout_set_by_build(negative) if k.endswith("data.pkl") else v)
                                        for k, v in r.items()})
    folder = case("dcp-shared-metadata-key", ".", "BudgetError", [".metadata", "DCP metadata", "objects"])
    from torch.distributed import checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a single-process save warns that no process group exists
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(folder))
    (folder / ".metadata").write_bytes(PROTO2 + pickle.EMPTY_DICT + doubling_tuples(100) + pickle.NONE + pickle.SETITEM
                                       + pickle.STOP)
    folder = case("pt-legacy-shared-magic-number", pt, "BudgetError", ["magic number", "objects"])
    (folder / pt).write_bytes(PROTO2 + pickle.EMPTY_DICT + doubling_tuples(100) + pickle.NONE + pickle.SETITEM
                              + pickle.STOP)
    folder = case("pt-not-a-checkpoint", pt, "CheckpointError", ["not a valid torch zip"])
    (folder / pt).write_bytes(b"this is plain text, not a model")

    model = {"model": TINY_MODEL, "model_args": TINY_ARGS}
    cli_model = ["--model", TINY_MODEL, *[f"--model-arg={k}={v}" for k, v in TINY_ARGS.items()]]
    folder = case("load-shape-mismatch", st, "ShapeMismatchError", ["model.norm.weight", "[8]", "[9]"], load=model, cli=cli_model)
    from bench.models.transformer import DecoderLM

    state = {k: v.contiguous() for k, v in DecoderLM(**TINY_ARGS).state_dict().items()}
    save_file({**state, "model.norm.weight": torch.ones(9)}, str(folder / st))
    folder = case("load-missing-and-unexpected", st, "KeyMismatchError", ["lm_head.weight", "stray"], load=model, cli=cli_model)
    save_file({**{k: v for k, v in state.items() if k != "lm_head.weight"}, "stray": torch.ones(1)}, str(folder / st))
    folder = case("load-fp16-overflow", st, "CastOverflowError", ["'big'", "overflows"], load={"dtype": "fp16"}, cli=["--dtype", "fp16"])
    save_file({"big": torch.tensor([1e9])}, str(folder / st))
    case("path-does-not-exist", "nowhere.safetensors", "CheckpointNotFoundError", ["no such file"])
    case("folder-without-checkpoint", ".", "CheckpointNotFoundError", ["holds no"])

    (root / "manifest.json").write_text(json.dumps([asdict(c) for c in cases], indent=1))
    return cases


if __name__ == "__main__":
    written = build(Path(sys.argv[1]))
    print(f"{len(written)} cases in {sys.argv[1]}")
