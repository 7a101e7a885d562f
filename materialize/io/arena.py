"""Small CPU destinations of one load, carved from a few large mappings, each tensor with a storage of its own.

A checkpoint of a hundred thousand small tensors (a mixture of experts'
projections) spends more on allocating them than on reading them: each
``torch.empty`` of a few kilobytes is a trip through the dispatcher and the
heap, and glibc writes each block's header into fresh memory, a page fault
per tensor. Measured in ``make bench-many`` (24 KB tensors): about 14 us a
tensor inside a load, against 2.8 us for a tensor over a slice of a mapping
made once.

:class:`HostArena` maps anonymous, private memory in chunks of
:data:`CHUNK_BYTES` (``MAP_PRIVATE``: a forked worker sees it copy-on-write,
as heap memory) and hands out each small tensor as ``torch.frombuffer`` over
a slice of it, given its shape in place (not a view: ``_base`` is ``None``,
``storage_offset()`` 0, the storage exactly the tensor's bytes, as
``torch.empty`` makes them). No page is touched here: a reader
thread faults in the span of a run of such tensors with one system call
(they lie one after another), instead of trapping once per page; a chunk is
advised huge pages where they pay (see :mod:`materialize.io.hostmem`).

Deliberate differences from ``torch.empty`` (docs/semantics.md lists them):

- a chunk's memory goes back to the system when the last tensor carved from
  it is freed, not tensor by tensor (as the heap keeps small blocks); only
  tensors of at most :data:`MAX_TENSOR_BYTES` are carved, so a chunk holds
  at least a hundred of them and no large tensor pins anything;
- tensors whose bytes lie a small header apart in a file (a torch zip's
  records) lie as far apart here, the bytes between none of theirs, so
  that one read fills both (see :meth:`HostArena.carved`): at most
  :data:`MIRRORED_GAP_BYTES` more of a chunk a tensor;
- the storages cannot grow (``resize_`` to more bytes than the tensor holds
  raises "storage that is not resizable"); reshaping within its bytes,
  ``share_memory_()``, ``pin_memory()``, ``torch.save`` and safetensors work
  as on any tensor.
"""

from __future__ import annotations

import mmap
from typing import Optional

import torch

from . import hostmem

CHUNK_BYTES = 32 * 1024 * 1024
MAX_TENSOR_BYTES = 256 * 1024  # a chunk of 32 MiB then holds 128 or more: what one pins of the rest is bounded
ALIGNMENT = 64  # as torch's CPU allocator aligns: any dtype and vectorized kernel is at home there
# The most bytes left between two tensors to mirror the file's gap between them: a torch zip's local header
# (30 bytes, the record's name, padding to 64) is under 200
MIRRORED_GAP_BYTES = 256
# dtypes torch.frombuffer cannot describe as torch.empty would (a quantized tensor needs its quantizer)
_NOT_CARVED = frozenset(getattr(torch, name) for name in ("quint8", "qint8", "qint32", "quint4x2", "quint2x4")
                        if hasattr(torch, name))


class HostArena:
    """The small CPU tensors of one load (or of any set of tensors made together and filled at once)."""

    def __init__(self) -> None:
        self._chunk: Optional[mmap.mmap] = None
        self._size = 0
        self._used = 0
        # The last tensor :meth:`carved` placed after a file's bytes: its file, where its bytes end there and
        # where it ends here (None once anything else is placed: a gap past it may then be another's)
        self._follows: Optional[tuple[object, int, int]] = None

    @staticmethod
    def carves(nbytes: int, dtype: torch.dtype) -> bool:
        """Whether a contiguous CPU tensor of ``nbytes`` bytes and ``dtype`` comes from an arena."""
        return 0 < nbytes <= MAX_TENSOR_BYTES and dtype not in _NOT_CARVED

    def carved(self, shape: tuple[int, ...], dtype: torch.dtype, numel: int, nbytes: int,
               path: object = None, offset: int = 0) -> tuple[Optional[torch.Tensor], int]:
        """:meth:`empty` where :meth:`carves` admits the tensor (else ``None``), both in one call for a load's
        loop over a hundred thousand tensors; and its slack, the bytes before it that are no tensor's.

        ``path`` and ``offset``: where the tensor's bytes lie in a file (None: nowhere said). A tensor whose
        bytes follow the last carved one's in the same file, at most :data:`MIRRORED_GAP_BYTES` after them
        (a torch zip's local header), is placed as far after it as the file places it, where that keeps it
        aligned: the bytes between are its slack, and one read fills both and the header between
        (``materialize.io.engine._direct_parts``, told by the read job's ``slack``)."""
        if not 0 < nbytes <= MAX_TENSOR_BYTES or dtype in _NOT_CARVED:
            return None, 0
        follows, at, gap = self._follows, -1, 0
        if follows is not None and path is follows[0]:
            gap = offset - follows[1]
            at = follows[2] + gap  # at or past where empty() would place it: nothing was placed since
            if not (0 < gap <= MIRRORED_GAP_BYTES and at % ALIGNMENT == 0 and at + nbytes <= self._size):
                at, gap = -1, 0
        if at < 0:
            at = self._next_at(nbytes)
        tensor = self._place(at, shape, dtype, numel, nbytes)
        if path is not None:
            self._follows = (path, offset + nbytes, at + nbytes)
        return tensor, gap

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, numel: int, nbytes: int) -> torch.Tensor:
        """An uninitialized contiguous tensor of ``shape`` (``numel`` elements, ``nbytes`` bytes, as
        :meth:`carves` admits), over memory of its own within a chunk."""
        return self._place(self._next_at(nbytes), shape, dtype, numel, nbytes)

    def _next_at(self, nbytes: int) -> int:
        """Where the next ``nbytes`` go, packed after the last: in a new chunk where this one has no room."""
        if self._used + nbytes > self._size:
            self._new_chunk()
        return self._used

    def _place(self, at: int, shape: tuple[int, ...], dtype: torch.dtype, numel: int, nbytes: int) -> torch.Tensor:
        end = at + nbytes
        self._used = end + (-end % ALIGNMENT)
        self._follows = None
        tensor = torch.frombuffer(self._chunk, dtype=dtype, count=numel, offset=at)
        # Its own sizes, in place: not a view of a flat tensor. Given one by one, not as a tuple: torch parses
        # a tuple argument in twice the time (1.7 against 3.0 us, a load of 100,000 tensors 0.13 s).
        return tensor.resize_(*shape) if shape else tensor.resize_(shape)

    def _new_chunk(self) -> None:
        # The mapping stays alive while any tensor carved from it does: torch.frombuffer holds a reference.
        self._chunk = mmap.mmap(-1, CHUNK_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if hostmem.huge_pages_pay():  # one fault per 2 MiB as the readers fill it, as large tensors are advised
            self._chunk.madvise(mmap.MADV_HUGEPAGE)
        self._size, self._used = CHUNK_BYTES, 0
