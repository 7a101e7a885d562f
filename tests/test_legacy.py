"""torch's legacy (pre-1.6, non-zip) files: read lazily like zips, values as torch.load gives them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import materialize as mz

from fuzz_targets import sweep_flipped_bytes
import preforked

CLI = str(Path(sys.executable).parent / "materialize")


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(6, 4)
    state = {
        "embed.weight": base,
        "head.weight": base,  # a tie: one storage, two names
        "rows": base[2:],  # a view at an offset
        "transposed": torch.randn(3, 5).t(),  # not contiguous
        "half": torch.randn(7).bfloat16(),
        "ids": torch.arange(9),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
    }
    return state


def _save_legacy(obj, path: Path) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    return path


@pytest.mark.parametrize("how", [{}, {"mmap": True}, {"dtype": "fp64"}])
def test_a_legacy_file_loads_as_torch_load_reads_it(tmp_path, how):
    path = _save_legacy(_state(), tmp_path / "old.pt")
    reference = torch.load(path, weights_only=True)

    tensors, report = mz.load_tensors(path, **how)

    assert tensors.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(tensors[name], value.to(tensors[name].dtype)), name
        assert tensors[name].shape == value.shape, name
    assert report.format == "torch"


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_legacy_file_of_any_pickle_protocol_loads(tmp_path, protocol):
    # Protocols 4 and 5 frame every pickle of the file, magic number included; torch's weights-only read
    # refuses the frames, torch.load(weights_only=False) reads them, and so does this loader (plain data only).
    state = _state()
    path = tmp_path / f"p{protocol}.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)

    tensors, _ = mz.load_tensors(path)

    assert tensors.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name


def test_a_call_hidden_in_a_legacy_files_leading_pickles_is_refused(tmp_path):
    import pickle

    class RunsCommand:
        def __reduce__(self):
            return (print, ("ran",))

    path = tmp_path / "trap.pt"
    with open(path, "wb") as handle:
        pickle.dump(RunsCommand(), handle, protocol=4)  # where the magic number belongs

    with pytest.raises(mz.UnsafeCheckpointError) as caught:
        mz.load_tensors(path)

    assert "builtins.print" in str(caught.value) and "trap.pt" in str(caught.value)


def test_a_legacy_checkpoint_loads_into_a_model_and_through_the_cli(tmp_path):
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    path = _save_legacy({"args": argparse.Namespace(lr=0.1), "state_dict": source.state_dict()}, tmp_path / "old.pth")
    with mz.meta_init():
        model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))

    mz.load(model, path, check=True)
    done = preforked.run([CLI, str(path), "--json"], capture_output=True, text=True)

    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert done.returncode == 0, done.stderr
    assert sorted(json.loads(done.stdout)["loaded"]) == sorted(source.state_dict())


def test_a_module_pickled_whole_in_the_legacy_format_needs_trust(tmp_path):
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    path = _save_legacy(source, tmp_path / "whole.pt")

    with pytest.raises(mz.UnsafeCheckpointError) as caught:
        mz.open_checkpoint(path)
    model, _ = mz.load_model(path, trust_pickle=True)

    assert "trust_pickle" in str(caught.value) and str(path) in str(caught.value)
    assert isinstance(model, nn.Sequential)
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_truncated_legacy_file_names_the_tensor_whose_storage_is_cut(tmp_path):
    path = _save_legacy({"small": torch.ones(2), "large": torch.ones(1000)}, tmp_path / "old.pt")
    path.write_bytes(path.read_bytes()[:-100])

    with pytest.raises(mz.CheckpointError) as caught:
        mz.load_tensors(path)

    assert "'large'" in str(caught.value) and "truncated" in str(caught.value) and str(path) in str(caught.value)


def test_every_flipped_byte_before_the_storages_is_refused_or_read_as_torch_reads_it(tmp_path):
    base = _save_legacy({"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}, tmp_path / "b.pt").read_bytes()
    data_start = len(base) - (8 + 6 * 4) - (8 + 3 * 2)  # the two storages close the file
    sweep_flipped_bytes(base, range(data_start), tmp_path / "flipped.pt")
