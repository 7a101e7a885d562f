"""Whether a plan fits: expected peak memory per device against what is available.

Read from the system at planning time (``/proc/meminfo``'s MemAvailable and
each GPU's free memory, and all the memory the process can ever have: RAM and
swap, or its cgroup's limit); no tensor data is involved.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..planning.plan import Plan
from .engine import CAST_CHUNK_BYTES, default_cast_threads
from . import hostmem
from .transfer import DEFAULT_SLOT_BYTES, DEFAULT_SLOTS


def available_host_bytes() -> Optional[int]:
    # Looked up on the module at each call, as the load's own checks are: one reading of the machine for both.
    return hostmem.meminfo_bytes("MemAvailable")


def available_device_bytes(device: str) -> Optional[int]:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.mem_get_info(torch.device(device))[0]
    return None


def staging_host_bytes(staging_bytes: Optional[int] = None) -> int:
    """The pinned host ring a load's copies to a GPU pass through."""
    return staging_bytes or DEFAULT_SLOT_BYTES * DEFAULT_SLOTS


def expected_peak_host_bytes(plan: Plan, *, mmap: bool = False, staging_bytes: Optional[int] = None) -> int:
    """Host memory the load will add: CPU tensors that are copied, plus staging."""
    copied, to_gpu, casts = 0, False, False
    usual, usual_kind = plan.device, plan.device.type
    for entry in plan.entries:  # one pass: a model of many small tensors has tens of thousands
        device = entry.device
        kind = usual_kind if device is usual else device.type  # most hold the plan's own device object
        if kind == "cpu":
            # stays_in_file's first test inline: a load that maps nothing asks no entry
            copied += 0 if (mmap or entry.on_disk) and entry.stays_in_file(mmap) else entry.nbytes
            if not casts:  # (once one is found, no other is asked)
                source = entry.source
                casts = source is not None and source.dtype != entry.dtype
        elif kind == "cuda":
            to_gpu = True
    staging = staging_host_bytes(staging_bytes) if to_gpu else 0
    return copied + staging + (CAST_CHUNK_BYTES * default_cast_threads() if casts else 0)


def fit_report(plan: Plan, *, mmap: bool = False, staging_bytes: Optional[int] = None) -> dict:
    """Per device: bytes the load puts there, bytes available now, and whether it fits (see :func:`verdict`)."""
    needs = {device: n for device, n in plan.bytes_by_device.items() if device not in ("cpu", "disk")}
    needs["cpu"] = expected_peak_host_bytes(plan, mmap=mmap, staging_bytes=staging_bytes)
    return verdict(needs)


def verdict(needs: dict[str, int]) -> dict:
    """For each device's need in bytes (``"cpu"``: what the load adds to host memory): ``needed``,
    ``available`` now (None: unknown) and ``fits`` (None: unknown); the host's ``limit`` too, all the memory
    the process can ever have (RAM and swap, or its cgroup's limit), beyond which the load is refused."""
    result = {}
    for device, needed in needs.items():
        available = available_host_bytes() if device == "cpu" else available_device_bytes(device)
        result[device] = {"needed": needed, "available": available, "fits": None if available is None else needed <= available}
        if device == "cpu":
            result[device]["limit"] = hostmem.ram_and_swap_bytes()
    return result
