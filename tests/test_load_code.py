"""A model's own load_state_dict code (pre-hooks, overridden _load_from_state_dict) run on names, as torch runs it;
modules' extra state (get_extra_state) handed back as load_state_dict hands it."""

from __future__ import annotations

import inspect
import json
import os
import textwrap

import pytest
import safetensors.torch
import torch
from torch import nn
from torch.nn.utils import parametrizations

import materialize as mz

from conftest import assert_state_equal, write_safetensors, write_torch
from test_cli import materialize_command
import preforked


def _vocoder_block(*, older_weight_norm: bool = False) -> nn.Sequential:
    """Convolutions under weight norm, as HiFi-GAN-style vocoders and wav2vec2's positional conv build them."""
    if older_weight_norm:
        with pytest.warns(FutureWarning):
            convs = [nn.utils.weight_norm(nn.Conv1d(4, 4, 3, padding=1)) for _ in range(3)]
    else:
        convs = [parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=1)) for _ in range(3)]
    return nn.Sequential(convs[0], nn.LeakyReLU(0.1), convs[1], nn.LeakyReLU(0.1), convs[2])


def _older_weight_norm_save() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    source = _vocoder_block(older_weight_norm=True)
    state = {name: value.detach().clone() for name, value in source.state_dict().items()}
    assert "0.weight_g" in state and "0.weight_v" in state
    return state


@pytest.mark.parametrize("writer", [write_torch, write_safetensors], ids=["pth", "safetensors"])
def test_weight_norm_parametrization_loads_an_older_weight_g_weight_v_save(tmp_path, writer):
    state = _older_weight_norm_save()
    path = writer(state, tmp_path / ("old.pth" if writer is write_torch else "old.safetensors"))
    reference = _vocoder_block()
    reference.load_state_dict(state)  # torch's hook renames weight_g/weight_v
    with mz.meta_init():
        model = _vocoder_block()

    report = mz.load(model, path)

    assert report.missing == [] and report.unexpected == []
    assert torch.equal(model[0].parametrizations.weight.original0, state["0.weight_g"])
    assert torch.equal(model[4].parametrizations.weight.original1, state["4.weight_v"])
    assert_state_equal(model, reference.state_dict())
    signal = torch.randn(1, 4, 16)
    with torch.no_grad():
        assert torch.equal(model(signal), reference(signal))


def test_a_model_built_with_the_older_weight_norm_loads_a_parametrization_save(tmp_path):
    torch.manual_seed(1)
    state = {name: value.detach().clone() for name, value in _vocoder_block().state_dict().items()}
    path = write_safetensors(state, tmp_path / "new.safetensors")
    model = _vocoder_block(older_weight_norm=True)  # on the CPU: filled in place

    report = mz.load(model, path)

    assert report.missing == [] and report.unexpected == []
    assert torch.equal(model[2].weight_g, state["2.parametrizations.weight.original0"])
    assert torch.equal(model[2].weight_v, state["2.parametrizations.weight.original1"])
    same = _vocoder_block()
    same.load_state_dict(state)
    signal = torch.randn(1, 4, 16)
    with torch.no_grad():
        assert torch.allclose(model(signal), same(signal), atol=1e-6)


class FrozenBatchNorm2d(nn.Module):
    """A batch norm with fixed statistics, written as detection models write it: no counter, and it drops one."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(channels))
        self.register_buffer("bias", torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        state_dict.pop(prefix + "num_batches_tracked", None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        return x * scale[None, :, None, None] + (self.bias - self.running_mean * scale)[None, :, None, None]


def _backbone(norm: type[nn.Module]) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 6, 3, bias=False), norm(6), nn.ReLU(), nn.Conv2d(6, 6, 1, bias=False), norm(6))


@pytest.mark.parametrize("on_meta", [True, False], ids=["meta", "cpu"])
def test_a_frozen_batch_norm_that_drops_the_counter_loads_a_trained_batch_norm_save(tmp_path, on_meta):
    torch.manual_seed(2)
    trained = _backbone(nn.BatchNorm2d)
    trained.train()(torch.randn(4, 3, 8, 8))
    state = trained.state_dict()
    path = write_torch(state, tmp_path / "backbone.pth")
    reference = _backbone(FrozenBatchNorm2d)
    reference.load_state_dict(state)
    if on_meta:
        with mz.meta_init():
            model = _backbone(FrozenBatchNorm2d)
    else:
        model = _backbone(FrozenBatchNorm2d)

    report = mz.load(model, path)

    assert sorted(report.ignored) == ["1.num_batches_tracked", "4.num_batches_tracked"]
    assert report.unexpected == []
    assert_state_equal(model, reference.state_dict())
    images = torch.randn(2, 3, 8, 8)
    assert torch.equal(model(images), reference(images))
    assert torch.allclose(model(images), trained.eval()(images), atol=1e-5)


class Renamed(nn.Module):
    """A block whose attention projection was renamed; its hook takes the old name, as libraries keep old saves."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_load_state_dict_pre_hook(Renamed._old_name)

    @staticmethod
    def _old_name(module, state_dict, prefix, *_):
        for kind in ("weight", "bias"):
            if prefix + "fc." + kind in state_dict:
                state_dict[prefix + "proj." + kind] = state_dict.pop(prefix + "fc." + kind)


def test_a_pre_hook_renaming_older_names_is_followed_and_the_values_read_where_they_lie(tmp_path):
    torch.manual_seed(3)
    older = {f"blocks.{i}.fc.{kind}": torch.randn(*((4, 4) if kind == "weight" else (4,)))
             for i in range(2) for kind in ("weight", "bias")}
    older["head.weight"] = torch.randn(2, 4)
    path = write_safetensors(older, tmp_path / "older.safetensors")

    def build() -> nn.Module:
        model = nn.Module()
        model.blocks = nn.ModuleList([Renamed(), Renamed()])
        model.head = nn.Linear(4, 2, bias=False)
        return model

    reference = build()
    reference.load_state_dict(older)
    with mz.meta_init():
        model = build()

    report = mz.load(model, path)

    assert sorted(report.loaded) == sorted(reference.state_dict())
    assert torch.equal(model.blocks[1].proj.weight, older["blocks.1.fc.weight"])
    assert_state_equal(model, reference.state_dict())
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in older.values())


def test_planning_runs_the_load_code_without_touching_the_models_tensors(tmp_path):
    torch.manual_seed(4)
    trained = _backbone(nn.BatchNorm2d)
    path = write_torch(trained.state_dict(), tmp_path / "backbone.pth")
    model = _backbone(FrozenBatchNorm2d)
    before = {name: value.clone() for name, value in model.state_dict().items()}

    plan = mz.plan(model, path)

    assert plan.ignored == ["1.num_batches_tracked", "4.num_batches_tracked"]
    assert_state_equal(model, before)
    assert all(tensor.device.type == "cpu" for tensor in model.state_dict().values())


class ChecksValues(nn.Module):
    """Load code that looks at a value: it cannot run on names, but the names may match without it."""

    def __init__(self, renames: bool, shape: tuple[int, int] = (2, 2)) -> None:
        super().__init__()
        self.lin = nn.Linear(shape[1], shape[0])
        self.renames = renames
        self.register_load_state_dict_pre_hook(ChecksValues._hook)

    @staticmethod
    def _hook(module, state_dict, prefix, *_):
        if module.renames and prefix + "old.weight" in state_dict:
            weight, bias = state_dict.pop(prefix + "old.weight"), state_dict.pop(prefix + "old.bias")
            if weight.abs().max().item() >= 0:  # needs the values: halfway through on names alone
                state_dict[prefix + "lin.weight"], state_dict[prefix + "lin.bias"] = weight, bias
        elif not module.renames:
            state_dict[prefix + "lin.weight"].sum().item()


def test_load_code_that_needs_values_leaves_matching_names_to_load(tmp_path):
    state = ChecksValues(renames=False).state_dict()
    path = write_safetensors(dict(state), tmp_path / "m.safetensors")
    with mz.meta_init():
        model = ChecksValues(renames=False)

    mz.load(model, path)

    assert_state_equal(model, state)


def test_load_code_that_needs_values_is_given_them_and_its_renames_are_followed(tmp_path):
    torch.manual_seed(5)
    older = {"old.weight": torch.randn(2, 2), "old.bias": torch.randn(2)}
    path = write_safetensors(older, tmp_path / "old.safetensors")
    reference = ChecksValues(renames=True)
    reference.load_state_dict(dict(older))

    for strict in (True, False):
        with mz.meta_init():
            model = ChecksValues(renames=True)

        report = mz.load(model, path, strict=strict)

        assert_state_equal(model, reference.state_dict())
        assert report.missing == report.unexpected == [] and sorted(report.loaded) == ["lin.bias", "lin.weight"]
        assert report.fed_to_load_code == []  # what it reads it renames into the model: loaded, read once
        assert report.bytes_read == 24
    assert mz.plan(model, path).renamed_by_model == {"old.weight": "lin.weight", "old.bias": "lin.bias"}


# More than the values planning reads for load code (VALUES_BUDGET): the code stays unrun on names.
BIG = (600, 600)


def test_load_code_needing_more_values_than_planning_reads_is_named_when_names_then_disagree_and_undone(tmp_path):
    torch.manual_seed(5)
    path = write_safetensors({"old.weight": torch.randn(*BIG), "old.bias": torch.randn(BIG[0])},
                             tmp_path / "old.safetensors")
    with mz.meta_init():
        model = ChecksValues(renames=True, shape=BIG)

    for strict in (True, False):  # not strict, the load would skip what the code renames: another model
        with pytest.raises(mz.KeyMismatchError) as caught:
            mz.load(model, path, strict=strict)

        message = str(caught.value)
        assert "\n" not in message and "old.safetensors" in message
        assert "the model's own load code, ChecksValues's load_state_dict pre-hook (ChecksValues, which raised " \
            "RuntimeError" in message and "decides from checkpoint values what it does with" in message
        assert sorted(caught.value.unexpected) == ["old.bias", "old.weight"]  # popped, then put back
        assert sorted(caught.value.missing) == ["lin.bias", "lin.weight"]
        assert model.lin.weight.is_meta  # left as it was


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_the_refusal_of_load_code_needing_values_is_followed_with_torch_as_it_says(tmp_path, fmt):
    torch.manual_seed(5)
    state = {"old.weight": torch.randn(*BIG), "old.bias": torch.randn(BIG[0])}
    path = tmp_path / f"old.{fmt}"
    torch.save(state, path) if fmt == "pt" else write_safetensors(state, path)
    with mz.meta_init():
        model = ChecksValues(renames=True, shape=BIG)
    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)
    offered = {"pt": "torch.load(path, weights_only=True)", "safetensors": "safetensors.torch.load_file(path)"}[fmt]
    assert str(caught.value).endswith(f"build the model on the CPU and call model.load_state_dict({offered})")

    model = ChecksValues(renames=True, shape=BIG)
    model.load_state_dict(torch.load(path, weights_only=True) if fmt == "pt" else safetensors.torch.load_file(path))

    assert torch.equal(model.lin.weight, state["old.weight"]) and torch.equal(model.lin.bias, state["old.bias"])


class FusesProjections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(2, 6)
        self.register_load_state_dict_pre_hook(FusesProjections._fuse)

    @staticmethod
    def _fuse(module, state_dict, prefix, *_):
        if prefix + "q.weight" in state_dict:
            for kind in ("weight", "bias"):
                state_dict[prefix + "qkv." + kind] = torch.cat([state_dict.pop(f"{prefix}{p}.{kind}") for p in "qkv"])


def test_load_code_computing_a_tensor_from_checkpoint_values_is_refused_naming_it(tmp_path):
    torch.manual_seed(6)
    separate = {f"{p}.{kind}": torch.randn(*((2, 2) if kind == "weight" else (2,))) for p in "qkv"
                for kind in ("weight", "bias")}
    path = write_torch(separate, tmp_path / "separate.pth")
    with mz.meta_init():
        model = FusesProjections()

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)

    message = str(caught.value)
    assert "separate.pth" in message and "qkv.weight, qkv.bias" in message and "load_state_dict" in message
    assert model.qkv.weight.is_meta


def test_transformers_mamba_loads_a_save_with_its_older_embedding_name(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                                      conv_kernel=4)
    torch.manual_seed(7)
    source = transformers.MambaForCausalLM(config).eval()
    state = {name.replace(".embeddings.", ".embedding."): value.detach().contiguous()
             for name, value in source.state_dict().items() if name != "lm_head.weight"}  # tied to the embedding
    assert "backbone.embedding.weight" in state
    path = write_safetensors(state, tmp_path / "model.safetensors")
    with mz.meta_init():
        model = transformers.MambaForCausalLM(config).eval()

    report = mz.load(model, path)

    assert report.missing == [] and report.unexpected == []
    assert torch.equal(model.backbone.embeddings.weight, state["backbone.embedding.weight"])
    tokens = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, source(tokens).logits)


def test_the_cli_loads_a_vocoder_with_weight_norm_from_an_older_save(tmp_path):
    (tmp_path / "vocoder.py").write_text(textwrap.dedent("""
        from torch import nn
        from torch.nn.utils import parametrizations

        def build():
            return nn.Sequential(*[parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=1)) for _ in range(3)])
    """), encoding="utf-8")
    torch.manual_seed(8)
    with pytest.warns(FutureWarning):
        older = nn.Sequential(*[nn.utils.weight_norm(nn.Conv1d(4, 4, 3, padding=1)) for _ in range(3)])
    path = write_torch(older.state_dict(), tmp_path / "generator.pth")
    environment = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

    result = preforked.run([materialize_command(), str(path), "--model", "vocoder:build", "--json"],
                            capture_output=True, text=True, env=environment, timeout=300)

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    expected = [f"{i}.parametrizations.weight.original{k}" for i in range(3) for k in (0, 1)]
    assert sorted(report["loaded"]) == sorted(expected + [f"{i}.bias" for i in range(3)])
    assert report["missing"] == [] and report["unexpected"] == []


class Counted(nn.Module):
    """Keeps plain state beside its tensors, as schedulers-in-a-module and quantization observers do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.steps, self.tags = 0, ["fresh"]

    def get_extra_state(self):
        return {"steps": self.steps, "tags": list(self.tags)}

    def set_extra_state(self, state) -> None:
        if state["steps"] < 0:
            raise ValueError("a negative step count")
        self.steps, self.tags = state["steps"], state["tags"]


class Scaled(nn.Module):
    """Keeps a tensor as its extra state, as TransformerEngine keeps its FP8 scaling metadata."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scales = torch.ones(4)

    def get_extra_state(self) -> torch.Tensor:
        return self.scales.clone()

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.scales = state.clone()


def _stateful() -> nn.Sequential:
    return nn.Sequential(Counted(), Counted(), Scaled())


def _trained_stateful() -> nn.Sequential:
    torch.manual_seed(9)
    model = _stateful()
    model[0].steps, model[0].tags = 120, ["warm", "up"]
    model[1].steps = 7
    model[2].scales = torch.tensor([0.5, 2.0, 4.0, 8.0])
    return model


def test_extra_state_of_each_module_is_handed_back_as_load_state_dict_hands_it(tmp_path):
    source = _trained_stateful()
    path = write_torch(source.state_dict(), tmp_path / "stateful.pth")
    reference = _stateful()
    reference.load_state_dict(torch.load(path, weights_only=True))
    with mz.meta_init():
        model = _stateful()

    report = mz.load(model, path)

    assert report.missing == [] and report.unexpected == []
    assert (model[0].steps, model[0].tags, model[1].steps) == (120, ["warm", "up"], 7)
    assert (reference[0].steps, reference[0].tags, reference[1].steps) == (120, ["warm", "up"], 7)
    assert torch.equal(model[2].scales, source[2].scales)
    assert_state_equal(model, {k: v for k, v in source.state_dict().items() if not k.endswith("_extra_state")})
    assert mz.plan(_stateful(), path).to_dict()["extra_states"] == ["0._extra_state", "1._extra_state", "2._extra_state"]


def test_a_tensor_extra_state_loads_from_safetensors_too(tmp_path):
    source = _trained_stateful()
    state = {name: value for name, value in source.state_dict().items() if not name.startswith(("0.", "1."))}
    path = write_safetensors(state, tmp_path / "scaled.safetensors")
    with mz.meta_init():
        model = Scaled()

    mz.load(model, path, key_map=mz.KeyMap.strip_prefix("2."))

    assert torch.equal(model.scales, source[2].scales)
    assert torch.equal(model.lin.weight, source[2].lin.weight)


def test_extra_state_missing_is_missing_when_strict_and_left_to_the_module_otherwise(tmp_path):
    source = _trained_stateful()
    path = write_torch({k: v for k, v in source.state_dict().items() if not k.endswith("_extra_state")},
                       tmp_path / "tensors_only.pth")
    with mz.meta_init():
        model = _stateful()

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)
    assert caught.value.missing == ["0._extra_state", "1._extra_state", "2._extra_state"]
    assert model[0].lin.weight.is_meta

    report = mz.load(model, path, strict=False)
    assert report.missing == [] and model[0].steps == 0 and torch.equal(model[2].scales, torch.ones(4))


def test_extra_state_without_a_module_to_take_it_is_unexpected(tmp_path):
    path = write_torch(_trained_stateful().state_dict(), tmp_path / "stateful.pth")
    with mz.meta_init():
        plain = nn.Sequential(nn.Module(), nn.Module(), nn.Module())
        for index in range(3):
            plain[index].lin = nn.Linear(3, 3)

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(plain, path)

    assert sorted(caught.value.unexpected) == ["0._extra_state", "1._extra_state", "2._extra_state"]


def test_a_module_refusing_its_extra_state_fails_the_load_and_leaves_every_module_as_it_was(tmp_path):
    source = _trained_stateful()
    source[1].steps = -1
    path = write_torch(source.state_dict(), tmp_path / "bad_state.pth")
    with mz.meta_init():
        model = _stateful()

    with pytest.raises(mz.CheckpointError) as caught:
        mz.load(model, path)

    message = str(caught.value)
    assert "bad_state.pth" in message and "1._extra_state" in message and "negative step count" in message
    assert "\n" not in message
    assert (model[0].steps, model[0].tags) == (0, ["fresh"])  # handed its state, then given its own back
    assert model[0].lin.weight.is_meta and model[2].lin.weight.is_meta


class Calibration:
    """An object a restricted read does not rebuild."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


class Calibrated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calibration = Calibration(1.0)

    def get_extra_state(self):
        return self.calibration

    def set_extra_state(self, state) -> None:
        self.calibration = state


def test_extra_state_of_a_class_is_refused_unless_the_pickle_is_trusted(tmp_path):
    source = Calibrated()
    source.calibration = Calibration(0.25)
    path = write_torch(source.state_dict(), tmp_path / "calibrated.pth")
    with mz.meta_init():
        model = Calibrated()

    with pytest.raises(mz.CheckpointError) as caught:
        mz.load(model, path)
    assert "Calibration" in str(caught.value) and "trust_pickle" in str(caught.value)
    assert "_extra_state" in str(caught.value) and model.calibration.scale == 1.0

    mz.load(model, path, trust_pickle=True)
    assert model.calibration.scale == 0.25 and torch.equal(model.lin.weight, source.lin.weight)


class Fused(nn.Module):
    """Derives a fused weight from its loaded projections in a load post-hook, as inference libraries do."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
        self.fused = None
        self.seen: list = []
        self.register_load_state_dict_post_hook(Fused._fuse)

    @staticmethod
    def _fuse(module, incompatible) -> None:
        module.seen.append((list(incompatible.missing_keys), list(incompatible.unexpected_keys)))
        module.fused = torch.cat([module.q.weight, module.k.weight]).detach().clone()


def test_load_post_hooks_run_once_the_load_is_done_children_first(tmp_path):
    torch.manual_seed(10)
    source = nn.Sequential(Fused(), Fused())
    path = write_safetensors(dict(source.state_dict()), tmp_path / "fused.safetensors")
    order: list[str] = []
    with mz.meta_init():
        model = nn.Sequential(Fused(), Fused())
    model.register_load_state_dict_post_hook(lambda module, incompatible: order.append("root"))
    model[1].register_load_state_dict_post_hook(lambda module, incompatible: order.append("second"))
    model[0].register_load_state_dict_post_hook(lambda module, incompatible: order.append("first"))

    mz.load(model, path)

    assert order == ["first", "second", "root"]
    for index in range(2):
        assert model[index].seen == [([], [])]
        assert torch.equal(model[index].fused, torch.cat([source[index].q.weight, source[index].k.weight]))


class HookedByItsLoadCode(nn.Module):
    """Its own load code (a pre-hook) registers a post-hook on its child the first time it runs: a post-hook
    on a module that held no load hook of any kind until some of the model's load code ran."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.finished: list = []
        self._register_load_state_dict_pre_hook(self._arm)

    def _arm(self, state_dict, prefix, *rest) -> None:
        if not self.lin._load_state_dict_post_hooks:
            self.lin.register_load_state_dict_post_hook(lambda lin, incompatible: self.finished.append(
                torch.equal(lin.weight, torch.full((2, 2), 3.0))))


def test_a_post_hook_registered_by_the_models_own_load_code_runs_as_load_state_dict_runs_it(tmp_path):
    # Planning asks each module for its post-hooks once, in one pass with the pre-hooks, before any load code
    # runs; where code ran, it asks again: here the hook it would miss is the one the code registered.
    path = write_safetensors({"lin.weight": torch.full((2, 2), 3.0), "lin.bias": torch.zeros(2)},
                             tmp_path / "hooked.safetensors")
    eager = HookedByItsLoadCode()
    eager.load_state_dict(safetensors.torch.load_file(path))
    with mz.meta_init():
        model = HookedByItsLoadCode()

    mz.load(model, path)

    assert eager.finished == [True]
    assert model.finished == eager.finished


class UpgradesOnLoad(nn.Module):
    """Converts older names in its own load_state_dict, as fairseq's models do: code that loads, never called."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        state_dict = {key.replace("fc.", "proj."): value for key, value in state_dict.items()}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def test_a_model_converting_names_in_its_own_load_state_dict_is_named_when_names_disagree(tmp_path):
    path = write_safetensors({"fc.weight": torch.ones(2, 2), "fc.bias": torch.zeros(2)}, tmp_path / "older.safetensors")
    with mz.meta_init():
        model = UpgradesOnLoad()

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)

    assert "<root> (UpgradesOnLoad overrides load_state_dict, which a load does not call)" in str(caught.value)
    matching = write_safetensors({"proj.weight": torch.ones(2, 2), "proj.bias": torch.zeros(2)}, tmp_path / "m.safetensors")
    mz.load(model, matching)
    assert torch.equal(model.proj.weight, torch.ones(2, 2))


def test_convert_warns_that_extra_state_safetensors_cannot_hold_is_left_out(tmp_path):
    path = write_torch(_trained_stateful().state_dict(), tmp_path / "stateful.pth")

    with pytest.warns(mz.ConvertWarning, match="0._extra_state, 1._extra_state"):
        mz.convert(path, tmp_path / "out.safetensors")
    result = preforked.run([materialize_command(), "convert", str(path), str(tmp_path / "cli.safetensors")],
                            capture_output=True, text=True, timeout=300)

    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if line.startswith("Warning: ")]
    assert len(warned) == 1 and "0._extra_state, 1._extra_state" in warned[0] and "stateful.pth" in warned[0]
    converted = mz.open_checkpoint(tmp_path / "cli.safetensors")
    assert "2._extra_state" in converted and "0.lin.weight" in converted  # tensor extra state kept, as a tensor


def test_plan_shows_what_the_models_load_code_renamed(tmp_path):
    path = write_torch(_older_weight_norm_save(), tmp_path / "old.pth")
    environment = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    (tmp_path / "vocoder_block.py").write_text(
        "from torch import nn\nfrom torch.nn.utils import parametrizations\n\n"
        "def build():\n    return nn.Sequential(parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=1)), nn.LeakyReLU(0.1),\n"
        "                         parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=1)), nn.LeakyReLU(0.1),\n"
        "                         parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=1)))\n", encoding="utf-8")
    with mz.meta_init():
        model = _vocoder_block()

    summary = mz.plan(model, path).to_dict()
    result = preforked.run([materialize_command(), "plan", str(path), "--model", "vocoder_block:build"],
                            capture_output=True, text=True, env=environment, timeout=300)

    assert summary["renamed_by_model"]["0.weight_g"] == "0.parametrizations.weight.original0"
    assert summary["renamed_by_model"]["4.weight_v"] == "4.parametrizations.weight.original1"
    assert len(summary["renamed_by_model"]) == 6 and summary["missing"] == [] and summary["unexpected"] == []
    assert result.returncode == 0, result.stderr
    renamed = [line for line in result.stdout.splitlines() if line.startswith("renamed")]
    assert len(renamed) == 1 and "0.weight_g -> 0.parametrizations.weight.original0" in renamed[0]
    assert "by the model's own load code" in renamed[0]


class Serialized(nn.Module):
    """torch's CustomState: its parameter saved as ``serialized`` = param + 1, copied back as serialized - 1;
    ``fills`` False: its load code forgets the copy (but still reads the entry, into an attribute)."""

    def __init__(self, fills: bool = True) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.ones(3))
        self.fills = fills

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "serialized"] = self.param.data + 1

    def _load_from_state_dict(self, state_dict, prefix, *rest):
        self.seen = state_dict[prefix + "serialized"]
        if self.fills:
            self.param.data.copy_(self.seen - 1)


def test_a_tensor_load_code_makes_is_written_once_by_it_under_the_sanitizer_and_the_plan_says_so(tmp_path):
    path = write_safetensors({"serialized": torch.tensor([3.0, 4.0, 5.0])}, tmp_path / "custom.safetensors")
    with mz.meta_init():
        model = Serialized()

    summary = mz.plan(model, path).to_dict()
    report = mz.load(model, path, check=True)

    assert summary["fed_to_load_code"] == ["serialized"] and summary["filled_by_load_code"] == ["param"]
    assert summary["missing"] == summary["unexpected"] == []
    assert torch.equal(model.param.detach(), torch.tensor([2.0, 3.0, 4.0]))
    assert report.filled_by_load_code == ["param"] and report.fed_to_load_code == ["serialized"]
    assert report.loaded == report.initialized == []
    (tmp_path / "custom.py").write_text("import torch\nfrom torch import nn\n\n\n" + inspect.getsource(Serialized))
    result = preforked.run([materialize_command(), "plan", str(path), "--model", f"{tmp_path / 'custom.py'}:Serialized"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "load code    reads serialized" in result.stdout and "made by code param" in result.stdout


def test_a_tensor_load_code_was_to_make_and_left_unwritten_is_an_error_naming_it(tmp_path):
    path = write_safetensors({"serialized": torch.tensor([3.0, 4.0, 5.0])}, tmp_path / "custom.safetensors")
    with mz.meta_init():
        model = Serialized(fills=False)

    with pytest.raises(mz.InitError, match=r"custom\.safetensors: the model's own load code was to make param"):
        mz.load(model, path)

    assert model.param.is_meta  # put back
    real = Serialized(fills=False)  # built real: load_state_dict keeps its value, and so does the load
    mz.load(real, path)
    assert torch.equal(real.param.detach(), torch.ones(3)) and torch.equal(real.seen, torch.tensor([3.0, 4.0, 5.0]))


class RejectsValues(nn.Module):
    """Load code that refuses what it reads, as load_state_dict collects it: in error_msgs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        if int(state_dict.pop(prefix + "version")) > 3:
            error_msgs.append("saved by a newer version (4); upgrade")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs)


def test_load_code_refusing_the_checkpoints_values_fails_the_load_naming_it(tmp_path):
    path = write_safetensors({"version": torch.tensor(4), "lin.weight": torch.ones(2, 2), "lin.bias": torch.ones(2)},
                             tmp_path / "newer.safetensors")
    with pytest.raises(RuntimeError, match="saved by a newer version"):
        RejectsValues().load_state_dict(safetensors.torch.load_file(path))
    with mz.meta_init():
        model = RejectsValues()

    with pytest.raises(mz.CheckpointError, match=r"newer\.safetensors: the model's own load code, "
                                                  r"RejectsValues\._load_from_state_dict of '<root>', refused the "
                                                  r"checkpoint's values: saved by a newer version \(4\); upgrade"):
        mz.load(model, path)

    assert model.lin.weight.is_meta


class NegatesOnValue(nn.Module):
    """Load code that, given values, puts a tensor of its making where it left the entry on names alone."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def _load_from_state_dict(self, state_dict, prefix, *rest):
        if state_dict[prefix + "lin.weight"].sum().item() < 0:
            state_dict[prefix + "lin.weight"] = -state_dict[prefix + "lin.weight"]
        super()._load_from_state_dict(state_dict, prefix, *rest)


def test_load_code_doing_with_values_what_it_did_not_on_names_stops_the_load(tmp_path):
    path = write_torch({"lin.weight": -torch.ones(2, 2), "lin.bias": torch.ones(2)}, tmp_path / "negative.pth")
    with mz.meta_init():
        model = NegatesOnValue()

    with pytest.raises(mz.KeyMismatchError, match=r"negative\.pth: the model's own load code, NegatesOnValue\."
                                                  r"_load_from_state_dict of '<root>', replaced or removed lin\.weight"):
        mz.load(model, path)

    assert model.lin.weight.is_meta


class OwnLoad(nn.Linear):
    """A class with load code of its own: the replay then asks every module, not the hooked ones alone."""

    def _load_from_state_dict(self, state_dict, prefix, *args):
        key = prefix + "old_weight"
        if key in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args)


@pytest.mark.parametrize("with_code_class", [False, True])
def test_the_replay_asking_only_hooked_modules_decides_as_asking_every_module(tmp_path, with_code_class):
    from materialize.checkpoint import open_checkpoint
    from materialize.planning.loadhooks import load_hooked, replay_load_hooks
    from materialize.skeleton.modtree import named_modules

    def build() -> nn.Module:
        model = nn.Module()
        model.blocks = nn.ModuleList([Renamed(), nn.Linear(4, 4), Renamed()])
        model.blocks[1].register_load_state_dict_pre_hook(Renamed._old_name)  # a hook from outside, after building
        model.head = OwnLoad(4, 2) if with_code_class else nn.Linear(4, 2)
        return model

    state = {"blocks.0.fc.weight": torch.randn(4, 4), "blocks.0.fc.bias": torch.randn(4),
             "blocks.1.weight": torch.randn(4, 4), "blocks.1.bias": torch.randn(4),
             "blocks.2.fc.weight": torch.randn(4, 4), "blocks.2.fc.bias": torch.randn(4),
             "head.old_weight" if with_code_class else "head.weight": torch.randn(2, 4), "head.bias": torch.randn(2)}
    path = write_safetensors(state, tmp_path / "older.safetensors")
    with mz.meta_init():
        model = build()
    modules = named_modules(model, remove_duplicate=False)
    model_names = set(model.state_dict())
    with open_checkpoint(path) as ckpt:
        sources = dict(ckpt.items())
        every = replay_load_hooks(modules, dict(sources), model_names, path)
        hooked_only = replay_load_hooks(modules, dict(sources), model_names, path, hooked=load_hooked(modules),
                                        classes={type(module) for _, module in modules})

    assert hooked_only.sources == every.sources and hooked_only.renamed == every.renamed
    assert hooked_only.unrun == every.unrun and hooked_only.dropped == every.dropped
    assert [run.prefix for run in hooked_only.runs] == [run.prefix for run in every.runs]
    assert every.renamed == {"blocks.0.fc.weight": "blocks.0.proj.weight", "blocks.0.fc.bias": "blocks.0.proj.bias",
                             "blocks.2.fc.weight": "blocks.2.proj.weight", "blocks.2.fc.bias": "blocks.2.proj.bias",
                             **({"head.old_weight": "head.weight"} if with_code_class else {})}
    reference = build()
    reference.load_state_dict(state)
    report = mz.load(model, path)
    assert report.unexpected == [] and report.missing == []
    assert_state_equal(model, reference.state_dict())
