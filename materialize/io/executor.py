"""The one executor: every byte that ``load``, ``load_tensors`` or ``convert`` puts into a tensor goes through
:class:`Reads`, read or mapped.

The callers decide what to allocate (a plan's entries, a dict of tensors, a
batch of an output shard) and hand over jobs: a destination and the
checkpoint tensor that fills it. How the bytes travel is the engine's
business (:func:`~materialize.io.engine.stream`). What is done here, once for
all three:

* the files are read as :class:`~materialize.options.ReadOptions` say:
  around the page cache with ``direct_io``, counted per tensor in check mode
  (the sanitizer's evidence);
* GPU copies are staged within ``staging_bytes``, and a narrowing cast that
  would overflow is refused unless ``allow_overflow``;
* with ``maps``, tensors that can stay in the file are copy-on-write views of it;
* every bool tensor, read or mapped, is checked to hold only 0 and 1 (the one
  check of values a file format cannot express);
* the bytes read are counted for the report.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch

from ..checkpoint import TensorInfo
from ..checkpoint.pieces import Job
from ..options import ProgressFn, ReadOptions
from .engine import default_cast_threads, stream
from ..sources.fileio import CountingFiles, FileSet, reading
from .transfer import Staging, staging_for
from .validate import check_bools
from .zerocopy import FileMaps


class Reads:
    """Reads jobs from one checkpoint's files as the options say; see the module docstring."""

    def __init__(self, files: FileSet, options: ReadOptions, *, maps: bool = False) -> None:
        self.files = files
        self.options = options
        self._maps = FileMaps() if maps else None
        self.bytes_read = 0  # from storage
        self.bytes_received = 0  # from the group's other ranks
        self._group = None
        if options.group is not None:
            from .groupread import GroupReads  # torch.distributed, only where a group is asked for

            self._group = GroupReads(options.group, options.staging_bytes)

    @property
    def counted(self) -> Optional[CountingFiles]:
        """The bytes read per tensor, in check mode (else None)."""
        return self.files if isinstance(self.files, CountingFiles) else None

    @property
    def maps(self) -> bool:
        """Whether tensors may be views of the files (:meth:`view` gives none otherwise)."""
        return self._maps is not None

    def view(self, info: TensorInfo) -> Optional[torch.Tensor]:
        """A copy-on-write view of the file's bytes of ``info``; None where it must be read (no maps asked,
        a strided or misaligned tensor)."""
        view = self._maps.view(info) if self._maps is not None else None
        if view is not None:
            check_bools([(info, view)])
        return view

    def read(self, jobs: list[Job], *, progress: Optional[ProgressFn] = None) -> int:
        """Fill every job's destination; the bytes read."""
        if self._group is not None:
            # The engine copies each piece into place from the chunks the group delivered: work for the cores.
            # A GPU's pinned staging is made once for the load, not once a round.
            kept: dict[torch.device, Staging] = {}

            def staging(device: torch.device) -> Staging:
                if device not in kept:
                    kept[device] = self._staging(device)
                return _KeptOpen(kept[device])  # type: ignore[return-value]

            def fill(part: list[Job], files: FileSet, told: Optional[ProgressFn]) -> int:
                return stream(part, files, staging_factory=staging, allow_overflow=self.options.allow_overflow,
                              progress=told, reader_threads=default_cast_threads())

            try:
                done = self._group.stream(jobs, self.files, fill, progress)
            finally:
                for made in kept.values():
                    made.close()
            self.bytes_received = self._group.counts.received
        else:
            done = stream(jobs, self.files, staging_factory=self._staging, allow_overflow=self.options.allow_overflow,
                          progress=progress)
        check_bools((job.info, job.dest) for job in jobs)
        self.bytes_read += done
        return done

    def _staging(self, device: torch.device) -> Staging:
        return staging_for(device, self.options.staging_bytes)


class _KeptOpen:
    """A staging the engine may close after each of a group load's rounds, left open for the next one."""

    def __init__(self, staging: Staging) -> None:
        self._staging = staging

    def __getattr__(self, name: str):
        return getattr(self._staging, name)

    def close(self) -> None:
        pass  # closed once, when the group's load ends


@contextmanager
def reads(files: FileSet, options: ReadOptions, *, maps: bool = False) -> Iterator[Reads]:
    """:class:`Reads` of ``files`` for the length of the block (direct reads' buffers are freed after it)."""
    with reading(files, options.direct_io) as read_files:
        # Counted outermost: O_DIRECT reads go through the bounce buffer, never through the files they wrap.
        yield Reads(CountingFiles(read_files) if options.check else read_files, options, maps=maps)
