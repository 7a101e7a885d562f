"""A call leaves the process as it found it: no thread counts, default dtype or other global setting changed.

Each public verb runs in a fresh process that has not touched torch's settings
before the call, since torch sets some of them lazily, per thread, on first
use: a process that reads its thread count before the load would hide a load
that changed it. What the process sees after the call is compared with a
fresh process that makes none. The warning filters are compared around a
second call instead, since the first imports parts of torch that add their own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

# torch's settings that a thread takes from the process-wide ones on first use: never read before the call.
_LAZY = textwrap.dedent("""
    def lazy_settings():
        import torch
        return {"threads": torch.get_num_threads(), "interop threads": torch.get_num_interop_threads()}
""")
_PLAIN = textwrap.dedent("""
    def plain_settings():
        import gc, sys, torch
        return {
            "default dtype": str(torch.get_default_dtype()), "default device": str(torch.get_default_device()),
            "grad": torch.is_grad_enabled(), "inference mode": torch.is_inference_mode_enabled(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "matmul precision": torch.get_float32_matmul_precision(), "anomaly": torch.is_anomaly_enabled(),
            "collector": gc.isenabled(), "recursion limit": sys.getrecursionlimit(),
            "int digits": sys.get_int_max_str_digits(),
            "torch function mode": torch._C._is_torch_function_mode_enabled(),
        }
""")

# Each verb, as a user's script calls it first thing. Files are written by the test, not by the child (writing
# them would run torch kernels, and so settle the lazy settings before the call).
VERBS = {
    "load_tensors": "mz.load_tensors(FILES['safetensors'])",
    "load_tensors cast": "mz.load_tensors(FILES['safetensors'], dtype=torch.float16)",
    "load_tensors torch file": "mz.load_tensors(FILES['torch'])",
    "load_tensors mmap": "mz.load_tensors(FILES['torch'], mmap=True)",
    "load": "with mz.meta_init():\n    model = torch.nn.Linear(256, 256)\nmz.load(model, FILES['safetensors'])",
    "load cast": ("with mz.meta_init():\n    model = torch.nn.Linear(256, 256)\n"
                  "mz.load(model, FILES['safetensors'], dtype=torch.bfloat16)"),
    "materialize": "mz.materialize(mz.deferred_init(torch.nn.Linear, 256, 256))",
    "load_model hf float16": "mz.load_model(FILES['hf'])",
    "plan": "mz.plan(FILES['hf'], FILES['hf'])",
    "open_checkpoint": "[info.nbytes for info in mz.open_checkpoint(FILES['torch']).tensors.values()]",
    "convert": "mz.convert(FILES['torch'], FILES['out'], dtype=torch.float16, overwrite=True)",
}


def _child(files: dict[str, str], call: str) -> dict:
    script = "\n".join([
        "import json, sys", _LAZY, _PLAIN,
        "import torch, materialize as mz",
        f"FILES = {json.dumps(files)}",
        "import transformers",
        call,
        "lazy, after = lazy_settings(), plain_settings()",
        "import warnings; filters = repr(warnings.filters)",
        call,
        "print(json.dumps({'lazy': lazy, 'after': after, 'filters': [filters, repr(warnings.filters)]}))",
    ])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("state")
    weights = {"weight": torch.randn(256, 256), "bias": torch.randn(256)}
    save_file(weights, folder / "linear.safetensors")
    torch.save(weights, folder / "linear.pt")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=99, max_position_embeddings=64)
    transformers.BertModel(config).to(torch.float16).save_pretrained(folder / "bert")
    assert json.loads((folder / "bert" / "config.json").read_text())["dtype"] == "float16"
    return {"safetensors": str(folder / "linear.safetensors"), "torch": str(folder / "linear.pt"),
            "hf": str(folder / "bert"), "out": str(folder / "converted")}


@pytest.fixture(scope="module")
def untouched(files) -> dict:
    return _child(files, "pass")


@pytest.mark.parametrize("verb", list(VERBS))
def test_a_call_in_a_fresh_process_changes_no_process_wide_setting(files, untouched, verb):
    seen = _child(files, VERBS[verb])

    assert seen["lazy"] == untouched["lazy"]
    assert seen["after"] == untouched["after"]
    assert seen["filters"][1] == seen["filters"][0]

