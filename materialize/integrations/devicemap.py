"""Device maps: which device each module's tensors live on, computed by accelerate.

A device map names modules (``"model.layers.3"``, ``""`` for the root) and
gives each a GPU index, ``"cuda:N"``, ``"cpu"`` or ``"disk"``. ``"disk"``
here means: left in the checkpoint file and mapped copy-on-write, never
copied (no offload folder needed). ``"auto"``, ``"balanced"``,
``"balanced_low_0"`` and ``"sequential"`` are computed by accelerate's
``infer_auto_device_map`` on the meta skeleton, with ``max_memory`` as its
budget per device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
from torch import nn

from ..errors import DeviceError
from ..io.transfer import resolve_device

DISK = "disk"
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
DeviceMapLike = Union[str, Mapping[str, Union[int, str, torch.device]]]


def compute_device_map(
    model: nn.Module,
    device_map: DeviceMapLike,
    *,
    max_memory: Optional[Mapping[Union[int, str], Union[int, str]]] = None,
    dtype: Optional[torch.dtype] = None,
) -> dict[str, Union[int, str]]:
    """A module name -> device mapping, computed by accelerate for the named strategies."""
    if isinstance(device_map, Mapping):
        return dict(device_map)
    if device_map not in STRATEGIES:
        raise DeviceError(f"device_map must be a dict or one of {', '.join(STRATEGIES)}, got {device_map!r}")
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    budget: Any = dict(max_memory) if max_memory is not None else None
    if device_map != "sequential":
        budget = get_balanced_memory(
            model, max_memory=budget, no_split_module_classes=no_split, dtype=dtype, low_zero=device_map == "balanced_low_0"
        )
    return dict(infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split, dtype=dtype))


class Placement:
    """Tensor name -> where it goes, by the longest module prefix in a device map."""

    def __init__(self, device_map: Mapping[str, Union[int, str, torch.device]]) -> None:
        self.device_map = {name: _normalize(value) for name, value in device_map.items()}

    def __call__(self, tensor_name: str) -> Union[torch.device, str]:
        best: Optional[str] = None
        for module in self.device_map:
            if module == "" or tensor_name == module or tensor_name.startswith(module + "."):
                if best is None or len(module) > len(best):
                    best = module
        if best is None:
            raise DeviceError(f"the device map places no module holding tensor '{tensor_name}'")
        return self.device_map[best]

    @property
    def needs_dispatch(self) -> bool:
        """Whether accelerate's hooks are needed: more than one device besides the CPU."""
        places = {"cpu" if p == DISK else str(p) for p in self.device_map.values()}
        return len(places) > 1

    def for_accelerate(self) -> dict[str, Union[int, str]]:
        # Our disk tensors are CPU views of the file: to accelerate they are CPU-offloaded.
        return {name: "cpu" if p == DISK else (p.index if p.type == "cuda" else str(p)) for name, p in self.device_map.items()}


def _normalize(value: Union[int, str, torch.device]) -> Union[torch.device, str]:
    if value == DISK:
        return DISK
    if isinstance(value, int):
        value = f"cuda:{value}"
    return resolve_device(value)
