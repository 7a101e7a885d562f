"""What torch files say about their tensors, read from the pickle's opcodes without running any of it.

Tensors are rebuilt on meta storages, and meta quietly turns a negative
stride into a positive one, so the rebuilt tensor cannot show a hostile
layout: :func:`hostile_calls` reads the arguments of every
``_rebuild_tensor`` call as written. A quantized tensor cannot be rebuilt
on meta at all: :func:`quantized_tensors` finds them and the names they
are stored under, for the refusal to name them (protocols 4 and 5 name
torch's rebuild from a memoized module string, which no byte pattern
finds). The walk follows only the opcodes
torch's weights-only unpickler accepts; anything else ends it without a
verdict on the rest rather than a guess.
"""

from __future__ import annotations

import pickletools
from collections.abc import Callable
from typing import Any, Optional

_REBUILDS = {"torch._utils _rebuild_tensor_v2", "torch._utils _rebuild_tensor_v3", "torch._utils _rebuild_tensor"}
_QUANTIZED_REBUILD = "torch._utils _rebuild_qtensor"
_PUSH_ARG = {
    "BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG", "BINFLOAT", "FLOAT",
    "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "BINSTRING", "SHORT_BINSTRING",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "NONE", "NEWTRUE", "NEWFALSE",
}
_PUSH_OPAQUE = {"EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET", "BYTEARRAY8"}
_OPAQUE = object()

Call = Callable[[str, Any], Any]  # (the global called, its arguments) -> what the call stands for on the stack
Item = Callable[[Any, Any], None]  # a key and its value, set in a dict


# Calls that allocate memory from a count the file gives (bytearray(3_000_000_000), torch.FloatTensor(n, m),
# torch.UntypedStorage(n)) rather than from data it holds; torch.save never writes them with a count.
def _allocates(function: str) -> bool:
    module, _, name = function.partition(" ")
    return name == "bytearray" and module in ("builtins", "__builtin__") or (
        module.split(".")[0] == "torch" and name.endswith(("Tensor", "Storage")))


def hostile_calls(data: bytes) -> tuple[list[tuple[Any, Any, Any]], list[str], list[str]]:
    """What no torch.save writes, found in one walk of the opcodes, as far as it reads.

    First, (offset, size, stride) of every rebuilt tensor where any of them
    is negative. A tensor's layout can also be set after its rebuild, by
    pickle's BUILD (``Tensor.__setstate__`` with ``(storage, offset, size,
    stride)``, which both torch's readers apply): every BUILD state of that
    shape is read too. Second, the globals called with a number among their
    arguments where such a call allocates that many bytes or elements
    (:func:`_allocates`). Third, every global the pickle names, once each
    (``module name``), in order.
    """
    layouts: list[tuple[Any, Any, Any]] = []
    allocations: list[str] = []
    named: dict[str, None] = {}

    def call(function: str, args: Any) -> Any:
        layout = _layout(args) if function in _REBUILDS else None
        if layout is not None:
            layouts.append(layout)
        if _allocates(function) and _holds_a_number(args):
            allocations.append(function.replace(" ", "."))
        return args if function == "torch Size" else _OPAQUE  # a size's numbers stay counts

    def build(state: Any) -> None:
        layout = _layout(state) if isinstance(state, tuple) and len(state) == 4 else None
        if layout is not None:
            layouts.append(layout)

    _walk(data, call, build=build, named=named)
    return layouts, allocations, list(named)


def _holds_a_number(args: Any, depth: int = 0) -> bool:
    if isinstance(args, int):
        return True
    if isinstance(args, tuple) and depth < 4:
        return any(_holds_a_number(item, depth + 1) for item in args)
    return False


class _Quantized:
    """What a quantized tensor's rebuild stands for in the walk."""


def quantized_tensors(data: bytes) -> tuple[int, list[str]]:
    """How many quantized tensors the pickle rebuilds, and the dict keys they are stored under, as far as the walk reads."""
    names: list[str] = []
    calls = 0

    def call(function: str, args: Any) -> Any:
        nonlocal calls
        if function != _QUANTIZED_REBUILD:
            return _OPAQUE
        calls += 1
        return _Quantized

    def item(key: Any, value: Any) -> None:
        if value is _Quantized and isinstance(key, str):
            names.append(key)

    _walk(data, call, item)
    return calls, names


def _walk(data: bytes, call: Call, item: Optional[Item] = None, build: Optional[Callable[[Any], None]] = None,
          named: Optional[dict[str, None]] = None) -> None:
    """Follow ``data``'s opcodes on a stack of plain values: each REDUCE and NEWOBJ goes to ``call``, each dict
    item to ``item``, each BUILD's state to ``build``, each global's name into ``named``."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
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
                if named is not None:
                    named[arg] = None
            elif name == "STACK_GLOBAL":
                attr, module = stack.pop(), stack.pop()
                stack.append(("global", f"{module} {attr}"))
                if named is not None:
                    named[f"{module} {attr}"] = None
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
                if name == "DICT" and item is not None:
                    for key, value in zip(items[::2], items[1::2]):
                        item(key, value)
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
                global_name = function[1] if isinstance(function, tuple) and len(function) == 2 and function[0] == "global" else ""
                stack.append(call(global_name, args))
            elif name == "NEWOBJ":
                args = stack.pop()
                cls = stack.pop()
                global_name = cls[1] if isinstance(cls, tuple) and len(cls) == 2 and cls[0] == "global" else ""
                call(global_name, args)
                stack.append(_OPAQUE)
            elif name == "SETITEM":
                key, value = stack[-2:]
                del stack[-2:]
                if item is not None:
                    item(key, value)
            elif name == "BUILD":
                state = stack.pop()
                if build is not None:
                    build(state)
            elif name == "APPEND":
                stack.pop()
            elif name == "SETITEMS":
                start = marks.pop()
                if item is not None:
                    for key, value in zip(stack[start::2], stack[start + 1::2]):
                        item(key, value)
                del stack[start:]
            elif name in ("APPENDS", "ADDITEMS"):
                del stack[marks.pop():]
            else:
                return  # an opcode this walk does not model: no verdict on the rest
    except (IndexError, KeyError, ValueError, TypeError):
        return


def _layout(args: Any) -> Any:
    if not (isinstance(args, tuple) and len(args) >= 4):
        return None
    offset, size, stride = args[1], args[2], args[3]
    numbers = [offset, *size, *stride] if isinstance(size, tuple) and isinstance(stride, tuple) else []
    if numbers and all(isinstance(n, int) for n in numbers) and any(n < 0 for n in numbers):
        return offset, size, stride
    return None
