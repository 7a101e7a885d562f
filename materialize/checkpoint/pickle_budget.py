"""Bounds on what a pickle may build, checked on its opcodes before any of it is unpickled.

A pickle of a few kilobytes can describe a structure that is exponentially
large when walked: each memo GET is a second reference to an object already
built, so a chain of tuples that each hold the previous one twice is 2**n
objects to whoever hashes it (a dict key), prints it (an error message) or
walks it (finding a state dict in it). Unpickling itself hashes dict keys and
set items, in C, where nothing can interrupt it, so the bound is checked
before: :func:`check_budget` follows the opcodes on a model of the stack and
the memo, then counts, for every container the pickle builds, how many
objects a walk of it meets (an object once per reference to it) and how deep
it nests. Both are bounded:

- :data:`MAX_DEPTH` containers inside one another (deeper structures make
  Python's recursive ``repr``, comparisons and our own walks fail);
- :data:`OBJECTS_PER_BYTE` objects per byte of the pickle, plus
  :data:`OBJECTS_FLOOR`: a pickle that shares nothing builds at most one
  object per opcode, at least a byte each; torch's own saves share only
  globals, strings and tied tensors, and stay near one per byte.

- :data:`MAX_CHOSEN_HASHES` objects, in all, whose hash the file can
  choose, where the unpickler hashes them (dict keys, set items, and the
  arguments of a call, which may build either): integers outside the 32
  bits the ``BININT`` opcodes hold, floats, frozensets, and any tuple or call
  result holding one. ``k * (2**61 - 1)`` hashes to 0 for every ``k``, and
  200,000 such keys make the C unpickler build one dict in quadratic time,
  out of reach of any signal. Strings and bytes hash under a seed chosen at
  start-up (unless ``PYTHONHASHSEED`` fixes it), small integers to
  themselves (all distinct), tuples of those by a 64-bit mix that a file
  cannot steer to one value; torch's saves key everything by one of those.

The count is over the whole stack and memo model, mutations included (a list
filled after it was referenced still counts what it holds in the end), so the
order in which a hostile pickle builds its structure does not matter. The
scan costs about as much as a second unpickling at C speed; see docs/reliability.md.
"""

from __future__ import annotations

import pickletools
import re
import struct
from pathlib import Path
from typing import Optional, Union

from ..errors import BudgetError, CheckpointError

MAX_DEPTH = 200
OBJECTS_PER_BYTE = 16
OBJECTS_FLOOR = 1 << 20
# 8,192 int keys that all hash alike take 0.4 s to insert; a tuple key holding one costs more per comparison,
# so a key counts as many objects as it holds.
MAX_CHOSEN_HASHES = 8192


# How each opcode's argument is laid out: a fixed width, a length prefix of 1, 4 or 8 bytes, one line, two lines.
_FIXED, _PREFIX1, _PREFIX4, _PREFIX8, _LINE, _TWO_LINES, _NONE = range(7)
_PREFIX_KIND = {-2: _PREFIX1, -3: _PREFIX4, -4: _PREFIX4, -5: _PREFIX8}

# What each opcode does to the stack, as far as the count is concerned.
# A call's result counts as a container of its callable and arguments (it may keep them), as a tuple of its items.
(_ATOM, _NEW_CONTAINER, _MARK, _FROM_MARK, _FROM_TOP, _INTO_TOP, _INTO_TOP_FROM_MARK, _PUT, _MEMOIZE, _GET,
 _POP, _POP_MARK, _DUP, _KEEP, _STOP, _CHOSEN_ATOM) = range(16)
_EFFECTS = {
    "EMPTY_LIST": (_NEW_CONTAINER, 0), "EMPTY_TUPLE": (_NEW_CONTAINER, 0), "EMPTY_DICT": (_NEW_CONTAINER, 0),
    "EMPTY_SET": (_NEW_CONTAINER, 0),
    "MARK": (_MARK, 0),
    "TUPLE": (_FROM_MARK, 0), "LIST": (_FROM_MARK, 0), "DICT": (_FROM_MARK, 0), "FROZENSET": (_FROM_MARK, 0),
    "TUPLE1": (_FROM_TOP, 1), "TUPLE2": (_FROM_TOP, 2), "TUPLE3": (_FROM_TOP, 3),
    "APPEND": (_INTO_TOP, 1), "SETITEM": (_INTO_TOP, 2), "BUILD": (_INTO_TOP, 1),
    "APPENDS": (_INTO_TOP_FROM_MARK, 0), "SETITEMS": (_INTO_TOP_FROM_MARK, 0), "ADDITEMS": (_INTO_TOP_FROM_MARK, 0),
    "REDUCE": (_FROM_TOP, 2), "NEWOBJ": (_FROM_TOP, 2), "NEWOBJ_EX": (_FROM_TOP, 3), "BINPERSID": (_FROM_TOP, 1),
    "STACK_GLOBAL": (_FROM_TOP, 2), "OBJ": (_FROM_MARK, 0), "INST": (_FROM_MARK, 0),
    "PUT": (_PUT, 0), "BINPUT": (_PUT, 0), "LONG_BINPUT": (_PUT, 0), "MEMOIZE": (_MEMOIZE, 0),
    "GET": (_GET, 0), "BINGET": (_GET, 0), "LONG_BINGET": (_GET, 0),
    "POP": (_POP, 0), "POP_MARK": (_POP_MARK, 0), "DUP": (_DUP, 0),
    "PROTO": (_KEEP, 0), "FRAME": (_KEEP, 0), "READONLY_BUFFER": (_KEEP, 0), "STOP": (_STOP, 0),
    # Values whose hash the file chooses (see MAX_CHOSEN_HASHES).
    "LONG1": (_CHOSEN_ATOM, 0), "LONG4": (_CHOSEN_ATOM, 0), "INT": (_CHOSEN_ATOM, 0), "LONG": (_CHOSEN_ATOM, 0),
    "BINFLOAT": (_CHOSEN_ATOM, 0), "FLOAT": (_CHOSEN_ATOM, 0),
}
# Where the unpickler hashes what it is given: keys (every other item, from the first) or all the items.
_HASHES_KEYS = {ord(op.code) for op in pickletools.opcodes if op.name in ("SETITEM", "SETITEMS", "DICT")}
_HASHES_ITEMS = {ord(op.code) for op in pickletools.opcodes if op.name in ("ADDITEMS", "FROZENSET")}
_CALLS = {ord(op.code) for op in pickletools.opcodes if op.name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST")}
_FROZENSET = next(ord(op.code) for op in pickletools.opcodes if op.name == "FROZENSET")


def _opcode_table() -> list[Optional[tuple[int, int, int, int]]]:
    """(argument layout, its width, stack effect, effect's count) for each opcode byte; None where none is defined."""
    table: list[Optional[tuple[int, int, int, int]]] = [None] * 256
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            layout, width = _NONE, 0
        elif arg.n > 0:
            layout, width = _FIXED, arg.n
        elif arg.name == "stringnl_noescape_pair":
            layout, width = _TWO_LINES, 0
        elif arg.n == pickletools.UP_TO_NEWLINE:
            layout, width = _LINE, 0
        else:
            layout, width = _PREFIX_KIND[arg.n], 0
        effect, count = _EFFECTS.get(op.name, (_ATOM, 0))
        table[ord(op.code)] = (layout, width, effect, count)
    return table


_TABLE = _opcode_table()
# Opcode byte -> its whole length, for opcodes that push one immutable value and have a fixed-width argument
# (BININT1, NEWFALSE, ...): the scan's fast path. An empty tuple is such a value too.
_ATOM_WIDTHS = [1 + entry[1] if entry and entry[2] == _ATOM and entry[0] in (_NONE, _FIXED) else 0 for entry in _TABLE]
_ATOM_WIDTHS[ord(")")] = 1
# Opcode byte -> how many values it takes from the top of the stack into a new container, for the scan's fast
# path: TUPLE1-3, BINPERSID and REDUCE (torch's records are made of them); 0 for the rest.
_FROM_TOP_COUNTS = [0] * 256
for _name, _count in (("TUPLE1", 1), ("TUPLE2", 2), ("TUPLE3", 3), ("BINPERSID", 1), ("REDUCE", 2)):
    _FROM_TOP_COUNTS[next(ord(op.code) for op in pickletools.opcodes if op.name == _name)] = _count
assert all(_EFFECTS[op.name] == (_FROM_TOP, _FROM_TOP_COUNTS[ord(op.code)])
           for op in pickletools.opcodes if _FROM_TOP_COUNTS[ord(op.code)])


# A tensor's record as torch.save writes it at protocol 2 once the memo holds the globals and strings it shares
# and has passed 256 entries: the scan's record fast path (:func:`_tensor_record`) takes it in one match. Memo
# fetches (BINGET, LONG_BINGET) are captured whole, stores (LONG_BINPUT) by their index's four bytes; sizes and
# strides of one to three dimensions are TUPLE1-3, others a MARK ... TUPLE; 0-d ones EMPTY_TUPLE (not stored).
_FETCH_RE = rb"(h.|j.{4})"
_STORE_RE = rb"r(.{4})"
_INT_RE = rb"(?:K.|M..|J.{4})"  # BININT1, BININT2, BININT: never a hash the file chooses
_LAYOUT_RE = (rb"(?:\)|(" + _INT_RE + rb"\x85|" + _INT_RE * 2 + rb"\x86|" + _INT_RE * 3 + rb"\x87|\((?:" + _INT_RE
              + rb")*t)" + _STORE_RE + rb")")
_TENSOR_RECORD = re.compile(
    _FETCH_RE  # the rebuild's global
    + rb"\(\(" + _FETCH_RE + _FETCH_RE  # MARK (its arguments), MARK (the persistent id), 'storage', its class
    + rb"(?:X(.)\x00\x00\x00([0-9]+)" + _STORE_RE + rb"|" + _FETCH_RE + rb")"  # its key: new (and stored), or fetched
    + _FETCH_RE + _INT_RE + rb"t" + _STORE_RE + rb"Q"  # its location, element count, their tuple (stored), BINPERSID
    + _INT_RE + _LAYOUT_RE + _LAYOUT_RE  # storage offset, size (stored unless empty), stride
    + rb"[\x88\x89]"  # requires_grad
    + _FETCH_RE + rb"\)R" + _STORE_RE  # OrderedDict() (the backward hooks), stored
    + rb"t" + _STORE_RE + rb"R" + _STORE_RE,  # the arguments' tuple, stored; the rebuild's call, stored
    re.DOTALL)
_MISSING = object()

_CAP = 1 << 62  # counts stop growing here: past any limit, and still a machine-sized int


class _Node:
    """A container (or a call's result) the pickle builds: what it holds (atoms are ``None``), and, as far as
    the scan has seen, how many objects a walk of it meets and how deep it nests."""

    __slots__ = ("items", "objects", "depth", "used", "chosen")

    def __init__(self, items: list) -> None:
        self.items = items
        self.used = False  # held by another container: a later change to this one leaves that one's count stale
        if items.count(None) == len(items):  # atoms alone (a shape, a stride, a storage's key): counted at C speed
            self.objects = 1 + len(items) if len(items) < _CAP else _CAP
            self.depth = 1
            self.chosen = 0
            return
        objects = depth = 1
        chosen = 0  # values inside whose hash the file chooses (see MAX_CHOSEN_HASHES)
        for child in items:
            if child is None:
                objects += 1
            else:
                child.used = True
                objects += child.objects
                chosen += child.chosen
                if child.depth >= depth:
                    depth = child.depth + 1
        self.objects = objects if objects < _CAP else _CAP
        self.depth = depth
        self.chosen = chosen if chosen < _CAP else _CAP


class _ChosenAtom(_Node):
    """An integer or float: one object, no nesting, a hash the file chooses. One instance stands for them all."""

    def __init__(self) -> None:
        super().__init__([])
        self.depth = 0
        self.chosen = 1


_CHOSEN = _ChosenAtom()


Value = Union[_Node, None]


class _LongerThanThePickle(Exception):
    """An argument with an 8-byte length (BINBYTES8, BINUNICODE8, BYTEARRAY8: protocol 4 and later) that claims
    more bytes than the pickle holds. Python's C unpickler allocates the claimed length before it reads: a
    MemoryError for a few bytes of file, and for BYTEARRAY8 CPython 3.11 also frees the half-made bytearray
    with a buffer still exported (it prints ``SystemError: deallocated bytearray object has exported
    buffers``). Refused before any unpickler sees it."""


def check_budget(data: bytes, *, path: Union[str, Path], what: str) -> None:
    """Refuse ``data`` (a pickle) if unpickling it would build past :data:`MAX_DEPTH` or the object count.

    Malformed pickles end the scan without a verdict: the unpickler that
    follows reports them; but an 8-byte-length argument that claims more than
    the pickle holds is a :class:`CheckpointError` here (see
    :class:`_LongerThanThePickle`). Raises :class:`BudgetError` naming the file and the limit.
    """
    limit = OBJECTS_PER_BYTE * len(data) + OBJECTS_FLOOR
    try:
        objects, depth, memo_index, chosen = _scan(data, limit)
    except _LongerThanThePickle as claimed:
        raise CheckpointError(f"{what} is malformed: an argument claims {claimed.args[0]:,} bytes, more than the "
                              f"{len(data):,}-byte pickle holds", path=path) from None
    if chosen > MAX_CHOSEN_HASHES:
        raise BudgetError(
            f"{what} has the unpickler hash more than {MAX_CHOSEN_HASHES:,} objects whose hash a file can choose "
            "(dict keys, set items or call arguments that are integers past 32 bits, floats, frozensets or tuples "
            "holding them); keys that all hash alike make building a dict take quadratic time", path=path)
    if memo_index > len(data):
        raise BudgetError(
            f"{what} stores an object at memo index {memo_index:,}, past any a {len(data):,}-byte pickle can use "
            "(Python's unpickler allocates memory up to the index)", path=path)
    if depth > MAX_DEPTH:
        raise BudgetError(
            f"{what} nests containers more than {MAX_DEPTH} deep, the limit for an unpickled structure", path=path)
    if objects > limit:
        raise BudgetError(
            f"{what} refers to its objects so many times over that walking it would meet more than {limit:,} "
            f"objects (the limit: {OBJECTS_PER_BYTE} per byte of a {len(data):,}-byte pickle, plus {OBJECTS_FLOOR:,})",
            path=path)


def _scan(data: bytes, limit: int) -> tuple[int, int, int, int]:
    """The most objects a walk of any one container of the pickle meets, the deepest nesting, the memo
    index where the scan stopped at one past the pickle's length (0 if none), and how many objects whose
    hash the file chooses are hashed (each key counted as the objects it holds; see :data:`MAX_CHOSEN_HASHES`).

    A pickle numbers the objects it keeps for later (its memo) itself;
    numbers beyond its length are no pickler's, and Python's C unpickler
    allocates its memo table up to the largest (16 bytes each: 64 GiB for
    one opcode naming 2**32 - 1).

    Counted as the containers are built, each from what it holds (a
    container held twice counts twice), which is exact as long as no
    container changes after another took it in. torch's saves never do; a
    pickle that does (a cycle, a list filled after it was referenced) is
    counted again at the end, by :func:`_measure`. The scan stops early,
    with the count past the limit, once an exact count passes it.
    """
    table = _TABLE
    atom_widths = _ATOM_WIDTHS
    from_top = _FROM_TOP_COUNTS
    new_node = object.__new__
    stack: list[Value] = []
    marks: list[int] = []
    memo: dict[int, Value] = {}
    nodes: list[_Node] = []
    end = len(data)
    pos = 0
    unpack_from = struct.unpack_from
    stale = False
    most = deepest = hashed = 0
    try:
        while pos < end:
            code = data[pos]
            # The opcodes of torch's saves, most frequent first: LONG_BINPUT, BININT1, BINGET.
            if code == 0x72:
                index = unpack_from("<I", data, pos + 1)[0]
                if index > end:
                    return most, deepest, index, hashed
                memo[index] = stack[-1]
                pos += 5
                continue
            width = atom_widths[code]
            if width:
                stack.append(None)
                pos += width
                continue
            if code == 0x68 or code == 0x6A:  # BINGET, LONG_BINGET: a tensor's record starts with one
                record = _tensor_record(data, pos, memo, nodes)
                if record is not None:
                    pos, node = record
                    stack.append(node)
                    if node.objects > most:
                        most = node.objects
                    if node.depth > deepest:
                        deepest = node.depth
                    if not stale and (most > limit or deepest > MAX_DEPTH):
                        return most, deepest, 0, hashed
                    continue
                if code == 0x68:
                    stack.append(memo[data[pos + 1]])
                    pos += 2
                    continue
            if code == 0x58:  # BINUNICODE
                stack.append(None)
                pos += 5 + unpack_from("<I", data, pos + 1)[0]
                continue
            if code == 0x28:  # MARK
                marks.append(len(stack))
                pos += 1
                continue
            # Then the containers of each tensor's record (its storage's key, shape, stride, the rebuild's
            # arguments and call) and one-byte memo stores: what the table's general path does, less its lookups.
            count = from_top[code]
            if count or code == 0x74:
                if count:  # TUPLE1, TUPLE2, TUPLE3, BINPERSID, REDUCE
                    if len(stack) < count:
                        break
                    items = stack[-count:]
                    del stack[-count:]
                else:  # TUPLE
                    mark = marks.pop()
                    items = stack[mark:]
                    del stack[mark:]
                if items.count(None) == len(items):  # atoms alone: _Node's count, without its call
                    node = new_node(_Node)
                    node.items, node.used, node.objects, node.depth, node.chosen = items, False, 1 + len(items), 1, 0
                else:
                    node = _Node(items)
                    if node.chosen and code == 0x52:  # REDUCE: a call
                        hashed += _chosen_weight(node.items[1:])
                nodes.append(node)
                stack.append(node)
                pos += 1
                if node.objects > most:
                    most = node.objects
                if node.depth > deepest:
                    deepest = node.depth
                if hashed > MAX_CHOSEN_HASHES or (not stale and (most > limit or deepest > MAX_DEPTH)):
                    return most, deepest, 0, hashed
                continue
            if code == 0x71:  # BINPUT
                if pos + 2 > end:
                    break
                index = data[pos + 1]
                if index > end:
                    return most, deepest, index, hashed
                memo[index] = stack[-1]
                pos += 2
                continue
            entry = table[code]
            if entry is None:
                break
            layout, width, effect, count = entry
            start = pos + 1
            if layout == _NONE:
                pos = start
            elif layout == _FIXED:
                pos = start + width
            elif layout == _PREFIX4:
                pos = start + 4 + unpack_from("<I", data, start)[0]
            elif layout == _PREFIX1:
                pos = start + 1 + data[start]
            elif layout == _PREFIX8:
                pos = start + 8 + unpack_from("<Q", data, start)[0]
            elif layout == _LINE:
                pos = data.index(b"\n", start) + 1
            else:
                pos = data.index(b"\n", data.index(b"\n", start) + 1) + 1
            if pos > end:
                if layout == _PREFIX8:  # left to the unpickler, it would allocate it (see _LongerThanThePickle)
                    raise _LongerThanThePickle(pos - start - 8)
                break
            if effect == _ATOM:
                stack.append(None)
                continue
            if effect == _CHOSEN_ATOM:
                stack.append(_CHOSEN)
                continue
            if effect == _PUT:
                index = _memo_index(data, width, start, pos)
                if index > end:
                    return most, deepest, index, hashed
                memo[index] = stack[-1]
                continue
            if effect == _GET:
                stack.append(memo[_memo_index(data, width, start, pos)])
                continue
            if effect == _MARK:
                marks.append(len(stack))
                continue
            if effect == _FROM_TOP:
                if len(stack) < count:
                    break
                node = _Node(stack[-count:])
                del stack[-count:]
                nodes.append(node)
                stack.append(node)
                if node.chosen and code in _CALLS:
                    hashed += _chosen_weight(node.items[1:])
            elif effect == _FROM_MARK:
                mark = marks.pop()
                node = _Node(stack[mark:])
                del stack[mark:]
                nodes.append(node)
                stack.append(node)
                if code in _HASHES_KEYS or code in _HASHES_ITEMS or code in _CALLS:
                    hashed += _hashed_weight(code, node.items)
                    if code == _FROZENSET:  # XOR-combined item hashes: equal for many sets of small integers
                        node.chosen += 1
            elif effect == _NEW_CONTAINER:
                node = _Node([])
                nodes.append(node)
                stack.append(node)
                continue
            elif effect == _INTO_TOP or effect == _INTO_TOP_FROM_MARK:
                mark = len(stack) - count if effect == _INTO_TOP else marks.pop()
                items = stack[mark:]
                del stack[mark:]
                node = _filled(stack, nodes, items)
                stale = stale or node.used
                if code in _HASHES_KEYS or code in _HASHES_ITEMS:
                    hashed += _hashed_weight(code, items)
            elif effect == _MEMOIZE:
                memo[len(memo)] = stack[-1]
                continue
            elif effect == _POP:
                if stack and (not marks or marks[-1] < len(stack)):
                    stack.pop()
                elif marks:
                    marks.pop()
                continue
            elif effect == _POP_MARK:
                del stack[marks.pop():]
                continue
            elif effect == _DUP:
                stack.append(stack[-1])
                continue
            elif effect == _STOP:
                break
            else:
                continue
            if node.objects > most:
                most = node.objects
            if node.depth > deepest:
                deepest = node.depth
            if hashed > MAX_CHOSEN_HASHES or (not stale and (most > limit or deepest > MAX_DEPTH)):
                return most, deepest, 0, hashed
    except (IndexError, KeyError, ValueError, struct.error):
        pass  # malformed: the unpickler says how
    if stale:
        return (*_measure(nodes, limit), 0, hashed)
    return most, deepest, 0, hashed


def _tensor_record(data: bytes, pos: int, memo: dict[int, Value], nodes: list[_Node]) -> Optional[tuple[int, _Node]]:
    """Where a tensor's record (:data:`_TENSOR_RECORD`) starting at ``pos`` ends, and the node of its rebuild's
    call, with the memo and ``nodes`` as the general path leaves them; None where it is not one, or where the
    general path could count it otherwise (it then takes the record opcode by opcode, as before).

    That is: every fetch finds an atom (a global or a string) stored before the record, and no store is past
    the pickle's length (which the general path refuses). The nodes are those the general path makes, in its
    order, counted alike.
    """
    found = _TENSOR_RECORD.match(data, pos)
    if found is None:
        return None
    (rebuild, name, kind, key_length, key, key_put, key_get, location, id_put,
     size_items, size_put, stride_items, stride_put, hooks_get, hooks_put, args_put, call_put) = found.groups()
    if key is not None and len(key) != key_length[0]:
        return None  # the digits run on past the string: another layout of opcodes than the one matched
    from_bytes = int.from_bytes
    key_at = from_bytes(key_put, "little") if key_put is not None else -1
    id_at = from_bytes(id_put, "little")
    size_at = from_bytes(size_put, "little") if size_put is not None else -1
    stride_at = from_bytes(stride_put, "little") if stride_put is not None else -1
    hooks_at = from_bytes(hooks_put, "little")
    args_at = from_bytes(args_put, "little")
    call_at = from_bytes(call_put, "little")
    if max(key_at, id_at, size_at, stride_at, hooks_at, args_at, call_at) > len(data):
        return None
    # Each fetch must find an atom: stored before the record (it stores atoms only at key_at, which the location
    # fetch follows; the hooks' fetch follows the stores of the key, its id and the layout).
    get = memo.get
    for token in (rebuild, name, kind, key_get):
        if token is not None and get(token[1] if len(token) == 2 else from_bytes(token[1:], "little"), _MISSING) is not None:
            return None
    location_at = location[1] if len(location) == 2 else from_bytes(location[1:], "little")
    hooks_from = hooks_get[1] if len(hooks_get) == 2 else from_bytes(hooks_get[1:], "little")
    if location_at == key_at or get(location_at, _MISSING) is not None or get(hooks_from, _MISSING) is not None \
            or hooks_from in (key_at, id_at, size_at, stride_at):
        return None
    persistent_id = _made([None] * 5, 6, 1)  # ('storage', class, key, location, count)
    storage = _made([persistent_id], 7, 2)  # BINPERSID's result
    nodes.append(persistent_id)
    nodes.append(storage)
    size = _layout_node(size_items, nodes) if size_items is not None else None
    stride = _layout_node(stride_items, nodes) if stride_items is not None else None
    hooks = _made([None, None], 3, 1)  # OrderedDict()
    args = _made([storage, None, size, stride, None, hooks],
                 13 + (size.objects if size is not None else 1) + (stride.objects if stride is not None else 1), 3)
    call = _made([None, args], 2 + args.objects, 4)
    call.used = False
    nodes += (hooks, args, call)
    if key_at >= 0:
        memo[key_at] = None
    memo[id_at] = persistent_id
    if size is not None:
        memo[size_at] = size
    if stride is not None:
        memo[stride_at] = stride
    memo[hooks_at] = hooks
    memo[args_at] = args
    memo[call_at] = call
    return found.end(), call


def _made(items: list, objects: int, depth: int) -> _Node:
    """A node of a record, held by the next (``used``), of counts known from the record's form: as
    ``_Node(items)`` counts them, less its loop."""
    node = _new_node(_Node)
    node.items, node.used, node.objects, node.depth, node.chosen = items, True, objects, depth, 0
    return node


_new_node = object.__new__


def _layout_node(items: bytes, nodes: list[_Node]) -> _Node:
    """The node of a record's size or stride tuple, appended to ``nodes``."""
    last = items[-1]
    if last != 0x74:  # TUPLE1-3
        count = last - 0x84
    else:  # MARK, then that many integers of 2, 3 or 5 bytes
        count, at = 0, 1
        while at < len(items) - 1:
            at += _INT_WIDTHS[items[at]]
            count += 1
    node = _made([None] * count, 1 + count, 1)
    nodes.append(node)
    return node


_INT_WIDTHS = {ord("K"): 2, ord("M"): 3, ord("J"): 5}


def _hashed_weight(code: int, items: list[Value]) -> int:
    """What hashing ``items`` costs at worst, counted in objects whose hash the file chooses."""
    return _chosen_weight(items[::2] if code in _HASHES_KEYS else items)


def _chosen_weight(values: list[Value]) -> int:
    # A key holding a chosen hash costs a comparison per object it holds, each time it meets a colliding key.
    return sum(value.objects for value in values if value is not None and value.chosen)


def _memo_index(data: bytes, width: int, start: int, end: int) -> int:
    if width == 1:
        return data[start]
    if width == 4:
        return struct.unpack_from("<I", data, start)[0]
    return int(data[start:end - 1])  # PUT and GET: the index as a decimal line


def _filled(stack: list[Value], nodes: list[_Node], items: list[Value]) -> _Node:
    """The container on top of the stack, given ``items``; an atom there (a global given state) becomes one."""
    top = stack[-1]
    if top is None or top is _CHOSEN:
        top = _Node([])
        nodes.append(top)
        stack[-1] = top
    added = _Node(items)  # what the items add, less the one object it counts for itself
    top.items.extend(items)
    top.objects = min(top.objects + added.objects - 1, _CAP)
    top.chosen = min(top.chosen + added.chosen, _CAP)
    if added.depth > top.depth:
        top.depth = added.depth
    return top


def _measure(nodes: list[_Node], limit: int) -> tuple[int, int]:
    """The most objects a walk of any one container meets, and the deepest nesting, each capped past ``limit``.

    One pass over the graph: every container's count and depth are computed
    once (memoized), so the pass is linear however often containers are
    referenced. A container met again while it is being counted (a cycle)
    counts as one object, as walks that remember what they saw treat it.
    """
    counted: dict[int, tuple[int, int]] = {}
    in_progress: set[int] = set()
    most = deepest = 0
    cap = limit + 1
    for root in nodes:
        if id(root) in counted:
            continue
        work: list[tuple[_Node, int]] = [(root, 0)]
        in_progress.add(id(root))
        while work:
            node, index = work[-1]
            while index < len(node.items):
                child = node.items[index]
                index += 1
                if child is not None and child is not _CHOSEN and id(child) not in counted and id(child) not in in_progress:
                    work[-1] = (node, index)
                    work.append((child, 0))
                    in_progress.add(id(child))
                    break
            else:
                objects, depth = 1, 1
                for child in node.items:
                    if child is None or child is _CHOSEN:
                        objects += 1
                    else:
                        known = counted.get(id(child))
                        if known is not None:
                            objects += known[0]
                            if known[1] >= depth:
                                depth = known[1] + 1
                        else:  # a cycle back to a container being counted
                            objects += 1
                if objects > cap:
                    objects = cap
                counted[id(node)] = (objects, depth)
                in_progress.discard(id(node))
                work.pop()
                if objects > most:
                    most = objects
                if depth > deepest:
                    deepest = depth
                continue
    return most, deepest
