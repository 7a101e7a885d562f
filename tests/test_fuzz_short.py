"""The fuzz targets of ``fuzz_targets.py``, briefly: the short run that is part of ``make test``.

``python -m fuzz.run --seconds N`` runs the same targets for as long as it is
given. Here each gets a few hundred examples, and each bug found so far is
pinned by an ``xfail(strict=True)`` test whose ``@example`` reproduces it:
when the library is fixed the test XPASSes, which fails the suite until its
xfail mark and its ``KNOWN_BUGS`` entry are removed. The pickle-opcode
targets, whose inputs can hang a reader or make it allocate without bound,
run as the long run runs them: in a child process, each input under a time
and a memory limit.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings

import fuzz_targets
import materialize as mz
from fuzz_targets import (
    cx_config,
    expensive_configs,
    mutated_torch_bytes,
    raw_index,
    raw_safetensors,
    shard_index,
    safetensors_header,
    structured_index,
    structured_safetensors,
    torch_zip,
    torch_zip_records,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the fuzz package, whichever way pytest was started
from fuzz import run as fuzz_run  # noqa: E402

# A mutated pickle may announce any protocol; torch warns about it, which is noise here.
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")

# A few hundred examples per target: about 15 s for these on 2 cores (the pickle targets below, 10-20 s more).
SHORT = settings(
    max_examples=300,
    derandomize=True,  # the same inputs on every CI run; `make fuzz` is where new ones are explored
    deadline=None,
    database=None,  # reproducers are kept as @example below, not in a .hypothesis folder
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
# The regression tests run their explicit example only.
EXPLICIT_ONLY = settings(phases=[Phase.explicit], deadline=None, database=None)


def run_tolerating_known_bugs(target, data: bytes) -> None:
    """Run a target; a failure that is one of the pinned KNOWN_BUGS is not news, anything else is."""
    try:
        target(data)
    except Exception as exc:
        if fuzz_targets.known_bug(exc) is None:
            raise


# ---------------------------------------------------------------- short runs


@SHORT
@given(data=raw_safetensors)
def test_random_bytes_as_a_safetensors_file_open_or_raise_a_materialize_error(data):
    run_tolerating_known_bugs(safetensors_header, data)


@SHORT
@given(data=structured_safetensors())
def test_plausible_safetensors_headers_open_and_load_the_file_bytes_or_raise_a_materialize_error(data):
    run_tolerating_known_bugs(safetensors_header, data)


@SHORT
@given(data=raw_index)
def test_random_bytes_as_a_shard_index_open_or_raise_a_materialize_error(data):
    run_tolerating_known_bugs(shard_index, data)


@SHORT
@given(data=structured_index())
def test_hostile_weight_maps_never_reach_outside_the_folder_and_raise_only_materialize_errors(data):
    run_tolerating_known_bugs(shard_index, data)


@SHORT
@given(data=mutated_torch_bytes())
def test_torch_files_with_flipped_inserted_or_deleted_bytes_open_and_load_or_raise_a_materialize_error(data):
    run_tolerating_known_bugs(torch_zip, data)


@SHORT
@given(data=torch_zip_records())
def test_torch_files_with_edited_records_open_and_load_or_raise_a_materialize_error(data):
    run_tolerating_known_bugs(torch_zip, data)


# Pickles rewritten opcode by opcode (expansion chains, deep nesting, shared references, hostile calls and
# BUILDs) can make a reader hang or allocate without bound, so these run in a child process under the fuzz
# runner's limits (fuzz/run.py), as `make fuzz` runs them: an input past the time limit, one that kills its
# process, or one whose peak memory goes past the per-input budget fails the test (its input is kept under
# the test's tmp_path, named in the message), instead of stalling or sinking the suite. Fewer examples than
# above: a child costs a couple of seconds to start, and these inputs are slower.
def _mapped_mib() -> int:
    """This process's address space (torch and pytest imported), MiB: a child maps less after its imports."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmSize:"))


# The address-space cap leaves 2 GiB above what the imports map: a CUDA build of torch (make test-oldest's
# 2.7.1, the only one PyPI has) maps 3.4 GiB before the first input, the CPU build half that.
PICKLE_LIMITS = fuzz_run.Limits(input_seconds=10, memory_mb=max(3072, _mapped_mib() + 2048), input_memory_mb=1024)


@pytest.mark.parametrize(("case", "examples"), [("torch_pickle_ops", 100), ("dcp_pickle_ops", 40)])
def test_pickles_rewritten_opcode_by_opcode_open_and_load_or_raise_a_materialize_error_within_the_limits(
    case, examples, tmp_path
):
    outcome = fuzz_run.fuzz_case(case, 300, limits=PICKLE_LIMITS, directory=tmp_path, max_examples=examples,
                                 seed=0, restart=False)  # the same inputs on every run; the first hang ends it

    report = "\n".join(fuzz_run.describe(fuzz_run.find_case(case), outcome, tmp_path))
    assert outcome.new_failures == 0, report
    assert outcome.examples == examples, report


# Inputs made to be expensive rather than malformed (the cx_* cases: hash-flooded pickles, zips of many
# records, DCP tensors of many chunks, huge safetensors numbers and names, large indexes and configs), each
# under limits in proportion to its size (fuzz/run.py's defaults: 10 s + 4 s per MB, 1 GiB + 64 MiB per MB
# of peak growth), as `make fuzz` runs them: the known expensive input of each class (the case's seeds)
# first, then a couple drawn. The first hang ends a case, so a reader that is quadratic costs one limit.
# The time limit counts the child's CPU time: beside the suite's other worker and its rank processes on two cores,
# a linear reader's wall-clock time stretches past a limit set for the quiet machine (it did: a 2.2 MB DCP index
# scanned in 9 s of CPU ran past its 18.8 s), while a reader whose time grows with the square of its input
# burns its CPU time all the same.
CX_LIMITS = fuzz_run.Limits(input_seconds=fuzz_run.DEFAULT_INPUT_SECONDS, memory_mb=PICKLE_LIMITS.memory_mb,
                            input_memory_mb=fuzz_run.DEFAULT_INPUT_MEMORY_MB, cpu_time=True)
CX_DRAWN = 2


@pytest.mark.parametrize("case", [case.name for case in fuzz_targets.COMPLEXITY_CASES])
def test_expensive_inputs_load_or_raise_a_materialize_error_within_limits_in_proportion_to_their_size(case, tmp_path):
    examples = len(fuzz_run.find_case(case).seeds) + CX_DRAWN
    outcome = fuzz_run.fuzz_case(case, 900, limits=CX_LIMITS, directory=tmp_path, max_examples=examples, seed=0,
                                 restart=False)

    report = "\n".join(fuzz_run.describe(fuzz_run.find_case(case), outcome, tmp_path))
    assert outcome.new_failures == 0, report
    assert outcome.examples == examples, report


# Inputs the fuzzer found breaking a reader, kept as they were found (tests/fuzz_findings/README.md says
# what each did), replayed through their target under the same limits: a regression is a failure here.
FINDINGS = sorted((Path(__file__).parent / "fuzz_findings").glob("*.bin"))




@pytest.mark.parametrize("finding", FINDINGS, ids=[path.name for path in FINDINGS])
def test_each_kept_fuzz_finding_replays_within_the_limits(finding, capsys):
    assert fuzz_run.replay([str(finding)], limits=PICKLE_LIMITS) == 0, capsys.readouterr().out


def test_every_known_bug_names_a_test_of_this_file():
    # A KNOWN_BUGS entry without its xfail test would silence a failure nobody sees.
    assert {bug.test for bug in fuzz_targets.KNOWN_BUGS} <= set(globals())


# ---------------------------------------------------------------- reproducers of the bugs found


def safetensors_file(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def index_file(text: str) -> bytes:
    return text.encode("utf-8")


def torch_file() -> bytes:
    buffer = io.BytesIO()
    torch.save({"weight": torch.arange(4, dtype=torch.float32)}, buffer)
    return buffer.getvalue()


def central_entry(data: bytes, name: str) -> int:
    """Offset of the zip central directory header of record ``archive/<name>``."""
    wanted = f"archive/{name}".encode()
    position = data.index(b"PK\x01\x02")
    while data[position + 46: position + 46 + struct.unpack_from("<H", data, position + 28)[0]] != wanted:
        position = data.index(b"PK\x01\x02", position + 4)
    return position


def patched(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new):]


def torch_file_with_non_utf8_name() -> bytes:
    """Central directory: the UTF-8 flag (bit 11) set on a name whose last byte is 0xff."""
    data = torch_file()
    entry = central_entry(data, "version")
    data = patched(data, entry + 8, struct.pack("<H", 0x800))
    return patched(data, entry + 46 + len("archive/version") - 1, b"\xff")


def torch_file_needing_zip_version_6_4() -> bytes:
    """Central directory: 'version needed to extract' 64, one past what zipfile reads."""
    data = torch_file()
    return patched(data, central_entry(data, "version") + 6, struct.pack("<H", 64))


def torch_file_with_central_directory_offset_past_its_start() -> bytes:
    """Zip64 end record: the central directory's offset 4096 too large, so every record offset is negative."""
    data = torch_file()
    end = data.rindex(b"PK\x06\x06")
    (offset,) = struct.unpack_from("<Q", data, end + 48)
    return patched(data, end + 48, struct.pack("<Q", offset + 4096))


def torch_file_with_a_storage_record_marked_as_a_directory() -> bytes:
    """Central directory: the DOS directory bit in data/0's external attributes; torch.load then returns unread memory."""
    data = torch_file()
    return patched(data, central_entry(data, "data/0") + 38, struct.pack("<I", 0x10))


def torch_file_with_data_pkl_compression_99() -> bytes:
    data = torch_file()
    return patched(data, central_entry(data, "data.pkl") + 10, struct.pack("<H", 99))


def torch_file_with_non_utf8_local_name_of_data_pkl() -> bytes:
    """data.pkl's local header: the UTF-8 flag set, the name's first byte 0xff."""
    data = torch_file()
    (local,) = struct.unpack_from("<I", data, central_entry(data, "data.pkl") + 42)
    return patched(patched(data, local + 6, struct.pack("<H", 0x800)), local + 30, b"\xff")


def torch_view_file(*, size: int, stride: int, offset: int) -> bytes:
    """A torch.save file of one 1-D view whose pickled size, stride and storage offset are replaced.

    The pickle is rewritten opcode by opcode (it stays well formed) and the
    zip rewritten with fresh CRCs, as the torch_zip_records fuzz case does.
    """
    buffer = io.BytesIO()
    torch.save({"v": torch.arange(8, dtype=torch.float32).as_strided((2,), (3,), 1)}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        records = [(info.filename, archive.read(info.filename)) for info in archive.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
        for filename, content in records:
            if filename.endswith("/data.pkl"):
                # Its integers, in order: the storage's numel (8), then offset 1, size 2, stride 3.
                content = fuzz_targets._replace_pickle_ints(content, [(1, offset), (2, size), (3, stride)])
            archive.writestr(filename, content)
    return out.getvalue()


DEEP_JSON = "[" * 100_000 + "]" * 100_000  # deeper than Python's recursion limit
LONG_INT = "1" + "0" * 4300  # one digit past Python's int-from-string limit (sys.get_int_max_str_digits)


@EXPLICIT_ONLY
@example(data=safetensors_file(b'{"a":{"dtype":[],"shape":[],"data_offsets":[0,0]}}'))
@given(data=structured_safetensors())
def test_safetensors_dtype_that_is_not_a_string_is_a_checkpoint_error(data):
    safetensors_header(data)


@EXPLICIT_ONLY
@example(data=safetensors_file(('{"a":' + DEEP_JSON + "}").encode()))
@given(data=structured_safetensors())
def test_safetensors_header_nested_deeper_than_the_recursion_limit_is_a_checkpoint_error(data):
    safetensors_header(data)


@EXPLICIT_ONLY
@example(data=safetensors_file(('{"a":{"dtype":"F32","shape":[' + LONG_INT + '],"data_offsets":[0,0]}}').encode()))
@given(data=structured_safetensors())
def test_safetensors_header_with_an_integer_of_over_4300_digits_is_a_checkpoint_error(data):
    safetensors_header(data)


@EXPLICIT_ONLY
@example(data=safetensors_file(b'{"a":{"dtype":"F32","shape":[0,9223372036854775808],"data_offsets":[0,0]}}'))
@given(data=structured_safetensors())
def test_zero_element_tensor_with_a_dimension_past_int64_is_a_checkpoint_error(data):
    safetensors_header(data)


@EXPLICIT_ONLY
@example(data=safetensors_file(
    b'{"a":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904,0],"data_offsets":[0,0]}}'
))
@given(data=structured_safetensors())
def test_zero_element_tensor_whose_dimensions_multiply_past_int64_is_a_checkpoint_error(data):
    safetensors_header(data)


@EXPLICIT_ONLY
@example(data=index_file('{"weight_map": ' + DEEP_JSON + "}"))
@given(data=structured_index())
def test_index_nested_deeper_than_the_recursion_limit_is_a_checkpoint_error(data):
    shard_index(data)


@EXPLICIT_ONLY
@example(data=index_file('{"weight_map": {"a": "s1.safetensors"}, "metadata": {"total_size": ' + LONG_INT + "}}"))
@given(data=structured_index())
def test_index_with_an_integer_of_over_4300_digits_is_a_checkpoint_error(data):
    shard_index(data)


@EXPLICIT_ONLY
@example(data=index_file(json.dumps({"weight_map": {"a": "x" * 256 + ".safetensors"}})))
@given(data=structured_index())
def test_shard_name_longer_than_the_file_system_allows_is_a_checkpoint_error(data):
    shard_index(data)


@EXPLICIT_ONLY
@example(data=torch_file_with_non_utf8_name())
@given(data=mutated_torch_bytes())
def test_torch_zip_with_a_non_utf8_name_flagged_as_utf8_is_a_checkpoint_error(data):
    torch_zip(data)


@EXPLICIT_ONLY
@example(data=torch_file_needing_zip_version_6_4())
@given(data=mutated_torch_bytes())
def test_torch_zip_needing_a_newer_zip_version_is_a_checkpoint_error(data):
    torch_zip(data)


@EXPLICIT_ONLY
@example(data=torch_file().replace(b"little", b"LITTLE"))  # the record's bytes no longer match its CRC
@given(data=mutated_torch_bytes())
def test_torch_zip_whose_byteorder_record_fails_its_crc_is_a_checkpoint_error(data):
    torch_zip(data)


@EXPLICIT_ONLY
@example(data=torch_file_with_central_directory_offset_past_its_start())
@given(data=mutated_torch_bytes())
def test_torch_zip_whose_central_directory_points_before_the_file_is_a_checkpoint_error(data):
    torch_zip(data)


@EXPLICIT_ONLY
@example(data=torch_file_with_a_storage_record_marked_as_a_directory())
@given(data=mutated_torch_bytes())
def test_torch_zip_whose_storage_record_is_marked_as_a_directory_is_a_checkpoint_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.pt"
        path.write_bytes(data)
        with pytest.raises(mz.CheckpointError, match="marked as a directory"):
            mz.open_checkpoint(path)
    torch_zip(data)


@EXPLICIT_ONLY
@example(data=torch_file_with_data_pkl_compression_99())
@given(data=mutated_torch_bytes())
def test_torch_zip_whose_data_pkl_uses_an_unknown_compression_is_a_checkpoint_error(data):
    torch_zip(data)


@EXPLICIT_ONLY
@example(data=torch_file_with_non_utf8_local_name_of_data_pkl())
@given(data=mutated_torch_bytes())
def test_torch_zip_whose_data_pkl_local_name_is_not_utf8_is_a_checkpoint_error(data):
    torch_zip(data)


@EXPLICIT_ONLY
@example(data=torch_view_file(size=2, stride=-(2**63), offset=4))
@given(data=torch_zip_records())
def test_torch_tensor_with_a_stride_of_minus_2_63_is_a_checkpoint_error(data):
    torch_zip(data)


@EXPLICIT_ONLY
@example(data=torch_view_file(size=-(2**63), stride=1, offset=0))
@given(data=torch_zip_records())
def test_torch_tensor_with_a_size_of_minus_2_63_is_a_checkpoint_error(data):
    torch_zip(data)


@EXPLICIT_ONLY
@example(data=torch_view_file(size=2, stride=-1, offset=4))
@given(data=torch_zip_records())
def test_torch_view_with_a_negative_stride_is_refused_not_read_as_a_contiguous_one(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.pt"
        path.write_bytes(data)

        with pytest.raises(mz.MaterializeError):
            mz.open_checkpoint(path)


@EXPLICIT_ONLY
@example(data=('{"hidden_size": ' + DEEP_JSON + "}").encode())
@given(data=expensive_configs())
def test_config_json_nested_deeper_than_the_recursion_limit_is_a_materialize_error(data):
    cx_config(data)
