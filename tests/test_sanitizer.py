"""Check mode catches every planted fault; casts that overflow are refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import materialize as mz
from materialize.io import executor
from materialize.sanitizer import is_poisoned, poison

from conftest import reference_model, saved_state, tiny_skeleton, write_safetensors, write_torch
import preforked

CLI = str(Path(sys.executable).parent / "materialize")


class Lazy(nn.Module):
    """A module whose reset_parameters forgets its bias."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4))
        self.bias = nn.Parameter(torch.empty(4))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3, bias=False)
        self.b = nn.Linear(3, 3, bias=False)
        self.b.weight = self.a.weight
        self.extra = nn.Linear(3, 3, bias=False)


def _meta(factory):
    with mz.meta_init():
        return factory()


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_a_correct_load_passes_the_audit(dtype, tmp_path, tokens):
    source = reference_model(tie=True, dtype=torch.bfloat16)
    path = write_torch(saved_state(source), tmp_path / "m.pt")
    with torch.device("meta"):
        from bench.models.transformer import DecoderLM
        from conftest import TINY

        model = DecoderLM(**TINY, tie_embeddings=True)

    report = mz.load(model, path, dtype=dtype, check=True)

    assert len(report.loaded) == len(saved_state(source))
    if dtype is None:
        with torch.no_grad():
            assert torch.equal(model(tokens), source(tokens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                                   torch.uint8, torch.int32, torch.int64, torch.bool])
def test_poison_is_recognised_and_real_values_are_not(dtype):
    tensor = torch.empty(16, dtype=dtype)

    poison(tensor)
    poisoned = is_poisoned(tensor)
    tensor.zero_()

    assert poisoned and not is_poisoned(tensor)


@pytest.mark.parametrize("check", [True, False])
def test_an_init_that_forgets_a_tensor_is_caught(tmp_path, check):
    # Every load checks what a module's own init leaves unwritten now (materialize.io.checkedinit), the sanitizer's
    # mode or not: the load stops there, before the sanitizer's own audit would.
    path = write_safetensors({"weight": torch.ones(4)}, tmp_path / "m.safetensors")  # the bias is left to the init
    model = _meta(Lazy)

    with pytest.raises(mz.InitError, match=r"bias \(of Lazy\): Lazy\.reset_parameters\(\) leaves them unwritten"):
        mz.load(model, path, strict=False, check=check)

    assert model.bias.is_meta and model.weight.is_meta  # rolled back


def test_a_tensor_the_engine_never_writes_is_caught(tmp_path, monkeypatch):
    path = write_safetensors(saved_state(reference_model()), tmp_path / "m.safetensors")
    real_stream = executor.stream
    monkeypatch.setattr(executor, "stream", lambda jobs, *a, **k: real_stream(list(jobs)[:-1], *a, **k))

    with pytest.raises(mz.SanitizerError, match="0 bytes written from the file"):
        mz.load(tiny_skeleton(), path, check=True)


def test_a_tensor_written_twice_is_caught(tmp_path, monkeypatch):
    path = write_safetensors(saved_state(reference_model()), tmp_path / "m.safetensors")
    real_stream = executor.stream
    monkeypatch.setattr(executor, "stream", lambda jobs, *a, **k: real_stream(list(jobs) + list(jobs)[:1], *a, **k))

    with pytest.raises(mz.SanitizerError, match="bytes written from the file, .* expected"):
        mz.load(tiny_skeleton(), path, check=True)


def test_an_init_that_breaks_a_tie_is_caught(tmp_path):
    path = write_safetensors({"a.weight": torch.randn(3, 3)}, tmp_path / "m.safetensors")
    model = _meta(Tied)

    def careless_init(module: nn.Module) -> None:
        module.b.weight = nn.Parameter(torch.zeros(3, 3))  # replaces the shared parameter on one side
        module.extra.weight.data.fill_(1)

    with pytest.raises(mz.SanitizerError, match="tie broken"):
        mz.load(model, path, strict=False, check=True, init=lambda m: careless_init(model) if m is model.extra else None)


def test_an_init_that_changes_dtype_is_caught(tmp_path):
    path = write_safetensors({"weight": torch.randn(4)}, tmp_path / "m.safetensors")
    model = _meta(Lazy)

    def wrong_dtype_init(module: nn.Module) -> None:
        module.bias = nn.Parameter(torch.zeros(4, dtype=torch.float64))

    with pytest.raises(mz.SanitizerError, match="bias: torch.float64, planned torch.float32"):
        mz.load(model, path, strict=False, check=True, init=wrong_dtype_init)


def test_check_finite_lists_tensors_with_nan_or_inf(tmp_path):
    state = {"ok": torch.ones(3), "bad": torch.tensor([1.0, float("nan")]), "worse": torch.tensor([float("inf")])}
    path = write_safetensors(state, tmp_path / "m.safetensors")

    _, report = mz.load_tensors(path, check_finite=True)

    assert sorted(report.nonfinite) == ["bad", "worse"]


@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_cast_that_overflows_fp16_names_the_tensor(source_dtype, tmp_path):
    state = {"fine": torch.tensor([1.0, 60000.0], dtype=source_dtype), "huge": torch.tensor([1.0, 1e5], dtype=source_dtype)}
    path = write_safetensors(state, tmp_path / "m.safetensors")

    with pytest.raises(mz.CastOverflowError, match="tensor 'huge'.*overflows"):
        mz.load_tensors(path, dtype="fp16")
    tensors, _ = mz.load_tensors(path, dtype="fp16", allow_overflow=True)

    assert torch.isinf(tensors["huge"][1]) and tensors["fine"][1] == state["fine"][1].half()


def test_infinities_already_in_the_file_are_not_an_overflow(tmp_path):
    path = write_torch({"w": torch.tensor([float("inf"), -float("inf"), float("nan"), 3.0])}, tmp_path / "m.pt")

    tensors, _ = mz.load_tensors(path, dtype="fp16")

    assert torch.isinf(tensors["w"][:2]).all() and torch.isnan(tensors["w"][2])


def test_cli_check_and_overflow_options(tmp_path):
    path = write_safetensors({"huge": torch.tensor([1e6])}, tmp_path / "m.safetensors")

    refused = preforked.run([CLI, str(path), "--dtype", "fp16"], capture_output=True, text=True)
    allowed = preforked.run([CLI, str(path), "--dtype", "fp16", "--allow-overflow", "--check-finite", "--json"],
                             capture_output=True, text=True)

    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1 and "tensor 'huge'" in refused.stderr and "--allow-overflow" in refused.stderr
    assert allowed.returncode == 1  # --check-finite found the inf the allowed overflow made: it fails, naming it
    assert json.loads(allowed.stdout)["nonfinite"] == ["huge"]
    assert allowed.stderr.strip().endswith("NaN or Inf in 1 tensor(s): huge")
