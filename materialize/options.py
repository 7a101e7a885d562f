"""What a load is asked to do, built once by the public functions and passed down whole.

``load``, ``plan``, ``load_model`` and ``load_tensors`` keep their keyword
arguments (they are the API); each builds these frozen objects once, and the
layers below (planning, the executor, capacity) take the objects instead of
a dozen parameters each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

if TYPE_CHECKING:
    from .integrations.devicemap import DeviceMapLike
    from .planning.keymap import KeyMapLike

ProgressFn = Callable[[int, int], None]
InitFn = Callable[[torch.nn.Module], None]


@dataclass(frozen=True)
class PlanOptions:
    """What to make of the checkpoint: where each tensor goes, in which dtype, under which name."""

    device: torch.device
    dtype: Optional[torch.dtype] = None
    strict: bool = True
    key_map: "KeyMapLike" = None
    init: Optional[InitFn] = None
    ignore_mismatched_sizes: bool = False
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
