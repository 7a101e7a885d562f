"""A module transformers' _init_weights does not know (an adapter, a peft layer), its tensors missing from the
checkpoint: a load gives them eager construction's values, or refuses naming them; never zeros reported as
initialized. The oracle is eager construction then load_state_dict(strict=False); from_pretrained (5.24)
leaves such tensors as torch.empty's memory (docs/huggingface.md)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import materialize as mz

transformers = pytest.importorskip("transformers")

WIDTH = 32


class InitCalls(nn.Module):
    """(a) torch.nn.init calls in the constructor; AdaLoRA's ranknum, a frozen parameter filled after a draw."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(n))
        nn.init.constant_(self.scale, 0.5)
        self.proj = nn.Parameter(torch.empty(n, 4))
        nn.init.kaiming_uniform_(self.proj, a=math.sqrt(5))
        self.ranknum = nn.Parameter(torch.randn(1), requires_grad=False)
        with torch.no_grad():
            self.ranknum.fill_(4.0)


class WithReset(nn.Module):
    """(b) a reset_parameters() the constructor calls (LoRA's: A random, B zero)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(torch.empty(4, n))
        self.lora_b = nn.Parameter(torch.empty(n, 4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)


class PlainOps(nn.Module):
    """(c) plain tensor ops: OFT's and BOFT's identity blocks, a scale."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.ones = nn.Parameter(torch.ones(n))
        self.full = nn.Parameter(torch.full((n,), 0.25))
        self.eye = nn.Parameter(torch.eye(n))


class Buffers(nn.Module):
    """(d) buffers, persistent and not, beside a parameter."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.register_buffer("ranknum", torch.empty(1))
        self.ranknum.fill_(8.0)
        self.register_buffer("mask", torch.tril(torch.ones(n, n)), persistent=False)


class BuffersOnly(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("ranknum", torch.full((1,), 8.0))
        self.register_buffer("mask", torch.tril(torch.ones(n, n)), persistent=False)


FAMILY = [InitCalls, WithReset, PlainOps, Buffers, BuffersOnly]


def _config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=99, tie_word_embeddings=True)
    return transformers.BertConfig(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   vocab_size=99, max_position_embeddings=64)


def _model_class(kind: str):
    return transformers.LlamaForCausalLM if kind == "llama" else transformers.BertModel


def _layer(model: nn.Module, kind: str) -> nn.Module:
    return model.model.layers[0] if kind == "llama" else model.encoder.layer[0]


def _saved(kind: str, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    source = _model_class(kind)(_config(kind))
    folder = tmp_path / kind
    source.save_pretrained(folder)
    return folder, {name: value.clone() for name, value in source.state_dict().items()}


def _eager(kind: str, adapter_class: type, state: dict[str, torch.Tensor]) -> nn.Module:
    """Eager construction, the adapter inserted as peft inserts its layers, then load_state_dict(strict=False)."""
    torch.manual_seed(1)
    model = _model_class(kind)(_config(kind))
    torch.manual_seed(2)
    _layer(model, kind).adapter = adapter_class(WIDTH)
    model.load_state_dict(state, strict=False)
    return model


def _assert_equal_tensors(ours: nn.Module, eager: nn.Module) -> None:
    theirs = dict(eager.named_parameters()) | dict(eager.named_buffers())
    mine = dict(ours.named_parameters()) | dict(ours.named_buffers())
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        assert mine[name].dtype == value.dtype and torch.equal(mine[name], value), name
        assert mine[name].requires_grad == value.requires_grad, name


def _adapter_names(model: nn.Module, kind: str) -> list[str]:
    prefix = "model.layers.0.adapter." if kind == "llama" else "encoder.layer.0.adapter."
    adapter = _layer(model, kind).adapter
    return [prefix + name for name, _ in [*adapter.named_parameters(), *adapter.named_buffers()]]


@pytest.mark.parametrize("adapter_class", FAMILY, ids=lambda c: c.__name__)
@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_an_unknown_module_built_by_deferred_init_is_replayed_as_eager_construction_made_it(kind, adapter_class, tmp_path):
    folder, state = _saved(kind, tmp_path)
    eager = _eager(kind, adapter_class, state)
    model = mz.build(folder)
    torch.manual_seed(2)
    _layer(model, kind).adapter = mz.deferred_init(adapter_class, WIDTH)

    report = mz.load(model, folder, strict=False)

    _assert_equal_tensors(model, eager)
    missing = [n for n in _adapter_names(model, kind) if n.rpartition(".")[2] != "mask"]
    assert sorted(report.missing) == sorted(missing)
    assert sorted(report.replayed) == sorted(report.initialized) == sorted(_adapter_names(model, kind))


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_an_unknown_module_with_reset_parameters_built_on_meta_is_reset_as_its_constructor_resets_it(kind, tmp_path):
    folder, state = _saved(kind, tmp_path)
    eager = _eager(kind, WithReset, state)
    model = mz.build(folder)
    with mz.meta_init():
        _layer(model, kind).adapter = WithReset(WIDTH)

    torch.manual_seed(2)  # the draws of reset_parameters come from the generator as eager construction's did
    report = mz.load(model, folder, strict=False)

    _assert_equal_tensors(model, eager)
    assert sorted(report.initialized) == sorted(_adapter_names(model, kind)) and report.replayed == []
    assert not _layer(model, kind).adapter.lora_b.any()  # LoRA's B zero, so the adapter starts as the identity


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_buffers_kept_real_on_meta_keep_their_constructors_values(kind, tmp_path):
    folder, state = _saved(kind, tmp_path)
    eager = _eager(kind, BuffersOnly, state)
    model = mz.build(folder)
    with mz.meta_init():
        _layer(model, kind).adapter = BuffersOnly(WIDTH)

    report = mz.load(model, folder, strict=False)

    _assert_equal_tensors(model, eager)
    assert report.initialized == []


@pytest.mark.parametrize("adapter_class, names, include_buffers", [
    (InitCalls, ["scale", "proj", "ranknum"], False),
    (PlainOps, ["ones", "full", "eye"], False),
    (Buffers, ["weight"], False),
    (BuffersOnly, ["ranknum", "mask"], True),
], ids=["init-calls", "plain-ops", "param-beside-buffers", "buffers-on-meta"])
@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_an_unknown_module_whose_values_were_lost_on_meta_is_refused_naming_it_and_the_way_out(
        kind, adapter_class, names, include_buffers, tmp_path):
    folder, _ = _saved(kind, tmp_path)
    model = mz.build(folder)
    with mz.meta_init(include_buffers=include_buffers):
        _layer(model, kind).adapter = adapter_class(WIDTH)

    with pytest.raises(mz.MaterializeError) as caught:
        mz.load(model, folder, strict=False)

    message = str(caught.value)
    assert "\n" not in message
    assert f"(of {adapter_class.__name__})" in message and "_init_weights does not initialize" in message
    assert "mz.deferred_init" in message and "reset_parameters()" in message
    for name in names:
        assert f"adapter.{name}" in message


class Older(nn.Module):
    """Tensors an older _init_weights writes through .data (a parameter, an integer buffer)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))
        self.register_buffer("steps", torch.ones(2, dtype=torch.long))


def _llama_holding(adapter_class: type, write=None) -> type:
    """A Llama whose constructor holds ``adapter_class`` (a custom model class); its _init_weights hands that
    module to ``write`` where given, else passes it over as transformers' own does."""

    class LlamaWithAdapter(transformers.LlamaForCausalLM):
        def __init__(self, config) -> None:
            super().__init__(config)
            self.adapter = adapter_class(config.hidden_size)
            self.post_init()

        def _init_weights(self, module: nn.Module) -> None:
            if write is not None and isinstance(module, adapter_class):
                write(module)
            else:
                super()._init_weights(module)

    return LlamaWithAdapter


def test_an_init_writing_through_data_as_older_ones_do_counts_as_writing(tmp_path):
    def write(module):  # no version counter moves; zero is a value like any other
        module.scale.data.zero_()
        module.steps.data.zero_()

    folder, _ = _saved("llama", tmp_path)
    with mz.meta_init(include_buffers=True):
        model = _llama_holding(Older, write)(_config("llama"))

    report = mz.load(model, folder, strict=False)

    assert {"adapter.scale", "adapter.steps"} <= set(report.initialized)
    assert not model.adapter.scale.any() and not model.adapter.steps.any()


def _writes_part(module):
    module.scale.data[:4].fill_(1.0)
    module.steps.zero_()


def _only_rescales(module):  # a counter moves, yet no value was given
    module.scale.mul_(2.0)
    module.steps.zero_()


@pytest.mark.parametrize("write, words", [
    (_writes_part, r"adapter\.scale: LlamaWithAdapter\._init_weights writes only part of"),
    (_only_rescales, r"adapter\.scale \(of Older\): LlamaWithAdapter\._init_weights does not initialize"),
], ids=["part", "rescale"])
def test_an_init_leaving_a_tensor_without_values_is_refused_naming_it(write, words, tmp_path):
    folder, _ = _saved("llama", tmp_path)
    with mz.meta_init(include_buffers=True):
        model = _llama_holding(Older, write)(_config("llama"))

    with pytest.raises(mz.MaterializeError, match=words):
        mz.load(model, folder, strict=False)


@pytest.mark.parametrize("adapter_class", [InitCalls, PlainOps, Buffers], ids=lambda c: c.__name__)
def test_a_model_class_holding_an_unknown_module_recorded_whole_loads_as_eager_construction_then_load_state_dict(
        adapter_class, tmp_path):
    folder, state = _saved("llama", tmp_path)
    cls = _llama_holding(adapter_class)
    torch.manual_seed(3)
    eager = cls(_config("llama"))
    eager.load_state_dict(state, strict=False)
    torch.manual_seed(3)
    recorded = mz.deferred_init(cls, _config("llama"))

    model, report = mz.load_model(folder, model=recorded, strict=False)

    _assert_equal_tensors(model, eager)
    adapter = [f"adapter.{name}" for name, _ in [*eager.adapter.named_parameters(), *eager.adapter.named_buffers()]]
    assert set(adapter) <= set(report.replayed)


def test_a_model_class_holding_an_unknown_module_built_on_meta_is_refused_naming_the_way_out(tmp_path):
    folder, _ = _saved("llama", tmp_path)

    with pytest.raises(mz.MaterializeError) as caught:
        mz.load_model(folder, model=_meta(_llama_holding(InitCalls)), strict=False)

    assert "adapter.ranknum" in str(caught.value) and "LlamaWithAdapter._init_weights does not initialize" in str(caught.value)


def _meta(cls: type) -> nn.Module:
    with mz.meta_init():
        return cls(_config("llama"))
