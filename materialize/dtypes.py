"""Dtype names: the safetensors table and the spellings users type."""

from __future__ import annotations

from typing import Optional

import torch


def _optional(name: str) -> Optional[torch.dtype]:
    # fp8 and the wider unsigned kinds exist only in newer torch builds.
    return getattr(torch, name, None)


_ALIASES = {
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}
for _name, _dtype in (("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")):
    if _optional(_dtype) is not None:
        _ALIASES[_name] = _ALIASES[_dtype] = getattr(torch, _dtype)

USER_DTYPE_NAMES: tuple[str, ...] = tuple(_ALIASES)


def parse_dtype(value: "str | torch.dtype | None") -> Optional[torch.dtype]:
    """Turn ``"bf16"``, ``"torch.float16"`` or a dtype into a floating dtype.

    ``None`` and ``"auto"`` mean "keep each tensor's checkpoint dtype".
    """
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {value}")
        return value
    key = value.strip().lower().removeprefix("torch.")
    if key == "auto":
        return None
    if key not in _ALIASES:
        raise ValueError(f"unknown dtype '{value}'; choose one of: auto, {', '.join(USER_DTYPE_NAMES)}")
    return _ALIASES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
