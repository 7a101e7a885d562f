"""Shared builders: a tiny real model, and real checkpoint files in every format."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import save_file

from bench.models.transformer import DecoderLM
from tests.tiers import pytest_addoption, pytest_collection_modifyitems, pytest_configure  # noqa: F401 (the tiers' hooks)

# The stand-in servers listen on 127.0.0.1, and streaming goes through the proxy the environment names: a
# proxy of the machine running the tests (set for its package downloads) must not carry them off. The proxy
# tests set their own.
for _variable in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
    os.environ.pop(_variable, None)
    os.environ.pop(_variable.upper(), None)

import preforked  # noqa: E402 - here, so its server gets the session's environment (above), never a test's

# The demo/bench model by its file: a spec any subprocess resolves, whatever its working directory.
DECODER_SPEC = f"{Path(__file__).resolve().parent.parent / 'bench' / 'models' / 'transformer.py'}:DecoderLM"

TINY = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)


def reference_model(*, tie: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0) -> DecoderLM:
    """A real CPU model; only parameters are cast, buffers stay as built."""
    torch.manual_seed(seed)
    model = DecoderLM(**TINY, tie_embeddings=tie)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model.eval()


def saved_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What saving tools write: persistent tensors, each tie group once."""
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            state[name] = tensor.detach().clone().contiguous()
    return state


def write_safetensors(state: dict[str, torch.Tensor], path: Path) -> Path:
    save_file(state, str(path))
    return path


def write_torch(state: dict, path: Path) -> Path:
    torch.save(state, path)
    return path


def write_sharded(state: dict[str, torch.Tensor], folder: Path, *, kind: str = "safetensors", shards: int = 3) -> Path:
    """Hugging Face layout: shards plus an index whose weight_map names them."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(state)
    suffix, index_name = (
        (".safetensors", "model.safetensors.index.json") if kind == "safetensors" else (".bin", "pytorch_model.bin.index.json")
    )
    weight_map = {}
    for number in range(shards):
        part = {n: state[n] for n in names[number::shards]}
        file_name = f"model-{number + 1:05d}-of-{shards:05d}{suffix}"
        (write_safetensors if kind == "safetensors" else write_torch)(part, folder / file_name)
        weight_map.update({n: file_name for n in part})
    index = folder / index_name
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def general_way_only(entries, undo, arena, host, general, wants_grad):
    """``materialize.loading._allocated`` with its short ways switched off: every entry the general way."""
    return [job for entry in entries for job in general(entry)]


def tiny_skeleton(*, tie: bool = False) -> DecoderLM:
    from materialize import meta_init

    with meta_init():
        return DecoderLM(**TINY, tie_embeddings=tie)


def assert_state_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor], dtype: Optional[torch.dtype] = None) -> None:
    actual = model.state_dict()
    for name, value in expected.items():
        want = value.to(dtype) if dtype is not None and value.is_floating_point() else value
        got = actual[name]
        assert got.device.type != "meta", name
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        assert torch.equal(got, want), name


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))


SHARDED_WORKER = Path(__file__).with_name("sharded_worker.py")


def run_ranks(scenario: str, checkpoint: Path, workdir: Path, world: int = 2, worker: Path = SHARDED_WORKER) -> list[dict]:
    """Run a scenario of ``worker`` (``sharded_worker.py``, or another taking the same arguments) on ``world`` real
    processes (gloo over a file store); each rank's findings."""
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "store"
    outs = [workdir / f"rank{rank}.json" for rank in range(world)]
    root = str(SHARDED_WORKER.parent.parent)  # bench/ (the tiny model's module) importable, as in this process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    processes = [  # forked from the preloaded server (tests/preforked.py): no rank waits seconds for torch's import
        preforked.start([sys.executable, str(worker), scenario, str(checkpoint), str(store), str(rank), str(world),
                         str(out)], cwd=worker.parent, stderr_to_stdout=True, text=True, env=env)
        for rank, out in enumerate(outs)
    ]
    logs = [process.communicate(timeout=300)[0] for process in processes]
    results = []
    for out, log in zip(outs, logs):
        assert out.exists(), log[-3000:]
        result = json.loads(out.read_text())
        assert "crash" not in result, result.get("crash")
        results.append(result)
    return results


def hub_cache(tmp_path: Path, folder: Path, repo_id: str) -> Path:
    """A Hugging Face cache holding one repo snapshot, laid out as huggingface_hub does."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, file in enumerate(sorted(folder.iterdir())):
        blob = repo / "blobs" / f"{number:040d}"
        shutil.copy(file, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return cache


def pytest_report_header(config) -> str:
    """The zoo sample's seed (tests/test_zoo.py), so a failing sample can be drawn again with ZOO_SEED."""
    from zoo import sample

    return f"zoo sample: ZOO_SEED={sample.seed()} ZOO_SAMPLE={sample.size()}"
