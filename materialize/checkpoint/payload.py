"""Which part of what ``torch.save`` was given is the model state: what every reader of a torch pickle shares.

:func:`find_payload` picks the state dict (or module) from the unpickled
object. It imports no torch: what counts as a tensor, a module, a pickled
module's stand-in or a numpy array is the reader's to say (:class:`Kinds`),
so the torch-free reader of plain pickles (:mod:`.plainpickle`) and the
unpickler onto ``meta`` (:mod:`.torchpickle`) choose alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple, Optional

from ..errors import CheckpointError, summarize_names
from .base import is_extra_state
from .modelstate import Shapes, copies_of, not_there, several_copies

if TYPE_CHECKING:  # a torch-free reader hands on no module
    from torch import nn

# model_state_dict: PyTorch's own tutorial on saving a general checkpoint (Whisper's files too).
STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "model_state", "module")
# What training checkpoints keep beside the model (PyTorch Lightning, torchtitan, DeepSpeed, plain
# scripts): optimizer moments and scheduler state are tensors but not weights.
TRAINING_STATE_KEYS = ("optimizer", "optimizers", "optim", "optimizer_states", "optimizer_state_dict", "optim_state_dict",
                       "lr_scheduler", "lr_schedulers", "scheduler", "scheduler_state_dict", "lr_scheduler_state_dict",
                       "dataloader", "train_state", "callbacks", "loops", "scaler", "scaler_state_dict", "rng_state")


class Payload(NamedTuple):
    """What a torch file holds for a load: its model state's tensors, its module if it is one, the extra states of
    its modules that are not tensors, and the entry of the saved dict they were taken from (``None``: the saved
    object itself). The readers hand it on with each tensor located (a :class:`TensorInfo`)."""

    tensors: dict[str, Any]
    module: Optional["nn.Module"]
    extra_states: dict[str, Any]
    key: Optional[str] = None
    module_metadata: Optional[dict[str, dict[str, Any]]] = None  # the state dict's ``_metadata`` (see saved_metadata)


def _never(value: Any) -> bool:
    return False


class Kinds(NamedTuple):
    """What a reader's unpickled objects are: ``is_tensor``; ``module_tensors``, a module's tensors by name
    (``None`` for what is not a module); ``module_state``, a pickled module's stand-in's state-dict entries
    (``None`` for anything else); ``is_numpy_array``."""

    is_tensor: Callable[[Any], bool]
    module_tensors: Callable[[Any], Optional[dict[str, Any]]] = lambda value: None
    module_state: Callable[[Any, str], Optional[Iterable[tuple[str, Any]]]] = lambda value, prefix: None
    is_numpy_array: Callable[[Any], bool] = _never


def find_payload(obj: Any, kinds: Kinds, *, state_dict_key: Optional[str] = None) -> Payload:
    """The model state (state dict or module) inside what ``torch.save`` was given.

    A module pickled whole but read without ``trust_pickle`` is made of
    stand-ins: its state-dict entries are taken from them, no module is built.
    The model state is the entry ``state_dict_key`` names, where one is
    named; else the value under ``state_dict``, ``model`` or ``module`` where
    one holds tensors, unless another entry holds another copy of that
    model's state (an EMA: refused, see :mod:`.modelstate`); else the whole
    object but the training state beside it (:data:`TRAINING_STATE_KEYS`).
    Dicts nested in it are flattened with dotted names, as ``state_dict()`` names a
    submodule's tensors: ``{"encoder": enc.state_dict(), "decoder": ...}``
    reads as ``encoder.weight``, ``decoder.weight``, ...

    A module's extra state (``get_extra_state``, saved as ``<module>._extra_state``)
    that is not a tensor comes third, by name: a tensor one is a tensor like any.
    """
    if state_dict_key is not None:
        return _named_entry(obj, state_dict_key, kinds)
    found = _module_payload(obj, kinds)
    if found is not None:
        return found
    if isinstance(obj, dict):
        for key in STATE_DICT_KEYS:
            found = _entry_state(dict.get(obj, key), kinds)  # not obj.get: a file can set an OrderedDict's attributes (BUILD)
            if found is not None:
                entries = {key: _shapes(found.tensors), **_other_entries(obj, key, kinds)}
                copies = copies_of(key, entries)
                if len(copies) > 1:
                    raise several_copies(copies, entries)
                return found._replace(key=key)
        found_tensors, extra_states = _tensor_entries(obj, kinds, leave_out=TRAINING_STATE_KEYS)
        return Payload(found_tensors, None, extra_states, module_metadata=saved_metadata(obj))
    return Payload({}, None, {})


_PLAIN_VALUES = (int, float, str, bool, type(None))


def saved_metadata(mapping: Any) -> Optional[dict[str, dict[str, Any]]]:
    """What ``state_dict()`` keeps beside the tensors (the ``_metadata`` attribute it sets on the
    ``OrderedDict``: each module's ``{"version": its _version}``, by the module's name), which
    ``load_state_dict`` hands each module's load code; ``None`` where the mapping has none (a plain dict).
    Only what torch writes is kept: a name's dict of plain values (see :func:`_plain_entries`)."""
    try:
        saved = vars(mapping).get("_metadata")  # the instance's own dict: nothing of the file's is called
    except TypeError:  # a plain dict has no attributes
        return None
    if not isinstance(saved, dict):
        return None
    return {name: _plain_entries(entry, nested=True) for name, entry in dict.items(saved)
            if type(name) is str and isinstance(entry, dict)}


def _plain_entries(entry: dict, *, nested: bool) -> dict[str, Any]:
    """A module's saved metadata: plain values by name, and, one level down, dicts of them (spectral norm's
    ``{"spectral_norm": {"weight.version": 1}}``)."""
    kept: dict[str, Any] = {}
    for key, value in dict.items(entry):
        if type(key) is str and type(value) in _PLAIN_VALUES:
            kept[key] = value
        elif type(key) is str and nested and isinstance(value, dict):
            kept[key] = _plain_entries(value, nested=False)
    return kept


def _module_payload(value: Any, kinds: Kinds) -> Optional[Payload]:
    """The model state of a module, or of a pickled module's stand-in; None for anything else."""
    tensors = kinds.module_tensors(value)
    if tensors is not None:
        return Payload(tensors, value, {})
    entries = kinds.module_state(value, "")
    if entries is not None:
        return Payload(dict(entries), None, {})
    return None


def _entry_state(value: Any, kinds: Kinds) -> Optional[Payload]:
    """The model state an entry of the saved dict holds: a module, a pickled module's stand-in, or a (nested)
    state dict holding tensors; None for anything else."""
    found = _module_payload(value, kinds)
    if found is not None:
        return found
    if isinstance(value, dict):
        tensors, extra_states = _tensor_entries(value, kinds)
        return Payload(tensors, None, extra_states, module_metadata=saved_metadata(value)) if tensors else None
    return None


def _named_entry(obj: Any, key: str, kinds: Kinds) -> Payload:
    """The model state under ``key``, which the caller named; refused where it holds none."""
    if not isinstance(obj, dict):
        raise not_there(key, {})
    value = dict.get(obj, key) if isinstance(key, str) else None
    found = _entry_state(value, kinds)
    if found is None or not found.tensors:
        raise not_there(key, _other_entries(obj, None, kinds))
    return found._replace(key=key)


def _other_entries(obj: dict, chosen: Optional[str], kinds: Kinds) -> dict[str, Shapes]:
    """The shapes of the tensors of each entry (named by a string) but ``chosen`` and the training state, in the
    file's order, for those that hold any: what could be another copy of the model's state."""
    entries: dict[str, Shapes] = {}
    for key, value in dict.items(obj):
        if not isinstance(key, str) or key == chosen or key in TRAINING_STATE_KEYS:
            continue
        try:
            found = _entry_state(value, kinds)
        except CheckpointError:  # numpy arrays, a name given twice: nothing a load could take anyway
            continue
        if found is not None and found.tensors:
            entries[key] = _shapes(found.tensors)
    return entries


def _shapes(tensors: dict[str, Any]) -> Shapes:
    return {name: tuple(tensor.shape) for name, tensor in tensors.items()}


def _tensor_entries(mapping: dict, kinds: Kinds,
                    leave_out: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors of a (nested) state dict by dotted name, and its modules' extra states that are not tensors."""
    entries: dict[str, Any] = {}
    extra_states: dict[str, Any] = {}
    arrays: list[str] = []
    _gather(mapping, "", entries, arrays, leave_out, set(), extra_states, kinds)
    if arrays:
        raise CheckpointError(
            f"holds numpy arrays where tensors are expected ({summarize_names(arrays)}); this loader reads tensors "
            "only: re-save them as tensors (torch.from_numpy), or load the file with torch.load if you trust it")
    return entries, extra_states


def _gather(mapping: dict, prefix: str, entries: dict[str, Any], arrays: list[str],
            leave_out: tuple[str, ...], seen: set[int], extra_states: dict[str, Any], kinds: Kinds) -> None:
    if id(mapping) in seen:  # a pickle can make a dict that holds itself
        return
    seen.add(id(mapping))
    is_tensor = kinds.is_tensor
    if all(map(is_tensor, dict.values(mapping))):  # a state dict's level of tensors alone, taken at once
        if not entries and not prefix and set(map(type, dict.keys(mapping))) <= {str}:
            entries.update(mapping if type(mapping) is dict else dict.items(mapping))  # its names as they are
            return
        names = map(str, dict.keys(mapping))
        taken = dict(zip(map(prefix.__add__, names) if prefix else names, dict.values(mapping)))
        # (taken where no name is met twice: where one is, the loop below says which)
        if len(taken) == len(mapping) and entries.keys().isdisjoint(taken):
            entries.update(taken)
            return
    for key, value in dict.items(mapping):
        name = prefix + str(key)
        if is_tensor(value):
            pairs: Iterable[tuple[str, Any]] = [(name, value)]
        elif kinds.is_numpy_array(value):
            arrays.append(name)
            continue
        elif key in leave_out:
            continue
        elif is_extra_state(name):
            extra_states[name] = value
            continue
        else:
            module_entries = kinds.module_state(value, name + ".")
            if module_entries is not None:
                pairs = list(module_entries)
            elif isinstance(value, dict):
                _gather(value, name + ".", entries, arrays, (), seen, extra_states, kinds)
                continue
            else:
                continue
        for full, tensor in pairs:
            if full in entries:
                raise CheckpointError("is named twice, once by a nested dict's keys: which one is meant is unclear",
                                      tensor=full)
            entries[full] = tensor
