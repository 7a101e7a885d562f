"""Stacked sources: several checkpoint tensors, each one block of one model tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import materialize as mz
from materialize.checkpoint import TensorInfo
from materialize.loading import execute
from materialize.planning import make_plan
from materialize.stacking import StackSlot, stack

from conftest import write_safetensors

FILE = Path("experts.safetensors")


def _info(name: str, shape: tuple[int, ...], dtype: str = "float32", offset: int = 0) -> TensorInfo:
    return TensorInfo(name=name, dtype_name=dtype, itemsize=torch.finfo(getattr(torch, dtype)).bits // 8,
                      shape=shape, path=FILE, offset=offset)


def test_blocks_are_laid_out_expert_by_expert_groups_in_order():
    slots = [(StackSlot("up", index, group), _info(f"e{index}.g{group}", (2 + group, 3)))
             for index in (1, 0) for group in (1, 0)]

    stacked = stack("up", slots)

    assert stacked.shape == (2, 5, 3)
    assert [(p.info.name, p.start) for p in stacked.pieces] == [("e0.g0", 0), ("e0.g1", 6), ("e1.g0", 15), ("e1.g1", 21)]
    assert stacked.read_nbytes == 2 * 5 * 3 * 4


@pytest.mark.parametrize("slots, words", [
    ([(StackSlot("t", 0, 0), _info("a", (2, 3))), (StackSlot("t", 2, 0), _info("c", (2, 3)))], "lacks number 1"),
    ([(StackSlot("t", 0, 0), _info("a", (2, 3))), (StackSlot("t", 0, 0), _info("b", (2, 3)))], "same place as 'a'"),
    ([(StackSlot("t", 0, 0), _info("a", (2, 3))), (StackSlot("t", 1, 0), _info("b", (2, 4)))], "'a', stacked into 't'"),
    ([(StackSlot("t", 0, 0), _info("a", (2, 3))), (StackSlot("t", 1, 0), _info("b", (2, 3), "bfloat16"))], "bfloat16"),
    ([(StackSlot("t", 0, 0), _info("a", (2, 3))), (StackSlot("t", 0, 1), _info("b", (2, 4)))], "cannot be concatenated"),
    ([(StackSlot("t", 0, 0, ".x.*.up"), _info("a", (2, 3))), (StackSlot("t", 0, 1, ".x.*.gate"), _info("b", (2, 3))),
      (StackSlot("t", 1, 0, ".x.*.up"), _info("c", (2, 3)))], "number 1 of '.x.*.gate'"),
])
def test_pieces_that_do_not_fit_together_are_refused_naming_one(slots, words):
    with pytest.raises(mz.CheckpointError) as caught:
        stack("t", slots)

    assert words in str(caught.value) and str(FILE) in str(caught.value)


def test_a_key_map_can_stack_tensors_of_a_real_file_into_a_plain_model(tmp_path):
    experts = {f"experts.{e}.{w}": torch.randn(3, 4) + 10 * e for e in range(3) for w in ("gate", "up")}
    path = write_safetensors(experts, tmp_path / "experts.safetensors")
    model = torch.nn.Module()
    model.register_parameter("gate_up", torch.nn.Parameter(torch.empty(3, 6, 4, device="meta")))

    def to_slot(name: str) -> StackSlot:
        _, number, which = name.split(".")
        return StackSlot("gate_up", int(number), ("gate", "up").index(which))

    with mz.open_checkpoint(path) as ckpt:
        plan = make_plan(model, ckpt, device=torch.device("cpu"), key_map=to_slot)
        report = execute(plan, ckpt, check=True)

    for e in range(3):
        assert torch.equal(model.gate_up[e], torch.cat([experts[f"experts.{e}.gate"], experts[f"experts.{e}.up"]]))
    assert report.bytes_read == 3 * 2 * 3 * 4 * 4
