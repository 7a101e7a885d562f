"""What a load is asked to do, built once by the public functions and passed down whole.

``load``, ``plan``, ``load_model`` and ``load_tensors`` keep their keyword
arguments (they are the API); each builds these frozen objects once, and the
layers below (planning, the executor, capacity) take the objects instead of
a dozen parameters each. Beside them, what a model says of its own load
(:data:`DtypeRule`, :class:`Tolerated`): :mod:`materialize.integrations.hf`
makes them for a transformers model and the planner reads them, so they sit
here, below both.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TYPE_CHECKING, Callable, Optional, Union

import torch

from .progress import ProgressFn

if TYPE_CHECKING:
    from .checkpoint import TensorInfo
    from .integrations.devicemap import DeviceMapLike
    from .planning.keymap import KeyMapLike

InitFn = Callable[[torch.nn.Module], None]
IgnoreUnexpected = Union[bool, str, Sequence[str]]


def unexpected_to_ignore(ignore_unexpected: IgnoreUnexpected) -> Optional[re.Pattern]:
    """One expression searching checkpoint names for what ``ignore_unexpected`` leaves unread: ``True`` every
    name, a regular expression (or several) the names it finds; ``False`` or none: nothing."""
    if ignore_unexpected is True:
        return re.compile("")  # found in every name
    if ignore_unexpected is False or ignore_unexpected is None:
        return None
    patterns = [ignore_unexpected] if isinstance(ignore_unexpected, str) else list(ignore_unexpected)
    if not patterns:
        return None
    if not all(isinstance(pattern, str) and pattern for pattern in patterns):
        raise ValueError(f"ignore_unexpected: expected True or regular expressions, got {ignore_unexpected!r}")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"ignore_unexpected: {pattern!r} is not a regular expression: {error}") from None
    return re.compile("|".join(f"(?:{pattern})" for pattern in patterns))


@dataclass(frozen=True)
class PlanOptions:
    """What to make of the checkpoint: where each tensor goes, in which dtype, under which name."""

    device: torch.device
    dtype: Optional[torch.dtype] = None
    strict: bool = True
    key_map: "KeyMapLike" = None
    init: Optional[InitFn] = None
    ignore_mismatched_sizes: bool = False
    # Checkpoint names left unread, neither loaded nor unexpected (a pipeline stage's others): see unexpected_to_ignore.
    ignore_unexpected: Optional[re.Pattern] = None
    device_map: "Optional[DeviceMapLike]" = None
    max_memory: Optional[Mapping[Union[int, str], Union[int, str]]] = None


DtypeRule = Callable[[str, torch.dtype], torch.dtype]  # a model's own say: (name, the dtype it would get) -> its dtype


@dataclass(frozen=True)
class Tolerated:
    """Differences a model declares expected: names it may miss (it initializes them) or may find and drop.

    Regular expressions searched in model names (``missing``) and checkpoint
    names (``unexpected``), as transformers' ``_keys_to_ignore_on_load_*``;
    ``unexpected_tensor`` may also let an unexpected tensor go by what it is
    (its model-side name and its shape and dtype), where a name alone would
    let too much go.
    """

    missing: Optional[re.Pattern] = None
    unexpected: Optional[re.Pattern] = None
    unexpected_tensor: Optional[Callable[[str, "TensorInfo"], bool]] = None
    # A checkpoint's value for a buffer the model computes (non-persistent) is
    # set aside, not loaded: the model's own value stands, as transformers does.
    computed_buffers_stand: bool = False

    def also_unexpected(self, pattern: Optional[re.Pattern]) -> "Tolerated":
        """These differences and the unexpected names ``pattern`` finds too (the caller's ``ignore_unexpected``)."""
        if pattern is None:
            return self
        either = pattern if self.unexpected is None else re.compile(f"(?:{self.unexpected.pattern})|(?:{pattern.pattern})")
        return dataclasses.replace(self, unexpected=either)

    def lets_go(self, model_name: str, info: "TensorInfo") -> bool:
        """Whether the checkpoint tensor ``info``, mapped to ``model_name`` (not in the model), is expected."""
        if self.lets_name_go(info.name):
            return True
        return self.unexpected_tensor is not None and self.unexpected_tensor(model_name, info)

    def lets_name_go(self, checkpoint_name: str) -> bool:
        """Whether an unexpected checkpoint entry is expected by its name alone."""
        return self.unexpected is not None and bool(self.unexpected.search(checkpoint_name))


@dataclass(frozen=True)
class ReadOptions:
    """How to read the bytes and what to check on the way."""

    mmap: bool = False
    staging_bytes: Optional[int] = None
    allow_overflow: bool = False
    check: bool = False
    check_finite: bool = False
    progress: Optional[ProgressFn] = None
    direct_io: bool = False
    group: Any = None  # a torch.distributed process group whose ranks share the reads (materialize.io.groupread)
