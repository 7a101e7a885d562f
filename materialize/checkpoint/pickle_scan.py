"""What torch files say about their tensors' layout, read from the pickle's opcodes.

Tensors are rebuilt on meta storages, and meta quietly turns a negative
stride into a positive one, so the rebuilt tensor cannot show a hostile
layout. This scan reads the arguments of every ``_rebuild_tensor`` call as
written. It follows only the opcodes torch's weights-only unpickler accepts
(it runs after that unpickler succeeded); anything else ends the scan
without a verdict rather than a guess.
"""

from __future__ import annotations

import pickletools
from typing import Any

_REBUILDS = {"torch._utils _rebuild_tensor_v2", "torch._utils _rebuild_tensor_v3", "torch._utils _rebuild_tensor"}
_PUSH_ARG = {
    "BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG", "BINFLOAT", "FLOAT",
    "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "BINSTRING", "SHORT_BINSTRING",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "NONE", "NEWTRUE", "NEWFALSE",
}
_PUSH_OPAQUE = {"EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET", "BYTEARRAY8"}
_OPAQUE = object()


def negative_layouts(data: bytes) -> list[tuple[Any, Any, Any]]:
    """(offset, size, stride) of every rebuilt tensor where any of them is negative."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    found = []
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            if name in ("PROTO", "FRAME", "STOP"):
                continue
            if name in _PUSH_ARG:
                stack.append(None if name == "NONE" else arg)
            elif name in _PUSH_OPAQUE:
                stack.append(_OPAQUE)
            elif name == "MARK":
                marks.append(len(stack))
            elif name == "GLOBAL":
                stack.append(("global", arg))
            elif name == "STACK_GLOBAL":
                attr, module = stack.pop(), stack.pop()
                stack.append(("global", f"{module} {attr}"))
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                count = int(name[-1])
                items = tuple(stack[-count:])
                del stack[-count:]
                stack.append(items)
            elif name in ("TUPLE", "LIST", "DICT", "FROZENSET"):
                start = marks.pop()
                items = tuple(stack[start:])
                del stack[start:]
                stack.append(items if name == "TUPLE" else _OPAQUE)
            elif name in ("BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name == "BINPERSID":
                stack[-1] = _OPAQUE
            elif name == "REDUCE":
                args = stack.pop()
                function = stack.pop()
                if isinstance(function, tuple) and function[1:] and function[1] in _REBUILDS:
                    layout = _layout(args)
                    if layout is not None:
                        found.append(layout)
                stack.append(_OPAQUE)
            elif name in ("NEWOBJ", "SETITEM"):
                del stack[-2:]
                stack.append(_OPAQUE) if name == "NEWOBJ" else None
            elif name in ("BUILD", "APPEND"):
                stack.pop()
            elif name in ("SETITEMS", "APPENDS", "ADDITEMS"):
                del stack[marks.pop():]
            else:
                return found  # an opcode this scan does not model: no verdict on the rest
    except (IndexError, KeyError, ValueError, TypeError):
        return found
    return found


def _layout(args: Any) -> Any:
    if not (isinstance(args, tuple) and len(args) >= 4):
        return None
    offset, size, stride = args[1], args[2], args[3]
    numbers = [offset, *size, *stride] if isinstance(size, tuple) and isinstance(stride, tuple) else []
    if numbers and all(isinstance(n, int) for n in numbers) and any(n < 0 for n in numbers):
        return offset, size, stride
    return None
