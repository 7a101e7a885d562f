"""The format-independent view of a checkpoint: names to byte locations."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..sources.fileio import FileSet

if TYPE_CHECKING:  # reading headers must not import torch: `materialize inspect` stays fast
    import torch
    from torch import nn

DCP_METADATA_NAME = ".metadata"  # a torch.distributed.checkpoint save: its metadata file
DCP_DATA_SUFFIX = ".distcp"  # and its data files


EXTRA_STATE = "_extra_state"  # the name torch's state_dict() gives what a module's get_extra_state() returns


def is_extra_state(name: str) -> bool:
    """Whether a state-dict name is a module's extra state (``<module>._extra_state``)."""
    return name.rpartition(".")[2] == EXTRA_STATE


@dataclass(frozen=True, eq=False)
class SavedTensor:
    """A tensor inside a module's extra state (``{"scale": tensor, "steps": 3}``), as a torch file holds it:
    where its bytes lie (read with the load, onto the CPU), and what ``torch.load`` makes of it beyond its
    values. One object for each tensor the file saved once, however often the state refers to it."""

    info: "TensorInfo"
    requires_grad: bool = False
    parameter: bool = False


_DTYPES: dict[str, "torch.dtype"] = {}  # dtype name -> torch's dtype, filled as met (reading headers imports no torch)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live, and what they mean: the values of an open :class:`Checkpoint`.

    Fields:
        name: the tensor's name in the checkpoint.
        dtype_name: torch's name for its dtype (``"bfloat16"``); :attr:`dtype` gives the ``torch.dtype``.
        itemsize: the bytes of one element.
        shape: the tensor's shape.
        path: the file holding its bytes.
        offset: the absolute file offset of its first element.
        stride: ``None`` for a contiguous tensor; a torch file may hold a strided view, whose elements then
            span ``span_nbytes`` bytes from ``offset``.
        span_nbytes: the bytes a strided view's elements span in the file (``None`` for a contiguous tensor).
        storage: the file offset of the storage record a torch file's tensor views: tensors with the same one
            shared a storage when saved.
        view_shape: when set, the shape ``stride`` describes: the tensor is those elements reshaped to
            ``shape`` (a rearranged checkpoint tensor, see
            :func:`materialize.planning.stacking.deinterleave`).
    """

    name: str
    dtype_name: str
    itemsize: int
    shape: tuple[int, ...]
    path: Path
    offset: int
    stride: Optional[tuple[int, ...]] = None
    span_nbytes: Optional[int] = None
    storage: Optional[int] = None
    view_shape: Optional[tuple[int, ...]] = None

    @property
    def dtype(self) -> "torch.dtype":
        """The ``torch.dtype`` of ``dtype_name`` (imports torch, which reading a header does not)."""
        dtype = _DTYPES.get(self.dtype_name)
        if dtype is None:
            import torch

            dtype = _DTYPES.setdefault(self.dtype_name, getattr(torch, self.dtype_name))
        return dtype

    @functools.cached_property
    def numel(self) -> int:  # cached: planning and reading ask per tensor, many times
        """The number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes (``numel`` times ``itemsize``)."""
        return self.numel * self.itemsize

    @property
    def contiguous(self) -> bool:
        """Whether its elements lie in the file in order, one after another (no ``stride``)."""
        return self.stride is None

    @property
    def mappable(self) -> bool:
        """Whether a view of the file's bytes can be this tensor (``mmap``): contiguous, and starting on a
        multiple of its element size, as a tensor's memory must."""
        return self.contiguous and self.offset % self.dtype.itemsize == 0

    @property
    def dense_strided(self) -> bool:
        """A strided view whose elements fill its span one after another in some dimension order (a
        transposed or column-major save): its stored bytes are that tensor's memory as they are."""
        return self.stride is not None and self.view_shape is None and self.span_nbytes == self.nbytes

    @property
    def read_nbytes(self) -> int:
        """Bytes that must be read from the file to rebuild the tensor."""
        return self.nbytes if self.stride is None else (self.span_nbytes or 0)


def make_info(name: str, dtype_name: str, itemsize: int, shape: tuple[int, ...], path: Path, offset: int,
              storage: Optional[int] = None, numel: Optional[int] = None) -> TensorInfo:
    """A contiguous tensor's :class:`TensorInfo`, made without the frozen dataclass's ``__init__`` (an attribute
    set at a time).

    Equal to ``TensorInfo(...)`` with the same fields (``stride``,
    ``span_nbytes`` and ``view_shape`` keep their defaults), about 5x
    faster: a header of tens of thousands of tensors notices. ``numel``,
    where the reader counted it already, is kept as
    :attr:`TensorInfo.numel` (it must be the shape's product). A view of
    other bytes of a tensor's file, strided or not, is :func:`view_of`'s.
    """
    info = object.__new__(TensorInfo)
    info.__dict__.update(name=name, dtype_name=dtype_name, itemsize=itemsize, shape=shape, path=path, offset=offset,
                         stride=None, span_nbytes=None, storage=storage)
    if numel is not None:
        info.__dict__["numel"] = numel  # the cached property's slot: its first read costs a lock otherwise
    return info


def view_of(info: TensorInfo, shape: tuple[int, ...], offset: int, stride: Optional[tuple[int, ...]] = None,
            span_nbytes: Optional[int] = None, storage: Optional[int] = None) -> TensorInfo:
    """``info``'s tensor (its name, dtype and file) as other bytes of its file: ``shape`` from ``offset``,
    strided as ``stride`` says across ``span_nbytes`` (``None``: contiguous), made as :func:`make_info` makes
    an info (a shard's box of each of a model's tensors, a read cut into blocks: one each)."""
    view = object.__new__(TensorInfo)
    view.__dict__.update(name=info.name, dtype_name=info.dtype_name, itemsize=info.itemsize, shape=shape,
                         path=info.path, offset=offset, stride=stride, span_nbytes=span_nbytes, storage=storage)
    return view


def shape_fits_int64(shape: list) -> bool:
    """Whether torch can describe the shape: each dimension, and the strides they multiply into, below 2**63."""
    limit = 2**63
    extent = 1
    for dim in shape:
        if dim >= limit:
            return False
        extent *= max(dim, 1)
        if extent >= limit:
            return False
    return True


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a contiguous tensor of ``shape`` (what ``stride=None`` stands for)."""
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


@dataclass
class Checkpoint(Mapping[str, TensorInfo]):
    """A lazy, read-only mapping of tensor name to :class:`TensorInfo`, made by :func:`open_checkpoint`.

    Opening reads headers and indexes only. The files stay open (one
    descriptor each, opened on first read) until :meth:`close` or the end of
    a ``with`` block. Pass it to :func:`load`, :func:`plan`,
    :func:`load_tensors`, :func:`convert` or :func:`inspect` in place of a path.

    Fields:
        path: the file, index or folder opened (a folder's chosen file, a DCP save's folder).
        format: ``safetensors``, ``torch``, ``torch-module`` (a pickled ``nn.Module``), ``dcp``, or a sharded
            one (``safetensors-sharded``, ``torch-sharded``, ``mixed-sharded``).
        tensors: name -> :class:`TensorInfo`, in the checkpoint's order (what the mapping reads).
        shards: every file holding tensor bytes.
        metadata: a safetensors header's ``__metadata__``, or a shard index's ``metadata``.
        module: the pickled module rebuilt on ``meta`` (``torch-module``, with ``trust_pickle=True``).
        extra_states: what modules' ``get_extra_state()`` saved that is not a tensor (a torch file's plain
            data, the tensors inside its dicts, lists and tuples as :class:`SavedTensor`), by
            ``"<module>._extra_state"``; a tensor one is among the tensors.
        state_dict_key: the entry of the saved dict the tensors were taken from (a training checkpoint's
            ``"state_dict_ema"``, say); ``None`` where the saved object is the state itself, and for formats
            without entries (safetensors).
        module_metadata: what ``state_dict()`` saved of each module beside its tensors (the state dict's
            ``_metadata``: ``{"blocks.0": {"version": 1}}``, by the module's name), which ``load_state_dict``
            hands each module's load code; ``None`` where the file has none (safetensors, a plain dict).
        files: the open file descriptors, shared by the reads.
    """

    path: Path
    format: str
    tensors: dict[str, TensorInfo]
    shards: list[Path]
    metadata: dict[str, Any] = field(default_factory=dict)
    module: Optional["nn.Module"] = None
    extra_states: dict[str, Any] = field(default_factory=dict)
    state_dict_key: Optional[str] = None
    module_metadata: Optional[dict[str, dict[str, Any]]] = None
    files: FileSet = field(default_factory=FileSet, repr=False)

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    # The dict's own views: the Mapping mixins' would call __getitem__ in Python once a tensor (inspect and
    # planning walk a hundred thousand)
    def keys(self) -> KeysView[str]:
        """The tensors' names, in the checkpoint's order."""
        return self.tensors.keys()

    def values(self) -> ValuesView[TensorInfo]:
        """Each tensor's :class:`TensorInfo`, in the checkpoint's order."""
        return self.tensors.values()

    def items(self) -> ItemsView[str, TensorInfo]:
        """``(name, TensorInfo)`` pairs, in the checkpoint's order."""
        return self.tensors.items()

    @property
    def nbytes(self) -> int:
        """The bytes of every tensor together."""
        return sum(info.nbytes for info in self.tensors.values())

    def close(self) -> None:
        """Close the checkpoint's files (a ``with`` block does it at its end)."""
        self.files.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Checkpoint({os.fspath(self.path)!r}, format={self.format!r}, "
            f"tensors={len(self)}, shards={len(self.shards)}, nbytes={self.nbytes})"
        )
