"""Whether a plan fits: expected peak memory per device against what is available.

Read from the system at planning time (``/proc/meminfo``'s MemAvailable and
each GPU's free memory); no tensor data is involved.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..planning.plan import Plan
from .engine import CAST_CHUNK_BYTES, default_cast_threads
from .hostmem import meminfo_bytes
from .transfer import DEFAULT_SLOT_BYTES, DEFAULT_SLOTS


def available_host_bytes() -> Optional[int]:
    return meminfo_bytes("MemAvailable")


def available_device_bytes(device: str) -> Optional[int]:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.mem_get_info(torch.device(device))[0]
    return None


def expected_peak_host_bytes(plan: Plan, *, mmap: bool = False, staging_bytes: Optional[int] = None) -> int:
    """Host memory the load will add: CPU tensors that are copied, plus staging."""
    copied, to_gpu, casts = 0, False, False
    for entry in plan.entries:  # one pass: a model of many small tensors has tens of thousands
        kind = entry.device.type
        if kind == "cpu":
            copied += 0 if entry.stays_in_file(mmap) else entry.nbytes
            casts = casts or (entry.source is not None and entry.source.dtype != entry.dtype)
        elif kind == "cuda":
            to_gpu = True
    staging = (staging_bytes or DEFAULT_SLOT_BYTES * DEFAULT_SLOTS) if to_gpu else 0
    return copied + staging + (CAST_CHUNK_BYTES * default_cast_threads() if casts else 0)


def fit_report(plan: Plan, *, mmap: bool = False, staging_bytes: Optional[int] = None) -> dict:
    """Per device: bytes the load puts there, bytes available now, and whether it fits."""
    needs = {device: n for device, n in plan.bytes_by_device.items() if device not in ("cpu", "disk")}
    needs["cpu"] = expected_peak_host_bytes(plan, mmap=mmap, staging_bytes=staging_bytes)
    result = {}
    for device, needed in needs.items():
        available = available_host_bytes() if device == "cpu" else available_device_bytes(device)
        result[device] = {"needed": needed, "available": available, "fits": None if available is None else needed <= available}
    return result
