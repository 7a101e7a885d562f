"""The pickle ``torch.save`` writes for a plain state dict, read without importing torch.

``materialize inspect`` of a safetensors file never imports torch; importing
it costs more than reading the header of a hundred thousand tensors. A
torch zip's ``data.pkl`` is read here without it wherever it is plainly what
``torch.save`` writes for a state dict: dicts and ``OrderedDict`` (their
``_metadata`` set by BUILD) keyed by strings, nested dicts, lists, tuples and
plain values beside them (a training checkpoint's ``epoch``), and tensors
made by ``torch._utils._rebuild_tensor_v2``/``_v3`` on the persistent id of a
storage record (``('storage', torch.FloatStorage, key, location, numel)``),
``nn.Parameter`` by ``torch._utils._rebuild_parameter``. Nothing is called
and nothing imported: each global the file names is looked up in a table of
inert tokens (:data:`_GLOBALS`); each opcode is taken by what it does to a
model of the unpickler's stack and memo.

Anything else (another global, another opcode, a layout, dtype or gradient
flag outside the records' domain (:mod:`.layouts`), a non-string key, a
memo fetch of a container, a storage named with two dtypes, a pickle that
does not end at its STOP, anything malformed) makes :func:`read_plain`
return ``None``: the reader onto ``meta`` (:mod:`.torchpickle`) then reads
the file as before and decides what is refused and how it is reported. It
never raises an error of its own; the model state is then chosen from what
it read by the same code (:func:`.payload.find_payload`), and each tensor
placed in the zip by the same checks (:func:`.located.located_infos`).

Its cost is linear in the pickle's length by construction: every opcode
does a constant amount of work but those that build a container (one step
per item, each item taken off the stack once) and strings (their length).
Memo fetches are taken only of values that are never walked into: strings,
numbers, globals' tokens and tensor records (leaves); a fetch of a
container, which would make a structure shared, declines.

The bounds of :mod:`.pickle_budget` hold for everything it accepts, so
:func:`~.pickle_budget.check_budget` (which costs as much as the reading) is
not run on this path:

- objects: without container fetches, what it builds is a tree whose every
  node and atom was pushed by an opcode of its own (at least a byte each),
  but the tensor records fetched again; each such fetch is counted at more
  than the budget counts a record (:data:`_RECORD_WEIGHT`), and the reader
  declines past :data:`~.pickle_budget.OBJECTS_PER_BYTE` objects a byte;
- depth: containers nest at most :data:`_MAX_NESTING` deep, records a few
  levels more, well below :data:`~.pickle_budget.MAX_DEPTH`;
- chosen hashes: dict keys are strings, and the only calls (records,
  ``OrderedDict()``, parameters) take integers of the ``BININT`` opcodes and
  booleans: no hash a file chooses is ever computed;
- memo indices: stores must number the memo 0, 1, 2, ... as torch.save's
  pickler does, so none is past the pickle's length.

Speed: a state dict's entries, each a key and a tensor's record, are most of
any checkpoint's pickle. From the 256th memo entry on (``LONG_BINPUT``), a
record is taken by one regular-expression match (:data:`_RECORD`, the form of
:mod:`.pickle_budget`'s ``_TENSOR_RECORD``), and a run of entries by a
pattern with the record's memo fetches filled in (:data:`_ENTRY`), their
stores' numbering checked for the run at once; what either would make of
anything else declines or is left to the opcode-by-opcode path.

Loads use it too, not only ``inspect``: every open of a torch zip tries it
first (but with ``trust_pickle``, and for the one tensor of a DCP chunk,
which take torch's readers). It opens the zip of 100,000 tensors of ``make bench-many`` in half the
time the unpickling onto ``meta`` takes (1.2 s against 2.4 s, torch already
imported), and what it gives is the same :class:`~.base.TensorInfo` each; a
load imports torch later all the same, for the tensors themselves.
"""

from __future__ import annotations

import collections
import functools
import re
import struct
from pathlib import Path
from typing import Any, Callable, Optional

from .base import TensorInfo
from .layouts import GRAD_DTYPE_NAMES, RECORD_DTYPE_SIZES, plain_layout
from .located import located_infos
from .payload import Kinds, Payload, find_payload
from .pickle_budget import MAX_DEPTH, OBJECTS_FLOOR, OBJECTS_PER_BYTE

# torch's legacy storage classes, by the dtype each stands for in a persistent id (torch.storage's own table).
_STORAGE_CLASSES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
_MAX_NESTING = 64  # containers inside one another: the budget's MAX_DEPTH less a record's own levels, and more
assert _MAX_NESTING + 8 < MAX_DEPTH
_MAX_DIMS = 64  # torch's own bound on a tensor's dimensions
# What a record fetched again adds to a walk, at most: the budget counts a rebuild's call as 17 objects and two
# per dimension, a parameter's a few more.
_RECORD_WEIGHT = 40


class _Decline(Exception):
    """The pickle is not plainly a state dict: the reader onto meta takes it."""


class PureTensor(tuple):
    """A tensor of a plain pickle: ``(key, layout, requires_grad, parameter)``: its storage record's key, then
    ``(nbytes, dtype_name, itemsize, offset, shape, stride, numel, contiguous, extent)``: the record's size in
    bytes, the tensor's dtype and layout as :func:`.layouts.plain_layout` accepted it (records alike share one);
    whether it asks for gradients, whether it is a parameter."""

    __slots__ = ()
    shape = property(lambda record: tuple.__getitem__(record, 1)[4])

    def numel(self) -> int:
        return tuple.__getitem__(self, 1)[6]


class _Token:
    """What a global the file names stands for here: never called, never given state."""

    __slots__ = ("kind", "dtype_name")

    def __init__(self, kind: str, dtype_name: Optional[str] = None) -> None:
        self.kind, self.dtype_name = kind, dtype_name


class _Long(int):
    """An integer of a LONG1 opcode, whose hash the file chooses: never a size, stride, offset or count of a record
    (each must be a plain ``int``), so never an argument of a call."""

    __slots__ = ()


class _Storage(tuple):
    """A BINPERSID's storage: ``(key, nbytes, dtype_name)``."""

    __slots__ = ()


_ORDERED_DICT = _Token("OrderedDict")
_REBUILD_V2 = _Token("rebuild_v2")
_REBUILD_V3 = _Token("rebuild_v3")
_REBUILD_PARAMETER = _Token("parameter")
_GLOBALS: dict[tuple[str, str], _Token] = {
    ("collections", "OrderedDict"): _ORDERED_DICT,
    ("torch._utils", "_rebuild_tensor_v2"): _REBUILD_V2,
    ("torch._utils", "_rebuild_tensor_v3"): _REBUILD_V3,
    ("torch._utils", "_rebuild_parameter"): _REBUILD_PARAMETER,
    ("torch", "UntypedStorage"): _Token("storage", "uint8"),
    ("torch.storage", "UntypedStorage"): _Token("storage", "uint8"),
    **{("torch", name): _Token("storage", dtype) for name, dtype in _STORAGE_CLASSES.items()},
    **{("torch", name): _Token("dtype", name) for name in RECORD_DTYPE_SIZES},
}
_ATOMS = (str, int, float, bool, type(None), _Token, PureTensor)  # what a memo fetch may find
_CONTAINERS = (dict, collections.OrderedDict, list, tuple)
_KINDS = Kinds(is_tensor=lambda value: type(value) is PureTensor)

# A tensor's record as torch.save writes it at protocols 2 and 3 (as pickle_budget's _TENSOR_RECORD, its values
# captured, its stores' indices too): taken in one match by the reader's fast path.
_FETCH = rb"(h.|j.{4})"
_STORE = rb"r(.{4})"  # LONG_BINPUT: past the memo's first 256 entries (a file's first records take the slow path)
_INT = rb"(K.|M..|J.{4})"
_INTS = rb"(?:K.|M..|J.{4})"
_LAYOUT = rb"(?:\)|(" + _INTS + rb"{1,3}[\x85-\x87]|\((?:" + _INTS + rb")*t)" + _STORE + rb")"
_RECORD = re.compile(
    _FETCH + rb"\(\(" + _FETCH + _FETCH  # the rebuild; MARK, MARK; 'storage', the storage class
    + rb"(?:X(.)\x00\x00\x00([0-9]+)" + _STORE + rb"|" + _FETCH + rb")"  # the key: new (stored) or fetched
    + _FETCH + _INT + rb"t" + _STORE + rb"Q"  # the location, the element count; the id's tuple, stored; BINPERSID
    + _INT + _LAYOUT + _LAYOUT  # storage offset, size, stride
    + rb"([\x88\x89])" + _FETCH + rb"\)R" + _STORE  # requires_grad; OrderedDict() (the hooks), stored
    + rb"t" + _STORE + rb"R" + _STORE,  # the arguments' tuple, stored; the rebuild's call, stored
    re.DOTALL)
# A state dict's entry past its key's string, for a run of them (:meth:`_Reader._entries`): the key's store, then
# a record as above, of a storage named for the first time, with sizes and strides, its fetches of the rebuild,
# 'storage', the location and OrderedDict those of the first record of the run (filled in, in that order).
_FULL_LAYOUT = rb"(" + _INTS + rb"{1,3}[\x85-\x87]|\((?:" + _INTS + rb")*t)" + _STORE
_ENTRY = (_STORE + rb"%s\(\(%s" + _FETCH + rb"X(.)\x00\x00\x00([0-9]+)" + _STORE + rb"%s" + _INT + rb"t" + _STORE
          + rb"Q" + _INT + _FULL_LAYOUT + _FULL_LAYOUT + rb"([\x88\x89])%s\)R" + _STORE + rb"t" + _STORE + rb"R"
          + _STORE)
_INT_WIDTH = {ord("K"): 2, ord("M"): 3, ord("J"): 5}
_NOT_FETCHED = object()  # a memo entry the reader declines to fetch (a container)
_FIVE_UNFETCHED = [_NOT_FETCHED] * 5


def read_plain(data: bytes) -> Optional[Any]:
    """The object a plain state dict's pickle holds, tensors as :class:`PureTensor`; ``None`` for any other."""
    if b"_rebuild_qtensor" in data:  # quantized: the reader onto meta refuses it, naming the tensors
        return None
    try:
        return _Reader(data).read()
    except _Decline:
        return None
    except (IndexError, KeyError, ValueError, TypeError, struct.error, UnicodeDecodeError, OverflowError):
        return None  # malformed: the reader onto meta says how


def plain_payload(path: Path, data: bytes, state_dict_key: Optional[str]) -> Optional[Payload]:
    """The model state of a plain pickle as the reader onto meta finds it (tensors as :class:`PureTensor`), or
    ``None`` wherever that reader could answer otherwise: any refusal is left to it to make."""
    unpickled = read_plain(data)
    if unpickled is None:
        return None
    try:
        found = find_payload(unpickled, _KINDS, state_dict_key=state_dict_key)
    except Exception:  # noqa: BLE001  (a refusal: the reader onto meta words it)
        return None
    if not found.tensors and not (isinstance(unpickled, dict) and not unpickled):
        return None  # holds no model tensors: refused there
    if isinstance(unpickled, dict) and "ds_version" in unpickled:
        return None  # a DeepSpeed save: checked there for partitioned parameters
    if found.extra_states and _holds_foreign(found.extra_states):
        return None  # handed on as they are: there, tensors are meta tensors, globals torch's own objects
    return found


def plain_infos(path: Path, tensors: dict[str, PureTensor], records: dict[str, tuple[int, int]],
                file_size: int) -> dict[str, TensorInfo]:
    """Each tensor of :func:`plain_payload` placed in the zip (see :func:`.located.located_infos`)."""
    return located_infos(path, tensors.items(), records, file_size)


def _holds_foreign(value: Any) -> bool:
    """Whether a tensor record, a storage, a global's token or a LONG1 integer is among the containers of
    ``value`` (a tree: nothing is met twice): what the reader onto meta would hand on as another object."""
    work = [value]
    while work:
        item = work.pop()
        if type(item) in _FOREIGN:
            return True
        if isinstance(item, dict):
            work.extend(item.values())
        elif isinstance(item, (list, tuple)):
            work.extend(item)
    return False


def _nesting(root: Any) -> int:
    """How deep containers nest in ``root`` (a tree), up to one past :data:`_MAX_NESTING`."""
    deepest = 0
    work = [(root, 1)]
    while work:
        item, depth = work.pop()
        if depth > deepest:
            deepest = depth
            if deepest > _MAX_NESTING:
                break
        children = item.values() if isinstance(item, dict) else item
        work.extend((child, depth + 1) for child in children if type(child) in _CONTAINER_TYPES)
    return deepest


_CONTAINER_TYPES = frozenset(_CONTAINERS)
_FOREIGN = frozenset((PureTensor, _Storage, _Token, _Long))


def _numbered(first: int, count: int) -> bytes:
    """``first``, ``first + 1``, ... as ``count`` four-byte little-endian integers: what LONG_BINPUT stores of
    the memo's next entries hold.

    Made as one integer of ``count`` four-byte lanes: ``0, 1, 2, ...`` plus ``first`` in every lane (no lane
    carries into the next below 2**32), five times faster than an array of the numbers (a run of a thousand
    entries stores 8,000)."""
    if first + count > 1 << 32:  # past what LONG_BINPUT can number: the lanes would carry
        raise _Decline
    counting, ones = _lanes(count)
    return (counting + first * ones).to_bytes(4 * count, "little")


@functools.lru_cache(maxsize=16)  # (runs are of one length but the last of each dict)
def _lanes(count: int) -> tuple[int, int]:
    """``0, 1, ..., count - 1`` and ``1, 1, ..., 1`` in ``count`` four-byte little-endian lanes, as integers."""
    return int.from_bytes(struct.pack(f"<{count}I", *range(count)), "little"), \
        int.from_bytes(b"\x01\x00\x00\x00" * count, "little")


def _int_of(token: bytes) -> int:
    """The value of a BININT1, BININT2 or BININT token; a negative one (BININT's sign) declines."""
    value = int.from_bytes(token[1:], "little")
    if token[0] == 0x4A and value >= 1 << 31:
        raise _Decline
    return value


def _layout_of(encoded: Optional[bytes]) -> tuple[int, ...]:
    """The integers of a size or stride tuple as the fast path matched it (``None``: the empty tuple)."""
    if encoded is None:
        return ()
    values, at, end = [], 1 if encoded[0] == 0x28 else 0, len(encoded) - 1
    while at < end:
        width = _INT_WIDTH[encoded[at]]
        values.append(_int_of(encoded[at:at + width]))
        at += width
    if at != end or (encoded[0] != 0x28 and encoded[-1] - 0x84 != len(values)):
        raise _Decline  # the opcodes matched are not one tuple of these integers
    return tuple(values)


class _Reader:
    """One read of a pickle on a model of the unpickler's stack, marks and memo."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.stack: list[Any] = []
        self.marks: list[int] = []
        # torch.save's pickler numbers what it stores 0, 1, 2, ... and never stores twice at one number: the memo is
        # a list, and any other store declines (so a value fetched once is what every later fetch of it finds).
        self.memo: list[Any] = []
        self.patterns: dict[tuple, Callable[[bytes, int], Optional[re.Match]]] = {}  # see _entries
        self.forms: dict[tuple, tuple] = {}  # the fast path's records' layouts, by their fetches' and integers' bytes
        self.dtypes: dict[str, str] = {}  # storage key -> the dtype it was first named with
        self.fetched_weight = 0  # what records fetched again add to a walk (see the module's note)

    def read(self) -> Any:
        data = self.data
        if len(data) < 3 or data[0] != 0x80 or not 2 <= data[1] <= 5:
            raise _Decline
        end = len(data)
        pos = 2
        stack, marks, memo = self.stack, self.marks, self.memo
        record = _RECORD.match
        unpack_from = struct.unpack_from
        while True:
            code = data[pos]
            if code == 0x68 or code == 0x6A:  # BINGET, LONG_BINGET: a tensor's record may start here
                found = record(data, pos)
                if found is not None:
                    stack.append(self._record(found))
                    pos = found.end()
                    continue
                width = 2 if code == 0x68 else 5
                self._fetch(int.from_bytes(data[pos + 1:pos + width], "little"))
                pos += width
            elif code == 0x58:  # BINUNICODE: most often a state dict's key, stored, then its tensor's record
                pos = self._entries(pos)
                if data[pos] != 0x58:
                    continue
                start = pos + 5
                stop = start + int.from_bytes(data[pos + 1:start], "little")
                if stop > end:
                    raise _Decline
                name = data[start:stop].decode("utf-8", "surrogatepass")
                stack.append(name)
                pos = stop
                if data[stop] == 0x72:  # LONG_BINPUT
                    if int.from_bytes(data[stop + 1:stop + 5], "little") != len(memo):
                        raise _Decline
                    memo.append(name)
                    pos = stop + 5
                    found = record(data, pos)
                    if found is not None:
                        stack.append(self._record(found))
                        pos = found.end()
            elif code == 0x8C or code == 0x8D:  # SHORT_BINUNICODE, BINUNICODE8
                size_width = 1 if code == 0x8C else 8
                length = int.from_bytes(data[pos + 1:pos + 1 + size_width], "little")
                start = pos + 1 + size_width
                if start + length > end:
                    raise _Decline
                stack.append(data[start:start + length].decode("utf-8", "surrogatepass"))
                pos = start + length
            elif code == 0x71 or code == 0x72:  # BINPUT, LONG_BINPUT
                width = 2 if code == 0x71 else 5
                self._store(int.from_bytes(data[pos + 1:pos + width], "little"))
                pos += width
            elif code == 0x94:  # MEMOIZE
                self._store(len(memo))
                pos += 1
            elif code == 0x4B:  # BININT1
                stack.append(data[pos + 1])
                pos += 2
            elif code == 0x4D:  # BININT2
                stack.append(unpack_from("<H", data, pos + 1)[0])
                pos += 3
            elif code == 0x4A:  # BININT
                stack.append(unpack_from("<i", data, pos + 1)[0])
                pos += 5
            elif code == 0x8A:  # LONG1: a value beside the tensors (never a key, nor in a record: see _record_of)
                length = data[pos + 1]
                if pos + 2 + length > end:
                    raise _Decline
                stack.append(_Long(int.from_bytes(data[pos + 2:pos + 2 + length], "little", signed=True)))
                pos += 2 + length
            elif code == 0x47:  # BINFLOAT
                stack.append(unpack_from(">d", data, pos + 1)[0])
                pos += 9
            elif code == 0x28:  # MARK
                marks.append(len(stack))
                pos += 1
            elif code == 0x74:  # TUPLE
                stack.append(tuple(self._take_from_mark()))
                pos += 1
            elif 0x85 <= code <= 0x87:  # TUPLE1-3
                stack.append(tuple(self._take(code - 0x84)))
                pos += 1
            elif code == 0x29:  # EMPTY_TUPLE
                stack.append(())
                pos += 1
            elif code == 0x7D:  # EMPTY_DICT
                stack.append({})
                pos += 1
            elif code == 0x5D:  # EMPTY_LIST
                stack.append([])
                pos += 1
            elif code == 0x75:  # SETITEMS
                self._set_items(self._take_from_mark())
                pos += 1
            elif code == 0x73:  # SETITEM
                self._set_items(self._take(2))
                pos += 1
            elif code == 0x65:  # APPENDS
                self._append(self._take_from_mark())
                pos += 1
            elif code == 0x61:  # APPEND
                self._append(self._take(1))
                pos += 1
            elif code == 0x52:  # REDUCE
                function, arguments = self._take(2)
                stack.append(self._call(function, arguments))
                pos += 1
            elif code == 0x51:  # BINPERSID
                stack.append(self._storage(self._take(1)[0]))
                pos += 1
            elif code == 0x62:  # BUILD
                self._build(self._take(1)[0])
                pos += 1
            elif code == 0x63:  # GLOBAL
                module_end = data.index(b"\n", pos + 1)
                name_end = data.index(b"\n", module_end + 1)
                stack.append(self._global(data[pos + 1:module_end].decode("utf-8"),
                                          data[module_end + 1:name_end].decode("utf-8")))
                pos = name_end + 1
            elif code == 0x93:  # STACK_GLOBAL
                module, name = self._take(2)
                if type(module) is not str or type(name) is not str:
                    raise _Decline
                stack.append(self._global(module, name))
                pos += 1
            elif code == 0x4E:  # NONE
                stack.append(None)
                pos += 1
            elif code == 0x88 or code == 0x89:  # NEWTRUE, NEWFALSE
                stack.append(code == 0x88)
                pos += 1
            elif code == 0x95:  # FRAME: a hint of where the next opcodes end, which must be within the data
                if data[1] < 4 or pos + 9 + unpack_from("<Q", data, pos + 1)[0] > end:
                    raise _Decline
                pos += 9
            elif code == 0x2E:  # STOP
                if pos + 1 != end or marks or len(stack) != 1:
                    raise _Decline  # trailing bytes, an open mark, or more than one object: not torch.save's
                break
            else:
                raise _Decline
        result = stack[0]
        if self.fetched_weight > OBJECTS_PER_BYTE * end + OBJECTS_FLOOR - end:
            raise _Decline
        if type(result) in _CONTAINER_TYPES and _nesting(result) > _MAX_NESTING:
            raise _Decline
        return result

    def _take(self, count: int) -> list[Any]:
        """The top ``count`` items of the stack, above its last mark (the unpickler's fence), taken off it."""
        stack = self.stack
        fence = self.marks[-1] if self.marks else 0
        if len(stack) - fence < count:
            raise _Decline
        items = stack[-count:]
        del stack[-count:]
        return items

    def _take_from_mark(self) -> list[Any]:
        if not self.marks:
            raise _Decline
        mark = self.marks.pop()
        items = self.stack[mark:]
        del self.stack[mark:]
        return items

    def _top(self) -> Any:
        fence = self.marks[-1] if self.marks else 0
        if len(self.stack) <= fence:
            raise _Decline
        return self.stack[-1]

    def _store(self, index: int) -> None:
        if index != len(self.memo):  # (which also keeps it below the pickle's length, as the budget wants)
            raise _Decline
        top = self._top()
        self.memo.append(top if isinstance(top, _ATOMS) and type(top) is not _Storage else _NOT_FETCHED)

    def _fetch(self, index: int) -> None:
        value = self.memo[index]  # (never a negative index: from unsigned bytes)
        if value is _NOT_FETCHED:
            raise _Decline  # a container shared: walks of it could multiply (see the module's note)
        if type(value) is PureTensor:
            self.fetched_weight += _RECORD_WEIGHT + 2 * len(value[1][4])
        self.stack.append(value)

    def _set_items(self, items: list[Any]) -> None:
        target = self._top()
        keys = items[::2]
        if type(target) not in (dict, collections.OrderedDict) or len(items) % 2 \
                or not set(map(type, keys)) <= {str}:  # torch's keys are names; others could have a hash the file chooses
            raise _Decline
        target.update(zip(keys, items[1::2]))

    def _append(self, items: list[Any]) -> None:
        target = self._top()
        if type(target) is not list:
            raise _Decline
        target.extend(items)

    def _build(self, state: Any) -> None:
        """An OrderedDict's attributes (its ``_metadata``), set as the unpickler sets them; any other BUILD declines."""
        target = self._top()
        if type(target) is not collections.OrderedDict or type(state) is not dict \
                or any(type(key) is not str for key in state):
            raise _Decline
        vars(target).update(state)

    def _global(self, module: str, name: str) -> _Token:
        token = _GLOBALS.get((module, name))
        if token is None:
            raise _Decline
        return token

    def _storage(self, saved_id: Any) -> _Storage:
        """A persistent id's storage, as the reader onto meta's ``persistent_load`` takes it."""
        if type(saved_id) is not tuple or len(saved_id) != 5:
            raise _Decline
        tag, kind, key, location, numel = saved_id
        if tag != "storage" or type(kind) is not _Token or kind.kind != "storage" or type(key) is not str \
                or type(location) is not str or type(numel) is not int or numel < 0:
            raise _Decline
        dtype_name = kind.dtype_name
        if self.dtypes.setdefault(key, dtype_name) != dtype_name:  # refused there, naming both dtypes
            raise _Decline
        return _Storage((key, numel * RECORD_DTYPE_SIZES[dtype_name], dtype_name))

    def _call(self, function: Any, arguments: Any) -> Any:
        if type(arguments) is not tuple:
            raise _Decline
        if function is _ORDERED_DICT and not arguments:
            return collections.OrderedDict()
        if function is _REBUILD_V2 and len(arguments) == 6:
            storage = arguments[0]
            if type(storage) is not _Storage:
                raise _Decline
            return _record_of(storage, *arguments[1:5], arguments[5], storage[2])
        if function is _REBUILD_V3 and len(arguments) == 7:
            dtype = arguments[6]
            if type(arguments[0]) is not _Storage or type(dtype) is not _Token or dtype.kind != "dtype":
                raise _Decline
            return _record_of(*arguments[:6], dtype.dtype_name)
        if function is _REBUILD_PARAMETER and len(arguments) == 3:
            data, requires_grad, hooks = arguments
            if type(data) is not PureTensor or type(requires_grad) is not bool or not _no_hooks(hooks) \
                    or (requires_grad and data[1][1] not in GRAD_DTYPE_NAMES):
                raise _Decline
            return PureTensor((data[0], data[1], requires_grad, True))
        raise _Decline

    def _entries(self, pos: int) -> int:
        """The fastest path: the state dict's entries from ``pos`` on, each a key (BINUNICODE, stored) and its
        tensor's record of a storage named there for the first time, both pushed as their opcodes would push
        them; where the next one stops. The records are :meth:`_record`'s, its checks made alike, but for two:
        the fetches of the rebuild, ``'storage'``, the location and ``OrderedDict`` are checked once, as the
        first record makes them, and are then part of the pattern that takes the rest (what a fetch finds never
        changes: see :meth:`_store`); the order of the memo's stores is checked for the whole run at once (a run
        out of order declines).
        """
        data, memo, stack, forms, dtypes = self.data, self.memo, self.stack, self.forms, self.dtypes
        setdefault, from_bytes = dtypes.setdefault, int.from_bytes
        first = len(memo)
        stores: list[bytes] = []
        unfetched = _NOT_FETCHED
        match = None
        while data[pos] == 0x58:
            start = pos + 5
            stop = start + from_bytes(data[pos + 1:start], "little")
            if match is None:
                match = self._entry_pattern(stop)
                if match is None:
                    break
            found = match(data, stop)
            if found is None:
                break
            (name_store, kind, key_length, key_digits, key_store, numel, id_store, offset, size, size_store, stride,
             stride_store, requires_grad, hooks_store, arguments_store, call_store) = found.groups()
            form = (kind, numel, offset, size, stride)
            layout = forms.get(form) or self._form(form)
            if len(key_digits) != key_length[0]:
                raise _Decline  # the digits run on past the string
            key = key_digits.decode()
            dtype_name = layout[1]
            if setdefault(key, dtype_name) != dtype_name:  # refused there, naming both dtypes
                raise _Decline
            if requires_grad == b"\x89":
                made = PureTensor((key, layout, False, False))
            elif dtype_name in GRAD_DTYPE_NAMES:
                made = PureTensor((key, layout, True, False))
            else:
                raise _Decline
            name = data[start:stop].decode("utf-8", "surrogatepass")
            stores += (name_store, key_store, id_store, size_store, stride_store, hooks_store, arguments_store,
                       call_store)
            memo += (name, key, unfetched, unfetched, unfetched, unfetched, unfetched, made)
            stack += (name, made)
            pos = found.end()
        if stores and b"".join(stores) != _numbered(first, len(stores)):
            raise _Decline  # a store out of turn: what a later fetch finds would differ
        return pos

    def _entry_pattern(self, at: int) -> Optional[Callable[[bytes, int], Optional[re.Match]]]:
        """The ``match`` of an entry's pattern (:data:`_ENTRY`) with the fetches of the record at ``at`` in it, where
        they find what torch.save's do; None where there is no record there, or too many patterns were made."""
        found = _RECORD.match(self.data, at + 5) if self.data[at] == 0x72 else None
        if found is None:
            return None
        rebuild, tag, _, _, _, _, _, location, *_ = found.groups()
        hooks = found.group(17)
        fetches = (rebuild, tag, location, hooks)
        pattern = self.patterns.get(fetches)
        if pattern is None:
            rebuild_value, tag_value, location_value, hooks_value = (
                self.memo[int.from_bytes(token[1:], "little")] for token in fetches)
            if rebuild_value is not _REBUILD_V2 or tag_value != "storage" or type(location_value) is not str \
                    or hooks_value is not _ORDERED_DICT or len(self.patterns) >= 8:  # (few in any checkpoint)
                return None
            pattern = self.patterns[fetches] = re.compile(_ENTRY % tuple(re.escape(token) for token in fetches),
                                                          re.DOTALL).match
        return pattern

    def _record(self, found: re.Match) -> PureTensor:
        """The fast path: a tensor's whole record, as its opcodes one at a time would make it.

        Its fetches precede its stores but the location's and the hooks' (after
        the key's, and the key's, id's and layout's): each must find an earlier
        entry, so none finds one of the record's own. Its stores must number
        the memo on, as any store must (see :meth:`_store`).
        """
        (rebuild, tag, kind, key_length, key_digits, key_store, key_fetch, location, numel, id_store, offset,
         size, size_store, stride, stride_store, requires_grad, hooks, hooks_store, arguments_store,
         call_store) = found.groups()
        memo = self.memo
        form = (rebuild, tag, location, hooks, kind, numel, offset, size, stride)
        layout = self.forms.get(form)
        if layout is None:
            layout = self._form(form)
        from_bytes = int.from_bytes
        at = len(memo)
        if key_digits is not None:
            if len(key_digits) != key_length[0] or from_bytes(key_store, "little") != at:
                raise _Decline  # the digits run on past the string, or a store out of turn
            key = key_digits.decode()
            memo.append(key)
            at += 1
        else:
            key = memo[from_bytes(key_fetch[1:], "little")]
            if type(key) is not str:
                raise _Decline
        if size_store is not None and stride_store is not None:
            if from_bytes(id_store, "little") != at or from_bytes(size_store, "little") != at + 1 \
                    or from_bytes(stride_store, "little") != at + 2 \
                    or from_bytes(hooks_store, "little") != at + 3 \
                    or from_bytes(arguments_store, "little") != at + 4:
                raise _Decline
            memo += _FIVE_UNFETCHED
            at += 5
        else:  # an empty size or stride, which is not stored
            for store in (id_store, size_store, stride_store, hooks_store, arguments_store):
                if store is not None:
                    if from_bytes(store, "little") != at:
                        raise _Decline
                    memo.append(_NOT_FETCHED)
                    at += 1
        if from_bytes(call_store, "little") != at:
            raise _Decline
        dtype_name = layout[1]
        if self.dtypes.setdefault(key, dtype_name) != dtype_name:  # refused there, naming both dtypes
            raise _Decline
        if requires_grad == b"\x89":
            made = PureTensor((key, layout, False, False))
        elif dtype_name in GRAD_DTYPE_NAMES:
            made = PureTensor((key, layout, True, False))
        else:
            raise _Decline
        memo.append(made)
        return made

    def _form(self, form: tuple) -> tuple:
        """A record's storage size, dtype and layout (see :func:`_record_of`) from the bytes of its fetches (of
        the storage class; with :meth:`_record`'s, of the rebuild, ``'storage'``, location and ``OrderedDict``
        before it) and of its integers, where its fetches find what torch.save's do (each an earlier entry: see
        :meth:`_record`); noted, as later records alike have the same (what a fetch finds never changes: see
        :meth:`_store`)."""
        fetched = [self.memo[int.from_bytes(token[1:], "little")] for token in form[:-4]]
        kind = fetched[-1]
        if len(fetched) > 1 and (fetched[0] is not _REBUILD_V2 or fetched[1] != "storage"
                                 or type(fetched[2]) is not str or fetched[3] is not _ORDERED_DICT):
            raise _Decline
        if type(kind) is not _Token or kind.kind != "storage":
            raise _Decline
        numel, offset, size, stride = form[-4:]
        storage = _Storage(("", _int_of(numel) * RECORD_DTYPE_SIZES[kind.dtype_name], kind.dtype_name))
        layout = _record_of(storage, _int_of(offset), _layout_of(size), _layout_of(stride), False,
                            collections.OrderedDict(), kind.dtype_name)[1]
        if len(self.forms) < 4096:  # a checkpoint has few distinct ones; a hostile file many
            self.forms[form] = layout
        return layout


def _no_hooks(hooks: Any) -> bool:
    return type(hooks) is collections.OrderedDict and not hooks


def _record_of(storage: _Storage, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
               dtype_name: str) -> PureTensor:
    """The record torch's rebuild (through the reader onto meta's records) makes of these arguments; those it
    would make a meta tensor of, or refuse, decline."""
    itemsize = RECORD_DTYPE_SIZES.get(dtype_name)
    if itemsize is None or type(requires_grad) is not bool or (requires_grad and dtype_name not in GRAD_DTYPE_NAMES) \
            or not _no_hooks(hooks) or type(size) is not tuple or len(size) > _MAX_DIMS:
        raise _Decline
    layout = plain_layout(offset, size, stride, itemsize)
    if layout is None:
        raise _Decline
    numel, contiguous, extent = layout
    return PureTensor((storage[0], (storage[1], dtype_name, itemsize, offset, size, stride, numel, contiguous, extent),
                       requires_grad, False))
