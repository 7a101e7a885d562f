"""Run in a fresh interpreter by test_memory.py: load one way, print peak anonymous memory growth.

Usage: python memory_probe.py write|ours|ours-mmap|naive CHECKPOINT [DTYPE|auto] [DEVICE]
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

import materialize as mz
from materialize.memory import PeakMemory

LAYERS, WIDTH = 20, 2048  # 20 x 2048 x 2048 fp32 weights: 336 MB


def make_model() -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


def write(path: str) -> None:
    model = make_model()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, path)
    else:
        torch.save(state, path)


def measure(how: str, path: str, dtype: str | None, device: str) -> dict:
    if how.startswith("ours"):
        with mz.meta_init():
            model = make_model()
        if device.startswith("cuda"):
            torch.ones(1, device=device)  # CUDA's own context memory is not the load's
        with PeakMemory() as memory:
            mz.load(model, path, dtype=dtype, device=device, mmap=how == "ours-mmap")
            if how == "ours-mmap":
                checksum = sum(float(p.detach().sum()) for p in model.parameters())  # touch every page
                assert checksum == checksum
    else:
        with PeakMemory() as memory:
            model = make_model()
            model.load_state_dict(torch.load(path, weights_only=True))
    final = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"growth": memory.host_growth, "model_bytes": final}


if __name__ == "__main__":
    action, target = sys.argv[1], sys.argv[2]
    if action == "write":
        write(target)
    else:
        dtype = sys.argv[3] if len(sys.argv) > 3 else "auto"
        device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
        print(json.dumps(measure(action, target, dtype, device)))
