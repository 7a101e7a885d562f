"""Zero-copy CPU tensors: copy-on-write views of the checkpoint files.

Each file is mapped once, privately (``MAP_PRIVATE``): reading a tensor
faults in page-cache pages, writing to it copies just the written pages into
process memory, and the file itself is never modified. Every view holds a
reference to its mapping, which lives as long as any tensor uses it.

The trade-off: the file must stay as it is while the tensors live; a file
truncated under a live mapping makes the next access fault (SIGBUS).

A private writable mapping is charged against the kernel's commit limit as
if every page might be written, so a file larger than RAM and swap could
not be mapped at all; it is mapped with ``MAP_NORESERVE``, which the
default (heuristic) and the always-overcommit modes do not charge. Only
pages actually written take memory. Under strict accounting
(``vm.overcommit_memory=2``) the kernel charges it anyway; there, a file
past the commit limit is mapped read-only, with a warning: its tensors can
be read (inference), and a write to one would crash the process.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

from ..errors import CheckpointError, MaterializeWarning

from ..checkpoint import TensorInfo
from ..sources.fileio import open_for_reading


# Linux's flag (Python's mmap module names it from 3.13 on): no commit charge for the mapping.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _private_map(fd: int, path: Path) -> mmap.mmap:
    writable = mmap.PROT_READ | mmap.PROT_WRITE
    try:
        try:
            return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE, prot=writable)
        except OSError as error:
            if error.errno != errno.ENOMEM:
                raise
        warnings.warn(MaterializeWarning(
            f"{path}: mapped read-only: the kernel's strict overcommit accounting (vm.overcommit_memory=2) will "
            "not let a copy-on-write mapping of it count against its commit limit; its tensors can be read, and "
            "writing to one would crash the process"), stacklevel=4)
        return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    except OSError as error:
        raise CheckpointError(f"cannot be mapped: {error.strerror}", path=path) from None


class FileMaps:
    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            fd = open_for_reading(path)
            try:
                self._maps[path] = _private_map(fd, path)
            finally:
                os.close(fd)
        return self._maps[path]

    def view(self, info: TensorInfo) -> Optional[torch.Tensor]:
        """A tensor viewing the file's bytes, or None where no view can be made."""
        if not info.mappable:
            return None
        if info.numel == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        mapping = self._map(info.path)
        if info.offset + info.nbytes > len(mapping):
            return None  # the file shrank since it was opened: the copy path reports it
        flat = torch.frombuffer(mapping, dtype=info.dtype, count=info.numel, offset=info.offset)
        return flat.view(info.shape)
