"""A plain state dict's tensors as records: what the fast unpickler hands back in place of meta tensors.

Describing a tensor of a torch file needs its storage record, dtype, offset,
shape and stride; making a meta tensor to hold them (a storage per persistent
id, ``torch.empty`` then ``set_``) cost most of the opening of a file of
100,000 tensors. :class:`PlainTensor` keeps them as the file wrote them, with
what its :class:`~.base.TensorInfo` needs computed once: element count,
contiguity (as torch decides it) and the elements its view spans.

A record is made only where torch's own ``set_`` certainly makes that layout
as given (:func:`plain_layout`): plain ``int`` offset, sizes and strides, as
many strides as sizes, every value and the bytes the view reaches below
2**62, a dtype of :data:`_RECORD_DTYPES`, and gradients only for a floating
or complex one. Anything else is made as a meta tensor, as before, so it
meets torch's checks and errors unchanged. Records and their storages refuse
attribute writes (a BUILD on one makes the file not plain: the weights-only
path reads it), are not iterable and have no truth value, as a meta tensor
has none.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .layouts import RECORD_DTYPE_SIZES, plain_layout
from .sealed import Unchangeable

# The dtypes a record may have (see .layouts), as this torch spells them.
_RECORD_DTYPES = frozenset(getattr(torch, name) for name in RECORD_DTYPE_SIZES if hasattr(torch, name))
_GRAD_DTYPES = frozenset(dtype for dtype in _RECORD_DTYPES if dtype.is_floating_point or dtype.is_complex)
_set = object.__setattr__


class PlainStorage(Unchangeable):
    """A storage a plain pickle names: its key, size in bytes and dtype (its ``StorageRef``, read alike). The
    meta storage torch's own rebuild needs is made only when asked for (:meth:`typed`), and then noted in
    ``refs`` as before. Its fields are one tuple: one write to make."""

    __slots__ = ("fields", "_typed")
    key = property(lambda storage: storage.fields[0])
    nbytes = property(lambda storage: storage.fields[1])
    dtype = property(lambda storage: storage.fields[2])

    def typed(self) -> torch.storage.TypedStorage:
        """The meta storage this stands for, made once; noted in ``refs`` for :func:`.torchpickle.tensor_info`."""
        made = getattr(self, "_typed", None)
        if made is None:
            _, nbytes, dtype, refs = self.fields
            storage = torch.UntypedStorage(nbytes, device="meta")
            refs[storage._cdata] = self
            made = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
            _set(self, "_typed", made)
        return made

    def __iter__(self) -> Any:
        raise TypeError("a storage record is not iterable")

    def __setstate__(self, state: Any) -> None:  # pickle's BUILD: the file is not plain
        raise TypeError("a storage record takes no state")

    def __str__(self) -> str:  # as the meta storage reads (a file can key a dict by one)
        return str(self.typed())

    def __repr__(self) -> str:
        return repr(self.typed())


def plain_storage(key: str, nbytes: int, dtype: torch.dtype, refs: dict[int, Any]) -> PlainStorage:
    """The record of a storage ``key`` of ``nbytes`` bytes; ``refs`` notes the meta storage, if one is made."""
    storage = object.__new__(PlainStorage)
    _set(storage, "fields", (key, nbytes, dtype, refs))
    return storage


class PlainTensor(Unchangeable):
    """A tensor of a plain pickle as written, its fields one tuple (one write to make):
    ``(storage, offset, shape, stride, dtype, requires_grad, numel, contiguous, extent, parameter)``:
    ``extent`` the elements its view spans from ``offset`` (0 when it has none), ``parameter`` whether
    torch's parameter rebuild made it."""

    __slots__ = ("fields",)
    shape = property(lambda record: record.fields[2])
    dtype = property(lambda record: record.fields[4])

    def numel(self) -> int:
        return self.fields[6]

    def tensor(self) -> torch.Tensor:
        """The meta tensor torch's rebuild would have made of it (not the parameter, for a parameter's)."""
        storage, offset, shape, stride, dtype, requires_grad, _, _, _, parameter = self.fields
        tensor = torch.empty((0,), dtype=dtype, device="meta").set_(storage.typed()._untyped_storage, offset, shape, stride)
        if requires_grad and not parameter:
            tensor.requires_grad = True
        return tensor

    def with_grad(self, requires_grad: Any) -> Optional["PlainTensor"]:
        """The record of ``torch.nn.Parameter`` of it (torch's parameter rebuild); None where torch decides."""
        if type(requires_grad) is not bool or (requires_grad and self.dtype not in _GRAD_DTYPES):
            return None
        return _record(self.fields[:5] + (requires_grad,) + self.fields[6:9] + (True,))

    def __bool__(self) -> bool:
        raise TypeError("the truth value of a tensor record is undefined")

    def __iter__(self) -> Any:
        raise TypeError("a tensor record is not iterable")

    def __setstate__(self, state: Any) -> None:  # pickle's BUILD: the file is not plain
        raise TypeError("a tensor record takes no state")

    def __repr__(self) -> str:  # as the meta tensor reads (a file can key a dict by one, or name a storage by it)
        tensor = self.tensor()
        return repr(torch.nn.Parameter(tensor, self.fields[5]) if self.fields[9] else tensor)


def _record(fields: tuple) -> PlainTensor:
    record = object.__new__(PlainTensor)
    _set(record, "fields", fields)
    return record


def plain_tensor(storage: PlainStorage, offset: int, size: tuple, stride: tuple, dtype: Any,
                 requires_grad: Any) -> Optional[PlainTensor]:
    """The record of a rebuilt tensor, or None where torch must make it (a layout, dtype or gradient flag
    outside the records' domain)."""
    if dtype not in _RECORD_DTYPES or type(requires_grad) is not bool or (requires_grad and dtype not in _GRAD_DTYPES):
        return None
    layout = plain_layout(offset, size, stride, dtype.itemsize)
    if layout is None:
        return None
    return _record((storage, offset, size, stride, dtype, requires_grad) + layout + (False,))
