"""Zero-copy loads: tensors are copy-on-write views of the checkpoint files."""

from __future__ import annotations

import torch

import materialize as mz

from conftest import assert_state_equal, reference_model, saved_state, tiny_skeleton, write_safetensors, write_sharded, write_torch


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
