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
    for name, record in tensors:
        key = record[0]
        nbytes, dtype_name, itemsize, offset, shape, stride, numel, contiguous, extent = record[1]
        located = records.get(key)
        start = offset * itemsize
        # An empty view's offset may lie anywhere past its storage's start, as torch's set_ lets it (it reads nothing).
        if located is None or located[1] < nbytes or located[0] + nbytes > file_size \
                or (numel and start + extent * itemsize > nbytes):
            raise _refusal(path, name, key, nbytes, start, extent * itemsize, located, file_size)
        if not numel and start > nbytes:  # an empty view is said to start where its storage ends, not past the file
            start = nbytes
        info = _new(TensorInfo)  # as make_info makes it: a dict of fields, the element count cached
        info.__dict__.update({
            "name": name, "dtype_name": dtype_name, "itemsize": itemsize, "shape": shape, "path": path,
            "offset": located[0] + start, "stride": None if contiguous else stride,
            "span_nbytes": None if contiguous else extent * itemsize, "storage": located[0], "numel": numel})
        infos[name] = info
    return infos


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
