"""Ties, buffers, init of missing tensors, strictness, key maps, dtypes, rollback."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from torch import nn

import materialize as mz

from conftest import TINY, assert_state_equal, reference_model, saved_state, tiny_skeleton, write_safetensors, write_torch
from bench.models.transformer import DecoderLM


class Scaled(nn.Module):
    """A module whose own init is recognisable: weight 7, bias -1."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, n))
        self.bias = nn.Parameter(torch.empty(n))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 7.0)
        nn.init.constant_(self.bias, -1.0)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Scaled()
        self.second = Scaled()


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.known = nn.Linear(2, 2)
        self.bare = NoInit()


def _meta(factory):
    with mz.meta_init():
        return factory()


def test_tied_weights_stay_one_tensor_when_the_checkpoint_holds_either_name(tmp_path):
    source = reference_model(tie=True)
    for kept in ("model.embed_tokens.weight", "lm_head.weight"):
        state = {k: v for k, v in source.state_dict().items() if k != ({"model.embed_tokens.weight", "lm_head.weight"} - {kept}).pop()}
        path = write_safetensors({k: v.contiguous() for k, v in state.items()}, tmp_path / f"{kept}.safetensors")
        model = tiny_skeleton(tie=True)

        report = mz.load(model, path)

        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert torch.equal(model.lm_head.weight, source.lm_head.weight)
        assert report.missing == [] and report.tied == [["model.embed_tokens.weight", "lm_head.weight"]]
        assert len({id(p) for p in model.parameters()}) == len(list(model.parameters()))


def test_non_persistent_buffers_survive_meta_init(tmp_path, tokens):
    source = reference_model()
    path = write_safetensors(saved_state(source), tmp_path / "m.safetensors")
    model = tiny_skeleton()

    report = mz.load(model, path)

    rotary = model.model.layers[0].self_attn.rotary.inv_freq
    assert torch.equal(rotary, source.model.layers[0].self_attn.rotary.inv_freq)
    assert len(report.kept) == TINY["num_layers"]
    with torch.no_grad():
        assert torch.equal(model(tokens), source(tokens))


def test_a_plain_models_computed_buffer_the_checkpoint_holds_is_loaded_from_it(tmp_path):
    source = reference_model()
    state = saved_state(source)
    saved_freq = source.model.layers[0].self_attn.rotary.inv_freq * 2
    state["model.layers.0.self_attn.rotary.inv_freq"] = saved_freq
    path = write_safetensors(state, tmp_path / "m.safetensors")
    model = tiny_skeleton()

    report = mz.load(model, path)

    assert torch.equal(model.model.layers[0].self_attn.rotary.inv_freq, saved_freq)  # the file knows best
    assert torch.equal(model.model.layers[1].self_attn.rotary.inv_freq, source.model.layers[1].self_attn.rotary.inv_freq)
    assert "model.layers.0.self_attn.rotary.inv_freq" in report.loaded and report.unexpected == []


def test_model_built_under_plain_meta_device_gets_its_buffers_recomputed(tmp_path, tokens):
    source = reference_model()
    path = write_safetensors(saved_state(source), tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = DecoderLM(**TINY)

    report = mz.load(model, path)

    assert all(t.device.type == "cpu" for t in list(model.parameters()) + list(model.buffers()))
    assert torch.equal(model.model.layers[1].self_attn.rotary.inv_freq, source.model.layers[1].self_attn.rotary.inv_freq)
    assert sorted(report.initialized) == [f"model.layers.{i}.self_attn.rotary.inv_freq" for i in range(TINY["num_layers"])]
    with torch.no_grad():
        assert torch.equal(model(tokens), source(tokens))


def test_missing_tensors_are_initialized_and_loaded_ones_untouched(tmp_path):
    loaded_weight = torch.randn(4, 4)
    path = write_safetensors({"first.weight": loaded_weight, "extra": torch.ones(2)}, tmp_path / "m.safetensors")
    model = _meta(Pair)

    with pytest.warns(mz.MostlyInitializedWarning, match="3 of the model's tensors get no value"):  # 1 loaded
        report = mz.load(model, path, strict=False)

    assert torch.equal(model.first.weight, loaded_weight)  # loaded after its module's init ran
    assert torch.equal(model.first.bias, torch.full((4,), -1.0))
    assert torch.equal(model.second.weight, torch.full((4, 4), 7.0))
    assert sorted(report.missing) == ["first.bias", "second.bias", "second.weight"]
    assert sorted(report.initialized) == sorted(report.missing)
    assert report.unexpected == ["extra"]


def test_custom_init_replaces_reset_parameters(tmp_path):
    path = write_safetensors({"first.weight": torch.randn(4, 4), "first.bias": torch.randn(4)}, tmp_path / "m.safetensors")
    model = _meta(Pair)
    seen = []

    def init(module: nn.Module) -> None:
        seen.append(module)
        for param in module.parameters(recurse=False):
            param.fill_(0.5)

    mz.load(model, path, strict=False, init=init)

    assert seen == [model.second]
    assert torch.equal(model.second.weight, torch.full((4, 4), 0.5))


def test_missing_tensor_without_an_initializer_is_an_error_naming_it(tmp_path):
    path = write_safetensors({"known.weight": torch.randn(2, 2), "known.bias": torch.randn(2)}, tmp_path / "m.safetensors")
    model = _meta(Holder)

    with pytest.raises(mz.InitError, match="bare.weight"):
        mz.load(model, path, strict=False)

    assert model.known.weight.device.type == "meta"


def test_strict_mismatch_names_every_tensor_and_leaves_model_untouched(tmp_path):
    path = write_safetensors({"first.weight": torch.randn(4, 4), "stray.a": torch.ones(1), "stray.b": torch.ones(1)}, tmp_path / "m.safetensors")
    model = _meta(Pair)

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)

    message = str(caught.value)
    for name in ("first.bias", "second.weight", "second.bias", "stray.a", "stray.b", str(path)):
        assert name in message
    assert all(p.device.type == "meta" for p in model.parameters())


def test_a_mismatch_of_many_tensors_names_a_few_and_counts_the_rest(tmp_path):
    path = write_safetensors({f"other.{i}": torch.ones(1) for i in range(30)}, tmp_path / "m.safetensors")
    model = nn.Sequential(*(nn.Linear(2, 2, device="meta") for _ in range(20)))

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)

    message = str(caught.value)
    assert "40 missing from the checkpoint: 0.weight, 0.bias," in message and "(and 32 more)" in message
    assert "30 unexpected in the checkpoint: other.0," in message and "(and 22 more)" in message
    assert "19.bias" not in message and len(message) < 1000
    assert len(caught.value.missing) == 40 and len(caught.value.unexpected) == 30


def _convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 5),
                         nn.BatchNorm1d(5))


@pytest.mark.parametrize("writer", [write_torch, write_safetensors], ids=["pth", "safetensors"])
@pytest.mark.parametrize("buffers_on_meta", [False, True])
def test_batch_norm_counters_older_saves_lack_are_kept_as_load_state_dict_keeps_them(tmp_path, writer, buffers_on_meta):
    # Saves from before torch 0.4.1 (torchvision's classic weights) have no num_batches_tracked.
    torch.manual_seed(0)
    source = _convnet()
    source.train()(torch.randn(8, 3, 8, 8))  # running statistics of their own
    state = {name: value for name, value in source.state_dict().items() if not name.endswith("num_batches_tracked")}
    path = writer(state, tmp_path / ("old" + (".pth" if writer is write_torch else ".safetensors")))
    reference = _convnet()
    reference.load_state_dict(torch.load(path) if writer is write_torch else state)  # strict: torch lets them go
    with mz.meta_init(include_buffers=buffers_on_meta):
        model = _convnet()

    report = mz.load(model, path)

    assert report.missing == []
    assert_state_equal(model, reference.state_dict())
    assert model[1].num_batches_tracked.item() == 0 and model[1].num_batches_tracked.dtype == torch.long
    images = torch.randn(2, 3, 8, 8)
    assert torch.equal(model.eval()(images), reference.eval()(images))


def test_a_batch_norms_running_statistics_missing_are_still_missing(tmp_path):
    state = {name: value for name, value in _convnet().state_dict().items() if not name.startswith("1.running_")}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    with mz.meta_init():
        model = _convnet()

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)

    assert sorted(caught.value.missing) == ["1.running_mean", "1.running_var"]


def _wrap_blocks(model: DecoderLM) -> DecoderLM:
    """Blocks wrapped as training scripts wrap them before loading: activation checkpointing, then compiled."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for index, layer in enumerate(model.model.layers):
        model.model.layers[index] = torch.compile(checkpoint_wrapper(layer), backend="eager")
    return model


def test_a_model_with_wrapped_blocks_loads_a_plain_checkpoint(tmp_path):
    source = reference_model()
    path = write_safetensors(saved_state(source), tmp_path / "m.safetensors")
    model = _wrap_blocks(tiny_skeleton())

    report = mz.load(model, path)

    assert "model.layers.1._orig_mod._checkpoint_wrapped_module.mlp.up_proj.weight" in report.loaded
    assert report.missing == [] and report.unexpected == []
    tokens = torch.arange(9)[None] % TINY["vocab_size"]
    with torch.no_grad():
        assert torch.equal(model(tokens), source(tokens))


def test_a_checkpoint_saved_from_wrapped_blocks_loads_into_a_plain_model(tmp_path):
    source = _wrap_blocks(reference_model())
    state = saved_state(source)
    assert any("._orig_mod." in name for name in state)  # torch.compile'd blocks name their tensors so
    path = write_safetensors(state, tmp_path / "m.safetensors")
    model = tiny_skeleton()

    mz.load(model, path)

    assert_state_equal(model, saved_state(reference_model()))


def test_a_wrapped_name_whose_bare_name_the_checkpoint_also_holds_stays_unexpected(tmp_path):
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Linear(2, 2)
            self.block_orig = nn.Module()
            self.block_orig._orig_mod = nn.Linear(2, 2)  # bare "block_orig.weight": no checkpoint name's

    path = write_safetensors({"block._orig_mod.weight": torch.ones(2, 2), "block._orig_mod.bias": torch.ones(2),
                              "block.weight": torch.zeros(2, 2), "block.bias": torch.zeros(2)}, tmp_path / "m.safetensors")
    with mz.meta_init():
        model = Both()

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)

    assert sorted(caught.value.unexpected) == ["block._orig_mod.bias", "block._orig_mod.weight"]
    assert sorted(caught.value.missing) == ["block_orig._orig_mod.bias", "block_orig._orig_mod.weight"]


def test_without_a_device_a_model_on_meta_is_loaded_to_the_cpu_and_a_real_one_where_it_is(tmp_path):
    source = reference_model()
    path = write_safetensors(saved_state(source), tmp_path / "m.safetensors")
    on_meta = tiny_skeleton()
    real = reference_model(seed=1)
    addresses = {name: tensor.data_ptr() for name, tensor in real.state_dict().items()}

    planned = mz.plan(on_meta, path)
    mz.load(on_meta, path)
    mz.load(real, path)

    assert planned.device == torch.device("cpu") and set(planned.bytes_by_device) == {"cpu"}
    assert {tensor.device for tensor in on_meta.state_dict().values()} == {torch.device("cpu")}
    assert {name: tensor.data_ptr() for name, tensor in real.state_dict().items()} == addresses  # filled in place
    assert_state_equal(on_meta, saved_state(source))
    assert_state_equal(real, saved_state(source))


def _lazy_net() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))


@pytest.mark.parametrize("built", ["meta_init", "real"])
def test_lazy_modules_take_their_shapes_from_the_checkpoint_as_load_state_dict_gives_them(tmp_path, built):
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    path = write_safetensors(dict(source.state_dict()), tmp_path / "m.safetensors")
    reference = _lazy_net()
    reference.load_state_dict(source.state_dict())
    if built == "meta_init":
        with mz.meta_init():
            model = _lazy_net()
    else:
        model = _lazy_net()

    mz.load(model, path, check=True, check_finite=True)

    assert_state_equal(model, source.state_dict())
    inputs = torch.randn(5, 3)
    assert torch.equal(model(inputs), reference(inputs)) and type(model[0]) is nn.Linear  # sized: plain again


def test_a_lazy_tensor_the_checkpoint_lacks_is_missing_or_left_for_its_first_forward(tmp_path):
    path = write_safetensors(dict(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).state_dict()),
                             tmp_path / "m.safetensors")
    with mz.meta_init():
        model = nn.Sequential(*_lazy_net(), nn.LazyLinear(7))

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(model, path)
    report = mz.load(model, path, strict=False, check=True, check_finite=True)

    assert caught.value.missing == ["3.weight", "3.bias"] and report.missing == ["3.weight", "3.bias"]
    assert isinstance(model[3].weight, nn.parameter.UninitializedParameter)
    assert model(torch.randn(5, 3)).shape == (5, 7)


def test_shape_mismatch_is_an_error_even_when_not_strict(tmp_path):
    path = write_safetensors({"first.weight": torch.randn(4, 5)}, tmp_path / "m.safetensors")
    model = _meta(Pair)

    with pytest.raises(mz.ShapeMismatchError, match=r"first.weight \(model \[4, 4\], checkpoint \[4, 5\]\)"):
        mz.load(model, path, strict=False)


def test_initialized_tensors_follow_the_loaded_dtype(tmp_path):
    path = write_safetensors({"first.weight": torch.randn(4, 4, dtype=torch.bfloat16)}, tmp_path / "m.safetensors")
    model = _meta(Pair)

    with pytest.warns(mz.MostlyInitializedWarning):
        mz.load(model, path, strict=False)

    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "key_map, saved_prefix",
    [
        (mz.KeyMap.strip_prefix("model."), "model."),
        ({r"^backbone\.": ""}, "backbone."),
        (lambda name: name.replace("enc.", "", 1), "enc."),
        (None, "module."),       # DistributedDataParallel's prefix is stripped automatically
        (None, "_orig_mod."),    # and torch.compile's
        (None, "_orig_mod.module."),  # torch.compile(DDP(model))
        (None, "module._orig_mod."),  # DDP(torch.compile(model))
    ],
)
def test_key_map_renames_checkpoint_names(key_map, saved_prefix, tmp_path):
    source = saved_state(reference_model())
    state = {f"{saved_prefix}{k}": v for k, v in source.items()}
    path = write_torch(state, tmp_path / "m.pt")
    model = tiny_skeleton()

    mz.load(model, path, key_map=key_map)

    assert_state_equal(model, source)


def _decoder_wrapped_as(attr: str) -> nn.Module:
    """A module holding the decoder under ``attr``, built on meta: its names carry ``attr.``."""
    def wrapper() -> nn.Module:
        outer = nn.Module()
        outer.add_module(attr, DecoderLM(**TINY))
        return outer

    return _meta(wrapper)


def test_add_prefix_key_map_loads_a_base_model_checkpoint_into_a_wrapper(tmp_path):
    state = saved_state(reference_model())
    path = write_safetensors(state, tmp_path / "m.safetensors")
    wrapper = _decoder_wrapped_as("model")

    mz.load(wrapper, path, key_map=mz.KeyMap.add_prefix("model."))

    assert torch.equal(wrapper.model.model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_real_model_is_filled_in_place(tmp_path):
    state = saved_state(reference_model())
    path = write_safetensors(state, tmp_path / "m.safetensors")
    model = DecoderLM(**TINY)
    before = model.model.embed_tokens.weight

    mz.load(model, path)

    assert model.model.embed_tokens.weight is before
    assert_state_equal(model, state)


def test_a_real_model_keeps_its_dtype_as_load_state_dict_keeps_it(tmp_path):
    source = reference_model()
    state = saved_state(source)
    path = write_safetensors({name: value.to(torch.bfloat16) for name, value in state.items()}, tmp_path / "m.safetensors")
    real = DecoderLM(**TINY)
    before = {name: tensor.data_ptr() for name, tensor in real.state_dict().items()}
    reference = DecoderLM(**TINY)
    reference.load_state_dict({name: value.to(torch.bfloat16) for name, value in state.items()})
    on_meta = tiny_skeleton()

    mz.load(real, path)
    mz.load(on_meta, path)
    mz.load(cast := DecoderLM(**TINY), path, dtype="bf16")

    assert {name: tensor.data_ptr() for name, tensor in real.state_dict().items()} == before  # cast into place
    assert_state_equal(real, reference.state_dict())  # fp32, holding the bf16 values
    assert {p.dtype for p in on_meta.parameters()} == {torch.bfloat16}  # a skeleton takes the checkpoint's dtype
    assert {p.dtype for p in cast.parameters()} == {torch.bfloat16}  # and a dtype asked for wins


def test_requires_grad_is_kept(tmp_path):
    state = saved_state(reference_model())
    path = write_safetensors(state, tmp_path / "m.safetensors")
    model = tiny_skeleton()
    model.model.norm.weight.requires_grad_(False)

    mz.load(model, path)

    assert model.model.norm.weight.requires_grad is False
    assert model.lm_head.weight.requires_grad is True
    assert isinstance(model.lm_head.weight, nn.Parameter)


def test_file_truncated_after_opening_fails_naming_the_tensor_and_rolls_back(tmp_path):
    state = saved_state(reference_model())
    path = write_safetensors(state, tmp_path / "m.safetensors")
    model = tiny_skeleton()
    with mz.open_checkpoint(path) as ckpt:
        last = max(ckpt.values(), key=lambda info: info.offset)
        os.truncate(path, last.offset + 4)

        with pytest.raises(mz.CheckpointError, match=f"{last.name}.*truncated"):
            mz.load(model, ckpt)

    assert all(p.device.type == "meta" for p in model.parameters())


def test_plan_reports_what_a_load_would_do_without_reading(tmp_path):
    source = reference_model(tie=True, dtype=torch.bfloat16)
    path = write_safetensors(saved_state(source), tmp_path / "m.safetensors")
    model = tiny_skeleton(tie=True)

    plan = mz.plan(model, path, dtype="fp16")
    summary = plan.to_dict()

    assert summary["tied_groups"] == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert summary["tensors"] == {"load": len(saved_state(source)), "init": 0, "keep": TINY["num_layers"]}
    assert summary["read_bytes"] == sum(t.numel() * 2 for t in saved_state(source).values())
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown when no GPU is visible")
def test_cuda_without_a_gpu_is_a_clear_device_error(tmp_path):
    path = write_safetensors({"w": torch.ones(2)}, tmp_path / "m.safetensors")

    with pytest.raises(mz.DeviceError, match="CUDA is not available"):
        mz.load_tensors(path, device="cuda")


def test_real_tensors_absent_from_the_checkpoint_are_missing_under_strict(tmp_path):
    path = write_safetensors({"first.weight": torch.randn(4, 4)}, tmp_path / "m.safetensors")
    model = Pair()

    with pytest.raises(mz.KeyMismatchError, match="second.weight"):
        mz.load(model, path)
    with pytest.warns(mz.MostlyInitializedWarning):
        report = mz.load(model, path, strict=False)

    assert torch.equal(model.second.weight, torch.full((4, 4), 7.0))  # kept as built
    assert "second.weight" in report.missing and "second.weight" in report.kept
    assert sorted(report.not_from_checkpoint) == ["first.bias", "second.bias", "second.weight"]


def test_a_lightning_checkpoints_module_prefix_is_stripped_when_it_explains_every_name(tmp_path):
    import argparse
    from pathlib import PurePosixPath

    source = reference_model()
    state = saved_state(source)
    # What a LightningModule holding the model as `self.net` saves, beside its training state.
    torch.save({
        "epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.4.0",
        "state_dict": {f"net.{k}": v for k, v in state.items()},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 1e-3}]}],
        "hyper_parameters": {"args": argparse.Namespace(lr=1e-3), "root": PurePosixPath("/data")},
    }, tmp_path / "last.ckpt")
    model = tiny_skeleton()

    report = mz.load(model, tmp_path / "last.ckpt")

    assert_state_equal(model, state)
    assert report.missing == [] and report.unexpected == []
    with torch.no_grad():
        assert torch.equal(model(torch.arange(5)[None]), source(torch.arange(5)[None]))


def test_a_wrappers_attribute_prefix_is_added_when_it_explains_every_name(tmp_path):
    state = saved_state(reference_model())
    path = write_safetensors(state, tmp_path / "m.safetensors")
    wrapper = _decoder_wrapped_as("inner")

    mz.load(wrapper, path)

    assert_state_equal(wrapper.inner, state)


def test_a_prefix_that_explains_only_some_names_is_not_guessed(tmp_path):
    state = {f"net.{k}": v for k, v in saved_state(reference_model()).items()}
    state["net.extra.weight"] = torch.ones(3)  # one name the model lacks, and the model's buffers the file lacks
    path = write_safetensors(state, tmp_path / "m.safetensors")
    model = tiny_skeleton()
    model.register_buffer("step", torch.zeros(()))  # persistent, absent from the file

    with pytest.raises(mz.KeyMismatchError, match=r"prefix 'net\.'"):
        mz.load(model, path)


def test_a_prefix_mismatch_error_says_which_prefix_to_strip(tmp_path):
    state = {f"model.{k}": v for k, v in saved_state(reference_model()).items()}
    path = write_safetensors(state, tmp_path / "m.safetensors")

    with pytest.raises(mz.KeyMismatchError, match=r"prefix 'model\.'.*strip_prefix\('model\.'\)"):
        mz.load(tiny_skeleton(), path)


def test_the_cyclic_collector_is_paused_while_loading_and_left_as_found(tmp_path):
    state = saved_state(reference_model())
    path = write_safetensors(state, tmp_path / "m.safetensors")
    collecting_during_load: list[bool] = []

    model = tiny_skeleton()
    mz.load(model, path, progress=lambda done, total: collecting_during_load.append(gc.isenabled()))

    assert collecting_during_load and not any(collecting_during_load)
    assert gc.isenabled()
    assert_state_equal(model, state)
    with pytest.raises(mz.CheckpointError):
        mz.load_tensors(tmp_path / "missing.safetensors")
    assert gc.isenabled()  # a failed load restores it too
    gc.disable()
    try:
        mz.load_tensors(path)
        assert not gc.isenabled()  # the caller's choice stands
    finally:
        gc.enable()


class SharedBlock(nn.Module):
    """One block registered under two names (and an empty slot), as weight-shared layers are."""

    def __init__(self) -> None:
        super().__init__()
        block = Scaled()
        self.encoder = nn.ModuleList([block, Scaled()])
        self.decoder = block
        self.unused = None
        self.head = nn.Linear(4, 2)


def test_the_module_walk_is_torchs_for_shared_and_empty_children():
    from materialize.skeleton.modtree import named_modules

    model = SharedBlock()

    for remove_duplicate in (True, False):
        ours = [(name, id(module)) for name, module in named_modules(model, remove_duplicate=remove_duplicate)]
        theirs = [(name, id(module)) for name, module in model.named_modules(remove_duplicate=remove_duplicate)]
        assert ours == theirs
    assert len(named_modules(model, remove_duplicate=False)) == len(named_modules(model)) + 1  # the block, twice


def test_the_nameless_module_walk_is_torchs_for_shared_and_empty_children():
    from materialize.skeleton.modtree import modules_of

    model = nn.Sequential(SharedBlock(), nn.Sequential(nn.Identity(), SharedBlock()))
    model.add_module("later", model[0].decoder)

    assert [id(module) for module in modules_of(model)] == [id(module) for module in model.modules()]


def test_one_shared_walk_answers_every_walk_as_torch_does():
    from materialize.skeleton.modtree import modules_of, named_modules, one_walk

    model = nn.Sequential(SharedBlock(), nn.Sequential(nn.Identity(), SharedBlock()))
    model.add_module("later", model[0].decoder)
    model[1].register_module("gap", None)
    plain = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    walk = one_walk(model)
    for _ in range(2):  # entered again: the same walk
        with walk:
            for remove_duplicate in (True, False):
                ours = [(name, id(module)) for name, module in named_modules(model, remove_duplicate=remove_duplicate)]
                theirs = [(name, id(module)) for name, module in model.named_modules(remove_duplicate=remove_duplicate)]
                assert ours == theirs
            assert [id(module) for module in modules_of(model)] == [id(module) for module in model.modules()]
            vacant: list[str] = []
            named_modules(model, remove_duplicate=False, vacant=vacant)
            assert vacant == ["1.gap"]
            assert modules_of(plain) == list(plain.modules())  # another model: walked as ever
    model.add_module("added", nn.Linear(2, 2))  # outside the span: a fresh walk sees it
    assert modules_of(model)[-1] is model.added


def test_a_load_refreshes_the_flat_weights_of_its_rnns(tmp_path):
    from safetensors.torch import save_file

    import materialize as mz

    source = nn.Sequential(nn.LSTM(4, 3, num_layers=2), nn.Linear(3, 2))
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "m.safetensors")
    with mz.meta_init():
        model = nn.Sequential(nn.LSTM(4, 3, num_layers=2), nn.Linear(3, 2))
    mz.load(model, tmp_path / "m.safetensors")
    lstm = model[0]
    assert [id(w) for w in lstm._flat_weights] == [id(getattr(lstm, name)) for name in lstm._flat_weights_names]
    x = torch.randn(5, 1, 4)
    assert torch.equal(lstm(x)[0], source[0](x)[0])


def _parametrized_rnn(cls: type, parametrize: str) -> nn.Module:
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    rnn = cls(4, 4, num_layers=2)
    getattr(parametrizations, parametrize)(rnn, "weight_hh_l0")
    getattr(parametrizations, parametrize)(rnn, "weight_ih_l1")
    return rnn


@pytest.mark.parametrize("cls", [nn.RNN, nn.LSTM, nn.GRU], ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("how, parametrize", [("load", "spectral_norm"), ("load", "orthogonal"),
                                              ("materialize", "spectral_norm")])  # deferred_init refuses orthogonal's check
def test_an_rnn_under_a_parametrization_is_refreshed_as_eager_keeps_it(tmp_path, cls, parametrize, how):
    # The refresh once read each weight through its parametrization, in training mode: spectral_norm ran one
    # more power iteration (its _u and _v neither the file's nor eager's) and the forward differed.
    import materialize as mz

    source = _parametrized_rnn(cls, parametrize)
    torch.save(source.state_dict(), tmp_path / "rnn.pt")
    reference = _parametrized_rnn(cls, parametrize)
    reference.load_state_dict(torch.load(tmp_path / "rnn.pt"))
    if how == "load":
        with mz.meta_init():
            model = _parametrized_rnn(cls, parametrize)
        mz.load(model, tmp_path / "rnn.pt")
    else:
        reference = _parametrized_rnn(cls, parametrize)
        model = mz.materialize(mz.deferred_init(_parametrized_rnn, cls, parametrize))

    expected = reference.state_dict()
    assert list(model.state_dict()) == list(expected)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    for name in ("weight_hh_l0", "weight_ih_l1"):
        index = model._flat_weights_names.index(name)
        assert model._flat_weights[index] is model.parametrizations[name].original
    x = torch.randn(3, 1, 4)
    assert torch.equal(model(x)[0], reference(x)[0])
    for name, value in model.state_dict().items():  # the forward moved both alike
        assert torch.equal(value, reference.state_dict()[name]), name


def test_a_block_registered_twice_loads_once_under_either_name(tmp_path):
    source = SharedBlock()
    for kept in ("encoder.0", "decoder"):
        state = {k: v.clone() for k, v in source.state_dict().items() if not k.startswith(
            ({"encoder.0", "decoder"} - {kept}).pop() + ".")}
        path = write_safetensors(state, tmp_path / f"{kept}.safetensors")
        model = _meta(SharedBlock)

        report = mz.load(model, path)

        assert model.decoder is model.encoder[0]
        assert model.decoder.weight.device.type == "cpu"
        assert torch.equal(model.decoder.weight, source.decoder.weight)
        assert torch.equal(model.head.weight, source.head.weight)
        assert sorted(map(sorted, report.tied)) == [["decoder.bias", "encoder.0.bias"], ["decoder.weight", "encoder.0.weight"]]
        assert report.missing == [] and report.unexpected == []


@pytest.mark.parametrize("check", [False, True])
def test_names_the_model_ties_but_the_checkpoint_holds_apart_are_loaded_apart(check, tmp_path):
    source = reference_model(tie=False)  # its own lm_head
    state = saved_state(source)
    path = write_safetensors(state, tmp_path / "untied.safetensors")
    model = tiny_skeleton(tie=True)

    report = mz.load(model, path, check=check)

    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert report.untied == [["model.embed_tokens.weight", "lm_head.weight"]] and report.tied == []
    with torch.no_grad():
        assert torch.equal(model(torch.arange(5)[None]), source(torch.arange(5)[None]))


def test_names_the_model_ties_saved_apart_with_equal_values_are_tied_again(tmp_path):
    source = reference_model(tie=True)
    state = saved_state(source)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # a copy, as conversions write one
    path = write_safetensors(state, tmp_path / "copies.safetensors")
    model = tiny_skeleton(tie=True)

    report = mz.load(model, path)

    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    assert report.tied == [["model.embed_tokens.weight", "lm_head.weight"]] and report.untied == []
    assert len({id(p) for p in model.parameters()}) == len(list(model.parameters()))


def test_a_plan_lists_the_ties_a_load_will_compare(tmp_path):
    state = saved_state(reference_model(tie=False))
    path = write_safetensors(state, tmp_path / "untied.safetensors")

    plan = mz.plan(tiny_skeleton(tie=True), path)

    assert plan.to_dict()["ties_to_compare"] == [[["model.embed_tokens.weight"], ["lm_head.weight"]]]


def _with_own_rows(state: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    """The state with an lm_head equal to the embedding but in ``rows``."""
    head = state["model.embed_tokens.weight"].clone()
    head[rows] = torch.randn_like(head[rows])
    return {**state, "lm_head.weight": head}


@pytest.mark.parametrize("check", [False, True])
def test_a_tie_that_differs_only_in_its_last_rows_is_loaded_apart_reading_each_byte_once(check, tmp_path, monkeypatch):
    monkeypatch.setattr("materialize.planning.ties.COMPARE_BLOCK_BYTES", 10 * TINY["hidden_size"] * 4)  # 10 rows a block
    state = _with_own_rows(saved_state(reference_model(tie=True)), slice(-3, None))
    path = write_safetensors(state, tmp_path / "late.safetensors")
    model = tiny_skeleton(tie=True)

    report = mz.load(model, path, check=check)

    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert report.untied == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert report.bytes_read == sum(t.nbytes for t in state.values())


@pytest.mark.parametrize("rows", [slice(0, 0), slice(40, 41)])
def test_a_tie_is_compared_as_the_cast_makes_it(rows, tmp_path, monkeypatch):
    monkeypatch.setattr("materialize.planning.ties.COMPARE_BLOCK_BYTES", 16 * TINY["hidden_size"] * 2)
    state = _with_own_rows(saved_state(reference_model(tie=True, dtype=torch.bfloat16)), rows)
    path = write_safetensors(state, tmp_path / "bf16.safetensors")
    model = tiny_skeleton(tie=True)

    report = mz.load(model, path, dtype=torch.float32)

    apart = rows.stop > rows.start
    assert (model.lm_head.weight is not model.model.embed_tokens.weight) == apart
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"].float())
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"].float())
    assert (report.untied if apart else report.tied) == [["model.embed_tokens.weight", "lm_head.weight"]]


def test_a_differing_tie_whose_cast_overflows_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr("materialize.planning.ties.COMPARE_BLOCK_BYTES", 16 * TINY["hidden_size"] * 4)
    state = saved_state(reference_model(tie=True))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    state["lm_head.weight"][50, 3] = 1e6  # beyond fp16, in a block after equal ones
    path = write_safetensors(state, tmp_path / "wide.safetensors")
    model = tiny_skeleton(tie=True)

    with pytest.raises(mz.CastOverflowError) as raised:
        mz.load(model, path, dtype=torch.float16)

    assert "lm_head.weight" in str(raised.value) and str(path) in str(raised.value)
    assert all(p.is_meta for p in model.parameters())  # the model got back what it had


@pytest.mark.parametrize("differ", [False, True])
def test_a_tie_saved_as_a_strided_copy_in_a_torch_file_is_compared_in_blocks(differ, tmp_path, monkeypatch):
    monkeypatch.setattr("materialize.planning.ties.COMPARE_BLOCK_BYTES", 7 * TINY["hidden_size"] * 4)
    state = saved_state(reference_model(tie=True))
    embedding = state["model.embed_tokens.weight"]
    head = embedding.t().contiguous().t()  # same values, column-major: a strided view of its own storage
    if differ:
        head[-1, -1] += 1
    path = write_torch({**state, "lm_head.weight": head}, tmp_path / "strided.pt")
    model = tiny_skeleton(tie=True)

    report = mz.load(model, path, check=True)

    assert (model.lm_head.weight is model.model.embed_tokens.weight) != differ
    assert torch.equal(model.lm_head.weight, head) and torch.equal(model.model.embed_tokens.weight, embedding)
    assert (report.untied if differ else report.tied) == [["model.embed_tokens.weight", "lm_head.weight"]]


def test_a_tie_restored_after_comparing_counts_its_memory_once(tmp_path):
    state = saved_state(reference_model(tie=True))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    path = write_safetensors(state, tmp_path / "copies.safetensors")
    reference = mz.load(tiny_skeleton(tie=True), write_safetensors(
        {k: v for k, v in state.items() if k != "lm_head.weight"}, tmp_path / "once.safetensors"))

    report = mz.load(tiny_skeleton(tie=True), path)

    assert report.model_bytes == reference.model_bytes
    assert report.bytes_read == reference.bytes_read + state["lm_head.weight"].nbytes  # both copies were read


@pytest.mark.parametrize("equal", [True, False])
def test_a_tie_read_rearranged_is_loaded_whole_then_compared(tmp_path, equal):
    from materialize.checkpoint.targets import Deinterleave, Rearranged

    state = saved_state(reference_model(tie=True))
    embedding = state["model.embed_tokens.weight"]
    pairs_apart = embedding.reshape(2, -1, embedding.shape[1]).transpose(0, 1).reshape(embedding.shape)
    state["lm_head.weight"] = pairs_apart if equal else torch.randn_like(embedding)  # read back deinterleaved
    path = write_safetensors(state, tmp_path / "rearranged.safetensors")
    model = tiny_skeleton(tie=True)
    rename = {"lm_head.weight": Rearranged("lm_head.weight", Deinterleave(dim=0))}

    report = mz.load(model, path, key_map=lambda name: rename.get(name, name), check=True)

    assert (model.lm_head.weight is model.model.embed_tokens.weight) == equal
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    deinterleaved = state["lm_head.weight"].reshape(-1, 2, embedding.shape[1]).transpose(0, 1).reshape(embedding.shape)
    assert torch.equal(model.lm_head.weight, deinterleaved)
    assert (report.tied if equal else report.untied) == [["model.embed_tokens.weight", "lm_head.weight"]]


def test_a_model_built_on_meta_is_one_dtype_decision_its_real_buffers_follow_its_parameters(tmp_path):
    # A bf16 checkpoint into a conv net built under meta_init: bf16 weights beside fp32 batch-norm
    # statistics (kept real by meta_init) made the forward pass fail.
    class ConvBN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.conv(x))

    torch.manual_seed(0)
    trained = ConvBN()
    trained.bn.running_mean.uniform_()
    state = {k: v.bfloat16() if v.is_floating_point() else v for k, v in trained.state_dict().items()}
    torch.save(state, tmp_path / "bf16.pt")
    with mz.meta_init():
        model = ConvBN()

    plan = mz.plan(model, mz.open_checkpoint(tmp_path / "bf16.pt"))
    mz.load(model, tmp_path / "bf16.pt")

    assert {e.name: e.dtype for e in plan.entries}["bn.running_mean"] == torch.bfloat16
    assert {k: v.dtype for k, v in model.state_dict().items()} == {k: v.dtype for k, v in state.items()}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert model.eval()(torch.randn(1, 3, 8, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    real = ConvBN()  # a real model keeps its own dtype, as load_state_dict does
    mz.load(real, tmp_path / "bf16.pt")
    assert {v.dtype for v in real.state_dict().values()} == {torch.float32, torch.int64}


@pytest.mark.parametrize("built", ["meta_init", "real"])
def test_a_new_head_of_another_size_is_initialized_and_listed_with_ignore_mismatched_sizes(tmp_path, built):
    class Classifier(nn.Module):
        def __init__(self, classes: int) -> None:
            super().__init__()
            self.body = nn.Linear(8, 16)
            self.head = nn.Linear(16, classes)

    torch.manual_seed(0)
    pretrained = Classifier(1000)
    torch.save(pretrained.state_dict(), tmp_path / "imagenet.pt")
    if built == "meta_init":
        with mz.meta_init():
            model = Classifier(10)
    else:
        model = Classifier(10)
        own_head = model.head.weight.detach().clone()

    with pytest.raises(mz.ShapeMismatchError, match="ignore_mismatched_sizes=True"):
        mz.load(model, tmp_path / "imagenet.pt")
    report = mz.load(model, tmp_path / "imagenet.pt", ignore_mismatched_sizes=True)

    assert report.reinitialized == ["head.weight", "head.bias"] and report.missing == []
    assert torch.equal(model.body.weight, pretrained.body.weight)
    assert model.head.weight.shape == (10, 16) and not model.head.weight.is_meta
    if built == "real":  # a real model keeps its own head, as from_pretrained leaves it initialized
        assert torch.equal(model.head.weight, own_head)
    assert mz.plan(Classifier(10), tmp_path / "imagenet.pt", ignore_mismatched_sizes=True).reinitialized == [
        "head.weight", "head.bias"]
