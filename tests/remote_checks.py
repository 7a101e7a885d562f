"""What the object-store tests (s3://, gs://, az://) share: a small state of every kind of tensor, the byte-for-byte
comparison of a load with its local file's, and the upload of a folder under a prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def small_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Floats, a bf16 tensor, integers and an empty tensor."""
    torch.manual_seed(seed)
    return {"embed.weight": torch.randn(200, 32), "norm.weight": torch.randn(32).to(torch.bfloat16),
            "steps": torch.arange(9), "empty": torch.zeros(0)}


def same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, ordered: bool = True) -> None:
    """The same names (in the same order, where ``ordered``), dtypes, shapes and bytes."""
    assert (list(got) == list(want)) if ordered else (set(got) == set(want))
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want[name].reshape(-1).view(torch.uint8)), name


def upload(server: Any, bucket: str, folder: Path, prefix: str) -> None:
    """Every file under ``folder`` put into ``bucket`` (a container) as ``prefix`` + its relative path."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            server.put(bucket, f"{prefix}{path.relative_to(folder).as_posix()}", path)
