"""Tensors of a torch zip placed in the file: each storage record's bytes checked, each TensorInfo made.

What the readers of torch pickles share once a tensor is known by its
storage key and layout (:mod:`.plainrecords` onto ``meta``,
:mod:`.plainpickle` without torch): one set of checks, one set of errors.
Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError
from .base import TensorInfo

# A tensor's layout: (its storage's bytes, dtype name, element size, storage offset, shape, stride, element count,
# whether contiguous, the elements its view spans from the offset), as plain_layout accepted it.
Layout = tuple[int, str, int, int, tuple, tuple, int, bool, int]
# A named tensor: (name, (storage key, layout, ...)), as .plainpickle's records are, one item of their dict.
Located = tuple[str, tuple]

_new = object.__new__


def located_infos(path: Path, tensors: Iterable[Located], records: dict[str, tuple[int, int]],
                  file_size: int) -> dict[str, TensorInfo]:
    """The :class:`TensorInfo` of each named tensor (see :data:`Located`), by name, in order; refused, naming the
    first tensor that fails, where the zip lacks its storage record ``data/<key>``, the record is short or runs
    past the file's end, or the view lies outside it.

    ``records``: storage key -> (absolute offset, size) of the zip's records.
    """
    infos: dict[str, TensorInfo] = {}
    # What each layout makes of its tensors, worked out once a layout (tensors alike share one object): the
    # storage's bytes, where the view starts in it, whether the view lies within it, and the info's fields but
    # the tensor's own (its name and where its record lies), which each tensor's info copies.
    by_layout: dict[int, tuple[int, int, bool, dict]] = {}
    set_fields = object.__setattr__
    for name, record in tensors:
        key, layout = record[0], record[1]
        made = by_layout.get(id(layout))  # (each layout is held by its tensors, so its id is its own throughout)
        if made is None:
            made = by_layout[id(layout)] = _layout_fields(layout, path)
        nbytes, start, within, fields = made
        located = records.get(key)
        if located is None or located[1] < nbytes or located[0] + nbytes > file_size or not within:
            _, _, itemsize, offset, _, _, _, _, extent = layout
            raise _refusal(path, name, key, nbytes, offset * itemsize, extent * itemsize, located, file_size)
        fields = fields.copy()
        fields["name"], fields["offset"], fields["storage"] = name, located[0] + start, located[0]
        info = _new(TensorInfo)  # as make_info makes it: a dict of fields, the element count cached
        set_fields(info, "__dict__", fields)  # (past the frozen dataclass's __setattr__, as object's sets it)
        infos[name] = info
    return infos


def _layout_fields(layout: Layout, path: Path) -> tuple[int, int, bool, dict]:
    """For :func:`located_infos`: a layout's storage bytes, where its view starts in the storage, whether the view
    lies within it, and the fields of a :class:`TensorInfo` of it (``name``, ``offset`` and ``storage`` left to
    each tensor)."""
    nbytes, dtype_name, itemsize, offset, shape, stride, numel, contiguous, extent = layout
    start = offset * itemsize
    # An empty view's offset may lie anywhere past its storage's start, as torch's set_ lets it (it reads nothing);
    # it is said to start where its storage ends, not past the file.
    within = not numel or start + extent * itemsize <= nbytes
    if not numel and start > nbytes:
        start = nbytes
    return nbytes, start, within, {
        "name": None, "dtype_name": dtype_name, "itemsize": itemsize, "shape": shape, "path": path, "offset": None,
        "stride": None if contiguous else stride, "span_nbytes": None if contiguous else extent * itemsize,
        "storage": None, "numel": numel}


def _refusal(path: Path, name: str, key: str, nbytes: int, start: int, span: int,
             located: Optional[tuple[int, int]], file_size: int) -> CheckpointError:
    def fail(reason: str) -> CheckpointError:
        return CheckpointError(reason, path=path, tensor=name)

    if located is None:
        return fail(f"storage record data/{key} is missing from the zip")
    record_offset, record_size = located
    if record_size < nbytes:
        return fail(f"storage record data/{key} holds {record_size} bytes, {nbytes} expected")
    if record_offset + nbytes > file_size:
        return fail(f"storage record data/{key} runs past the end of the file (truncated?)")
    return fail(f"view of bytes [{start}, {start + span}) lies outside its {nbytes}-byte storage")
