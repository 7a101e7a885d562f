"""What a load is asked to do, built once by the public functions and passed down whole.

``load``, ``plan``, ``load_model`` and ``load_tensors`` keep their keyword
arguments (they are the API); each builds these frozen objects once, and the
layers below (planning, the executor, capacity) take the objects instead of
a dozen parameters each.
"""

from __future__ import annotations

from collections.abc import Mapping
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TYPE_CHECKING, Callable, Optional, Union

import torch

from .progress import ProgressFn

if TYPE_CHECKING:
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
