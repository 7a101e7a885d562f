"""Readers whose cost is bounded by the size of the file they read, against files crafted to make it grow faster.

Each hostile file is loaded in a child process under a time limit and an address-space limit (see :func:`_bounded`),
so a reader that turned quadratic again, or inflated what it then refused, fails the test instead of stopping the
suite. The limits are generous kill limits, not speed targets: a regression runs for minutes or gigabytes.
"""

from __future__ import annotations

import io
import json
import pickle
import resource
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

import materialize as mz

TIME_LIMIT_S = 30
ADDRESS_SPACE = 3 << 30
CLI = [sys.executable, "-m", "cli.main"]
ROOT = Path(__file__).resolve().parents[1]


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _run_limited(argv: list[str], what: Path) -> subprocess.CompletedProcess:
    """``argv`` run in a child of bounded time and address space; a child past its time is a failed test."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=TIME_LIMIT_S, cwd=ROOT,
                              preexec_fn=_limit_address_space)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {TIME_LIMIT_S} s: {what}")


_CHILD = textwrap.dedent("""
    import json, resource, sys
    import torch
    import materialize as mz
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        if sys.argv[2:]:  # the names of tensors whose values to report
            tensors, _ = mz.load_tensors(sys.argv[1])
            outcome = {"error": None, "values": {name: tensors[name].flatten().tolist() for name in sys.argv[2:]}}
        else:
            mz.open_checkpoint(sys.argv[1]).close()
            outcome = {"error": None}
    except Exception as error:
        outcome = {"error": type(error).__name__, "message": str(error), "ours": isinstance(error, mz.MaterializeError)}
    outcome["grew_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline
    print(json.dumps(outcome))
""")


def _bounded(path: Path, *values_of: str) -> dict:
    """How opening ``path`` (loading it, to report the values of the tensors ``values_of``) ended in a child of
    bounded time and address space, and how much its peak memory grew."""
    done = _run_limited([sys.executable, "-c", _CHILD, str(path), *values_of], path)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


# ---------------------------------------------------------------- torch zip


def _stored_zip(records: list[tuple[str, bytes]], central_extra: bytes = b"") -> bytes:
    """A zip of stored records, written directly: zipfile refuses (or warns at) what these tests need; each central
    directory entry carries ``central_extra``."""
    body, directory = bytearray(), bytearray()
    for name, data in records:
        raw, crc = name.encode(), zlib.crc32(data)
        directory += struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, crc, len(data), len(data),
                                 len(raw), len(central_extra), 0, 0, 0, 0, len(body)) + raw + central_extra
        body += struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, 0, 0, 0, crc, len(data), len(data), len(raw), 0) + raw + data
    count, start = len(records), len(body) + len(directory)
    zip64 = struct.pack("<4sQ2H2I4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, len(directory), len(body))
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, start, 1)
    end = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, len(directory), len(body), 0)
    return bytes(body + directory + zip64 + locator + end)


def _genuine_records() -> list[tuple[str, bytes]]:
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(6.0)}, buffer)
    with zipfile.ZipFile(buffer) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


def test_a_zip_of_150000_records_with_one_name_twice_is_refused_naming_it(tmp_path):
    genuine = _genuine_records()
    prefix = genuine[0][0].split("/")[0]
    junk = [(f"{prefix}/extra/{number}", b"x") for number in range(150_000)]
    path = tmp_path / "many.pt"
    path.write_bytes(_stored_zip(genuine + junk + [(f"{prefix}/extra/74999", b"y")]))

    outcome = _bounded(path)

    assert outcome["ours"], outcome
    assert str(path) in outcome["message"] and f"more than once: {prefix}/extra/74999" in outcome["message"]


def test_a_zip_of_50000_records_loads_and_each_is_still_verified(tmp_path):
    genuine = _genuine_records()
    prefix = genuine[0][0].split("/")[0]
    junk = [(f"{prefix}/extra/{number}", b"x") for number in range(50_000)]
    path = tmp_path / "many.pt"
    path.write_bytes(_stored_zip(genuine + junk))
    assert _bounded(path)["error"] is None

    damaged = bytearray(path.read_bytes())
    last = damaged.rindex(b"extra/49999\x78")  # the record's one byte, in its local header's wake
    damaged[last + len("extra/49999")] = ord("z")
    path.write_bytes(bytes(damaged))

    outcome = _bounded(path)

    assert outcome["ours"] and str(path) in outcome["message"] and "extra/49999" in outcome["message"], outcome


def _deflated_pickle_file(path: Path, inflated: int) -> Path:
    """A torch file whose data.pkl is deflated: a pickle of ``inflated`` zero bytes popped before the state dict."""
    genuine = _genuine_records()
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for name, data in genuine:
            if not name.endswith("/data.pkl"):
                archive.writestr(name, data, compress_type=zipfile.ZIP_STORED)
                continue
            with archive.open(name, "w", force_zip64=True) as record:
                record.write(data[:2] + pickle.BINBYTES8 + struct.pack("<Q", inflated))
                block = bytes(64 << 20)
                for _ in range(inflated // len(block)):
                    record.write(block)
                record.write(pickle.POP + data[2:])
    return path


def test_a_deflated_data_pkl_is_refused_before_it_is_inflated(tmp_path):
    path = _deflated_pickle_file(tmp_path / "deflated.pt", 1 << 30)
    assert path.stat().st_size < 2 << 20

    outcome = _bounded(path)

    assert outcome["ours"], outcome
    assert str(path) in outcome["message"] and "data.pkl" in outcome["message"] and "compressed" in outcome["message"]
    assert outcome["grew_kb"] < 100_000  # inflated, it would be a gigabyte


# ---------------------------------------------------------------- torch.distributed.checkpoint


def _dcp_of_cells(folder: Path, cells: list[tuple[int, int]], shape: tuple[int, int], values: int) -> Path:
    """A DCP folder whose tensor 'w' of ``shape`` is described as one-element chunks at ``cells``, in that order;
    the chunk at cell number i is stored where the one-element tensor 'v{i % values}' (holding i % values) is."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a single-process save warns that no process group exists
        dcp.save({"w": torch.zeros(1, 1), **{f"v{k}": torch.full((1, 1), float(k)) for k in range(values)}},
                 checkpoint_id=str(folder))
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own file: read it with pickle itself
    stored = {index.fqn: where for index, where in metadata.storage_data.items()}
    entry = metadata.state_dict_metadata["w"]
    entry.size = torch.Size(shape)
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size(cell), sizes=torch.Size([1, 1])) for cell in cells]
    for row, column in cells:
        metadata.storage_data[MetadataIndex("w", torch.Size([row, column]))] = stored[f"v{(row * shape[1] + column) % values}"]
    path.write_bytes(pickle.dumps(metadata))
    return folder


def test_20000_one_element_chunks_of_which_two_overlap_are_refused_naming_both(tmp_path):
    cells = [(row, column) for row in range(100) for column in range(200)]
    folder = _dcp_of_cells(tmp_path / "dcp", cells[:-1] + [cells[-2]], (100, 200), values=1)
    assert (folder / ".metadata").stat().st_size > 1_000_000

    outcome = _bounded(folder)

    assert outcome["ours"], outcome
    assert str(folder) in outcome["message"] and "tensor 'w'" in outcome["message"]
    assert "overlap: [99:100, 198:199] and [99:100, 198:199]" in outcome["message"]


def test_20000_one_element_chunks_that_tile_their_tensor_load_each_into_its_place(tmp_path):
    cells = [(row, column) for row in range(100) for column in range(200)]
    folder = _dcp_of_cells(tmp_path / "dcp", cells[::-1], (100, 200), values=7)

    outcome = _bounded(folder, "w")

    assert outcome["error"] is None, outcome
    assert outcome["values"]["w"] == [float(number % 7) for number in range(20_000)]


@pytest.mark.parametrize("cells, words", [
    ([(0, 0), (0, 1), (1, 0), (1, 0)], "overlap: [1:2, 0:1] and [1:2, 0:1]"),
    ([(0, 0), (0, 1), (1, 1)], "cover 3 of its 4 elements"),
    ([(0, 0), (0, 0), (1, 0), (1, 1)], "overlap: [0:1, 0:1] and [0:1, 0:1]"),
    ([(0, 0), (1, 1), (1, 0), (1, 1)], "overlap: they hold its 4 elements but leave element [0, 1] uncovered"),
])
def test_chunks_that_do_not_tile_their_tensor_are_refused_naming_it(tmp_path, cells, words):
    folder = _dcp_of_cells(tmp_path / "dcp", cells, (2, 2), values=1)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(folder)

    assert str(folder) in str(caught.value) and "tensor 'w'" in str(caught.value) and words in str(caught.value)


# ---------------------------------------------------------------- safetensors


def _safetensors_of_header(path: Path, header: str, data: bytes = b"") -> Path:
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_a_shape_of_3000_dimensions_of_4000_digits_is_refused_by_the_cli_at_once_naming_the_tensor(tmp_path):
    huge = "9" * 4000
    path = _safetensors_of_header(tmp_path / "wide.safetensors",
                                  '{"w": {"dtype": "F32", "shape": [' + ", ".join([huge] * 3000) + ', 0], '
                                  '"data_offsets": [0, 0]}}')
    assert path.stat().st_size > 10_000_000
    script = ("import atexit, sys\n"
              "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
              f"sys.argv = ['materialize', 'inspect', {str(path)!r}]\n"
              "from materialize_cli.main import main\n"
              "main()\n")

    done = _run_limited([sys.executable, "-c", script], path)

    assert done.returncode == 1 and done.stdout.strip() == "torch imported: False", (done.stdout, done.stderr[-2000:])
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("Error: ")
    assert str(path) in done.stderr and "tensor 'w'" in done.stderr and "past 2**63" in done.stderr
    assert len(done.stderr) < 400  # the digits are not printed


def test_a_shape_of_400000_dimensions_is_refused_without_multiplying_them_all(tmp_path):
    # Each fits; their product, multiplied a step at a time, would grow to 13 million bits.
    shape = "[" + ", ".join(["4294967296"] * 400_000) + "]"
    path = _safetensors_of_header(tmp_path / "many.safetensors",
                                  '{"w": {"dtype": "F32", "shape": ' + shape + ', "data_offsets": [0, 0]}}')

    outcome = _bounded(path)

    assert outcome["ours"] and str(path) in outcome["message"] and "tensor 'w'" in outcome["message"], outcome
    assert "past 2**63" in outcome["message"] and len(outcome["message"]) < 400


@pytest.mark.parametrize("shape, words", [
    ("[9223372036854775807, 2, 0]", "past 2**63"),
    ("[3037000500, 3037000500, 0]", "past 2**63"),  # each dimension fits; the strides they multiply into do not
    ("[" + "1" * 21 + ", 0]", "past 2**63"),
    ("[2, " + "1" * 21 + ", -1]", "non-negative integers"),
    ("[2, -" + "1" * 21 + "]", "non-negative integers"),
    ("[2, 1.5]", "non-negative integers"),
])
def test_a_shape_torch_cannot_describe_is_refused_naming_the_tensor(tmp_path, shape, words):
    path = _safetensors_of_header(tmp_path / "bad.safetensors",
                                  '{"w": {"dtype": "F32", "shape": ' + shape + ', "data_offsets": [0, 0]}}')

    with pytest.raises(mz.CheckpointError) as caught:
        mz.open_checkpoint(path)

    message = str(caught.value)
    assert str(path) in message and "tensor 'w'" in message and words in message and len(message) < 400


def test_numbers_too_long_for_any_field_are_refused_where_a_field_needs_them_and_ignored_elsewhere(tmp_path):
    long = "1" * 4000
    path = _safetensors_of_header(tmp_path / "offsets.safetensors",
                                  '{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + long + ']}}', bytes(4))
    with pytest.raises(mz.CheckpointError, match=r"offsets.safetensors.*tensor 'w'.*run past the data region's 4 bytes"):
        mz.open_checkpoint(path)

    kept = _safetensors_of_header(tmp_path / "kept.safetensors",
                                  '{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "note": [' + long + ']},'
                                  ' "__metadata__": {"id": "' + long + '"}}', bytes(4))
    with mz.open_checkpoint(kept) as ckpt:
        assert ckpt["w"].shape == (1,) and ckpt.metadata == {"id": long}


def test_a_zip_whose_records_carry_thousands_of_extra_fields_is_refused_before_zipfile_reads_them(tmp_path):
    genuine = _genuine_records()
    prefix = genuine[0][0].split("/")[0]
    fields = b"\x99\x99\x00\x00" * 16_383  # 64 KB of empty fields: zipfile copies the rest of them at each one
    path = tmp_path / "extras.pt"
    path.write_bytes(_stored_zip(genuine + [(f"{prefix}/extra/{number}", b"x") for number in range(1000)],
                                 central_extra=fields))

    outcome = _bounded(path)

    assert outcome["ours"], outcome
    assert str(path) in outcome["message"] and f"{genuine[0][0]!r} carries more than 64 extra fields" in outcome["message"]


def test_a_zip_whose_records_carry_a_few_extra_fields_still_loads(tmp_path):
    path = tmp_path / "few.pt"
    path.write_bytes(_stored_zip(_genuine_records(), central_extra=b"\x99\x99\x00\x00" * 64))

    tensors, _ = mz.load_tensors(path)

    assert torch.equal(tensors["w"], torch.arange(6.0))


# ---------------------------------------------------------------- torch pickles


def test_a_deepspeed_shape_of_200000_huge_sizes_is_not_multiplied(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"ds_version": "0.14", "module": {"w": torch.zeros(0), "b": torch.ones(2)},
                "param_shapes": [{"w": (2**62,) * 200_000}]}, path)

    outcome = _bounded(path)

    assert outcome["error"] == "UnsupportedFormatError", outcome
    assert str(path) in outcome["message"] and "ZeRO-3" in outcome["message"]


def test_a_pickle_naming_250_unknown_classes_after_a_megabyte_is_read_once_for_them(tmp_path):
    # Each class torch's reader refuses gets an inert stand-in; found one per read of the whole pickle, 250 classes
    # named after 1 MB of data were 250 reads (about 90 s here). Found in one pass, it is one read.
    records = _genuine_records()
    name, pkl = next((n, d) for n, d in records if n.endswith("/data.pkl"))
    objects = b"".join(pickle.GLOBAL + f"unknown{k}\nThing\n".encode() + pickle.EMPTY_TUPLE + pickle.NEWOBJ
                       for k in range(250))
    value = pickle.EMPTY_LIST + pickle.MARK + (pickle.BININT1 + b"\x01") * 500_000 + objects + pickle.APPENDS
    key = pickle.BINUNICODE + struct.pack("<I", 4) + b"junk"
    assert pkl.endswith(pickle.SETITEM + pickle.STOP)
    hostile = pkl[:-1] + key + value + pickle.SETITEM + pickle.STOP
    path = tmp_path / "classes.pt"
    path.write_bytes(_stored_zip([(n, hostile if n == name else d) for n, d in records]))

    outcome = _bounded(path, "w")

    assert outcome["error"] is None, outcome
    assert outcome["values"]["w"] == torch.arange(6.0).tolist()
