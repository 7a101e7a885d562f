"""Deferred init, differences that were silent (issue 63): a recorded model against eager construction.

The oracle is torch itself: ``torch.manual_seed(0); eager = build()`` against
``torch.manual_seed(0); model = mz.deferred_init(build); mz.materialize(model)``, every parameter and buffer
compared bit for bit, with its dtype and strides. What cannot come out equal is refused, loud, naming the module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import warnings
from typing import Callable

import pytest
import torch
from torch import nn

import materialize as mz
from materialize.errors import MetaInitError, ReplayError
from materialize.skeleton import deferred
from materialize.skeleton.deferred import program_of


def built_both_ways(make: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(eager, recorded then materialized), both under ``seed``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notes (nuclear_norm, quantized modules)
        torch.manual_seed(seed)
        eager = make()
        torch.manual_seed(seed)
        recorded = mz.deferred_init(make)
        mz.materialize(recorded)
    return eager, recorded


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor's values in logical order (NaN equal to itself, -0.0 not to 0.0)."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat if flat.dtype == torch.bool else flat.view(torch.uint8)


def assert_bit_for_bit(recorded: nn.Module, eager: nn.Module) -> None:
    ours, theirs = recorded.state_dict(keep_vars=True), eager.state_dict(keep_vars=True)
    assert ours.keys() == theirs.keys()
    for name, b in theirs.items():
        a = ours[name]
        assert type(a) is type(b), name
        assert (a.dtype, a.shape, a.stride(), a.requires_grad) == (b.dtype, b.shape, b.stride(), b.requires_grad), name
        assert torch.equal(bits(a), bits(b)), name


# ------------------------------------------------------------------ where a tensor is, asked while recording

# The ways a constructor asks "is this weight on meta?" (peft's DEFT and PSOFT: `if not self.weight.is_meta`).
ON_META_CHECKS: dict[str, Callable[[torch.Tensor], bool]] = {
    "is_meta": lambda w: w.is_meta,
    "not is_cpu": lambda w: not w.is_cpu,
    "device.type": lambda w: w.device.type == "meta",
    "device == torch.device('meta')": lambda w: w.device == torch.device("meta"),
    "str(device)": lambda w: str(w.device) == "meta",
    "is_cuda or get_device": lambda w: w.is_cuda or w.get_device() >= 0 or not w.is_cpu,
    "a view's is_meta": lambda w: w[0].is_meta,
    ".data.is_meta": lambda w: w.data.is_meta,
    "detach().is_meta": lambda w: w.detach().is_meta,
}


class InitsOnlyOffMeta(nn.Module):
    """Initializes its weight only where it is not on meta, then makes a second tensor from it."""

    def __init__(self, on_meta: Callable[[torch.Tensor], bool]) -> None:
        super().__init__()
        self.before = nn.Linear(4, 4)
        self.weight = nn.Parameter(torch.empty(3, 4))
        if not on_meta(self.weight):
            nn.init.normal_(self.weight)
            with torch.no_grad():
                self.weight[:, 0].mul_(3)
        self.scaled = nn.Parameter(self.weight.detach() * 2)


@pytest.mark.parametrize("check", list(ON_META_CHECKS))
def test_a_constructor_asking_whether_a_weight_is_on_meta_takes_eager_constructions_path(check):
    eager, recorded = built_both_ways(lambda: InitsOnlyOffMeta(ON_META_CHECKS[check]))

    assert_bit_for_bit(recorded, eager)


def test_outside_the_recording_a_tensor_on_meta_says_so():
    class Asks(nn.Module):
        def __init__(self, before: torch.Tensor) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(2))
            self.before_says = (before.is_meta, before.device.type, before.add(1).is_meta)  # on meta eagerly too

    before = torch.empty(2, device="meta")
    recorded = mz.deferred_init(Asks, before)
    with mz.meta_init():
        built_on_meta = nn.Linear(2, 2)

    assert recorded.before_says == (True, "meta", True)
    assert recorded.weight.is_meta and not recorded.weight.is_cpu and recorded.weight.device.type == "meta"
    assert built_on_meta.weight.is_meta and built_on_meta.weight.device == torch.device("meta")
    mz.materialize(recorded)
    assert not recorded.weight.is_meta and recorded.weight.is_cpu


def test_a_constructor_formatting_a_value_gets_eager_constructions():
    class Formats(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3))
            self.said = f"{self.weight.sum():.6f}"  # on meta, torch's own __format__ raises

    eager, recorded = built_both_ways(Formats)

    assert recorded.said == eager.said
    assert_bit_for_bit(recorded, eager)


# ------------------------------------------------------------------ torch.linalg in a constructor

def _spd(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    a = torch.randn(*shape, 4, 4, dtype=dtype)
    return a @ a.mH + 4 * torch.eye(4, dtype=dtype)


def _hermitian(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    a = torch.randn(*shape, 4, 4, dtype=dtype)
    return a + a.mH


def _square(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, 4, 4, dtype=dtype)


def _tall(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, 5, 3, dtype=dtype)


def _rhs(shape: tuple, dtype: torch.dtype, rows: int = 4) -> torch.Tensor:
    return torch.randn(*shape, rows, 2, dtype=dtype)


L = torch.linalg
# Inputs for the functions that do not take one square matrix (the general rule), by what each needs.
LINALG_INPUTS: dict[str, Callable[[tuple, torch.dtype], object]] = {
    "cholesky": lambda b, dt: L.cholesky(_spd(b, dt)),
    "cholesky_ex": lambda b, dt: L.cholesky_ex(_spd(b, dt)),
    "cross": lambda b, dt: L.cross(torch.randn(*b, 4, 3, dtype=dt), torch.randn(*b, 4, 3, dtype=dt)),
    "eigh": lambda b, dt: L.eigh(_hermitian(b, dt)),
    "eigvalsh": lambda b, dt: L.eigvalsh(_hermitian(b, dt)),
    "householder_product": lambda b, dt: L.householder_product(_tall(b, dt), torch.randn(*b, 3, dtype=dt)),
    "ldl_factor": lambda b, dt: L.ldl_factor(_hermitian(b, dt)),
    "ldl_factor_ex": lambda b, dt: L.ldl_factor_ex(_hermitian(b, dt)),
    "ldl_solve": lambda b, dt: L.ldl_solve(*L.ldl_factor(_hermitian(b, dt)), _rhs(b, dt)),
    "lstsq": lambda b, dt: L.lstsq(_tall(b, dt), _rhs(b, dt, rows=5)),
    "lu_solve": lambda b, dt: L.lu_solve(*L.lu_factor(_square(b, dt)), _rhs(b, dt)),
    "matmul": lambda b, dt: L.matmul(_tall(b, dt), torch.randn(3, 2, dtype=dt)),
    "matrix_power": lambda b, dt: L.matrix_power(_square(b, dt), 3),
    "multi_dot": lambda b, dt: L.multi_dot([torch.randn(5, 3, dtype=dt), torch.randn(3, 4, dtype=dt),
                                            torch.randn(4, 2, dtype=dt)]),
    "solve": lambda b, dt: L.solve(_square(b, dt), _rhs(b, dt)),
    "solve_ex": lambda b, dt: L.solve_ex(_square(b, dt), _rhs(b, dt)),
    "solve_triangular": lambda b, dt: L.solve_triangular(_square(b, dt).triu() + 4 * torch.eye(4, dtype=dt),
                                                         _rhs(b, dt), upper=True),
    "tensorinv": lambda b, dt: L.tensorinv(torch.randn(4, 2, 8, dtype=dt), ind=2),
    "tensorsolve": lambda b, dt: L.tensorsolve(torch.randn(2, 3, 6, dtype=dt), torch.randn(2, 3, dtype=dt)),
    "vander": lambda b, dt: L.vander(torch.randn(*b, 4, dtype=dt)),
    "vecdot": lambda b, dt: L.vecdot(torch.randn(*b, 3, 4, dtype=dt), torch.randn(*b, 3, 4, dtype=dt)),
    "vector_norm": lambda b, dt: L.vector_norm(torch.randn(*b, 3, 4, dtype=dt)),
}
# What a recording refuses, and why: none now. lstsq has no meta kernel (the shape of its residuals depends on the
# values): it is computed from eager construction's values while recording, as every such op is.
LINALG_REFUSED: dict[str, str] = {}
LINALG_FUNCTIONS = sorted(name for name, value in vars(torch.linalg).items()
                          if not name.startswith("_") and callable(value) and not inspect.isclass(value))


def _tensors(out: object) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]


class UsesLinalg(nn.Module):
    """A linalg function's results as buffers (as returned: their strides too), as parameters, and fed through a
    matmul into parameters, after a Linear whose draws come first."""

    def __init__(self, name: str, batch: tuple, dtype: torch.dtype) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        make = LINALG_INPUTS.get(name, lambda b, dt: getattr(torch.linalg, name)(_square(b, dt)))
        for i, result in enumerate(_tensors(make(batch, dtype))):
            self.register_buffer(f"result{i}", result)
            if result.is_floating_point() or result.is_complex():
                self.register_parameter(f"copy{i}", nn.Parameter(result.clone()))
                if result.dim():
                    rows = result.shape[-2] if result.dim() >= 2 else result.shape[-1]
                    fed = torch.randn(3, rows, dtype=result.dtype) @ result
                    self.register_parameter(f"fed{i}", nn.Parameter(fed))


def test_the_linalg_functions_enumerated_are_all_of_them():
    assert len(LINALG_FUNCTIONS) >= 40 and {"svd", "eig", "svdvals", "cond", "eigvalsh"} <= set(LINALG_FUNCTIONS)
    assert set(LINALG_INPUTS) <= set(LINALG_FUNCTIONS)
    assert not LINALG_REFUSED and "lstsq" in LINALG_FUNCTIONS  # the one without a meta kernel comes out too


@pytest.mark.parametrize("batch", [(), (2,)], ids=["matrix", "batched"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=["float32", "complex64"])
@pytest.mark.parametrize("name", LINALG_FUNCTIONS)
def test_every_linalg_function_in_a_constructor_comes_out_as_eagerly(name, dtype, batch):
    make = lambda: UsesLinalg(name, batch, dtype)  # noqa: E731

    if name in LINALG_REFUSED:
        refused = rf"UsesLinalg runs aten\.{LINALG_REFUSED[name]}.* on meta, which it cannot"
        with pytest.raises(MetaInitError, match=refused):
            mz.deferred_init(make)
        return
    eager, recorded = built_both_ways(make)

    assert_bit_for_bit(recorded, eager)


class SvdInit(nn.Module):
    """peft's TinyLoRA and OSF start from an SVD of a random matrix."""

    def __init__(self) -> None:
        super().__init__()
        u, s, vh = torch.linalg.svd(torch.randn(5, 4), full_matrices=False)
        self.vh = nn.Parameter(vh.clone())
        self.scaled = nn.Parameter(u[:, :2] * s[:2])
        self.eigenvectors = nn.Parameter(torch.linalg.eig(torch.randn(4, 4))[1])


def test_an_svd_in_a_constructor_comes_out_in_eager_constructions_memory_order():
    eager, recorded = built_both_ways(SvdInit)

    assert recorded.vh.stride() == eager.vh.stride() == (1, 4)  # column-major, as the CPU's kernel makes it
    assert_bit_for_bit(recorded, eager)


def test_a_replay_whose_kernel_lays_a_result_out_otherwise_reads_it_in_the_recorded_layout(monkeypatch):
    # As a replay on CUDA meets it (its svd's Vh row-major): recorded here with the meta kernels' CUDA guess.
    monkeypatch.setattr(deferred, "_meta_kernels_laid_out_as_eager", contextlib.nullcontext)

    eager, recorded = built_both_ways(SvdInit)

    assert recorded.vh.stride() == (4, 1) != eager.vh.stride()
    for name, tensor in eager.state_dict().items():
        assert torch.equal(recorded.state_dict()[name], tensor), name


def test_the_meta_kernels_are_told_the_cpu_only_in_the_recordings_thread_and_only_while_it_records():
    import torch._meta_registrations as registrations

    torch_own = registrations.device_hint
    recording, measured = threading.Event(), threading.Event()
    built = {}

    class WaitsWhileRecording(SvdInit):
        def __init__(self) -> None:
            recording.set()
            measured.wait(10)
            super().__init__()

    thread = threading.Thread(target=lambda: built.update(model=mz.deferred_init(WaitsWhileRecording)))
    thread.start()
    recording.wait(10)
    elsewhere = torch.linalg.svd(torch.empty(5, 4, device="meta"), full_matrices=False)[2]
    measured.set()
    thread.join(10)

    assert elsewhere.stride() == (4, 1)  # torch's own guess (CUDA's layout), outside the recording's thread
    assert built["model"].vh.stride() == (1, 4)
    assert registrations.device_hint is torch_own


def test_a_result_of_another_shape_in_the_replay_than_recorded_is_refused_naming_it():
    recorded = mz.deferred_init(SvdInit)
    program = program_of(recorded)
    svd = next(step for step in program.steps if step.name == "_linalg_svd.default")
    vh = dict(svd.made)[2]
    program.made_as[vh] = dataclasses.replace(program.made_as[vh], size=(5, 4))  # as if shaped by values

    with pytest.raises(ReplayError, match=r"SvdInit's _linalg_svd.default .* made a torch.float32 tensor of shape "
                                          r"\[4, 4\] where the recording had torch.float32 \[5, 4\]"):
        mz.materialize(recorded)


# Composites that pick their kernels by whether a gradient may be needed (under a recording, torch says yes).
GRAD_DECIDED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "torch.svd(compute_uv=False)": lambda a: torch.svd(a, compute_uv=False)[1],
    "Tensor.svd(compute_uv=False)": lambda a: a.svd(compute_uv=False)[1],
    "torch.norm(p='nuc')": lambda a: torch.norm(a, p="nuc", dim=(-2, -1)),
    "Tensor.norm(p='nuc')": lambda a: a.norm(p="nuc", dim=(-2, -1)),
    "torch.nuclear_norm": lambda a: torch.nuclear_norm(a),
    "linalg.matrix_norm(2)": lambda a: torch.linalg.matrix_norm(a, 2),
    "linalg.norm(2)": lambda a: torch.linalg.norm(a, 2, dim=(-2, -1)),
    "linalg.cond": lambda a: torch.linalg.cond(a),
    "linalg.svdvals of a tensor needing grad": lambda a: torch.linalg.svdvals(a.requires_grad_()).detach(),
    "linalg.eigvals, then svdvals of a weight": lambda a: torch.linalg.eigvals(a).real + torch.linalg.svdvals(
        nn.Parameter(a)).detach(),
}


@pytest.mark.parametrize("spelling", list(GRAD_DECIDED))
def test_a_composite_choosing_its_kernels_by_grad_is_replayed_as_eager_construction_ran_it(spelling):
    class Composite(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(3, 3)
            self.weight = nn.Parameter(GRAD_DECIDED[spelling](torch.randn(2, 6, 6)))

    eager, recorded = built_both_ways(Composite)

    assert_bit_for_bit(recorded, eager)


def test_conjugated_and_negated_views_are_replayed_conjugated_and_negated():
    class Views(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            a = torch.randn(3, 3, dtype=torch.complex64)
            self.gram = nn.Parameter(a @ a.mH)
            self.negated_imag = nn.Parameter(a.conj().imag * 2)

    eager, recorded = built_both_ways(Views)

    assert_bit_for_bit(recorded, eager)


# ------------------------------------------------------------------ lazy and quantized modules

def _simple_arguments(cls: type) -> list:
    """3 for each required argument (a weight or bias: a tensor of three ones); for a ``*args`` signature (an RNN's),
    none where none will do, else two."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cls()
            return []
        except TypeError:
            return [3, 3]
    return [nn.Parameter(torch.ones(3)) if p.name in ("weight", "bias") else 3 for p in parameters
            if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]


LAZY = sorted(name for name in dir(nn) if name.startswith("Lazy") and inspect.isclass(getattr(nn, name)))


def _dummy_batch(name: str) -> torch.Tensor:
    dims = next((int(c) for c in name if c.isdigit()), 0)
    return torch.randn(2, 4) if dims == 0 else torch.randn(2, 2, *([5] * dims))


@pytest.mark.parametrize("name", LAZY)
def test_a_lazy_module_is_left_uninitialized_as_eagerly_and_its_first_forward_initializes_it_as_eagerly(name):
    cls = getattr(nn, name)

    eager, recorded = built_both_ways(lambda: cls(*_simple_arguments(cls)))

    for (key, a), b in zip(recorded.state_dict(keep_vars=True).items(), eager.state_dict(keep_vars=True).values()):
        assert type(a) is type(b) and a.device == b.device and a.dtype == b.dtype, key
    for model in (eager, recorded):  # each shapes its tensors at its first forward, with the same draws
        torch.manual_seed(1)
        model(_dummy_batch(name))
    assert type(recorded) is type(eager) and not isinstance(eager, nn.modules.lazy.LazyModuleMixin)
    assert_bit_for_bit(recorded, eager)


def _quantized_classes() -> list[tuple[str, type]]:
    import torch.ao.nn.quantized as quantized
    import torch.ao.nn.quantized.dynamic as dynamic

    found = []
    for package in (quantized, dynamic):
        for name in sorted(dir(package)):
            cls = getattr(package, name)
            if inspect.isclass(cls) and issubclass(cls, nn.Module):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        cls(*_simple_arguments(cls))
                    except (TypeError, ValueError, RuntimeError, AssertionError):
                        continue  # needs more than simple arguments
                found.append((f"{package.__name__}.{name}", cls))
    return found


QUANTIZED = _quantized_classes()


def _holds_quantized(model: nn.Module) -> bool:
    """Whether eager construction gives the model quantized or packed weights (in its state or attributes)."""
    values = [*model.state_dict().values()]
    for module in model.modules():
        values += [v for v in vars(module).values() if isinstance(v, (torch.Tensor, torch.ScriptObject))]
    return any(isinstance(v, torch.ScriptObject) or (isinstance(v, torch.Tensor) and v.is_quantized) for v in values)


def test_the_quantized_modules_enumerated_include_linear_and_conv():
    names = {name for name, _ in QUANTIZED}
    assert {"torch.ao.nn.quantized.Linear", "torch.ao.nn.quantized.Conv2d", "torch.ao.nn.quantized.dynamic.Linear",
            "torch.ao.nn.quantized.dynamic.LSTM"} <= names
    assert len(names) >= 30


@pytest.mark.parametrize("name,cls", QUANTIZED, ids=[name for name, _ in QUANTIZED])
def test_a_quantized_module_is_made_as_eagerly_or_refused_naming_it(name, cls):
    make = lambda: cls(*_simple_arguments(cls))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized_eagerly = _holds_quantized(make())

    if quantized_eagerly:
        with pytest.raises(MetaInitError, match=rf"^deferred_init: {name.replace('.', '[.]')} makes quantized tensors "
                                                r".*; build it outside deferred_init, or record the float model"):
            mz.deferred_init(make)
        return
    eager, recorded = built_both_ways(make)

    assert_bit_for_bit(recorded, eager)


class _IndexedByLists(nn.Module):
    """Indexing with Python lists of ints, as peft's TrainableTokens takes its tokens' rows."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.rows = nn.Parameter(self.embedding.weight[[1, 2, 3]].clone())
        self.block = nn.Parameter(self.embedding.weight[[4, 5], 1:3].clone())
        marked = torch.zeros(5, 4)
        marked[[0, 2]] = 1.0
        self.register_buffer("marked", marked)


def test_an_index_given_as_a_list_of_ints_is_recorded_with_its_values():
    # torch makes a list's index tensor in C++ on the indexed tensor's device: on meta, its values were lost and
    # the replay refused every tensor of the model, calling the index "made before deferred_init began".
    torch.manual_seed(0)
    reference = _IndexedByLists()
    torch.manual_seed(0)
    model = mz.materialize(mz.deferred_init(_IndexedByLists))

    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_replay_refused_for_a_value_never_recorded_names_only_the_tensors_that_need_it():
    # It listed every tensor of the model.
    outside = torch.empty(3, device="meta")  # on meta before the recording: no values anywhere

    class _UsesOutside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.plain = nn.Linear(3, 3)
            self.derived = nn.Parameter(outside * 2)

    model = mz.deferred_init(_UsesOutside)
    with pytest.raises(mz.ReplayError, match=r"^derived is made from a tensor whose values were never recorded"):
        mz.materialize(model)


class _ViewsOfOneStorage(nn.Module):
    """Tensors eager construction makes as views of one storage (peft's OFT keeps triu_indices' rows and columns)."""

    def __init__(self) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(4, 4, 1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        halves = torch.randn(2, 6)
        self.first, self.second = nn.Parameter(halves[0]), nn.Parameter(halves[1])
        self.alone = nn.Linear(3, 3)


def test_tensors_made_as_views_of_one_storage_share_one_again():
    # Each was allocated alone: storage offsets 0 where eager's are 6, memory no longer shared.
    torch.manual_seed(0)
    reference = _ViewsOfOneStorage()
    torch.manual_seed(0)
    model = mz.materialize(mz.deferred_init(_ViewsOfOneStorage))

    for name in ("rows", "cols", "first", "second"):
        ours, theirs = getattr(model, name), getattr(reference, name)
        assert torch.equal(ours, theirs) and type(ours) is type(theirs), name
        assert ours.storage_offset() == theirs.storage_offset() and ours.stride() == theirs.stride(), name
    assert model.rows.untyped_storage().data_ptr() == model.cols.untyped_storage().data_ptr()
    assert model.first.untyped_storage().data_ptr() == model.second.untyped_storage().data_ptr()
    assert model.alone.weight.untyped_storage().data_ptr() != model.alone.bias.untyped_storage().data_ptr()


def _norms_with_running_statistics() -> list[type]:
    """Every torch.nn class that takes ``track_running_stats`` (and is no sync or lazy variant needing more)."""
    found = []
    for name in sorted(dir(nn)):
        cls = getattr(nn, name)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and not name.startswith(("Lazy", "Sync")):
            if "track_running_stats" in inspect.signature(cls).parameters:
                found.append(cls)
    return found


_NORM_INPUT_DIMS = {"1d": 3, "2d": 4, "3d": 5}


@pytest.mark.parametrize("cls", _norms_with_running_statistics(), ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_forward_run_while_building_updates_running_statistics_as_eagerly(cls, momentum):
    # native_batch_norm's schema does not declare its writes to the running statistics: the recording missed them
    # and materialize gave the statistics from before the forward.
    dims = _NORM_INPUT_DIMS[cls.__name__[-2:]]

    def build() -> nn.Module:
        norm = cls(3, momentum=momentum, track_running_stats=True)
        norm(torch.randn(2, 3, *([4] * (dims - 2))))
        norm(torch.randn(2, 3, *([4] * (dims - 2))))
        return norm

    torch.manual_seed(0)
    reference = build()
    torch.manual_seed(0)
    model = mz.materialize(mz.deferred_init(build))

    assert len(_norms_with_running_statistics()) >= 6  # the batch and instance norms, three sizes each
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
