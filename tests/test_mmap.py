"""Zero-copy loads: tensors are copy-on-write views of the checkpoint files."""

from __future__ import annotations

import torch

import materialize as mz

from conftest import assert_state_equal, reference_model, saved_state, tiny_skeleton, write_safetensors, write_sharded, write_torch
import preforked


def test_mmap_load_gives_views_equal_to_the_source_and_a_working_forward(tmp_path, tokens):
    source = reference_model(tie=True, dtype=torch.bfloat16)
    state = saved_state(source)
    for path in (write_sharded(state, tmp_path / "st"), write_torch(state, tmp_path / "m.pt")):
        model = tiny_skeleton(tie=True)

        report = mz.load(model, path, mmap=True)

        assert_state_equal(model, state)
        assert sorted(report.mapped) == sorted(state)
        assert report.bytes_read == 0
        assert model.lm_head.weight is model.model.embed_tokens.weight
        with torch.no_grad():
            assert torch.equal(model(tokens), source(tokens))


def test_writing_to_a_mapped_tensor_never_changes_the_file(tmp_path):
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    before = path.read_bytes()

    tensors, _ = mz.load_tensors(path, mmap=True)
    tensors["w"].mul_(-1)

    assert path.read_bytes() == before
    assert torch.equal(tensors["w"], -state["w"])
    assert torch.equal(mz.load_tensors(path)[0]["w"], state["w"])


def test_tensors_that_need_a_cast_are_copied_not_mapped(tmp_path):
    state = {"f": torch.randn(4, 4), "i": torch.arange(6)}
    path = write_safetensors(state, tmp_path / "m.safetensors")

    tensors, report = mz.load_tensors(path, mmap=True, dtype="bf16")

    assert report.mapped == ["i"]
    assert torch.equal(tensors["f"], state["f"].bfloat16())
    assert torch.equal(tensors["i"], state["i"])


def test_mapped_tensors_outlive_the_checkpoint_object(tmp_path):
    state = {"w": torch.randn(64)}
    path = write_safetensors(state, tmp_path / "m.safetensors")

    with mz.open_checkpoint(path) as ckpt:
        tensors, _ = mz.load_tensors(ckpt, mmap=True)

    assert torch.equal(tensors["w"], state["w"])


def _sparse_safetensors(path, nbytes: int) -> None:
    """One uint8 tensor of ``nbytes`` whose data is a hole in the file: nothing is written."""
    import json
    import os
    import struct

    header = json.dumps({"huge": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
    os.truncate(path, 8 + len(header) + nbytes)


def test_a_file_larger_than_ram_and_swap_loads_mapped_as_the_refusal_says(tmp_path):
    # The mission's case: the copy is refused, its hint (--mmap) maps the file, whatever its size.
    import json
    import subprocess
    import sys
    from pathlib import Path

    from materialize.io.hostmem import ram_and_swap_bytes

    limit = ram_and_swap_bytes() or 2**35
    path = tmp_path / "huge.safetensors"
    _sparse_safetensors(path, limit + 8 * 2**30)
    cli = str(Path(sys.executable).parent / "materialize")

    refused = preforked.run([cli, str(path)], capture_output=True, text=True)
    assert refused.returncode == 1 and "--mmap" in refused.stderr

    mapped = preforked.run([cli, str(path), "--mmap", "--json"], capture_output=True, text=True)
    assert mapped.returncode == 0, mapped.stderr
    assert json.loads(mapped.stdout)["mapped"] == ["huge"]

    tensors, report = mz.load_tensors(path, mmap=True)
    huge = tensors["huge"]
    assert report.mapped == ["huge"] and huge.numel() == limit + 8 * 2**30
    assert int(huge[-4096:].sum()) == 0  # read from the file's hole
    huge[:8] = 7  # copy-on-write: one page of memory, the file untouched
    assert int(huge[:8].sum()) == 56
    with open(path, "rb") as handle:
        handle.seek(path.stat().st_size - huge.numel())
        assert handle.read(8) == bytes(8)
    assert report.host_growth_bytes < 256 * 2**20
