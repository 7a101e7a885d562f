"""Zero-copy CPU tensors: copy-on-write views of the checkpoint files.

Each file is mapped once, privately (``MAP_PRIVATE``): reading a tensor
faults in page-cache pages, writing to it copies just the written pages into
process memory, and the file itself is never modified. Every view holds a
reference to its mapping, which lives as long as any tensor uses it.

The trade-off: the file must stay as it is while the tensors live; a file
truncated under a live mapping makes the next access fault (SIGBUS).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Optional

import torch

from .checkpoint import TensorInfo
from .fileio import open_for_reading


class FileMaps:
    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            fd = open_for_reading(path)
            try:
                self._maps[path] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
        return self._maps[path]

    def view(self, info: TensorInfo) -> Optional[torch.Tensor]:
        """A tensor viewing the file's bytes, or None where no view can be made."""
        if not info.contiguous or info.offset % info.dtype.itemsize:
            return None
        if info.numel == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        mapping = self._map(info.path)
        if info.offset + info.nbytes > len(mapping):
            return None  # the file shrank since it was opened: the copy path reports it
        flat = torch.frombuffer(mapping, dtype=info.dtype, count=info.numel, offset=info.offset)
        return flat.view(info.shape)
