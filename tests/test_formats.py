"""Every supported format loads values equal to the source, with and without a cast."""

from __future__ import annotations

import json
import math
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

import materialize as mz
from materialize.io import hostmem

from conftest import (
    assert_state_equal,
    reference_model,
    saved_state,
    tiny_skeleton,
    write_safetensors,
    write_sharded,
    write_torch,
)
import preforked


def _write(kind: str, state: dict, tmp_path: Path) -> Path:
    if kind == "safetensors":
        return write_safetensors(state, tmp_path / "model.safetensors")
    if kind == "safetensors-sharded":
        return write_sharded(state, tmp_path / "sharded", kind="safetensors")
    if kind == "torch":
        return write_torch(state, tmp_path / "model.pt")
    if kind == "torch-sharded":
        return write_sharded(state, tmp_path / "sharded", kind="torch")
    if kind.startswith("torch-nested-"):
        key = kind.removeprefix("torch-nested-")
        return write_torch({key: state, "epoch": 3, "optimizer": {"lr": 0.1}}, tmp_path / "ckpt.pth")
    if kind == "hf-folder":
        write_sharded(state, tmp_path / "repo", kind="safetensors")
        (tmp_path / "repo" / "config.json").write_text(json.dumps({"model_type": "tiny"}))
        return tmp_path / "repo"
    if kind == "hf-folder-bin":
        folder = tmp_path / "repo"
        folder.mkdir()
        write_torch(state, folder / "pytorch_model.bin")
        return folder
    raise AssertionError(kind)


FORMATS = [
    "safetensors",
    "safetensors-sharded",
    "torch",
    "torch-sharded",
    "torch-nested-state_dict",
    "torch-nested-model",
    "torch-nested-module",
    "hf-folder",
    "hf-folder-bin",
]


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float16], ids=["keep", "fp32", "fp16"])
def test_every_format_loads_the_source_values(kind, dtype, tmp_path):
    source = reference_model(tie=True, dtype=torch.bfloat16)
    state = saved_state(source)
    path = _write(kind, state, tmp_path)
    model = tiny_skeleton(tie=True)

    report = mz.load(model, path, dtype=dtype)

    assert_state_equal(model, state, dtype)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in state.values())
    assert sorted(report.loaded) == sorted(state)


@pytest.mark.parametrize("kind", ["safetensors", "torch-sharded"])
def test_forward_after_load_matches_the_source_model(kind, tmp_path, tokens):
    source = reference_model(dtype=torch.bfloat16)
    path = _write(kind, saved_state(source), tmp_path)
    model = tiny_skeleton()

    mz.load(model, path)

    with torch.no_grad():
        assert torch.equal(model(tokens), source(tokens))


def test_bf16_checkpoint_stays_bf16_without_dtype(tmp_path):
    source = reference_model(dtype=torch.bfloat16)
    path = write_safetensors(saved_state(source), tmp_path / "m.safetensors")
    model = tiny_skeleton()  # built as fp32

    mz.load(model, path)

    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_load_tensors_materializes_a_plain_state_dict(tmp_path):
    state = saved_state(reference_model())
    path = write_torch(state, tmp_path / "m.pt")

    tensors, report = mz.load_tensors(path, dtype="bf16")

    assert set(tensors) == set(state)
    for name, value in state.items():
        assert torch.equal(tensors[name], value.to(torch.bfloat16)), name
    assert report.dtypes == {"bfloat16": len(state)}


def test_torch_file_with_shared_and_strided_views_loads_exactly(tmp_path):
    base = torch.randn(6, 5)
    state = {
        "base": base,
        "rows": base[2:],              # shares storage at an offset
        "transposed": base.t(),        # non-contiguous view
        "column": base[:, 1],          # strided
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "ints": torch.arange(7, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
    }
    path = write_torch(state, tmp_path / "views.pt")

    tensors, _ = mz.load_tensors(path)

    for name, value in state.items():
        assert tensors[name].shape == value.shape, name
        assert tensors[name].dtype == value.dtype, name
        assert torch.equal(tensors[name], value), name


@pytest.mark.parametrize("writer", [write_safetensors, write_torch], ids=["safetensors", "torch"])
def test_special_values_and_dtypes_are_bit_exact(writer, tmp_path):
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 65504.0])
    state = {
        "f32": special,
        "f16": special.half(),
        "bf16": special.bfloat16(),
        "f64": special.double(),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "i16": torch.tensor([-(2**15), 2**15 - 1], dtype=torch.int16),
        "i32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
        "i64": torch.tensor([-(2**63), 2**63 - 1], dtype=torch.int64),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(7, dtype=torch.int32),
        "zero_size": torch.empty(3, 0),
    }
    if hasattr(torch, "float8_e4m3fn"):
        state["f8"] = torch.tensor([1.0, -2.0, 448.0]).to(torch.float8_e4m3fn)
    for name in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):  # ROCm's, MX scales
        if hasattr(torch, name):
            state[name] = torch.tensor([1.0, -2.0, 0.5, 4.0]).abs().to(getattr(torch, name))
    if writer is write_safetensors:  # safetensors writes ROCm's float8s from 0.8 on; older ones refuse them
        state = {name: value for name, value in state.items() if _safetensors_writes(value.dtype)}
        assert "float8_e4m3fnuz" in state or _safetensors_version() < (0, 8), "safetensors 0.8+ writes every dtype"
    path = writer(state, tmp_path / ("m.safetensors" if writer is write_safetensors else "m.pt"))

    tensors, _ = mz.load_tensors(path)

    for name, value in state.items():
        assert tensors[name].dtype == value.dtype, name
        assert tensors[name].shape == value.shape, name
        got = tensors[name].reshape(-1).view(torch.uint8) if value.numel() else tensors[name]
        want = value.reshape(-1).view(torch.uint8) if value.numel() else value
        assert torch.equal(got, want), name


def _safetensors_version() -> tuple[int, ...]:
    import safetensors

    return tuple(int(part) for part in safetensors.__version__.split(".")[:2])


def _safetensors_writes(dtype: torch.dtype) -> bool:
    from safetensors.torch import save

    try:
        save({"probe": torch.zeros(1, dtype=dtype)})
    except (KeyError, ValueError, TypeError):
        return False
    return True


def test_open_checkpoint_reads_headers_only(tmp_path):
    big = {f"w{i}": torch.randn(1024, 1024) for i in range(16)}  # 64 MiB of data
    path = write_safetensors(big, tmp_path / "big.safetensors")
    sharded = write_sharded(big, tmp_path / "sharded", kind="torch", shards=2)

    for target in (path, sharded):
        before = _bytes_read_by_process()
        with mz.open_checkpoint(target) as ckpt:
            infos = dict(ckpt)
        read = _bytes_read_by_process() - before

        assert read < 1024 * 1024, f"{target}: opening read {read} bytes"
        assert infos["w3"].shape == (1024, 1024) and infos["w3"].dtype == torch.float32
        assert ckpt.nbytes == 16 * 1024 * 1024 * 4


def _bytes_read_by_process() -> int:
    with open("/proc/self/io") as io_stats:
        return next(int(line.split()[1]) for line in io_stats if line.startswith("rchar:"))


def test_checkpoint_is_a_lazy_mapping_with_byte_locations(tmp_path):
    state = {"a": torch.ones(2, 3, dtype=torch.float16), "b": torch.arange(4, dtype=torch.int32)}
    path = write_safetensors(state, tmp_path / "m.safetensors")

    with mz.open_checkpoint(path) as ckpt:
        info = ckpt["a"]

        assert set(ckpt) == {"a", "b"} and len(ckpt) == 2
        assert (info.dtype, info.shape, info.nbytes) == (torch.float16, (2, 3), 12)
        assert path.read_bytes()[info.offset:info.offset + info.nbytes] == state["a"].numpy().tobytes()
        assert ckpt.format == "safetensors"


def test_folder_with_both_formats_prefers_safetensors(tmp_path):
    state = {"w": torch.randn(3)}
    write_safetensors(state, tmp_path / "model.safetensors")
    write_torch({"w": torch.zeros(3)}, tmp_path / "pytorch_model.bin")

    with mz.open_checkpoint(tmp_path) as ckpt:
        assert ckpt.format == "safetensors"


@pytest.mark.parametrize("name", ["last.ckpt", "model_best.pth.tar"])
def test_a_folder_holding_one_training_checkpoint_opens_it(tmp_path, name):
    weights = {"module.weight": torch.randn(2, 3), "module.bias": torch.randn(2)}
    write_torch({"epoch": 90, "state_dict": weights, "best_acc1": torch.tensor(76.1)}, tmp_path / name)
    (tmp_path / "hparams.yaml").write_text("lr: 0.1\n")

    tensors, report = mz.load_tensors(tmp_path)

    assert report.checkpoint == str(tmp_path / name)
    assert all(torch.equal(tensors[key], value) for key, value in weights.items())


def test_a_folder_of_several_training_checkpoints_asks_for_one(tmp_path):
    for name in ("epoch=1.ckpt", "last.ckpt"):
        write_torch({"state_dict": {"w": torch.ones(1)}}, tmp_path / name)

    with pytest.raises(mz.CheckpointError, match=r"several candidate checkpoints \(epoch=1.ckpt, last.ckpt\)"):
        mz.open_checkpoint(tmp_path)


def _deepspeed_folder(folder: Path, weights: dict, shapes: dict) -> Path:
    """A DeepSpeed checkpoint step folder: the model states beside each rank's optimizer states."""
    folder.mkdir()
    write_torch({"module": weights, "buffer_names": ["norm.running_mean"], "param_shapes": [shapes],
                 "ds_version": "0.16.4", "global_steps": 100}, folder / "mp_rank_00_model_states.pt")
    for rank in range(2):
        write_torch({"optimizer_state_dict": {"fp32_flat_groups": [torch.zeros(8)]}, "ds_version": "0.16.4"},
                    folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return folder


def test_a_deepspeed_folder_opens_its_model_states(tmp_path):
    weights = {"w": torch.randn(4, 3), "norm.running_mean": torch.randn(3)}  # ZeRO-1/2: full weights
    folder = _deepspeed_folder(tmp_path / "global_step100", weights, {"w": torch.Size([4, 3])})

    tensors, report = mz.load_tensors(folder)

    assert report.checkpoint == str(folder / "mp_rank_00_model_states.pt")
    assert set(tensors) == set(weights) and all(torch.equal(tensors[k], v) for k, v in weights.items())


def test_a_deepspeed_zero3_save_says_to_gather_its_partitioned_parameters(tmp_path):
    weights = {"w": torch.empty(0), "v": torch.empty(0), "norm.running_mean": torch.randn(3)}
    folder = _deepspeed_folder(tmp_path / "global_step100", weights, {"w": torch.Size([4, 3]), "v": torch.Size([2])})

    with pytest.raises(mz.UnsupportedFormatError) as caught:
        mz.open_checkpoint(folder)

    assert str(caught.value) == (
        f"{folder / 'mp_rank_00_model_states.pt'}: is a DeepSpeed ZeRO-3 save: its parameters (w, v) are empty here, "
        "partitioned into the *_optim_states.pt files beside it; gather them with the zero_to_fp32.py script "
        "DeepSpeed writes into the checkpoint folder, and load what it writes")


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
@pytest.mark.parametrize("dtype", [None, "fp32"], ids=["same", "cast"])
def test_views_of_one_storage_in_a_torch_file_stay_one_storage(tmp_path, mmap, dtype):
    base = torch.randn(6, 4, dtype=torch.bfloat16)
    state = {
        "embed": base,
        "head": base,  # a tie saved as two names
        "rows": base[2:],
        "transposed": base.t(),
        "alone": torch.randn(3, dtype=torch.bfloat16),
    }
    path = write_torch(state, tmp_path / "tied.pt")

    tensors, report = mz.load_tensors(path, mmap=mmap, dtype=dtype)

    for name, value in state.items():
        want = value.float() if dtype and value.is_floating_point() else value
        assert torch.equal(tensors[name], want), name
    group = ["embed", "head", "rows", "transposed"]
    assert len({tensors[n].untyped_storage().data_ptr() for n in group}) == 1
    tensors["embed"][3, 1] = 42.0  # one memory: a write shows through every view of it
    assert tensors["head"][3, 1] == 42.0 and tensors["rows"][1, 1] == 42.0 and tensors["transposed"][1, 3] == 42.0
    itemsize = 4 if dtype else 2
    mapped = mmap and dtype is None
    assert report.bytes_read == (0 if mapped else (24 + 3) * 2)  # the shared storage read once, or mapped
    assert sorted(report.mapped) == (sorted(state) if mapped else [])
    assert report.model_bytes == (24 + 3) * itemsize


def test_an_expanded_tensor_stays_a_view_of_its_few_stored_values(tmp_path):
    row = torch.tensor([1.0, float("nan"), 3.0, 4.0])
    state = {"expanded": row.expand(2**31, 4), "plain": torch.ones(2)}  # 32 GiB claimed, 16 bytes stored
    path = write_torch(state, tmp_path / "expanded.pt")

    for mmap in (False, True):
        tensors, report = mz.load_tensors(path, mmap=mmap, check_finite=True)

        expanded = tensors["expanded"]
        assert expanded.shape == (2**31, 4) and expanded.stride() == (0, 1)
        assert expanded.untyped_storage().nbytes() == 16
        assert torch.allclose(expanded[123], row, equal_nan=True) and torch.allclose(expanded[-1], row, equal_nan=True)
        assert report.nonfinite == ["expanded"]
        assert report.model_bytes == 16 + 8


def test_converting_an_expansion_too_large_to_allocate_is_an_allocation_error(tmp_path):
    path = write_torch({"huge": torch.zeros(1).expand(2**40)}, tmp_path / "huge.pt")  # 4 TiB once written out

    with pytest.raises(mz.ExpansionError, match="'huge'.*allow_expansion"):  # refused by default, test_convert.py
        mz.convert(path, tmp_path / "out.safetensors")
    with pytest.raises(mz.AllocationError) as caught:  # allowed, it still cannot be allocated
        mz.convert(path, tmp_path / "out.safetensors", allow_expansion=True)

    assert "'huge'" in str(caught.value) and "out of memory" in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huge.pt"]


def test_a_load_beyond_ram_and_swap_is_refused_before_allocating_anything(tmp_path, monkeypatch):
    # Where the kernel overcommits, the allocations would succeed and the process die while filling them.
    state = {"small": torch.ones(4), "big": torch.arange(2**20, dtype=torch.float32)}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    monkeypatch.setattr(hostmem, "ram_and_swap_bytes", lambda: 2**20)
    allocated = []
    real_empty = torch.empty
    model = torch.nn.Module()
    for name, value in state.items():
        model.register_parameter(name, torch.nn.Parameter(torch.empty(value.shape, device="meta")))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))

    with pytest.raises(mz.AllocationError) as caught:
        mz.load_tensors(path)
    with pytest.raises(mz.AllocationError) as caught_in_load:
        mz.load(model, path)
    tensors, report = mz.load_tensors(path, mmap=True)  # mapped, nothing copied: fits

    for error in (caught.value, caught_in_load.value):
        assert str(error).startswith(f"{path}: the load copies 4.19 MB into host memory, more than this process can ever have (1.05 MB")
        assert "--mmap" in str(error)
    assert [shape for shape in allocated if shape and tuple(shape[0]) == (2**20,)] == []  # the mapped load made none
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(tensors["big"], state["big"]) and report.mapped


def _available_now(monkeypatch, nbytes: int) -> None:
    """This machine as if ``nbytes`` of memory were available now (MemAvailable), its RAM and swap unchanged."""
    real = hostmem.meminfo_bytes
    monkeypatch.setattr(hostmem, "meminfo_bytes", lambda *fields: nbytes if fields == ("MemAvailable",) else real(*fields))


def test_a_load_beyond_the_memory_available_now_warns_and_goes_on(tmp_path, monkeypatch):
    state = {"small": torch.ones(4), "big": torch.arange(2**20, dtype=torch.float32)}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    _available_now(monkeypatch, 2**20)
    model = torch.nn.Module()
    for name, value in state.items():
        model.register_parameter(name, torch.nn.Parameter(torch.empty(value.shape, device="meta")))

    with pytest.warns(mz.LowMemoryWarning) as warned_in_load_tensors:
        tensors, _ = mz.load_tensors(path)
    with pytest.warns(mz.LowMemoryWarning) as warned_in_load:
        mz.load(model, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # mapped, nothing copied: no warning
        mapped, _ = mz.load_tensors(path, mmap=True)

    for warned in (warned_in_load_tensors, warned_in_load):
        assert str(warned[0].message).startswith(
            f"{path}: the load copies 4.19 MB into host memory and 1.05 MB is available now")
    for name, value in state.items():
        assert torch.equal(tensors[name], value) and torch.equal(getattr(model, name), value)
        assert torch.equal(mapped[name], value)


def test_the_cli_prints_the_low_memory_warning_as_one_line_and_loads(tmp_path):
    state = {"big": torch.arange(2**20, dtype=torch.float32)}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    as_if_little_is_free = (
        "import sys, materialize.io.hostmem as h; real = h.meminfo_bytes; "
        "h.meminfo_bytes = lambda *f: 2**20 if f == ('MemAvailable',) else real(*f); "
        "from materialize_cli.main import main; sys.argv[0] = 'materialize'; main()"
    )

    done = preforked.run([sys.executable, "-c", as_if_little_is_free, str(path), "--json"],
                          capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"Warning: {path}: the load copies 4.19 MB into host memory and 1.05 MB is available now: it may swap, or be "
        "killed, unless other processes give memory back; mmap=True (CLI: --mmap) leaves the tensors mapped from the files"
    ]
    assert json.loads(done.stdout)["bytes_read"] == 2**22


def _allocator_refusing(monkeypatch, nbytes: int) -> None:
    """torch.empty failing, as torch's allocators do, for CPU tensors of at least ``nbytes``."""
    real_empty = torch.empty

    def empty(shape, *args, **kwargs):
        if math.prod(shape) * kwargs.get("dtype", torch.float32).itemsize >= nbytes:
            raise RuntimeError(f"DefaultCPUAllocator: not enough memory: you tried to allocate {nbytes} bytes.")
        return real_empty(shape, *args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)


def test_a_tensor_that_cannot_be_allocated_is_named_with_what_the_whole_load_needs(tmp_path, monkeypatch):
    state = {"small": torch.ones(4), "big": torch.arange(2**20, dtype=torch.float32)}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    model = torch.nn.Module()
    for name, value in state.items():
        model.register_parameter(name, torch.nn.Parameter(torch.empty(value.shape, device="meta")))
    _allocator_refusing(monkeypatch, 2**22)

    with pytest.raises(mz.AllocationError) as caught_in_load:
        mz.load(model, path)
    with pytest.raises(mz.AllocationError) as caught_in_load_tensors:
        mz.load_tensors(path, dtype="fp64")

    assert str(caught_in_load.value).startswith(
        f"{path}: tensor 'big': cannot allocate 4.19 MB on cpu for its [1048576] float32 values (out of memory); "
        "the load needs 4.19 MB on cpu in all: load with mmap=True (CLI: --mmap) to leave the tensors mapped from "
        "the files; or with device_map='auto', max_memory={")  # this machine's budgets: tests/test_hints.py follows it
    assert str(caught_in_load_tensors.value).startswith(
        f"{path}: tensor 'big': cannot allocate 8.39 MB on cpu for its [1048576] float64 values (out of memory); "
        "the load needs 8.39 MB on cpu in all")
    assert all(p.is_meta for p in model.parameters())  # the model is left as it was


def test_a_gpu_allocation_failure_points_to_a_device_map():
    error = mz.AllocationError("cannot allocate 2.00 GB on cuda:0 (out of memory)", path="m.safetensors", tensor="w")

    hostmem.with_whole_load(error, torch.device("cuda", 0), 30 * 10**9)

    assert str(error) == (
        "m.safetensors: tensor 'w': cannot allocate 2.00 GB on cuda:0 (out of memory); the load needs 30.00 GB on "
        "cuda:0 in all: device_map='auto' (CLI: --device-map auto) spreads the model over the GPUs and host memory, "
        "and a narrower dtype needs less")


def test_one_tensor_beyond_ram_and_swap_is_refused_naming_it(tmp_path, monkeypatch):
    path = write_safetensors({"big": torch.arange(2**20, dtype=torch.float32)}, tmp_path / "m.safetensors")
    monkeypatch.setattr(hostmem, "ram_and_swap_bytes", lambda: 2**20)

    with pytest.raises(mz.AllocationError) as caught:
        hostmem.empty_destination((2**20,), dtype=torch.float32, device=torch.device("cpu"), name="big", path=path)

    assert "'big'" in str(caught.value) and "4.19 MB" in str(caught.value) and "RAM and swap" in str(caught.value)


@pytest.mark.parametrize("version, files, expected", [
    ("v2", {"memory.max": "max"}, None),
    ("v2", {"memory.max": "1000", "memory.swap.max": "24"}, 1024),
    ("v2-parent", {"memory.max": "5000", "memory.swap.max": "0"}, 5000),  # the limit is the parent's
    ("v1", {"memory.limit_in_bytes": "9223372036854771712"}, None),
    ("v1", {"memory.limit_in_bytes": "1000", "memory.memsw.limit_in_bytes": "3000"}, 3000),
])
def test_a_containers_memory_limit_is_read_from_its_cgroup(tmp_path, version, files, expected):
    root = tmp_path / "cgroup"
    if version.startswith("v2"):
        own = root / "machine" / "job"
        membership = "0::/machine/job\n"
        limited = own.parent if version == "v2-parent" else own
    else:
        own = root / "memory" / "docker" / "abc"
        membership = "5:cpu:/docker/abc\n4:memory:/docker/abc\n0::/\n"
        limited = own
    own.mkdir(parents=True)
    for name, text in files.items():
        (limited / name).write_text(text + "\n")
    (tmp_path / "membership").write_text(membership)

    assert hostmem.cgroup_memory_limit(tmp_path / "membership", root) == expected


class EncoderDecoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(4, 3)
        self.decoder = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5))


@pytest.mark.parametrize("nested_under", [None, "model"])
def test_state_dicts_saved_per_submodule_read_as_dotted_names(nested_under, tmp_path):
    torch.manual_seed(0)
    source = EncoderDecoder()
    parts = {"encoder": source.encoder.state_dict(), "decoder": source.decoder.state_dict()}
    saved = {nested_under: parts} if nested_under else dict(parts)
    saved.update(epoch=7, optimizer={"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]})
    path = write_torch(saved, tmp_path / "parts.pt")

    tensors, _ = mz.load_tensors(path)
    with mz.meta_init():
        model = EncoderDecoder()
    report = mz.load(model, path)

    assert set(tensors) == set(source.state_dict())  # the optimizer's moments are training state, not weights
    for name, value in source.state_dict().items():
        assert torch.equal(tensors[name], value), name
        assert torch.equal(model.state_dict()[name], value), name
    assert report.missing == [] and report.unexpected == []


def _trained_a_step(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("model_key", ["model_state_dict", "model_state", None])
def test_a_general_checkpoint_as_the_pytorch_tutorial_saves_it_loads_its_weights(model_key, tmp_path):
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = _trained_a_step(source)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    saved = {"epoch": 5, "loss": 0.25, "optimizer_state_dict": optimizer.state_dict(),
             "scheduler_state_dict": scheduler.state_dict()}
    if model_key is None:  # per submodule beside the training state, no key for the model
        saved.update({"0": source[0].state_dict(), "1": source[1].state_dict()})
    else:
        saved[model_key] = source.state_dict()
    path = write_torch(saved, tmp_path / "checkpoint.pt")

    tensors, _ = mz.load_tensors(path)
    with mz.meta_init():
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    report = mz.load(model, path)

    assert set(tensors) == set(source.state_dict())  # the optimizer's moments are not weights
    for name, value in source.state_dict().items():
        assert torch.equal(tensors[name], value) and torch.equal(model.state_dict()[name], value), name
    assert report.missing == [] and report.unexpected == []


def test_a_nested_name_that_repeats_a_flat_one_is_refused_naming_it(tmp_path):
    path = write_torch({"encoder.weight": torch.ones(2), "encoder": {"weight": torch.zeros(2)}}, tmp_path / "twice.pt")

    with pytest.raises(mz.CheckpointError, match=r"twice\.pt.*encoder\.weight.*named twice"):
        mz.open_checkpoint(path)


def test_a_dict_that_holds_itself_is_read_once(tmp_path):
    looped = {"weight": torch.arange(3.0)}
    looped["again"] = looped
    path = write_torch(looped, tmp_path / "loop.pt")

    tensors, _ = mz.load_tensors(path)

    assert list(tensors) == ["weight"] and torch.equal(tensors["weight"], torch.arange(3.0))


@pytest.mark.parametrize("saved, outline", [
    ({"epoch": 3, "best_acc": 0.9, "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}}, "a dict of 3 entries (epoch, best_acc, optimizer)"),
    ([1, 2, 3], "a list"),
])
def test_a_torch_file_without_model_tensors_is_one_clear_error(saved, outline, tmp_path):
    import subprocess
    import sys

    path = write_torch(saved, tmp_path / "no_weights.pt")

    with pytest.raises(mz.UnsupportedFormatError, match="no_weights.pt.*holds no model tensors: its data.pkl is " + re.escape(outline)):
        mz.load_tensors(path)
    done = preforked.run([str(Path(sys.executable).parent / "materialize"), "inspect", str(path)], capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"Error: {path}: holds no model tensors: its data.pkl is {outline}"]


def test_an_empty_state_dict_is_an_empty_checkpoint(tmp_path):
    tensors, report = mz.load_tensors(write_torch({}, tmp_path / "empty.pt"))

    assert tensors == {} and report.loaded == []


def test_load_tensors_keeps_saved_dense_strides_as_torch_load_does_and_reads_them_straight_in(tmp_path):
    # facenet-pytorch's weights are saved column-major: torch.load gives them back so.
    torch.manual_seed(0)
    state = {"column_major": torch.randn(2048, 1024).t(), "permuted": torch.randn(3, 4, 5).permute(2, 0, 1),
             "row_major": torch.randn(5, 3)}
    path = write_torch(state, tmp_path / "m.pt")
    expected = torch.load(path, weights_only=True)

    tensors, report = mz.load_tensors(path)

    for name, value in expected.items():
        assert tensors[name].stride() == value.stride(), name
        assert torch.equal(tensors[name], value), name
    assert report.host_growth_bytes < 1.5 * sum(t.nbytes for t in expected.values())  # no second copy
    cast, _ = mz.load_tensors(path, dtype="bf16")
    assert cast["column_major"].stride() == (1, 1024) and torch.equal(cast["column_major"], expected["column_major"].bfloat16())
