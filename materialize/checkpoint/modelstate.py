"""Which entry of a saved dict holds the model's state: the one asked for, or the only one there, never a pick.

Training scripts save the model's state dict under a key (``state_dict``,
``model``, ...) beside the rest of their state, and often beside another copy
of the same model's state: timm's train script keeps ``state_dict`` and
``state_dict_ema``, DeiT ``model`` and ``model_ema``, DiT and YOLOv5 ``model``
and ``ema``, DINO ``student`` and ``teacher``. Which copy a user means is
theirs to say, and the libraries disagree: timm's ``load_checkpoint`` takes
the EMA by default, its ``resume_checkpoint`` and DeiT's scripts the trained
weights. So an entry found under a state-dict key is compared with every
other entry holding tensors (training state aside: optimizer moments are never
a model's); any holding the same model's tensors (:func:`same_model`) is
another copy, and the checkpoint is refused naming each, until the caller
names one (``state_dict_key``). A sibling holding another model (a GAN's
discriminator) or other tensors (a loss's buffers) is left out, as before.

Nothing here reads a file or imports torch: the readers hand over each
entry's tensor shapes by name.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from os import PathLike
from typing import Optional, Union

from ..errors import StateDictKeyError

Shapes = Mapping[str, Optional[tuple[int, ...]]]  # tensor name -> shape, of one entry

# Prefixes that wrappers add to every name of a state dict: DistributedDataParallel's, torch.compile's.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def unwrapped(name: str) -> str:
    """A tensor name without the wrapper prefixes before it: ``_orig_mod.module.fc.weight`` is ``fc.weight``."""
    while True:
        prefix = next((p for p in WRAPPER_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            return name
        name = name[len(prefix):]


def same_model(ours: Shapes, theirs: Shapes) -> bool:
    """Whether two entries hold the same model's state: half or more of the smaller one's tensors are in the
    other under the same name (wrapper prefixes aside: a DDP-trained model's ``module.`` beside its EMA's bare
    names) and of the same shape. An EMA of the parameters alone (no batch-norm statistics) is still a copy;
    an optimizer's ``state.0.exp_avg`` or another network's layers are not."""
    mine = {unwrapped(name): shape for name, shape in ours.items()}
    other = {unwrapped(name): shape for name, shape in theirs.items()}
    smaller = min(len(mine), len(other))
    shared = sum(1 for name, shape in mine.items() if shape is not None and name in other and other[name] == shape)
    return smaller > 0 and 2 * shared >= smaller


def copies_of(chosen: str, entries: Mapping[str, Shapes]) -> list[str]:
    """The keys of ``entries`` holding the same model's state as ``entries[chosen]``, ``chosen`` among them, in
    the order of ``entries``."""
    return [key for key, shapes in entries.items() if key == chosen or same_model(entries[chosen], shapes)]


def described(keys: list[str], entries: Mapping[str, Shapes]) -> str:
    """``'state_dict' (122 tensors), 'state_dict_ema' (122 tensors)``."""
    return ", ".join(f"{key!r} ({len(entries[key])} tensor{'s' if len(entries[key]) != 1 else ''})" for key in keys)


def pick_option(key: str) -> str:
    """How to name entry ``key``, in the library's and the CLI's spelling."""
    return f"state_dict_key={key!r} (CLI: --state-dict-key {shlex.quote(key)})"


def several_copies(copies: list[str], entries: Mapping[str, Shapes], path: Union[str, PathLike, None] = None
                   ) -> StateDictKeyError:
    """The refusal of a file holding several copies of one model's state, each named with how to pick it."""
    return StateDictKeyError(
        f"holds {len(copies)} state dicts of one model: {described(copies, entries)}; which one to load "
        "(the trained weights, or an EMA or average of them) is yours to say: pass "
        + " or ".join(pick_option(key) for key in copies), path=path)


def not_there(key: str, entries: Mapping[str, Shapes], path: Union[str, PathLike, None] = None) -> StateDictKeyError:
    """The refusal of a ``state_dict_key`` naming no entry that holds tensors."""
    held = f"its entries holding tensors are {described(list(entries), entries)}" if entries else \
        "none of its entries holds a state dict; without state_dict_key the saved object is read as the model's state"
    return StateDictKeyError(f"has no entry {key!r} holding tensors (state_dict_key={key!r}); {held}", path=path)
