"""meta_init: parameters on meta, buffers real, nested and thread-local."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import materialize as mz

from conftest import DECODER_SPEC
import preforked


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("table", torch.arange(4.0), persistent=False)


def test_parameters_go_to_meta_and_buffers_stay_real():
    with mz.meta_init():
        model = WithBuffer()

    assert model.linear.weight.device.type == "meta"
    assert isinstance(model.linear.weight, nn.Parameter)
    assert torch.equal(model.table, torch.arange(4.0))


class LegacyParameters(nn.Module):
    """Parameters made by the legacy constructor and torch.normal(size=) (wav2vec2's masked_spec_embed, DiffLlama's
    lambdas), which no factory-function mode sees."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.masked_spec_embed = nn.Parameter(torch.Tensor(3).uniform_())
        self.lambda_q1 = nn.Parameter(torch.normal(0, 0.1, size=(3,)))
        self.pos_bias = nn.Parameter(torch.FloatTensor(2, 3))


def test_legacy_constructed_parameters_go_to_meta_and_load_as_torch_loads(tmp_path):
    torch.manual_seed(0)
    eager = LegacyParameters()
    save_file({k: v.detach().clone() for k, v in eager.state_dict().items()}, str(tmp_path / "m.safetensors"))
    with mz.meta_init():
        model = LegacyParameters()
    assert all(p.is_meta and type(p) is nn.Parameter for p in model.parameters())

    mz.load(model, tmp_path / "m.safetensors")

    for name, value in eager.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_include_buffers_puts_buffers_on_meta_too():
    with mz.meta_init(include_buffers=True):
        model = WithBuffer()

    assert model.table.device.type == "meta"


def test_nested_contexts_restore_the_outer_setting():
    with mz.meta_init(include_buffers=True):
        with mz.meta_init():
            inner = WithBuffer()
        outer = WithBuffer()
    after = WithBuffer()

    assert inner.table.device.type == "cpu" and inner.linear.weight.device.type == "meta"
    assert outer.table.device.type == "meta"
    assert after.linear.weight.device.type == "cpu"


def test_other_threads_are_not_affected():
    inside = threading.Event()
    release = threading.Event()
    built = {}

    def build_under_meta() -> None:
        with mz.meta_init():
            inside.set()
            release.wait(5)
            built["meta"] = nn.Linear(2, 2)

    worker = threading.Thread(target=build_under_meta)
    worker.start()
    inside.wait(5)
    built["plain"] = nn.Linear(2, 2)
    release.set()
    worker.join()

    assert built["plain"].weight.device.type == "cpu"
    assert built["meta"].weight.device.type == "meta"


def test_context_is_left_even_when_the_body_raises():
    try:
        with mz.meta_init():
            raise RuntimeError("boom")
    except RuntimeError:
        pass

    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_the_collector_is_paused_while_building_and_left_as_found():
    with mz.meta_init():
        with mz.meta_init():
            pass
        paused_after_inner = not gc.isenabled()  # the outermost block holds the pause
        nn.Linear(2, 2)
    assert paused_after_inner and gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        with mz.meta_init():
            paused_before_raising = not gc.isenabled()
            raise RuntimeError("boom")
    assert paused_before_raising and gc.isenabled()
    gc.disable()
    try:
        with mz.meta_init():
            pass
        assert not gc.isenabled()  # the caller's choice stands
    finally:
        gc.enable()


def test_the_hooks_go_and_the_collector_is_on_again_even_where_leaving_the_block_fails(monkeypatch):
    from materialize.skeleton import meta

    def fails() -> None:
        raise RuntimeError("putting buffers on meta failed")

    hooks = _registration_hooks()
    monkeypatch.setattr(meta, "_put_unfilled_buffers_on_meta", fails)
    with pytest.raises(RuntimeError, match="putting buffers on meta failed"):
        with mz.meta_init():
            nn.Linear(2, 2)
    assert gc.isenabled() and _registration_hooks() == hooks
    assert nn.Linear(2, 2).weight.device.type == "cpu"


class _BuffersThatFailToBeRead(dict):
    def get(self, *args):
        raise RuntimeError("a buffer that cannot be read")


def test_a_failure_putting_buffers_on_meta_leaves_nothing_of_the_block_to_the_next():
    from materialize.skeleton import meta

    with pytest.raises(RuntimeError, match="a buffer that cannot be read"):
        with mz.meta_init():
            model = nn.BatchNorm1d(3)  # its buffers kept real (include_buffers=False), noted for the exit
            model._buffers = _BuffersThatFailToBeRead(model._buffers)
    assert meta._built_buffers() == [] and meta._unfilled() == {}  # no reference to the failed block's model
    with mz.meta_init():
        again = nn.BatchNorm1d(3)
    assert again.weight.is_meta and again.running_mean.device.type == "cpu"


class _PlainParameters(nn.Module):
    """Plain parameters set up by a constructor in the ways a load must keep: frozen, tagged, strided."""

    def __init__(self) -> None:
        super().__init__()
        frozen = nn.Parameter(torch.empty(4, 3), requires_grad=False)
        frozen.no_decay = True
        self.frozen = frozen
        self.channels_last = nn.Parameter(torch.empty(2, 3, 1, 5).to(memory_format=torch.channels_last))
        self.register_parameter("absent", None)
        self.in_half = nn.Parameter(torch.empty(3, dtype=torch.float16))


def test_plain_parameters_go_to_meta_as_eager_construction_makes_them():
    eager = _PlainParameters()
    with mz.meta_init():
        model = _PlainParameters()

    assert model.absent is None
    for name, param in eager.named_parameters():
        made = getattr(model, name)
        assert made.is_meta and type(made) is type(param) is nn.Parameter, name
        assert (made.shape, made.dtype, made.stride(), made.requires_grad, made.__dict__) == \
            (param.shape, param.dtype, param.stride(), param.requires_grad, param.__dict__), name


def _registration_hooks() -> int:
    from torch.nn.modules import module as module_hooks

    return len(module_hooks._global_parameter_registration_hooks) + len(module_hooks._global_buffer_registration_hooks)


def test_no_hook_is_left_installed_once_every_context_is_left():
    before = _registration_hooks()
    inside = threading.Event()
    release = threading.Event()

    def hold_a_context() -> None:
        with mz.meta_init():
            inside.set()
            release.wait(5)

    worker = threading.Thread(target=hold_a_context)
    worker.start()
    inside.wait(5)
    with mz.meta_init():
        pass
    still_held = _registration_hooks()  # the worker's context is still open: its hooks must stay
    with mz.meta_init():
        held_model = nn.Linear(2, 2)
    release.set()
    worker.join()

    assert still_held == before + 2
    assert held_model.weight.device.type == "meta"
    assert _registration_hooks() == before


class FilledBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.zeros(3).fill_(2.0))
        self.weight = nn.Parameter(torch.empty(3))
        nn.init.normal_(self.weight)


def test_in_place_ops_still_run_on_real_tensors():
    with mz.meta_init():
        model = FilledBuffer()

    assert torch.equal(model.scale, torch.full((3,), 2.0))
    assert model.weight.is_meta


def test_building_on_meta_skips_init_kernels_entirely():
    # In-place init on meta would import torch's reference kernels and dynamo: seconds per process.
    script = (
        "import sys, materialize as mz\n"
        f"model = mz.build({DECODER_SPEC!r}, vocab_size=64, hidden_size=32,"
        " num_layers=2, num_heads=4, intermediate_size=64)\n"
        "assert all(p.is_meta for p in model.parameters())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)

    assert done.stdout.strip() == "False"


class TableOnTheWeightsDevice(nn.Module):
    """Fills a real buffer from values computed where its weight is (timm's Swin V2 relative position tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("table", torch.empty(3, 4), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.proj.reset_parameters()
        self.table.copy_(torch.linspace(-1, 1, 12, device=self.proj.weight.device).reshape(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.table.sum()


class MaskOnTheNormsDevice(nn.Module):
    """Registers a buffer computed where its norm is, recomputed by timm's init_non_persistent_buffers()."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.init_non_persistent_buffers()

    def init_non_persistent_buffers(self) -> None:
        self.register_buffer("mask", torch.triu(torch.ones(4, 4, device=self.norm.weight.device)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) @ self.mask


@pytest.mark.parametrize("kind", [TableOnTheWeightsDevice, MaskOnTheNormsDevice])
def test_buffers_computed_from_meta_values_are_recomputed_by_the_load(kind, tmp_path):
    torch.manual_seed(0)
    source = kind()
    path = tmp_path / "m.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in source.state_dict().items()}, str(path))
    with mz.meta_init():
        model = kind()

    report = mz.load(model, path, check=True)

    assert report.missing == [] and set(report.initialized) == {n for n, _ in source.named_buffers()}
    ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, value in [*source.named_parameters(), *source.named_buffers()]:
        assert torch.equal(ours[name], value), name
    inputs = torch.randn(2, 4)
    assert torch.equal(model(inputs), source(inputs))


class ScaleWithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.init_non_persistent_buffers()

    def init_non_persistent_buffers(self) -> None:
        self.register_buffer("mask", torch.ones(4, device=self.scale.device), persistent=False)


def test_a_parameter_missing_from_a_module_that_only_recomputes_buffers_cannot_be_initialized(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"known.weight": torch.ones(2, 2), "known.bias": torch.ones(2)}, str(path))
    with mz.meta_init():
        model = nn.ModuleDict({"known": nn.Linear(2, 2), "masked": ScaleWithMask()})

    def init(module: nn.Module) -> None:
        module.scale.fill_(2.0)
        module.init_non_persistent_buffers()

    with pytest.raises(mz.InitError, match="no initializer for masked.scale, masked.mask: "):  # the mask: on meta too
        mz.load(model, path, strict=False)
    mz.load(model, path, strict=False, init=init)

    assert torch.equal(model.masked.scale, torch.full((4,), 2.0)) and torch.equal(model.masked.mask, torch.ones(4))


class SizedByAForward(nn.Module):
    """Runs its backbone on zeros to size its head, as hybrid vision transformers do; GroupNorm refuses mixed devices."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.GroupNorm(2, 8), nn.ReLU())
        with torch.no_grad():
            features = self.backbone(torch.zeros(1, 3, 16, 16))
        self.head = nn.Linear(features.shape[1] * features.shape[2] * features.shape[3], 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x).flatten(1))


def test_a_constructor_that_runs_a_forward_on_real_zeros_builds_and_loads(tmp_path):
    torch.manual_seed(0)
    source = SizedByAForward()
    path = tmp_path / "m.safetensors"
    save_file(dict(source.state_dict()), str(path))
    with mz.meta_init():
        model = SizedByAForward()

    mz.load(model, path)

    assert model.head.in_features == 8 * 7 * 7
    inputs = torch.randn(2, 3, 16, 16)
    assert torch.equal(model(inputs), source(inputs))


class _ChecksItsWeight(nn.Linear):
    """A constructor that asks its weight's values (torch's orthogonal parametrization once did, see below)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.symmetric = torch.allclose(self.weight, self.weight.T)


def test_a_constructor_asking_a_meta_tensors_value_is_one_clear_error(tmp_path):
    with pytest.raises(mz.MetaInitError) as caught, mz.meta_init():
        _ChecksItsWeight()

    assert isinstance(caught.value, RuntimeError)  # what code catching torch's own error expects
    assert "allclose() asks for the value of a tensor on meta" in str(caught.value)
    with mz.meta_init():
        weight = nn.Linear(2, 2).weight
        with pytest.raises(mz.MetaInitError, match="__bool__"):
            bool(weight.sum() > 0)


def test_the_cli_says_which_op_of_a_model_asked_a_meta_tensors_value(tmp_path):
    import os

    from test_cli import materialize_command

    (tmp_path / "orthogonal_model.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def build():\n    layer = nn.Linear(4, 4)\n    layer.symmetric = torch.allclose(layer.weight, layer.weight.T)\n"
        "    return layer\n", encoding="utf-8")
    path = tmp_path / "m.safetensors"
    save_file({"bias": torch.zeros(4), "weight": torch.eye(4)}, str(path))
    environment = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

    result = preforked.run([materialize_command(), str(path), "--model", "orthogonal_model:build"],
                            capture_output=True, text=True, env=environment, timeout=300)

    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "meta_init" in lines[0] and "allclose()" in lines[0]


def _orthogonal_linear(shape: tuple[int, int], **options) -> nn.Module:
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    return parametrizations.orthogonal(nn.Linear(*shape), **options)


@pytest.mark.parametrize("options", [{}, {"orthogonal_map": "cayley"}, {"orthogonal_map": "householder"},
                                     {"use_trivialization": False, "orthogonal_map": "householder"}],
                         ids=["default", "cayley", "householder", "householder-untrivialized"])
@pytest.mark.parametrize("shape", [(5, 5), (4, 6), (6, 4)], ids=lambda shape: "x".join(map(str, shape)))
def test_an_orthogonal_parametrization_builds_on_meta_and_loads_as_torch_loads_it(tmp_path, shape, options):
    # Its registration computes a `base` from the weight's values: a square weight's check asked a value (an
    # error), a non-square weight's completion had no meta kernel, whose NotImplementedError torch takes for
    # "no inverse", leaving `base` None and the checkpoint's `base` called unexpected.
    source = _orthogonal_linear(shape, **options)
    torch.save(source.state_dict(), tmp_path / "orthogonal.pt")
    reference = _orthogonal_linear(shape, **options)
    reference.load_state_dict(torch.load(tmp_path / "orthogonal.pt"))
    with mz.meta_init():
        model = _orthogonal_linear(shape, **options)

    report = mz.load(model, tmp_path / "orthogonal.pt")

    assert report.missing == [] and report.unexpected == []
    expected = reference.state_dict()
    assert list(model.state_dict()) == list(expected)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]) and value.dtype == expected[name].dtype, name
        assert value.stride() == expected[name].stride(), name  # base: column-major, as the QR lays it out
    assert torch.equal(model.weight, reference.weight)
    x = torch.randn(3, shape[0])  # in_features
    assert torch.equal(model(x), reference(x))
    from torch.nn.utils import parametrizations

    assert parametrizations._Orthogonal.right_inverse.__qualname__ == "_Orthogonal.right_inverse"  # torch's again


class _AttributesInConstructor(nn.Module):
    """A constructor that changes what its tensors are, not what they hold, then moves itself."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.backbone.requires_grad_(False)
        self.head.weight.share_memory_()  # for workers that read it (Hogwild-style training)
        self.to("cpu")


def test_metadata_ops_of_a_constructor_take_effect_and_value_ops_are_skipped(tmp_path):
    torch.manual_seed(0)
    reference = _AttributesInConstructor()
    save_file(reference.state_dict(), str(tmp_path / "m.safetensors"))
    with mz.meta_init():
        model = _AttributesInConstructor()  # self.to("cpu") keeps meta tensors on meta
    assert model.head.weight.is_meta and not model.backbone.weight.requires_grad

    mz.load(model, tmp_path / "m.safetensors")

    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in reference.parameters()]
    assert model.head.weight.is_shared() and not model.head.bias.is_shared()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


class _TaggedParameter(nn.Parameter):
    def __new__(cls, data: torch.Tensor, tag: str = "default") -> "_TaggedParameter":
        made = super().__new__(cls, data)
        made.tag = tag
        return made


def test_a_parameter_subclass_keeps_what_its_constructor_was_given_through_meta_init_and_the_load(tmp_path):
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = _TaggedParameter(torch.ones(3), tag="gate")

    save_file({"gate": torch.arange(3.0)}, str(tmp_path / "m.safetensors"))
    with mz.meta_init():
        model = Gated()
    assert type(model.gate) is _TaggedParameter and model.gate.tag == "gate"

    mz.load(model, tmp_path / "m.safetensors")

    assert type(model.gate) is _TaggedParameter and model.gate.tag == "gate"
    assert torch.equal(model.gate, torch.arange(3.0))


class _AsksNonzero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kept = torch.nonzero(self.lin.weight > 0)  # as peft's SHiRA and FRoD pick their entries


def test_an_op_with_no_meta_kernel_is_one_clear_error_naming_it():
    # It escaped as torch's raw NotImplementedError.
    with pytest.raises(mz.MetaInitError, match=r"^building a model under meta_init: nonzero\(\) has no kernel for "
                                               r"tensors on meta .*build that module outside meta_init") as caught:
        with mz.meta_init():
            _AsksNonzero()

    assert isinstance(caught.value, NotImplementedError)  # what torch's own fallbacks catch, still


def test_torch_code_that_takes_no_meta_kernel_for_no_inverse_still_does():
    # A parametrization whose right_inverse has no meta kernel is registered as torch registers one without an
    # inverse (the load then fills `original` from the checkpoint).
    from torch.nn.utils import parametrize

    class _Inverse(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
            return x[torch.nonzero(x > 0)[:, 0]].new_empty(x.shape).copy_(x / 2)

    with mz.meta_init():
        layer = nn.Linear(3, 3)
        parametrize.register_parametrization(layer, "weight", _Inverse())

    assert layer.parametrizations.weight.original.is_meta
    assert tuple(layer.parametrizations.weight.original.shape) == (3, 3)
