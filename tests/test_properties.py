"""Round trips through the real writers: whatever state dict is saved loads back bit for bit.

Hypothesis draws small state dicts (every dtype the formats share, 0-d
scalars, zero-size dimensions, NaN/Inf/-0.0 bit patterns, odd names) and, for
torch files, views sharing one storage. They are written with
``safetensors.torch.save_file`` and ``torch.save`` and read back with
``materialize.load_tensors``, with reads and with mmap.

Each example uses its own ``tempfile.TemporaryDirectory``: pytest's
``tmp_path`` is function-scoped, so it would be shared by every example of a
hypothesis test.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import materialize as mz
from fuzz_targets import raw_bytes

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
]
DTYPES += [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)]
FLOAT_DTYPES = [d for d in DTYPES if d.is_floating_point]

MAX_NUMEL = 64
MAX_TENSORS = 6

# Enough examples to meet 0-d, zero-size, every dtype and NaN payloads in
# each test, few enough that the whole file runs in well under a minute.
ROUND_TRIP = settings(
    max_examples=150,
    derandomize=True,  # the same state dicts on every CI run; `make fuzz` explores
    deadline=None,
    database=None,  # failures are kept as @example, not in a .hypothesis folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Values that break equality-based comparisons or conversions.
SPECIAL_FLOATS = [
    math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -1.0,
    5e-324, 1e-45, 6e-8, 65504.0, 65520.0, 3.4e38, 1e300, 448.0, 57344.0,
]


@st.composite
def shapes(draw: st.DrawFn, max_numel: int = MAX_NUMEL) -> tuple[int, ...]:
    """0 to 4 dimensions, a product of at most ``max_numel`` (zero-size dimensions included)."""
    dims: list[int] = []
    budget = max_numel
    for _ in range(draw(st.integers(0, 4))):
        dim = draw(st.integers(0, min(6, budget)))
        dims.append(dim)
        budget = budget // dim if dim else max_numel  # after a zero any dimension still holds 0 elements
    return tuple(dims)


@st.composite
def tensors(draw: st.DrawFn, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes()) if shape is None else shape
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype is torch.bool:
        return torch.tensor(draw(st.lists(st.booleans(), min_size=numel, max_size=numel))).reshape(shape)
    if dtype in FLOAT_DTYPES and draw(st.booleans()):
        # NaN with either sign, infinities, -0.0, subnormals, the dtype's edges: rounded by torch.
        values = draw(st.lists(st.sampled_from(SPECIAL_FLOATS) | st.floats(width=32), min_size=numel, max_size=numel))
        return torch.tensor(values, dtype=torch.float64).to(dtype).reshape(shape)
    # Any bit pattern at all, NaN payloads included.
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape).clone()


# Names as JSON and pickle carry them: any text but a lone surrogate, which neither can encode as UTF-8.
names = st.text(st.characters(exclude_categories=["Cs"]), max_size=12).filter(lambda n: n != "__metadata__")
state_dicts = st.dictionaries(names, tensors(), max_size=MAX_TENSORS)


@st.composite
def shared_views(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """Views of one base tensor, all sharing its storage: what torch.save keeps shared."""
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    base = draw(tensors(shape=(rows * cols,)))
    start = draw(st.integers(0, rows * cols - 1))
    stop = draw(st.integers(start, rows * cols))
    step = draw(st.integers(1, 3))
    candidates = {
        "shared.base": base,
        "shared.slice": base[start:stop],  # contiguous, at an offset in the storage
        "shared.strided": base[start::step],
        "shared.transposed": base.view(rows, cols).t(),  # non-contiguous
        "shared.column": base.view(rows, cols)[:, cols - 1],
        "shared.scalar": base[start],  # 0-d view at an offset
        "shared.empty": base[start:start],  # zero elements at an offset
    }
    keep = draw(st.lists(st.sampled_from(sorted(candidates)), min_size=1, max_size=4, unique=True))
    return {name: candidates[name] for name in keep}


@st.composite
def torch_state_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    state = draw(st.dictionaries(names.filter(lambda n: not n.startswith("shared.")), tensors(), max_size=3))
    if draw(st.booleans()):
        state.update(draw(shared_views()))
    return state


def _bits(tensor: torch.Tensor) -> bytes:
    # Bytes, not ==: NaN payloads, -0.0 and bool bytes compare exactly.
    return raw_bytes(tensor)


def assert_loaded_exactly(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(saved)
    for name, want in saved.items():
        got = loaded[name]
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), name
        if want.numel():
            assert _bits(got) == _bits(want), name


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
@ROUND_TRIP
@given(state=state_dicts)
def test_any_state_dict_saved_as_safetensors_loads_back_bit_for_bit(mmap, state):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file(state, str(path))

        loaded, _report = mz.load_tensors(path, mmap=mmap)

        assert_loaded_exactly(state, loaded)


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
@ROUND_TRIP
@given(state=torch_state_dicts())
def test_any_state_dict_saved_with_torch_save_loads_back_bit_for_bit_shared_views_included(mmap, state):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.pt"
        torch.save(state, path)

        loaded, _report = mz.load_tensors(path, mmap=mmap)

        assert_loaded_exactly(state, loaded)
        assert_sharing_kept(state, loaded)


def assert_sharing_kept(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    """Non-empty tensors that shared a storage when saved share one after the load."""
    def storage_of(tensor: torch.Tensor) -> int:
        return tensor.untyped_storage().data_ptr()

    names = [n for n in saved if saved[n].numel()]
    for a in names:
        for b in names:
            if storage_of(saved[a]) == storage_of(saved[b]):
                assert storage_of(loaded[a]) == storage_of(loaded[b]), (a, b)


@ROUND_TRIP
@given(state=state_dicts)
def test_every_safetensors_tensor_info_lies_inside_its_file_and_matches_the_saved_tensor(state):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file(state, str(path))
        size = path.stat().st_size

        with mz.open_checkpoint(path) as ckpt:
            infos = dict(ckpt.items())

        assert set(infos) == set(state)
        for name, info in infos.items():
            assert (info.dtype, info.shape) == (state[name].dtype, tuple(state[name].shape)), name
            assert info.offset + info.nbytes <= size, name
