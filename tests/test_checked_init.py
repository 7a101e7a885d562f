"""A plain model's own init of what a checkpoint lacks, checked: a tensor its reset_parameters() leaves unwritten
is refused by name, never reported initialized over memory nobody wrote; each way out the error names works."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import materialize as mz


class _ResetsPart(nn.Module):
    """A scale set in the constructor, which its reset_parameters() does not touch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))
        self.register_buffer("offset", torch.full((3,), 2.0))

    def reset_parameters(self) -> None:
        self.lin.reset_parameters()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _ResetsPart()
        self.head = nn.Linear(3, 2)


class _ResetsAll(_ResetsPart):
    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.ones_(self.scale)


def _head_only(tmp_path):
    torch.manual_seed(1)
    state = {name: value for name, value in _Model().state_dict().items() if name.startswith("head.")}
    torch.save(state, tmp_path / "head.pt")
    return tmp_path / "head.pt"


def test_a_tensor_its_modules_reset_parameters_leaves_unwritten_is_refused_by_name(tmp_path):
    # block.scale was reported initialized and left as the allocation found it.
    path = _head_only(tmp_path)
    with mz.meta_init(include_buffers=True):
        model = _Model()

    with pytest.raises(mz.InitError) as caught:
        mz.load(model, path, strict=False)

    message = str(caught.value)
    assert re.search(r"block\.(scale|offset).*\(of _ResetsPart\): _ResetsPart\.reset_parameters\(\) leaves them "
                     r"unwritten", message), message
    assert "block.lin.weight" not in message  # what it does write is not named
    assert "have their reset_parameters() initialize them" in message
    assert model.block.scale.is_meta and model.head.weight.is_meta  # a failed load leaves the model as it was


def test_each_way_out_the_refusal_names_works(tmp_path):
    path = _head_only(tmp_path)
    torch.manual_seed(0)
    reference = _Model()
    reference.load_state_dict(torch.load(path), strict=False)

    # mz.deferred_init(...): the load replays what the checkpoint lacks, as eager construction made it
    torch.manual_seed(0)
    recorded = mz.deferred_init(_Model)
    mz.load(recorded, path, strict=False)
    for name, value in reference.state_dict().items():
        assert torch.equal(recorded.state_dict()[name], value), name

    # a reset_parameters() that initializes them
    class _Fixed(_Model):
        def __init__(self) -> None:
            super().__init__()
            self.block = _ResetsAll()

    with mz.meta_init():
        fixed = _Fixed()
    report = mz.load(fixed, path, strict=False)
    assert torch.equal(fixed.block.scale, torch.ones(3)) and "block.scale" in report.initialized

    # init=fn(module)
    def init(module: nn.Module) -> None:
        if isinstance(module, _ResetsPart):
            module.lin.reset_parameters()
            nn.init.ones_(module.scale)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    with mz.meta_init():
        given = _Model()
    mz.load(given, path, strict=False, init=init)
    assert torch.equal(given.block.scale, torch.ones(3))

    # a checkpoint that holds them
    torch.save(reference.state_dict(), tmp_path / "whole.pt")
    with mz.meta_init():
        whole = _Model()
    mz.load(whole, tmp_path / "whole.pt")
    assert torch.equal(whole.block.scale, reference.block.scale)


def test_a_real_buffer_kept_by_meta_init_needs_no_init(tmp_path):
    path = _head_only(tmp_path)
    with mz.meta_init():  # buffers real, with their constructor's values: only the parameters are missing
        model = _Model()
    model.block.scale = nn.Parameter(torch.ones(3))  # real: kept, not initialized

    report = mz.load(model, path, strict=False)

    assert torch.equal(model.block.offset, torch.full((3,), 2.0)) and torch.equal(model.block.scale, torch.ones(3))
    assert "block.lin.weight" in report.initialized
