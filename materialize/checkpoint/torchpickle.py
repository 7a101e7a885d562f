"""torch's pickled objects read onto ``meta``: what zip and legacy torch files share.

The object ``torch.save`` was given is unpickled with torch's weights-only
unpickler, classes it does not allow replaced by inert stand-ins (see
:mod:`.standins`), or, only with ``trust_pickle``, the full pickler to
rebuild a pickled module. Every storage is created on ``meta`` and noted
(:class:`StorageRef`), so each tensor can then be located in the file by its
format's reader (:func:`tensor_info`).
"""

from __future__ import annotations

import codecs
import collections
import io
import math
import pickle
import re
import reprlib
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from torch import _weights_only_unpickler, nn

from ..errors import CheckpointError, UnsafeCheckpointError, UnsupportedFormatError, first_line, summarize_names
from .base import SavedTensor, TensorInfo, make_info, shape_fits_int64
from .located import located_infos
from .payload import Kinds, Payload, find_payload as payload_of
from .pickle_budget import check_budget
from .pickle_scan import hostile_calls, quantized_tensors
from .plainrecords import PlainStorage, PlainTensor, plain_storage, plain_tensor
from .sealed import Unchangeable, sealed_call
from .setstates import names_own_setstate, watched_build
from .standins import (
    INERT_GLOBALS, CalledStandIn, StandIn, is_module_state, is_numpy_array, module_state, stand_in_class,
)

_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 60, 60


def brief(value: Any) -> str:
    """A value of the file, for an error message: a few levels and items of it, whatever its size."""
    try:
        return _BRIEF.repr(value)
    except Exception:  # a stand-in's or a hostile object's repr may fail: the message must not
        return f"<{type(value).__name__}>"


class StorageRef:
    def __init__(self, key: str, nbytes: int) -> None:
        self.key = key
        self.nbytes = nbytes


def persistent_loader(path: Path, refs: dict[int, StorageRef], *, records: bool = False):
    """The ``persistent_load`` of a torch pickle: each storage made on meta and noted in ``refs``, or with
    ``records``, a :class:`.plainrecords.PlainStorage` (the plain path's), which makes one only if asked."""
    dtypes: dict[str, torch.dtype] = {}  # storage key -> the dtype it was first named with

    def persistent_load(saved_id: Any) -> Any:
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5):
            raise CheckpointError(f"unexpected persistent id {brief(saved_id)} in data.pkl", path=path)
        _, storage_type, key, _location, numel = saved_id
        if isinstance(storage_type, _StorageKind):  # the plain path's (first: asking a class for it is slower)
            dtype = storage_type.dtype
        elif storage_type is torch.UntypedStorage:
            dtype = torch.uint8
        else:
            dtype = getattr(storage_type, "_dtype", None) or getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype) or type(numel) is not int or numel < 0:
            raise CheckpointError(f"malformed storage record {brief(key)} in data.pkl", path=path)
        name = str(key)
        first = dtypes.setdefault(name, dtype)
        if first != dtype:  # torch.load would read it as the first dtype named; torch.save never writes this
            raise CheckpointError(
                f"storage record data/{key} is named as {first} and as {dtype}; torch.save never writes one storage "
                "with two dtypes", path=path)
        if records:
            return plain_storage(name, numel * dtype.itemsize, dtype, refs)
        storage = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
        refs[storage._cdata] = StorageRef(name, numel * dtype.itemsize)
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    return persistent_load


class _TrustedUnpickler(pickle.Unpickler):
    pass


class _WatchingUnpickler(pickle._Unpickler):
    """Python's own unpickler, for a trusted pickle naming a module class with a ``__setstate__`` of its own:
    each such call is watched (see :mod:`.setstates`), which the C unpickler cannot let anyone do."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, *, path: Path) -> None:
        super().__init__(file, encoding="utf-8")
        self.path = path

    def load_build(self) -> None:
        watched_build(self.stack[-2], self.stack[-1], lambda: pickle._Unpickler.load_build(self), self.path)

    dispatch[pickle.BUILD[0]] = load_build


class _NotPlain(Exception):
    pass


class _StorageKind(Unchangeable):
    """What a storage class stands for in a persistent id: its dtype. Unlike the class, it cannot be called."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        object.__setattr__(self, "dtype", dtype)


def _plain_globals() -> dict[str, Any]:
    untyped = _StorageKind(torch.uint8)
    named: dict[str, Any] = {"torch.UntypedStorage": untyped, "torch.storage.UntypedStorage": untyped}
    legacy = getattr(torch.storage, "_LegacyStorage", None)  # without it, such files take the weights-only path
    for name in dir(torch):
        candidate = getattr(torch, name)
        if isinstance(candidate, torch.dtype):  # dtypes without a storage class of their own (float8, uint16)
            named[f"torch.{name}"] = candidate
        elif (legacy is not None and name.endswith("Storage") and isinstance(candidate, type)
                and issubclass(candidate, legacy)):
            named[f"torch.{name}"] = _StorageKind(getattr(candidate, "_dtype", None) or candidate.dtype)
    rebuilds = {
        f"torch._utils.{name}": sealed_call(_plain_rebuild(getattr(torch._utils, name), dtype_given=name.endswith("v3")))
        for name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3") if hasattr(torch._utils, name)
    }
    # Beside a state dict, checkpoints often keep shapes, devices, bytes (protocol 2 pickles them as a call
    # of _codecs.encode) and parameters with attributes; each is on torch's weights-only allowlist too.
    beside = {
        "torch.Size": torch.Size,
        "torch.device": torch.device,
        "_codecs.encode": codecs.encode,
        "builtins.set": set,
        "builtins.complex": complex,
        "builtins.bytearray": sealed_call(_bytearray_of_data),
        "collections.Counter": sealed_call(collections.Counter),
        "torch._utils._rebuild_parameter_with_state": sealed_call(_plain_parameter_with_state),
    }
    beside.update({f"__builtin__.{kind.__name__}": kind for kind in (set, complex)})  # protocol 2's names
    beside["__builtin__.bytearray"] = beside["builtins.bytearray"]
    return {
        **rebuilds,
        "torch._utils._rebuild_parameter": sealed_call(_plain_parameter),
        "collections.OrderedDict": collections.OrderedDict,
        **beside,
        **named,
    }


def _bytearray_of_data(*args: Any) -> bytearray:
    """``bytearray`` of the bytes a file holds; given a count (``bytearray(3_000_000_000)``, a few bytes of a
    pickle asking for gigabytes), not plain: the weights-only path refuses it by name."""
    if args and not isinstance(args[0], (bytes, bytearray, str)):
        raise _NotPlain("bytearray of a count")
    return bytearray(*args)


# What each plain rebuild made, by thread: (tensor, offset, size, stride), checked once the pickle is read.
_MADE = threading.local()


def _plain_rebuild(rebuild: Callable[..., torch.Tensor], *, dtype_given: bool) -> Callable[..., torch.Tensor]:
    """torch's tensor rebuild, for meta storages, at a third of its cost; layouts checked as written.

    A tensor without hooks or metadata (every tensor of a state dict) is set
    straight onto its storage: torch's own rebuild also looks for a fake
    tensor mode on every call, most of its cost. On a storage of
    :func:`persistent_loader`'s records, it is not made at all where its
    layout is one torch makes as given: its record stands for it (see
    :mod:`.plainrecords`). A negative layout, which
    meta storages would quietly accept, sends the file to the weights-only
    path, whose opcode scan (:func:`.pickle_scan.hostile_calls`) refuses
    it with the layout named. So does a layout changed after the rebuild (a
    BUILD on the tensor calls ``Tensor.__setstate__``, which sets it anew),
    found when the pickle is read (:func:`_layouts_kept`).
    """
    def rebuild_checked(storage: Any, storage_offset: int, size: tuple, stride: tuple, requires_grad: bool,
                        backward_hooks: Any, *rest: Any) -> torch.Tensor:
        dtype = rest[0] if dtype_given else storage.dtype
        metadata = rest[1:] if dtype_given else rest
        bare = not (backward_hooks or any(metadata))
        if bare and type(storage) is PlainStorage:  # the fast path's: a record where torch makes the layout as given
            record = plain_tensor(storage, storage_offset, size, stride, dtype, requires_grad)
            if record is not None:  # (which no negative value is)
                return record
        if storage_offset < 0 or any(d < 0 for d in size) or any(s < 0 for s in stride):
            raise _NotPlain("negative layout")
        if type(storage) is PlainStorage:  # else a meta tensor, as below: torch's own checks and errors
            storage = storage.typed()
        if not bare or not isinstance(storage, torch.storage.TypedStorage):
            return rebuild(storage, storage_offset, size, stride, requires_grad, backward_hooks, *rest)
        tensor = torch.empty((0,), dtype=dtype, device="meta").set_(storage._untyped_storage, storage_offset, size, stride)
        if requires_grad:
            tensor.requires_grad = True
        _MADE.tensors.append((tensor, storage_offset, size, stride))
        return tensor

    return rebuild_checked


def _meta_tensor(record: PlainTensor) -> torch.Tensor:
    """The meta tensor a record stands for, where torch's own code must be given one; noted as rebuilds' are."""
    tensor = record.tensor()
    _MADE.tensors.append((tensor, record.fields[1], record.shape, record.fields[3]))
    return tensor


def _plain_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> Any:
    """torch's parameter rebuild; of a record, the record with its gradient flag, where it may have it."""
    if type(data) is PlainTensor:
        record = data.with_grad(requires_grad)
        if record is not None:
            return record
        data = _meta_tensor(data)
    return torch._utils._rebuild_parameter(data, requires_grad, backward_hooks)


def _plain_parameter_with_state(data: Any, *args: Any) -> Any:
    """torch's rebuild of a parameter with attributes, which it sets: of a meta tensor, always."""
    return torch._utils._rebuild_parameter_with_state(_meta_tensor(data) if type(data) is PlainTensor else data, *args)


_PLAIN_GLOBALS = _plain_globals()


class _PlainStateUnpickler(pickle.Unpickler):
    """Python's own (C) unpickler, for what nearly every checkpoint holds: tensors in (ordered) dicts.

    torch's weights-only unpickler is written in Python and costs about 100 us
    per tensor (2 s for 18,000); this one is ten times faster. It knows only
    the globals a plain state dict names: tensor and parameter rebuilds,
    ``OrderedDict``, dtypes, and storage kinds that cannot be called. Anything else,
    and any error at all, sends the file to the weights-only path, which
    decides what is refused and how it is reported. Each global it hands out
    refuses attribute writes (builtin types, dtypes, :class:`.sealed.Unchangeable`),
    so a BUILD on one (a file setting the dtype of every later load's float
    storages) is such an error, never a change seen by the next file.
    """

    def find_class(self, module: str, name: str) -> Any:
        found = _PLAIN_GLOBALS.get(f"{module}.{name}")
        if found is None:
            raise _NotPlain(f"{module}.{name}")
        return found


def _unpickle_plain(
    path: Path, data: bytes, refs: dict[int, StorageRef], persistent: Callable[[Path, dict[int, StorageRef]], Any],
    *, records: bool = False,
) -> Any:
    """The object a plain pickle holds, or :data:`_NOT_PLAIN`; with ``records``, its tensors of zip storages as
    :class:`.plainrecords.PlainTensor` where they can be."""
    unpickler = _PlainStateUnpickler(io.BytesIO(data), encoding="utf-8")
    unpickler.persistent_load = persistent_loader(path, refs, records=True) if records and persistent is persistent_loader \
        else persistent(path, refs)
    _MADE.tensors = []
    try:
        loaded = unpickler.load()
        return loaded if _layouts_kept(_MADE.tensors) else _NOT_PLAIN
    except Exception:  # not plain, or not well-formed: the weights-only path (which starts from clear refs) says which
        return _NOT_PLAIN
    finally:
        _MADE.tensors = []


def _layouts_kept(made: list[tuple[torch.Tensor, int, tuple, tuple]]) -> bool:
    """Whether every tensor still has the layout its rebuild gave it (no BUILD set another)."""
    return all(tensor.storage_offset() == offset and tensor.stride() == stride and tensor.shape == size
               for tensor, offset, size, stride in made)


_NOT_PLAIN = object()


class _WeightsOnlyUnpickler(_weights_only_unpickler.Unpickler):
    def _check_set_item_target(self, opcode: str) -> None:
        # A stand-in for a dict subclass takes its items inertly; a defaultdict is let through as one.
        if not isinstance(self.stack[-1], (StandIn, collections.defaultdict)):
            super()._check_set_item_target(opcode)


_MAX_STAND_INS = 256
_STAND_IN_SCOPE = getattr(torch.serialization, "safe_globals", None)  # torch 2.5+; before it, no stand-ins


def unpickle(
    path: Path, data: bytes, refs: dict[int, StorageRef], *, trust_pickle: bool,
    persistent: Callable[[Path, dict[int, StorageRef]], Any] = persistent_loader, what: str = "data.pkl",
    records: bool = False,
) -> tuple[Any, list[tuple[Any, Any, Any]]]:
    """The object ``torch.save`` was given, its tensors on meta; classes torch does not allow become stand-ins.

    Also the negative layouts (offset, size, stride) its tensors were given,
    which meta storages would quietly accept (see :func:`read_payload`). A
    plain state dict is read at C speed (:class:`_PlainStateUnpickler`),
    checking layouts as it rebuilds; anything else goes through torch's
    weights-only unpickler, after one walk of the opcodes
    (:func:`.pickle_scan.hostile_calls`) that finds them and refuses counted
    allocations before anything is built.
    Each class the weights-only unpickler refuses is given a stand-in (see
    :mod:`.standins`) and the pickle is read again, up to a bound; a call of
    anything it names is refused. While a read runs, torch's allowlist (one
    per process) holds its stand-ins: inert, so another thread's
    ``torch.load`` that meets them is no less safe.
    With ``records``, the plain path gives the tensors of :func:`persistent_loader`'s storages as
    :class:`.plainrecords.PlainTensor` where it can (:func:`tensor_info` takes both).
    """
    if trust_pickle:
        layouts, _, named = hostile_calls(data)
        # A zip file's storages hold their bytes as the pickle is read, so a module's __setstate__ may change them;
        # the legacy format's are filled after the pickle, over whatever it did (torch.load's values are the bytes).
        watch = persistent is persistent_loader and names_own_setstate(named)
        unpickler: Any = (_WatchingUnpickler(io.BytesIO(data), path=path) if watch
                          else _TrustedUnpickler(io.BytesIO(data), encoding="utf-8"))
        unpickler.persistent_load = persistent(path, refs)
        loaded = _load(path, unpickler, trust_pickle=True, what=what)
        if not watch and persistent is persistent_loader and _holds_own_setstate(loaded):
            # the scan of the pickle's names missed such a class (a name built at run time): read it again, watched
            unpickler = _WatchingUnpickler(io.BytesIO(data), path=path)
            unpickler.persistent_load = persistent(path, refs)
            loaded = _load(path, unpickler, trust_pickle=True, what=what)
        return loaded, layouts
    check_budget(data, path=path, what=what)
    plain = _unpickle_plain(path, data, refs, persistent, records=records)
    if plain is not _NOT_PLAIN:
        return plain, []  # its rebuilds checked the layouts on the way
    protocol = data[1] if len(data) > 1 and data[0] == pickle.PROTO[0] else 2
    if protocol >= 4:
        raise UnsupportedFormatError(
            f"was saved with pickle protocol {protocol} (torch.save(..., pickle_protocol={protocol})) and its "
            f"{what} holds objects beside tensors and plain data, which torch's weights-only reader does not read "
            "in that protocol; re-save it with torch.save's default protocol, or pass trust_pickle=True "
            "(CLI: --trust-pickle) if you trust the file", path=path)
    if protocol == 3:  # torch's reader warns at protocol 3's mark, then reads the opcodes it knows all the same
        data = pickle.PROTO + bytes([2]) + data[2:]
    layouts, allocations, named = hostile_calls(data)
    if allocations:  # torch's reader would make them: gigabytes asked for by a few bytes
        raise CheckpointError(
            f"{what} calls {allocations[0]} with a count, which would allocate memory the file does not hold; "
            "torch.save never writes that", path=path)
    stand_ins: dict[str, Any] = {}  # stand-in classes, and the inert globals let through as themselves
    _add_stand_ins(stand_ins, _refused_globals(path, named, what))
    while True:
        refs.clear()
        unpickler = _WeightsOnlyUnpickler(io.BytesIO(data), encoding="utf-8")
        unpickler.persistent_load = persistent(path, refs)
        try:
            if not stand_ins:
                return _load(path, unpickler, trust_pickle=False, what=what), layouts
            with _STAND_IN_SCOPE(list(stand_ins.values())):
                return _load(path, unpickler, trust_pickle=False, what=what), layouts
        except _RefusedGlobal as refused:  # one the probes did not find: a name they could not spell
            if refused.name in stand_ins:
                raise refused.error from None
            _add_stand_ins(stand_ins, [refused])


def _refused_globals(path: Path, named: list[str], what: str) -> list[_RefusedGlobal]:
    """The globals among ``named`` (``module name``) that torch's weights-only reader refuses, each asked of it
    on a pickle naming that global alone.

    Found one at a time, by reading the whole pickle again after each
    refusal, a file naming many classes after megabytes of data cost a read
    per class: 20 classes after 1 MB took 8 s.
    """
    refused = []
    if _STAND_IN_SCOPE is None:
        return refused
    for name in named[:_MAX_STAND_INS + 1]:
        module, _, attr = name.partition(" ")
        if "\n" in name or not attr:
            continue  # not a name the text opcode can spell: left to the read itself
        probe = pickle.PROTO + b"\x02" + pickle.GLOBAL + f"{module}\n{attr}\n".encode("utf-8", "surrogatepass") + pickle.STOP
        unpickler = _WeightsOnlyUnpickler(io.BytesIO(probe), encoding="utf-8")
        try:
            _load(path, unpickler, trust_pickle=False, what=what)
        except _RefusedGlobal as found:
            refused.append(found)
        except Exception:  # noqa: BLE001  (anything else about the global is for the read itself to report)
            continue
    return refused


def _add_stand_ins(stand_ins: dict[str, Any], refused: list[_RefusedGlobal]) -> None:
    """Stand-ins for the refused globals, or the first one's refusal: builtins (getattr, eval, ...) are never
    stood in for, nor more than :data:`_MAX_STAND_INS` classes."""
    for one in refused:
        if _STAND_IN_SCOPE is None or len(stand_ins) >= _MAX_STAND_INS:
            raise one.error from None
        if one.name in INERT_GLOBALS:
            stand_ins[one.name] = INERT_GLOBALS[one.name]
        elif "." in one.name:
            stand_ins[one.name] = stand_in_class(one.name)
        else:
            raise one.error from None


class _RefusedGlobal(Exception):
    def __init__(self, name: str, error: UnsafeCheckpointError) -> None:
        super().__init__(name)
        self.name = name
        self.error = error


def _load(path: Path, unpickler: Any, *, trust_pickle: bool, what: str) -> Any:
    try:
        return unpickler.load()
    except CheckpointError:
        raise
    except CalledStandIn as call:
        raise UnsafeCheckpointError(
            f"refused to unpickle a call of '{call.name}': calling it could run code from the file. If it is a "
            "class you know is safe (an Enum of a config, say), allow just it with "
            "torch.serialization.add_safe_globals; if you trust the file, pass trust_pickle=True (CLI: --trust-pickle)",
            path=path,
        ) from None
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if found and not trust_pickle:
            error = UnsafeCheckpointError(
                f"refused to unpickle global '{found.group(1)}': it is not plain tensor data and loading it "
                "could run code from the file. To allow this one class, if you know it is safe, register it with "
                "torch.serialization.add_safe_globals; if the file is a pickled model (torch.save(model)) that you "
                "trust, pass trust_pickle=True (CLI: --trust-pickle) to build the model from it",
                path=path,
            )
            if str(exc).startswith("Unsupported global:"):
                raise _RefusedGlobal(found.group(1), error) from None
            raise error from None
        listed = re.search(r"Can only (?:append to|extend) lists, but got <class '([\w.]+)'>", str(exc))
        if listed and not trust_pickle:  # a list subclass is filled by calling its own append or extend
            raise UnsafeCheckpointError(
                f"refused to unpickle an object of class '{listed.group(1)}', a list subclass: filling it calls "
                "its own methods, which could run code from the file; if you trust the file, pass "
                "trust_pickle=True (CLI: --trust-pickle)",
                path=path,
            ) from None
        raise CheckpointError(f"{what} is malformed: {first_line(exc)}", path=path) from None
    except Exception as exc:  # a hostile pickle can raise anything the unpickler touches
        raise CheckpointError(f"cannot unpickle {what}: {type(exc).__name__}: {first_line(exc)}", path=path) from None


def read_payload(
    path: Path, data: bytes, refs: dict[int, StorageRef], *, trust_pickle: bool,
    persistent: Callable[[Path, dict[int, StorageRef]], Any] = persistent_loader, what: str = "data.pkl",
    state_dict_key: Optional[str] = None,
) -> Payload:
    """The model state (tensors on meta) of the pickled object ``data`` (see :func:`find_payload`); hostile
    layouts refused."""
    if b"_rebuild_qtensor" in data:  # torch cannot make one on meta: it would fail deep inside, warning
        _refuse_quantized(path, data)
    unpickled, hostile = unpickle(path, data, refs, trust_pickle=trust_pickle, persistent=persistent, what=what,
                                  records=True)
    try:
        found = find_payload(unpickled, state_dict_key=state_dict_key)
        if found.extra_states and _holds_records(found.extra_states):  # handed on as they are: read again, for
            unpickled, hostile = unpickle(  # any tensor in them to be torch's, as it was before records
                path, data, refs, trust_pickle=trust_pickle, persistent=persistent, what=what)
            found = find_payload(unpickled, state_dict_key=state_dict_key)
        payload, module = found.tensors, found.module
    except CheckpointError as error:
        error.path = error.path or str(path)
        raise
    except (TypeError, AttributeError, ValueError, RecursionError) as exc:  # objects the file made, misbehaving
        raise CheckpointError(f"{what} holds a malformed structure: {type(exc).__name__}: {first_line(exc)}",
                              path=path) from None
    if hostile:
        offset, size, stride = hostile[0]
        raise CheckpointError(
            f"a tensor has a negative size, stride or offset ({list(size)}, {list(stride)}, {offset})", path=path
        )
    if not payload and module is None and not (isinstance(unpickled, dict) and not unpickled):
        raise UnsupportedFormatError(f"holds no model tensors: its {what} is {_outline(unpickled)}", path=path)
    partitioned = _partitioned_by_zero3(unpickled, payload)
    if partitioned:
        raise UnsupportedFormatError(
            f"is a DeepSpeed ZeRO-3 save: its parameters ({summarize_names(partitioned, limit=3)}) are empty here, "
            "partitioned into the *_optim_states.pt files beside it; gather them with the zero_to_fp32.py script "
            "DeepSpeed writes into the checkpoint folder, and load what it writes", path=path)
    return found


def _holds_own_setstate(value: Any) -> bool:
    """Whether a module of a class with a ``__setstate__`` of its own is in ``value`` (a module, or containers of
    them, as training checkpoints hold them): a safety net under the scan of the pickle's names."""
    from .setstates import has_own_setstate

    work, seen = [value], set()
    while work:
        item = work.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.nn.Module):
            if any(has_own_setstate(type(module)) for module in item.modules()):
                return True
        elif isinstance(item, dict):
            work.extend(dict.values(item))
        elif isinstance(item, (list, tuple)):
            work.extend(item)
    return False


def _holds_records(value: Any) -> bool:
    """Whether a record (:mod:`.plainrecords`) is among the containers of ``value``: builtin ones, all the plain
    path builds. Each container is walked once, however often it is referred to."""
    seen: set[int] = set()
    work = [value]
    while work:
        item = work.pop()
        if type(item) in (PlainTensor, PlainStorage):
            return True
        if isinstance(item, (dict, list, tuple, set, frozenset)) and id(item) not in seen:
            seen.add(id(item))
            if isinstance(item, dict):  # keys and values, not items(): a pair made here and freed would leave
                work.extend(dict.keys(item))  # its id in `seen` for the next object to reuse
                work.extend(dict.values(item))
            else:
                work.extend(item)
    return False


def _refuse_quantized(path: Path, data: bytes) -> None:
    """Raise naming the quantized tensors ``data`` rebuilds, if it rebuilds any."""
    calls, names = quantized_tensors(data)
    if not calls and not _QUANTIZED_REBUILD.search(data):
        return  # the name only as text (in a key, say)
    also = f" (so are {summarize_names(names[1:], limit=3)})" if len(names) > 1 else ""
    raise UnsupportedFormatError(
        ("is quantized" + also if names else "holds quantized tensors")
        + ": torch.ao's qint8/quint8 tensors, with scales and zero points, are not read by this loader; save "
        "their dequantize() instead, or load the file with torch.load",
        path=path, tensor=names[0] if names else None)


# How a pickle names torch's rebuild of a quantized tensor: GLOBAL's "module\nname" (protocols 0-3),
# or the two strings STACK_GLOBAL takes (4 and 5: a memo mark, an opcode and a length between them);
# where the walk of the opcodes stops short (an opcode it does not model), this finds the usual case.
_QUANTIZED_REBUILD = re.compile(rb"torch\._utils(?:\n|[\x00-\xff]{1,4})_rebuild_qtensor")


def _partitioned_by_zero3(unpickled: Any, payload: dict[str, torch.Tensor]) -> list[str]:
    """Parameters a DeepSpeed model-states file records a shape for but holds empty (ZeRO-3 partitions them)."""
    if not isinstance(unpickled, dict) or "ds_version" not in unpickled:
        return []
    groups = dict.get(unpickled, "param_shapes")
    groups = groups if isinstance(groups, list) else [groups]
    return [name for group in groups if isinstance(group, dict) for name, shape in dict.items(group)
            if isinstance(shape, tuple) and _is_shape(shape) and _product_positive(shape) and name in payload and payload[name].numel() == 0]


def _product_positive(shape: tuple[int, ...]) -> bool:
    """``math.prod(shape) > 0`` without the product: a file's thousands of huge sizes would multiply in quadratic time."""
    return 0 not in shape and sum(size < 0 for size in shape) % 2 == 0


def _is_shape(value: tuple) -> bool:
    return all(type(size) is int for size in value)


def _outline(obj: Any) -> str:
    """What an object without weights is, in a few words: a dict by its keys, else by its type."""
    if isinstance(obj, dict):
        keys = [key if isinstance(key, str) else brief(key) for key in obj]
        return f"a dict of {len(keys)} entries ({summarize_names(keys, limit=6)})"
    return f"a {type(obj).__name__}"


def read_bare_tensor(path: Path, data: bytes, refs: dict[int, StorageRef], *, what: str) -> torch.Tensor:
    """The one tensor (on meta) a pickle holds, as ``torch.save(tensor)`` writes it; anything else is refused."""
    unpickled, hostile = unpickle(path, data, refs, trust_pickle=False)
    if not isinstance(unpickled, torch.Tensor):
        raise CheckpointError(f"{what} holds a {type(unpickled).__name__}, not a tensor", path=path)
    if hostile:
        raise CheckpointError(f"{what} has a negative size, stride or offset", path=path)
    return unpickled


def _module_tensors(value: Any) -> Optional[dict[str, torch.Tensor]]:
    if not isinstance(value, nn.Module):
        return None
    named = dict(value.named_parameters(remove_duplicate=False))
    named.update(value.named_buffers(remove_duplicate=False))
    return {name: tensor for name, tensor in named.items() if tensor is not None}


def _module_state(value: Any, prefix: str) -> Optional[Iterable[tuple[str, torch.Tensor]]]:
    return module_state(value, prefix) if is_module_state(value) else None


# What this module's unpickling makes: meta tensors, records, modules (trusted) and stand-ins.
TORCH_KINDS = Kinds(is_tensor=lambda value: isinstance(value, (torch.Tensor, PlainTensor)),
                    module_tensors=_module_tensors, module_state=_module_state, is_numpy_array=is_numpy_array)


def find_payload(obj: Any, *, state_dict_key: Optional[str] = None) -> Payload:
    """The model state inside what ``torch.save`` was given, as :func:`.payload.find_payload` finds it in what
    this module unpickles."""
    return payload_of(obj, TORCH_KINDS, state_dict_key=state_dict_key)


_DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)}


def tensor_info(
    path: Path,
    name: str,
    tensor: torch.Tensor,
    refs: dict[int, StorageRef],
    records: dict[str, tuple[int, int]],
    file_size: int,
) -> TensorInfo:
    def fail(reason: str) -> CheckpointError:
        return CheckpointError(reason, path=path, tensor=name)

    if type(tensor) is PlainTensor:
        return _record_info(path, name, tensor, records, file_size)
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise fail(f"has layout {tensor.layout}; only dense tensors are supported")
    if tensor.is_conj() or tensor.is_neg():  # torch.load resolves the bit on use; the bytes alone are not the values
        bit, resolve = ("conjugate", "resolve_conj") if tensor.is_conj() else ("negative", "resolve_neg")
        raise fail(f"was saved as a lazy view with the {bit} bit set, whose values are not its stored bytes; this "
                   f"loader reads stored bytes only: re-save it as tensor.{resolve}()")
    ref = refs.get(tensor.untyped_storage()._cdata)
    if ref is None:
        raise fail("its storage is not a record of this file")
    if ref.key not in records:
        raise fail(f"storage record data/{ref.key} is missing from the zip")
    record_offset, record_size = records[ref.key]
    if record_size < ref.nbytes:
        raise fail(f"storage record data/{ref.key} holds {record_size} bytes, {ref.nbytes} expected")
    if record_offset + ref.nbytes > file_size:
        raise fail(f"storage record data/{ref.key} runs past the end of the file (truncated?)")
    itemsize = tensor.element_size()
    shape = tuple(tensor.shape)
    stride = tensor.stride()
    storage_offset = tensor.storage_offset()
    if storage_offset < 0 or any(d < 0 for d in shape) or any(st < 0 for st in stride):
        raise fail(f"has a negative size, stride or offset ({list(shape)}, {list(stride)}, {storage_offset})")
    if not shape_fits_int64(list(shape)):  # even empty: torch.empty computes its strides
        raise fail(f"has shape {list(shape)}, larger than any tensor can be (dimensions past 2**63)")
    start = storage_offset * itemsize
    contiguous = tensor.is_contiguous()
    numel = math.prod(shape)
    if numel == 0:
        span = 0
    elif contiguous:
        span = numel * itemsize
    else:
        span = (sum((size - 1) * step for size, step in zip(shape, stride)) + 1) * itemsize
    if start + span > ref.nbytes and numel:  # an empty view reads nothing, wherever torch's set_ lets it start
        raise fail(f"view of bytes [{start}, {start + span}) lies outside its {ref.nbytes}-byte storage")
    if not numel and start > ref.nbytes:  # and is said to start where its storage ends, not past the file
        start = ref.nbytes
    dtype_name = _DTYPE_NAMES.get(tensor.dtype) or str(tensor.dtype).removeprefix("torch.")
    if contiguous:
        return make_info(name, dtype_name, itemsize, shape, path, record_offset + start, storage=record_offset,
                         numel=numel)
    # A strided view (a transposed save) is rare among the tensors this path reads: the dataclass's own __init__
    return TensorInfo(name, dtype_name, itemsize, shape, path, record_offset + start, stride=stride, span_nbytes=span,
                      storage=record_offset)


def tensor_infos(path: Path, tensors: dict[str, Any], refs: dict[int, StorageRef], records: dict[str, tuple[int, int]],
                 file_size: int) -> dict[str, TensorInfo]:
    """:func:`tensor_info` of each named tensor, in order: records (see :mod:`.plainrecords`) by
    :func:`.located.located_infos`, meta tensors by :func:`tensor_info`."""
    infos: dict[str, TensorInfo] = {}
    for name, tensor in tensors.items():
        if type(tensor) is PlainTensor:
            infos[name] = _record_info(path, name, tensor, records, file_size)
        else:
            infos[name] = tensor_info(path, name, tensor, refs, records, file_size)
    return infos


def located_extra_states(path: Path, extra_states: dict[str, Any], refs: dict[int, StorageRef],
                         records: dict[str, tuple[int, int]], file_size: int) -> dict[str, Any]:
    """Each extra state with the tensors of the file's storages in its dicts, lists and tuples as
    :class:`~.base.SavedTensor` (each placed as :func:`tensor_info` places a state dict's), read with the load
    and handed to ``set_extra_state`` as ``torch.load`` makes them; a state holding none is left as it is.
    What the file made once (a tensor, a container it refers to twice) stays one object."""
    made: dict[int, Any] = {}  # id of a tensor or container met -> what it became
    open_: set[int] = set()  # the containers being walked: one holding itself is left as it is

    def located(value: Any, where: str) -> Any:
        known = made.get(id(value))
        if known is not None:
            return known
        if type(value) is PlainTensor or (isinstance(value, torch.Tensor) and value.is_meta
                                          and value.untyped_storage()._cdata in refs):
            info = tensor_info(path, where, value, refs, records, file_size)
            if type(value) is PlainTensor:
                saved = SavedTensor(info, value.fields[5], value.fields[9])
            else:
                saved = SavedTensor(info, value.requires_grad, isinstance(value, nn.Parameter))
            made[id(value)] = saved
            return saved
        if type(value) not in (dict, collections.OrderedDict, list, tuple) or id(value) in open_:
            return value  # anything else as it is: refused while planning if it holds tensors
        open_.add(id(value))
        if isinstance(value, dict):
            pairs = [(key, located(item, f"{where}[{key!r}]")) for key, item in dict.items(value)]
            changed = any(item is not dict.__getitem__(value, key) for key, item in pairs)
            rebuilt: Any = type(value)(pairs) if changed else value
        else:
            items = [located(item, f"{where}[{index}]") for index, item in enumerate(value)]
            rebuilt = type(value)(items) if any(new is not old for new, old in zip(items, value)) else value
        open_.discard(id(value))
        made[id(value)] = rebuilt
        return rebuilt

    if not extra_states:
        return extra_states
    try:
        return {name: located(value, name) for name, value in extra_states.items()}
    except RecursionError:  # (a trusted pickle's: the weights-only reads bound how deep containers nest)
        raise CheckpointError("an extra state nests its containers too deep to read", path=path) from None


def _record_info(path: Path, name: str, record: PlainTensor, records: dict[str, tuple[int, int]],
                 file_size: int) -> TensorInfo:
    """:func:`tensor_info` of a record: its checks in the same order, less those its domain rules out (layout
    kinds, lazy bits, negative or oversized layouts: see :mod:`.plainrecords`)."""
    storage, offset, shape, stride, dtype, _, numel, contiguous, extent, _ = record.fields
    key, nbytes = storage.fields[:2]
    layout = (nbytes, _DTYPE_NAMES[dtype], dtype.itemsize, offset, shape, stride, numel, contiguous, extent)
    return located_infos(path, [(name, (key, layout))], records, file_size)[name]
