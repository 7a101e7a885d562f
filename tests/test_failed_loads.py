"""A load that fails part-way: what the model holds afterwards.

Every tensor the load allocated is dropped and the model's own are put back (the same objects). Values the
load wrote into a real model's own tensors, filled in place as load_state_dict fills them, cannot be put back
(a copy to roll back to would be a second model in memory): the error names those tensors. Each case fails
for real, on a file truncated after it was opened, or on an interrupt from a reader thread.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import materialize as mz

from conftest import reference_model, saved_state, tiny_skeleton, write_safetensors


def snapshot(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor the model holds: the object itself, and a copy of its values (none for meta)."""
    held = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    return {name: (t, t if t.is_meta else t.detach().clone()) for name, t in held.items()}


def unchanged(model: torch.nn.Module, before: dict) -> list[str]:
    """Names whose tensor is not the same object as before, or whose values changed."""
    now = snapshot(model)
    return [name for name, (tensor, values) in before.items()
            if now[name][0] is not tensor or (not tensor.is_meta and not torch.equal(now[name][0], values))]


@pytest.fixture
def checkpoint(tmp_path):
    state = saved_state(reference_model(seed=1))
    return state, write_safetensors(state, tmp_path / "m.safetensors")


def truncated_load(model, path, state, **options):
    with mz.open_checkpoint(path) as ckpt:
        last = max(state, key=lambda name: ckpt[name].offset)
        os.truncate(path, ckpt[last].offset + 4)  # after it was opened: the headers were sound
        with pytest.raises(mz.CheckpointError, match=last) as raised:
            mz.load(model, ckpt, **options)
    return str(raised.value)


def test_a_model_on_meta_gets_back_every_tensor_it_had(checkpoint):
    state, path = checkpoint
    model = tiny_skeleton()
    before = snapshot(model)

    message = truncated_load(model, path, state)

    assert unchanged(model, before) == [] and all(p.is_meta for p in model.parameters())
    assert "filled in place" not in message


def test_a_tied_model_on_meta_gets_back_its_one_tensor_under_every_name(tmp_path):
    # A fresh parameter's undo record stands for all the names of its tie group (materialize.loading._undo)
    state = saved_state(reference_model(tie=True, seed=1))
    path = write_safetensors(state, tmp_path / "tied.safetensors")
    model = tiny_skeleton(tie=True)
    before = snapshot(model)
    tied = [name for name in before if before[name][0] is model.lm_head.weight]
    assert len(tied) == 2  # the fixture ties what it should: the test would see nothing otherwise

    truncated_load(model, path, state)

    assert unchanged(model, before) == [] and all(p.is_meta for p in model.parameters())
    now = snapshot(model)
    assert now[tied[0]][0] is now[tied[1]][0]


def test_a_real_model_whose_tensors_were_all_allocated_anew_is_left_exactly_as_it_was(checkpoint):
    state, path = checkpoint
    model = reference_model(seed=2)
    before = snapshot(model)

    message = truncated_load(model, path, state, dtype=torch.float16)  # another dtype: every tensor is new memory

    assert unchanged(model, before) == []
    assert "filled in place" not in message


def test_a_real_model_filled_in_place_keeps_its_objects_and_the_error_names_what_was_overwritten(checkpoint):
    state, path = checkpoint
    model = reference_model(seed=2)
    before = snapshot(model)

    message = truncated_load(model, path, state)

    changed = unchanged(model, before)
    assert changed and all(model.get_parameter(n) is before[n][0] for n, _ in model.named_parameters())
    assert f"the model's own tensors filled in place may now hold part of the checkpoint's values ({len(state)}:" \
        in message and "load them again" in message
    assert len(message.splitlines()) == 1


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) are Python 3.11+")
def test_an_interrupt_from_a_reader_thread_says_the_same_in_a_note(checkpoint):
    _, path = checkpoint
    model = reference_model(seed=2)

    def interrupt(done: int, total: int) -> None:
        if done:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as raised:
        mz.load(model, path, progress=interrupt)

    notes = getattr(raised.value, "__notes__", [])
    assert any("filled in place may now hold part of the checkpoint's values" in note for note in notes)
