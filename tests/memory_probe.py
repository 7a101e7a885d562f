"""Run in a fresh interpreter by test_memory.py: load one way, print peak anonymous memory growth.

Usage: python memory_probe.py write|ours|ours-mmap|naive CHECKPOINT [DTYPE|auto] [DEVICE]
       python memory_probe.py write-tied|ours-tied CHECKPOINT
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

import materialize as mz
from materialize.io.peak import PeakMemory

LAYERS, WIDTH = 20, 2048  # 20 x 2048 x 2048 fp32 weights: 336 MB


def make_model() -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


class TiedHead(nn.Module):
    """An embedding and an output layer sharing one weight: 256 MB fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8 * WIDTH, 2 * WIDTH)
        self.head = nn.Linear(2 * WIDTH, 8 * WIDTH, bias=False)
        self.head.weight = self.embed.weight


def write_tied(path: str) -> None:
    """Both names saved, as copies with equal values (as conversion scripts write them)."""
    from safetensors.torch import save_file

    weight = TiedHead().embed.weight.detach()
    save_file({"embed.weight": weight, "head.weight": weight.clone()}, path)


def measure_tied(path: str) -> dict:
    with mz.meta_init():
        model = TiedHead()
    with PeakMemory() as memory:
        report = mz.load(model, path)
    assert model.head.weight is model.embed.weight, report.untied
    final = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"growth": memory.host_growth, "model_bytes": final}


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
    elif action == "write-tied":
        write_tied(target)
    elif action == "ours-tied":
        print(json.dumps(measure_tied(target)))
    else:
        dtype = sys.argv[3] if len(sys.argv) > 3 else "auto"
        device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
        print(json.dumps(measure(action, target, dtype, device)))
