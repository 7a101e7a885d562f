"""A module pickled whole whose own __setstate__ changes its tensors: a trusted load gives the values
torch.load(weights_only=False) gives, or refuses naming the class; never the file's bytes as they are."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import materialize as mz

class Doubling(nn.Module):
    """Doubles its weight in place and adds one to its buffer through ``.data``, as it is unpickled."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(6.0).reshape(2, 3))
        self.register_buffer("b", torch.ones(3))
        self.frozen = nn.Parameter(torch.full((2,), 3.0), requires_grad=False)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        with torch.no_grad():
            self.w.mul_(2)
        self.b.data.add_(1)


class Parent(nn.Module):
    """Reads its child's tensors in its own __setstate__ (run after the child's, as pickle runs them), and
    counts its calls in an attribute: set once, as torch.load sets it."""

    def __init__(self) -> None:
        super().__init__()
        self.child = Doubling()
        self.plain = nn.Linear(3, 2)
        self.register_buffer("total", torch.zeros(3))
        self.calls = 0

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.calls += 1
        with torch.no_grad():
            self.total.copy_(self.child.w.sum(0))


class AttributesOnly(nn.Module):
    """A __setstate__ that writes no tensor (defaults for attributes an older version lacked): run once."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(4.0))

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.calls = getattr(self, "calls", 0) + 1


class Replacing(nn.Module):
    """Registers a tensor it computes in place of the file's."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(6.0).reshape(2, 3))

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.w = nn.Parameter(self.w.detach() * 2)


def _save(model: nn.Module, path: Path, legacy: bool = False) -> Path:
    torch.save(model, path, **({"_use_new_zipfile_serialization": False} if legacy else {}))
    return path


def _assert_as_torch_load(model: nn.Module, reference: nn.Module) -> None:
    assert type(model) is type(reference)
    ours = dict(model.named_parameters()) | dict(model.named_buffers())
    theirs = dict(reference.named_parameters()) | dict(reference.named_buffers())
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert type(ours[name]) is type(value) and ours[name].requires_grad == value.requires_grad, name
        assert ours[name].dtype == value.dtype and torch.equal(ours[name], value), name


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("cls", [Doubling, Parent], ids=lambda c: c.__name__)
def test_a_setstate_changing_tensors_gives_the_values_torch_load_gives(cls, legacy, tmp_path):
    path = _save(cls(), tmp_path / "whole.pt", legacy=legacy)
    reference = torch.load(path, weights_only=False)

    model, report = mz.load_model(path, trust_pickle=True)

    _assert_as_torch_load(model, reference)
    # torch.load's legacy reader fills the storages after the pickle, over what __setstate__ did: the bytes stand
    name = "w" if cls is Doubling else "child.w"
    assert torch.equal(model.state_dict()[name], cls().state_dict()[name]) == legacy
    assert getattr(model, "calls", None) == getattr(reference, "calls", None)
    assert sorted(report.loaded) == sorted(reference.state_dict())


def test_a_setstate_is_run_again_on_the_loaded_dtype(tmp_path):
    path = _save(Doubling(), tmp_path / "whole.pt")
    reference = torch.load(path, weights_only=False).to(torch.float64)

    model, _ = mz.load_model(path, trust_pickle=True, dtype=torch.float64)

    _assert_as_torch_load(model, reference)


def test_a_setstate_writing_no_tensor_runs_once(tmp_path):
    path = _save(AttributesOnly(), tmp_path / "whole.pt")
    reference = torch.load(path, weights_only=False)

    model, _ = mz.load_model(path, trust_pickle=True)

    _assert_as_torch_load(model, reference)
    assert model.calls == reference.calls == 1


def test_a_setstate_putting_its_own_tensor_in_place_of_the_files_is_refused_naming_it(tmp_path):
    path = _save(Replacing(), tmp_path / "whole.pt")

    with pytest.raises(mz.MaterializeError) as caught:
        mz.load_model(path, trust_pickle=True)

    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    assert "Replacing.__setstate__ puts tensors of its own in place of the file's (w)" in message
    assert "torch.load(weights_only=False)" in message


def test_loading_such_a_file_into_another_model_is_refused_naming_the_class(tmp_path):
    path = _save(Parent(), tmp_path / "whole.pt")
    other = Parent()

    with pytest.raises(mz.MaterializeError) as caught:
        mz.load(other, path, trust_pickle=True)

    message = str(caught.value)
    assert "\n" not in message
    assert "the __setstate__ of Parent, Doubling changes tensors of the pickled module (at <root>, child)" in message
    assert "mz.load_model(path, trust_pickle=True)" in message
    assert torch.equal(other.child.w, Parent().child.w)  # left as it was


def test_a_module_without_a_setstate_of_its_own_is_read_by_the_fast_unpickler(tmp_path, monkeypatch):
    path = _save(nn.Sequential(nn.Conv2d(2, 2, 1), nn.LSTM(2, 2)), tmp_path / "whole.pt")  # torch's own __setstate__s
    monkeypatch.setattr(pickle._Unpickler, "load", lambda self: pytest.fail("read by Python's unpickler"))

    model, _ = mz.load_model(path, trust_pickle=True)

    _assert_as_torch_load(model, torch.load(path, weights_only=False))


def test_a_class_the_scan_of_names_misses_is_still_watched(tmp_path, monkeypatch):
    # Which unpickler reads the file rests on a scan of the names the pickle holds; where it misses one (a name
    # the pickle builds at run time), the module rebuilt holds such a class all the same: read again, watched.
    from materialize.checkpoint import torchpickle

    path = _save(Parent(), tmp_path / "whole.pt")
    reference = torch.load(path, weights_only=False)
    monkeypatch.setattr(torchpickle, "names_own_setstate", lambda named: False)

    model, _ = mz.load_model(path, trust_pickle=True)

    _assert_as_torch_load(model, reference)
    assert not torch.equal(model.child.w, Parent().child.w)  # doubled, as torch.load gives it
