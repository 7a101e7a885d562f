"""The model's own load code against torch's own load_state_dict of the same file: each kind of code torch runs
(load pre-hooks by each registration API, an overridden _load_from_state_dict before and after super(), load
post-hooks, extra state with a tensor and without, a saved version older than the class's, the current one,
none), in both spellings (a change in place, a new tensor bound), loads as torch loads it or is refused."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Optional

import pytest
import safetensors.torch
import torch
from torch import nn

import materialize as mz

from conftest import write_safetensors


def _scale(state_dict: dict, key: str, spelling: str, by: float) -> None:
    if spelling == "in_place":
        state_dict[key].mul_(by)
    else:
        state_dict[key] = state_dict[key] * by


def _rescale_own(module: nn.Module, spelling: str) -> None:
    if spelling == "in_place":
        with torch.no_grad():
            module.w.mul_(2)
    else:
        module.w = nn.Parameter(module.w.detach() * 2)


class Block(nn.Module):
    """A block whose load code is one of KINDS; its parameter ``w`` is what the code changes."""

    _version = 2

    def __init__(self, kind: str, spelling: str) -> None:
        super().__init__()
        self.kind, self.spelling = kind, spelling
        self.lin = nn.Linear(2, 2)
        self.w = nn.Parameter(torch.ones(3))
        self.t = torch.zeros(3)
        self.steps = 0
        if kind == "pre_hook":  # the public API: the module first
            self.register_load_state_dict_pre_hook(
                lambda module, state_dict, prefix, *rest: _scale(state_dict, prefix + "w", module.spelling, 3))
        elif kind == "private_pre_hook":
            self._register_load_state_dict_pre_hook(
                lambda state_dict, prefix, *rest: _scale(state_dict, prefix + "w", spelling, 3))
        elif kind == "private_pre_hook_with_module":
            self._register_load_state_dict_pre_hook(
                lambda module, state_dict, prefix, *rest: _scale(state_dict, prefix + "w", module.spelling, 3),
                with_module=True)
        elif kind == "parent_pre_hook_on_child":  # the hook of a module changes its child's entry
            self.lin.register_load_state_dict_pre_hook(lambda *args: None)
            self.register_load_state_dict_pre_hook(
                lambda module, state_dict, prefix, *rest: _scale(state_dict, prefix + "lin.weight", module.spelling, 3))
        elif kind == "post_hook":
            self.register_load_state_dict_post_hook(lambda module, incompatible: _rescale_own(module, module.spelling))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if self.kind == "override_before_super":
            _scale(state_dict, prefix + "w", self.spelling, 3)
        if self.kind == "versioned":  # torch's idiom (BatchNorm's): saves before version 2 held w a tenth of its size
            version = local_metadata.get("version", None)
            if version is None or version < 2:
                _scale(state_dict, prefix + "w", self.spelling, 10)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        if self.kind == "override_after_super":
            _rescale_own(self, self.spelling)


class StatefulBlock(Block):
    """A block keeping state beside its tensors: a tensor and a count, or plain values only."""

    def get_extra_state(self) -> Any:
        if self.kind == "extra_state_tensor":
            return {"t": self.t.clone(), "n": self.steps}
        return {"n": self.steps, "tags": ["a", "b"]}

    def set_extra_state(self, state: Any) -> None:
        if self.kind == "extra_state_tensor":
            self.t = state["t"]
        self.steps = state["n"]


class Outer(nn.Module):
    def __init__(self, kind: str, spelling: str) -> None:
        super().__init__()
        self.block = (StatefulBlock if kind.startswith("extra_state") else Block)(kind, spelling)
        self.head = nn.Linear(2, 1)


KINDS = ["pre_hook", "private_pre_hook", "private_pre_hook_with_module", "parent_pre_hook_on_child",
         "override_before_super", "override_after_super", "post_hook", "versioned", "extra_state_tensor",
         "extra_state_plain"]
# How the file is written: a torch zip of the state dict (its _metadata: each module's version, "old" with
# block's set to 1), of a plain dict (no _metadata), torch's legacy format, and safetensors (no _metadata, no
# extra state but a tensor).
FORMATS = ["pt", "pt_old", "pt_plain", "pt_legacy", "safetensors"]


def _write(kind: str, spelling: str, fmt: str, path) -> Optional[Any]:
    torch.manual_seed(0)
    source = Outer(kind, spelling)
    with torch.no_grad():
        source.block.w.copy_(torch.tensor([1.0, 2.0, 3.0]))
    source.block.t = torch.tensor([4.0, 5.0, 6.0])
    source.block.steps = 7
    state = source.state_dict()
    if fmt == "safetensors":
        state = {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
        return write_safetensors(state, path)
    if fmt == "pt_old":
        state._metadata["block"]["version"] = 1
    torch.save(dict(state) if fmt == "pt_plain" else state, path, _use_new_zipfile_serialization=fmt != "pt_legacy")
    return path


def _torch_reads(path, fmt: str) -> dict:
    return safetensors.torch.load_file(path) if fmt == "safetensors" else torch.load(path, weights_only=True)


def _expected_refusal(kind: str, spelling: str, fmt: str) -> Optional[type]:
    """What the load refuses: a new tensor bound under a checkpoint name, computed from checkpoint values, where
    the code does so (the versioned conversion only for a save older than the class, or without a version)."""
    converts = kind in ("pre_hook", "private_pre_hook", "private_pre_hook_with_module", "parent_pre_hook_on_child",
                        "override_before_super") or (kind == "versioned" and fmt in ("pt_old", "pt_plain", "safetensors"))
    return mz.KeyMismatchError if converts and spelling == "rebinding" else None


def _assert_as_torch(model: nn.Module, reference: nn.Module) -> None:
    expected = reference.state_dict(keep_vars=True)
    got = model.state_dict(keep_vars=True)
    assert list(got) == list(expected)
    for name, want in expected.items():
        _assert_same(got[name], want, name)
    assert model.block.steps == reference.block.steps
    _assert_same(model.block.t, reference.block.t, "block.t")
    assert set(dict(model.named_parameters())) == set(dict(reference.named_parameters()))


def _assert_same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert type(got) is type(want), where
        assert not got.is_meta and got.dtype == want.dtype and got.requires_grad == want.requires_grad, where
        assert torch.equal(got.detach(), want.detach()), (where, got, want)
    elif isinstance(want, dict):
        assert type(got) is type(want) and list(got) == list(want), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}[{key!r}]")
    else:
        assert got == want, where


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("spelling", ["in_place", "rebinding"])
@pytest.mark.parametrize("kind", KINDS)
def test_load_code_loads_as_torchs_load_state_dict_or_is_refused(tmp_path, kind, spelling, fmt):
    if fmt == "safetensors" and kind.startswith("extra_state"):
        pytest.skip("safetensors holds tensors only: no extra state but a tensor")
    path = _write(kind, spelling, fmt, tmp_path / f"{kind}.{'safetensors' if fmt == 'safetensors' else 'pt'}")
    reference = Outer(kind, spelling)
    refusal = _expected_refusal(kind, spelling, fmt)
    if refusal is None:
        reference.load_state_dict(_torch_reads(path, fmt))
    with mz.meta_init():
        model = Outer(kind, spelling)

    if refusal is not None:
        with pytest.raises(refusal) as caught:
            mz.load(model, path)
        message = str(caught.value)
        assert "\n" not in message and path.name in message and "Block" in message
        assert model.block.w.is_meta  # nothing of it loaded
        return
    mz.load(model, path)

    _assert_as_torch(model, reference)


def test_the_refusal_of_a_versioned_conversion_names_the_code_and_the_versions(tmp_path):
    path = _write("versioned", "rebinding", "pt_old", tmp_path / "old.pt")
    with mz.meta_init():
        model = Outer("versioned", "rebinding")

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)

    assert ("the model's own load code, Block._load_from_state_dict of 'block', handed a version-1 save of a "
            "version-2 module, puts tensors of its making under block.w") in str(caught.value)


def test_the_saved_version_follows_a_stripped_wrapper_prefix(tmp_path):
    source = Outer("versioned", "in_place")
    with torch.no_grad():
        source.block.w.copy_(torch.tensor([1.0, 2.0, 3.0]))
    wrapper = nn.Module()
    wrapper.module = source  # DistributedDataParallel's prefix, on the names and on _metadata
    state = wrapper.state_dict()
    state._metadata["module.block"]["version"] = 1
    torch.save(state, tmp_path / "ddp.pt")
    reference = Outer("versioned", "in_place")
    torch_state = torch.load(tmp_path / "ddp.pt", weights_only=True)
    nn.modules.utils.consume_prefix_in_state_dict_if_present(torch_state, "module.")
    reference.load_state_dict(torch_state)
    with mz.meta_init():
        model = Outer("versioned", "in_place")

    mz.load(model, tmp_path / "ddp.pt")

    assert torch.equal(reference.block.w.detach(), torch.tensor([10.0, 20.0, 30.0]))
    _assert_as_torch(model, reference)


def test_a_change_in_place_is_made_on_the_files_values_then_cast_as_torch_casts(tmp_path):
    # The model's weight is bfloat16, the file's float32: torch's hook scales the float32 value, then copies it.
    path = _write("override_before_super", "in_place", "pt", tmp_path / "f32.pt")
    reference = Outer("override_before_super", "in_place").to(torch.bfloat16)
    reference.load_state_dict(torch.load(path, weights_only=True))
    with mz.meta_init():
        model = Outer("override_before_super", "in_place")

    mz.load(model, path, dtype=torch.bfloat16)

    _assert_as_torch(model, reference)


def test_a_real_model_takes_a_change_in_place_as_load_state_dict_does(tmp_path):
    path = _write("pre_hook", "in_place", "pt", tmp_path / "real.pt")
    reference = Outer("pre_hook", "in_place")
    reference.load_state_dict(torch.load(path, weights_only=True))
    model = Outer("pre_hook", "in_place")  # built on the CPU: filled in place
    weight = model.block.w

    mz.load(model, path)

    assert model.block.w is weight
    _assert_as_torch(model, reference)


class Keeps(nn.Module):
    """Keeps tensors in its extra state as torch.load makes them: a parameter, one tensor twice, a transposed view."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.state: Any = None

    def get_extra_state(self) -> Any:
        return self.state

    def set_extra_state(self, state: Any) -> None:
        self.state = state


def _kept_state() -> dict:
    shared = torch.arange(6.0).reshape(2, 3)
    return OrderedDict(scale=nn.Parameter(torch.tensor([0.5, 2.0])), grads=torch.ones(2).requires_grad_(),
                       pair=(shared, [shared, 3]), transposed=shared.t(), step=4)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_tensors_inside_an_extra_state_are_handed_over_as_torch_load_makes_them(tmp_path, legacy):
    source = Keeps()
    source.state = _kept_state()
    path = tmp_path / "kept.pt"
    torch.save(source.state_dict(), path, _use_new_zipfile_serialization=not legacy)
    reference = Keeps()
    reference.load_state_dict(torch.load(path, weights_only=True))
    with mz.meta_init():
        model = Keeps()

    mz.load(model, path)

    got, want = model.state, reference.state
    assert type(got) is type(want) is OrderedDict and list(got) == list(want)
    assert type(got["scale"]) is nn.Parameter and got["scale"].requires_grad
    assert torch.equal(got["scale"].detach(), want["scale"].detach())
    assert got["grads"].requires_grad and torch.equal(got["grads"].detach(), want["grads"].detach())
    assert type(got["pair"]) is tuple and type(got["pair"][1]) is list and got["pair"][1][1] == 3
    assert got["pair"][0] is got["pair"][1][0]  # one tensor saved once: one object, as torch.load makes it
    assert torch.equal(got["pair"][0], want["pair"][0])
    assert got["transposed"].stride() == want["transposed"].stride() == (1, 3)
    assert torch.equal(got["transposed"], want["transposed"]) and got["step"] == 4
    assert all(tensor.device.type == "cpu" for tensor in (got["scale"], got["grads"], got["transposed"]))
    assert torch.equal(model.lin.weight, reference.lin.weight)


def test_a_sharded_torch_checkpoint_hands_over_its_extra_states_tensors(tmp_path):
    source = Outer("extra_state_tensor", "in_place")
    source.block.t = torch.tensor([4.0, 5.0, 6.0])
    state = source.state_dict()
    first = {name: value for name, value in state.items() if name.startswith("block.")}
    second = {name: value for name, value in state.items() if not name.startswith("block.")}
    torch.save(first, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save(second, tmp_path / "pytorch_model-00002-of-00002.bin")
    weight_map = {name: f"pytorch_model-0000{1 if name in first else 2}-of-00002.bin" for name in state
                  if not name.endswith("_extra_state")}  # the index maps tensors
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with mz.meta_init():
        model = Outer("extra_state_tensor", "in_place")

    mz.load(model, tmp_path / "pytorch_model.bin.index.json")

    assert torch.equal(model.block.t, torch.tensor([4.0, 5.0, 6.0])) and not model.block.t.is_meta


class Holder:
    """An object holding a tensor: trusted, unpickled whole, its tensor on meta."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_an_extra_state_holding_a_tensor_inside_an_object_is_refused_while_planning(tmp_path):
    source = Keeps()
    source.state = Holder(torch.ones(2))
    path = tmp_path / "object.pt"
    torch.save(source.state_dict(), path)
    with mz.meta_init():
        model = Keeps()

    with pytest.raises(mz.CheckpointError) as caught:
        mz.plan(model, path, trust_pickle=True)

    message = str(caught.value)
    assert "object.pt" in message and "_extra_state" in message and "Keeps.set_extra_state" in message
    assert "\n" not in message and model.state is None


class _WithQFunctional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.add = torch.ao.nn.quantized.QFunctional()  # keeps its scale and zero point in its load code


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_torch_ao_load_code_runs_as_load_state_dict_runs_it(tmp_path, suffix):
    # torch.ao's load code was taken for torch's own and left unrun: its scale and zero point were "unexpected".
    source = _WithQFunctional()
    source.add.scale, source.add.zero_point = 0.5, 3
    path = tmp_path / f"model{suffix}"
    if suffix == ".pt":
        torch.save(source.state_dict(), path)
    else:
        safetensors.torch.save_file(source.state_dict(), path)
    reference = _WithQFunctional()
    reference.load_state_dict(torch.load(path) if suffix == ".pt" else safetensors.torch.load_file(path))
    with mz.meta_init():
        model = _WithQFunctional()

    report = mz.load(model, path)

    assert (model.add.scale, model.add.zero_point) == (reference.add.scale, reference.add.zero_point) == (0.5, 3)
    assert type(model.add.scale) is float and type(model.add.zero_point) is int
    assert torch.equal(model.lin.weight, reference.lin.weight)
    assert sorted(report.fed_to_load_code) == ["add.scale", "add.zero_point"]
