"""Host memory hints for freshly allocated destinations.

Filling a new tensor costs one page fault per 4 KiB page, which dominates a
load from the page cache. Asking for transparent huge pages on the
destination (``madvise(MADV_HUGEPAGE)``, honoured where the system's THP mode
is ``madvise`` or ``always``) makes that one fault per 2 MiB. Only the
2 MiB-aligned interior of the tensor's own allocation is advised; anything
unsupported is silently skipped, since this is a hint and never a
requirement.

Not on a virtual machine that hands free memory back to its host (a virtio
balloon with free page reporting): there the large free blocks huge pages are
carved from have been given back, and each must be faulted in again from the
host. Measured on such a VM, touching 1.9 GB of fresh huge pages took 0.12 s
if the memory had been freed under 2 s before and 0.9 s otherwise (the usual
case for a one-off load), against a steady 0.52 s for 4 KiB pages; loads
followed (copy 0.92 s with the hint against 0.63 s without, casts even).

Each chunk's destination is also faulted in just before it is filled
(:func:`prefault`, ``MADV_POPULATE_WRITE``): one system call maps the whole
chunk, instead of one trap per page in the middle of ``preadv`` or a cast's
copy. In ``make bench`` (1.9 GB, two reader threads) copies went from
0.62-0.65 s to 0.53-0.55 s.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Union

import torch

from ..dtypes import dtype_name
from ..errors import AllocationError, LowMemoryWarning, first_line
from ..sizes import format_bytes

PAGE_BYTES = mmap.PAGESIZE
HUGE_PAGE_BYTES = 2 * 1024 * 1024
MIN_ADVISED_BYTES = 2 * HUGE_PAGE_BYTES
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; EINVAL before
_EINVAL = 22
_BALLOON_DEVICES = Path("/sys/bus/virtio/drivers/virtio_balloon")
_VIRTIO_BALLOON_F_REPORTING = 5


def _load_libc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        # The running process's own symbols: no library search (find_library spawns a subprocess).
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


def reports_free_memory_to_host(devices: Path = _BALLOON_DEVICES) -> bool:
    """Whether a virtio balloon here reports free pages to the host (and the host discards them)."""
    try:
        for features in devices.glob("virtio*/features"):
            bits = features.read_text().strip()  # one '0'/'1' per feature bit, bit 0 first
            if len(bits) > _VIRTIO_BALLOON_F_REPORTING and bits[_VIRTIO_BALLOON_F_REPORTING] == "1":
                return True
    except OSError:
        pass
    return False


@functools.lru_cache(maxsize=None)
def huge_pages_pay() -> bool:
    """Whether fresh memory is faster to fill as transparent huge pages here (not under a reporting balloon)."""
    return not reports_free_memory_to_host()


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Hint that a fresh CPU tensor's memory should use huge pages, where that is faster."""
    if _libc is None or tensor.device.type != "cpu" or not huge_pages_pay():
        return
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < MIN_ADVISED_BYTES:
        return
    start = (tensor.data_ptr() + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1)
    end = (tensor.data_ptr() + nbytes) & ~(HUGE_PAGE_BYTES - 1)
    if end > start:
        _libc.madvise(start, end - start, _MADV_HUGEPAGE)


class _Populate:
    supported = True  # until the kernel says otherwise, once


def prefault(address: int, nbytes: int) -> None:
    """Fault in, writable, the pages of ``[address, address + nbytes)`` of this process.

    Only for memory about to be overwritten: contents are kept, but each page
    becomes resident. A hint: failures (an old kernel, an address range that
    is not all mapped) are ignored and the writes fault the pages themselves.
    """
    if _libc is None or not _Populate.supported or nbytes <= 0:
        return
    start = address & ~(PAGE_BYTES - 1)
    if _libc.madvise(start, address + nbytes - start, _MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == _EINVAL:
        _Populate.supported = False


def meminfo_bytes(*fields: str) -> Optional[int]:
    """The sum of ``/proc/meminfo`` fields in bytes, or None off Linux."""
    try:
        with open("/proc/meminfo") as meminfo:
            values = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo if ":" in line}
    except (OSError, ValueError, IndexError):
        return None
    if not any(field in values for field in fields):
        return None
    return sum(values.get(field, 0) for field in fields)


@functools.lru_cache(maxsize=None)
def ram_and_swap_bytes() -> Optional[int]:
    """All the memory this process could ever have: RAM and swap, or its cgroup's limit if lower; read once."""
    machine = meminfo_bytes("MemTotal", "SwapTotal")
    limit = cgroup_memory_limit()
    return limit if machine is None or (limit is not None and limit < machine) else machine


_CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_memory_limit(membership: Path = Path("/proc/self/cgroup"), root: Path = _CGROUP_ROOT) -> Optional[int]:
    """The memory this process's cgroup and its parents allow it, swap included; None where unlimited.

    A container sees the host's ``/proc/meminfo``; its own limit is its
    cgroup's: ``memory.max`` and ``memory.swap.max`` (cgroup v2), or
    ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` (v1).
    """
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, relative = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one hierarchy under the root
            limits.append(_lowest_limit(root, root / relative.strip().lstrip("/"), _v2_limit))
        elif "memory" in controllers.split(","):
            base = root / "memory"
            limits.append(_lowest_limit(base, base / relative.strip().lstrip("/"), _v1_limit))
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _lowest_limit(top: Path, folder: Path, limit_of: Callable[[Path], Optional[int]]) -> Optional[int]:
    lowest = None
    while True:
        limit = limit_of(folder)
        if limit is not None:
            lowest = limit if lowest is None else min(lowest, limit)
        if folder == top or top not in folder.parents:
            return lowest
        folder = folder.parent


def _v2_limit(folder: Path) -> Optional[int]:
    memory = _limit_in(folder / "memory.max")
    if memory is None:
        return None
    swap = _limit_in(folder / "memory.swap.max")
    return memory + (swap if swap is not None else meminfo_bytes("SwapTotal") or 0)


def _v1_limit(folder: Path) -> Optional[int]:
    with_swap = _limit_in(folder / "memory.memsw.limit_in_bytes")
    if with_swap is not None:
        return with_swap
    memory = _limit_in(folder / "memory.limit_in_bytes")
    return None if memory is None else memory + (meminfo_bytes("SwapTotal") or 0)


_UNLIMITED = 2**62  # v1 writes "no limit" as a page-rounded 2**63 - 1


def _limit_in(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < _UNLIMITED else None  # "max": no limit here


def admit_host_copies(needed: int, path: Optional[object], *, placeable: bool = False) -> None:
    """Before a load allocates: refuse copies that can never fit, warn about copies beyond what is free now.
    ``placeable``: the load has a model, which a device map can spread (see :func:`ways_out_of_host_memory`)."""
    refuse_beyond_host_memory(needed, path, placeable=placeable)
    warn_beyond_available_memory(needed, path)


def beyond_available_memory(needed: int, path: Optional[object]) -> Optional[LowMemoryWarning]:
    """The warning of a load that copies ``needed`` bytes into host memory, more than is available right now;
    None where they fit what is available, or where that is unknown.

    Only a warning: other processes may give memory back, and some caches
    that give it back (ZFS's ARC) are not counted as available.
    """
    available = meminfo_bytes("MemAvailable")
    if available is None or needed <= available:
        return None
    return LowMemoryWarning(
        f"{os.fspath(path) if path is not None else 'the load'}: the load copies {format_bytes(needed)} into host "
        f"memory and {format_bytes(available)} is available now: it may swap, or be killed, unless other processes "
        "give memory back; mmap=True (CLI: --mmap) leaves the tensors mapped from the files"
    )


def warn_beyond_available_memory(needed: int, path: Optional[object]) -> None:
    """Warn where a load that fits the machine copies more than the memory available right now (see
    :func:`beyond_available_memory`)."""
    warning = beyond_available_memory(needed, path)
    if warning is not None:
        warnings.warn(warning, stacklevel=3)


def beyond_host_memory(needed: int, path: Optional[object], *, placeable: bool = False) -> Optional[AllocationError]:
    """The refusal of a load whose copies into host memory, ``needed`` bytes, can never fit; None where they can.

    Where the kernel overcommits, such a load would run until the machine
    kills it, with no message. Loads that fit the machine but not the memory
    free right now are let through: other processes may give memory back.
    """
    limit = ram_and_swap_bytes()
    if limit is None or needed <= limit:
        return None
    return AllocationError(
        f"the load copies {format_bytes(needed)} into host memory, more than this process can ever have "
        f"({format_bytes(limit)}: RAM and swap, or its cgroup's limit); {ways_out_of_host_memory(placeable)}",
        path=path,
    )


def refuse_beyond_host_memory(needed: int, path: Optional[object], *, placeable: bool = False) -> None:
    """Refuse, before anything is allocated, a load whose copies into host memory can never fit (see
    :func:`beyond_host_memory`)."""
    refusal = beyond_host_memory(needed, path, placeable=placeable)
    if refusal is not None:
        raise refusal


def admit_planned(memory: Mapping[str, Mapping[str, Any]], path: Optional[object], *, placeable: bool = False) -> None:
    """Act on a plan's memory verdict (:func:`~materialize.io.capacity.fit_report`) as its load acts before it
    allocates: the host's need is refused or warned about by :func:`admit_host_copies`, in the load's own words;
    a GPU whose free memory is less than the load puts there is an :class:`AllocationError` with the ways out
    the load's own error would give, since that load fails at the first tensor that finds no room.
    ``placeable``: the plan is of a model, which a device map can spread.
    """
    host = memory.get("cpu")
    if host is not None:
        admit_host_copies(host["needed"], path, placeable=placeable)
    for device, verdict in memory.items():
        if device != "cpu" and verdict["fits"] is False:
            raise AllocationError(
                f"the load puts {format_bytes(verdict['needed'])} on {device} and {format_bytes(verdict['available'])} "
                f"is free there now: {ways_out(torch.device(device), placeable)}", path=path)


# Of the host memory available now, the share a suggested device map may fill: the rest is left to the process
# itself, the page cache the load reads through, and whatever else runs beside it.
HOST_BUDGET_SHARE = 0.8
# Of a GPU's free memory, the share a suggested device map may fill: CUDA's context and the forward's activations.
GPU_BUDGET_SHARE = 0.9


def ways_out_of_host_memory(placeable: bool) -> str:
    """What lets a load that cannot fit in host memory go on, on this machine: mapping the files (always); with
    a model (``placeable``), a device map whose budgets are given in numbers, so that it places what fits and
    leaves the rest mapped from the files (``"disk"``); a GPU only where there is one."""
    ways = ["load with mmap=True (CLI: --mmap) to leave the tensors mapped from the files"]
    budget = suggested_max_memory() if placeable else None
    if budget is not None:
        library = ", ".join(f"{device!r}: '{size}'" for device, size in budget.items())
        cli = ",".join(f"{device}={size}" for device, size in budget.items())
        where = "the GPUs and host memory" if len(budget) > 1 else "host memory"
        ways.append(f"with device_map='auto', max_memory={{{library}}} (CLI: --device-map auto --max-memory {cli}) "
                    f"to put what fits in {where} and leave the rest mapped from the files")
    if torch.cuda.is_available():
        ways.append("put the tensors on a GPU: device='cuda' (CLI: --device cuda)")
    return "; or ".join(ways)


def suggested_max_memory() -> Optional[dict[Union[int, str], str]]:
    """A device map's budget per device that fits now: each GPU's free memory and the host memory available
    (``MemAvailable``, never more than RAM and swap or the cgroup's limit), less a margin (the shares above),
    rounded down in binary units as ``max_memory`` and ``--max-memory`` take them; None where host memory is
    unknown."""
    available = meminfo_bytes("MemAvailable")
    limit = ram_and_swap_bytes()
    known = [n for n in (available, limit) if n is not None]
    if not known:
        return None
    budget: dict[Union[int, str], str] = {}
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            free, _ = torch.cuda.mem_get_info(index)
            budget[index] = _in_binary_units(int(free * GPU_BUDGET_SHARE))
    budget["cpu"] = _in_binary_units(int(min(known) * HOST_BUDGET_SHARE))
    return budget


def _in_binary_units(nbytes: int) -> str:
    """``nbytes`` rounded down, in the largest of GiB (to a tenth), MiB and KiB it holds one of: a budget
    never over its bytes."""
    if nbytes >= 2**30:
        return f"{math.floor(nbytes / 2**30 * 10) / 10:.1f}GiB"
    if nbytes >= 2**20:
        return f"{nbytes // 2**20}MiB"
    return f"{max(1, nbytes // 2**10)}KiB"


def _out_of_memory(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                   name: Optional[str], path: Optional[Path], reason: str = "out of memory") -> AllocationError:
    nbytes = math.prod(shape) * dtype.itemsize
    return AllocationError(
        f"cannot allocate {format_bytes(nbytes)} on {device} for its {list(shape)} {dtype_name(dtype)} values ({reason})",
        path=path, tensor=name,
    )


def with_whole_load(error: AllocationError, device: torch.device, needed: int, *, placeable: bool = False) -> None:
    """Tell ``error`` (one tensor that did not fit) what the whole load needs on that device and the ways out
    (``placeable``: the load has a model, which a device map can spread)."""
    error.reason += f"; the load needs {format_bytes(needed)} on {device} in all: {ways_out(device, placeable)}"


def ways_out(device: torch.device, placeable: bool = False) -> str:
    """What makes a load that does not fit ``device`` need less there, in words."""
    if device.type == "cpu":
        return ways_out_of_host_memory(placeable)
    return ("device_map='auto' (CLI: --device-map auto) spreads the model over the GPUs and host memory, "
            "and a narrower dtype needs less")


class SmallTensors(Protocol):
    """Where small CPU tensors come from instead of ``torch.empty`` (:class:`materialize.io.arena.HostArena`)."""

    def carves(self, nbytes: int, dtype: torch.dtype) -> bool: ...

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, numel: int, nbytes: int) -> torch.Tensor: ...


def empty_destination(
    shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device,
    name: Optional[str] = None, path: Optional[Path] = None, stride: Optional[tuple[int, ...]] = None,
    arena: Optional["SmallTensors"] = None,
) -> torch.Tensor:
    """Allocate a tensor that is about to be filled completely; running out of memory names it.

    A small contiguous CPU tensor comes from ``arena`` where one is given (see :mod:`materialize.io.arena`).
    Where the kernel overcommits (``vm.overcommit_memory=1``) an impossible
    allocation succeeds and the process is killed while filling it, so a CPU
    destination larger than all RAM and swap together is refused up front.
    """
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    on_cpu = device.type == "cpu"
    if arena is not None and on_cpu and stride is None and arena.carves(nbytes, dtype):
        try:
            return arena.empty(shape, dtype, numel, nbytes)
        except (MemoryError, OSError) as exc:  # mapping a new chunk failed
            raise _out_of_memory(shape, dtype, device, name, path, first_line(exc)) from None
    if on_cpu:
        limit = ram_and_swap_bytes()
        if limit and nbytes > limit:
            reason = f"out of memory: more than this machine's RAM and swap together, {format_bytes(limit)}"
            raise _out_of_memory(shape, dtype, device, name, path, reason)
    try:
        tensor = (torch.empty(shape, dtype=dtype, device=device) if stride is None
                  else torch.empty_strided(shape, stride, dtype=dtype, device=device))
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if not isinstance(exc, MemoryError) and "alloc" not in str(exc).lower():
            raise
        raise _out_of_memory(shape, dtype, device, name, path) from None
    if on_cpu and nbytes >= MIN_ADVISED_BYTES:
        advise_huge_pages(tensor)
    return tensor
