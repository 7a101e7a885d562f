"""Every header byte of a real torch file flipped in turn, read by us and by ``torch.load``.

For each damaged file: we either load it or raise a MaterializeError (never
anything else); where both load it, the values agree bit for bit; and we
never accept a file that torch's own reader refuses as corrupt. Only header
bytes are flipped (local headers, the central directory, the end records,
and ``data.pkl``, whose damage the unpickler sees): flips inside tensor data
change values without any check being able to tell.
"""

from __future__ import annotations

import io
import struct
import zipfile

import torch

import materialize as mz

from fuzz_targets import raw_bytes, torch_base_file


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
    path = tmp_path / "model.pt"
    accepted = refused = 0
    for position in positions:
        damaged = bytearray(base)
        damaged[position] ^= 0x01
        path.write_bytes(bytes(damaged))
        try:
            ours = mz.load_tensors(path)[0]
        except mz.MaterializeError as error:
            assert str(path) in str(error), (position, error)
            ours = None
        try:
            theirs = torch.load(path, weights_only=True, map_location="cpu")
        except Exception:
            theirs = None
        if ours is None:
            refused += 1
            continue
        accepted += 1
        assert theirs is not None, f"byte {position}: we loaded a file torch.load refuses"
        for name, tensor in ours.items():
            want = theirs[name]
            assert (tensor.dtype, tensor.shape) == (want.dtype, want.shape), (position, name)
            assert raw_bytes(tensor) == raw_bytes(want), (position, name)
    assert accepted and refused  # the sweep exercised both outcomes
