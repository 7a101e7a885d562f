"""Every header byte of a real file damaged in turn, read by us and by the format's own reader.

For each damaged file: we either load it or raise a MaterializeError (never
anything else); where both load it, the values agree bit for bit; and we
never accept a file that the reference reader (``torch.load``,
``safetensors.torch.load_file``) refuses as corrupt. Only header bytes are
damaged (for torch: local headers, the central directory, the end records
and ``data.pkl``): flips inside tensor data change values without any check
being able to tell.
"""

from __future__ import annotations

import io
import struct
import zipfile

import torch
from safetensors.torch import load_file, save

import materialize as mz

from fuzz_targets import raw_bytes, sweep_flipped_bytes, torch_base_file


def _data_ranges(base: bytes) -> list[tuple[int, int]]:
    ranges = []
    with zipfile.ZipFile(io.BytesIO(base)) as archive:
        for info in archive.infolist():
            if "/data/" not in info.filename:
                continue
            name_len, extra_len = struct.unpack_from("<HH", base, info.header_offset + 26)
            start = info.header_offset + 30 + name_len + extra_len
            ranges.append((start, start + info.file_size))
    return ranges


def test_every_flipped_header_byte_is_refused_or_read_as_torch_reads_it(tmp_path):
    base = torch_base_file()
    data = _data_ranges(base)
    positions = [p for p in range(len(base)) if not any(a <= p < b for a, b in data)]
    sweep_flipped_bytes(base, positions, tmp_path / "model.pt")


def test_every_safetensors_header_bit_flipped_is_refused_or_read_as_safetensors_reads_it(tmp_path):
    state = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "mask": torch.tensor([True, False]),
        "half": torch.ones(3, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
    }
    base = save(state, metadata={"format": "pt"})
    (header_len,) = struct.unpack("<Q", base[:8])
    path = tmp_path / "model.safetensors"
    outcomes = {"both": 0, "neither": 0}
    for position in range(8 + header_len):
        for bit in range(8):
            damaged = bytearray(base)
            damaged[position] ^= 1 << bit
            path.write_bytes(bytes(damaged))
            try:
                ours = mz.load_tensors(path)[0]
            except mz.MaterializeError as error:
                assert str(path) in str(error), (position, bit, error)
                ours = None
            try:
                theirs = load_file(str(path))
            except Exception:
                theirs = None
            assert (ours is None) == (theirs is None), f"byte {position} bit {bit}: {'we' if theirs is None else 'safetensors'} alone read it"
            if ours is None:
                outcomes["neither"] += 1
                continue
            outcomes["both"] += 1
            assert set(ours) == set(theirs)
            for name, tensor in ours.items():
                assert (tensor.dtype, tensor.shape) == (theirs[name].dtype, theirs[name].shape), (position, bit, name)
                assert raw_bytes(tensor) == raw_bytes(theirs[name]), (position, bit, name)
    assert outcomes["both"] and outcomes["neither"]
