"""Byte sizes as people write and read them."""

from __future__ import annotations

from typing import Optional, Union

_UNITS = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "B": 1}


def parse_size(text: Union[str, int]) -> int:
    """``"500MB"``, ``"1GiB"``, ``"4096"`` or an int, in bytes."""
    if isinstance(text, int):
        return text
    cleaned = text.strip().upper().replace(" ", "")
    for unit, factor in _UNITS.items():
        if cleaned.endswith(unit):
            number = cleaned[: -len(unit)]
            break
    else:
        number, factor = cleaned, 1
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 256MB, 1GiB, 4096)") from None
    if value < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return int(value * factor)


def format_bytes(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "n/a"
    value = float(nbytes)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    return f"{value:.2f} TB"
