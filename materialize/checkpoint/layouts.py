"""Tensor layouts (offset, sizes, strides) that torch certainly makes as a file gives them: the domain of records.

Both readers of plain pickles, onto ``meta`` (:mod:`.plainrecords`) and
without torch (:mod:`.plainpickle`), describe a tensor by a record only where
:func:`plain_layout` accepts its layout and its dtype is one of
:data:`RECORD_DTYPE_SIZES`; anything else is torch's to make, or refuse.
Imports no torch.
"""

from __future__ import annotations

from typing import Any, Optional

_LIMIT = 1 << 62  # below every bound of torch's layout arithmetic (int64 sizes, strides, element and byte counts)

# The dtypes a record may have, by torch's name, with their element sizes: torch makes each on meta without a
# warning, none quantized.
RECORD_DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "uint16": 2, "uint32": 4, "uint64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}
# Those a gradient may be asked for (floating point and complex ones).
GRAD_DTYPE_NAMES = frozenset(name for name in RECORD_DTYPE_SIZES if name.startswith(("float", "bfloat", "complex")))


def plain_layout(offset: Any, size: Any, stride: Any, itemsize: int) -> Optional[tuple[int, bool, int]]:
    """(element count, whether torch calls it contiguous, the elements its view spans from ``offset``) for a
    layout torch's ``set_`` certainly makes as given (see the module's note); None for any other."""
    if type(offset) is not int or type(size) is not tuple or type(stride) is not tuple or len(size) != len(stride) \
            or not 0 <= offset < _LIMIT:
        return None
    numel = extent_bound = 1  # the product of max(size, 1): bounds numel and every partial product torch forms
    reach = 0  # sum((size - 1) * stride) over non-empty dimensions
    contiguous = True
    expected = 1
    for dim in range(len(size) - 1, -1, -1):
        length, step = size[dim], stride[dim]
        if type(length) is not int or type(step) is not int or not (0 <= length < _LIMIT and 0 <= step < _LIMIT):
            return None
        numel *= length
        if length > 1:
            extent_bound *= length
            reach += (length - 1) * step
            if extent_bound >= _LIMIT or reach >= _LIMIT:
                return None
        if length != 1:  # torch's own test (compute_contiguous): size-1 dimensions may have any stride
            if step == expected:
                expected *= length
            else:
                contiguous = False
    if (offset + reach + 1) * itemsize >= _LIMIT:
        return None
    if numel == 0:
        return 0, True, 0
    return numel, contiguous, reach + 1
