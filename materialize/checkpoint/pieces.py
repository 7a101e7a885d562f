"""A model tensor assembled from several checkpoint tensors (stacked experts, fused projections), described as
one: its pieces, where each lies in it, and the part of the destination each fills."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional

from .base import TensorInfo, contiguous_strides

if TYPE_CHECKING:
    import torch


Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets and sizes of a block of a tensor


class Job(NamedTuple):
    """A read: fill ``dest`` (allocated; a box of a larger tensor may be strided) with the tensor ``info`` describes.

    A tuple, not a dataclass: a load of a hundred thousand small tensors makes one each, and a frozen
    dataclass's ``__init__`` costs about twice a tuple's."""

    dest: torch.Tensor
    info: TensorInfo
    # Bytes just before ``dest`` that are no tensor's (a load's arena left them, mirroring the file's gap
    # before ``info``'s bytes: see materialize.io.arena.HostArena.carved): a read may fill them with that gap
    slack: int = 0


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor's place in an assembled one: a run of its elements, or a box of it."""

    info: TensorInfo
    start: int  # element offset of its run in the stacked tensor (when box is None)
    box: Optional[Box] = None  # where it lies otherwise: a block cut along any dimensions (a tensor-parallel chunk)


_contiguous_strides = functools.lru_cache(maxsize=1024)(contiguous_strides)  # experts share a handful of shapes


def piece_destination(dest: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The part of ``dest`` (the assembled tensor's memory) that ``piece`` fills: contiguous for a run, maybe not for a box."""
    if piece.box is None:
        if dest.is_contiguous():  # one call, where view, slice and view again cost 2x for experts in their thousands
            shape = piece.info.shape
            return dest.as_strided(shape, _contiguous_strides(shape), dest.storage_offset() + piece.start)
        return dest.view(-1)[piece.start: piece.start + piece.info.numel].view(piece.info.shape)
    offsets, sizes = piece.box  # sizes are the piece's shape
    return dest[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


@dataclass(frozen=True)
class Stacked(TensorInfo):
    """A model tensor assembled from checkpoint tensors, described as one.

    Its name, path and offset are its first piece's, for messages; it is
    never one run of one file, so it is never read or mapped as a whole.
    """

    pieces: tuple[Piece, ...] = ()

    @property
    def contiguous(self) -> bool:
        return False  # cannot stay mapped

    @property
    def read_nbytes(self) -> int:
        return sum(piece.info.read_nbytes for piece in self.pieces)


def pieces_of(source: TensorInfo) -> tuple[Piece, ...]:
    return source.pieces if isinstance(source, Stacked) else (Piece(source, 0),)
