"""Dtype names (the safetensors table and the spellings users type) and the range check of a narrowing cast."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from .errors import CastOverflowError

if TYPE_CHECKING:
    from .checkpoint import TensorInfo


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


RangeCheck = Callable[[torch.Tensor, torch.dtype, "TensorInfo"], None]


def check_cast_range(values: torch.Tensor, target: torch.dtype, info: TensorInfo) -> None:
    """Refuse a cast that would turn finite values into inf (or NaN, for fp8)."""
    if not (values.is_floating_point() and target.is_floating_point) or values.numel() == 0:
        return
    limit = torch.finfo(target).max
    if limit >= torch.finfo(values.dtype).max:
        return
    wide = values if values.dtype == torch.float64 else values.float()
    peak = float(torch.where(torch.isfinite(wide), wide.abs(), torch.zeros((), dtype=wide.dtype)).max())
    if peak > limit:
        raise CastOverflowError(
            f"casting {info.dtype_name} to {str(target).removeprefix('torch.')} overflows: it holds {peak:.6g}, "
            f"beyond the target's largest value {limit:.6g}; choose a wider dtype or allow the overflow "
            "(allow_overflow=True, CLI: --allow-overflow)",
            path=info.path, tensor=info.name,
        )
