"""Byte sizes as people write them in settings: 1048576, "512MB", "1.5GiB", "10%".

"auto" is not a size: callers that accept it check for it before calling here.
"""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_byte_size"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*([a-z]*)")
_PERCENT_RE = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*%")
_ACCEPTED = "use bytes, '24GB' or '10%'"


def parse_byte_size(
    value: int | str, *, total_bytes: int | None = None, field: str = "size"
) -> int:
    """Return ``value`` as a positive number of bytes.

    Accepts an int, a digit string, a number with a unit (KB/MB/GB/TB are powers
    of 1000, KiB/MiB/GiB/TiB powers of 1024, case-insensitive, optional space) or
    a percentage of ``total_bytes`` in (0, 100]. Fractions round down. Raises
    ValueError naming ``field`` for anything else, for zero and for negatives.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _error(field, value, "expected an int or a string")
    if isinstance(value, int):
        num_bytes = value
    else:
        text = value.strip().lower()
        if text.endswith("%"):
            num_bytes = _parse_percent(text, total_bytes, field, value)
        else:
            num_bytes = _parse_with_unit(text, field, value)
    if num_bytes <= 0:
        raise _error(field, value, "must be at least 1 byte")
    return num_bytes


def _parse_percent(text: str, total_bytes: int | None, field: str, value: str) -> int:
    match = _PERCENT_RE.fullmatch(text)
    if match is None:
        raise _error(field, value, "not a percentage")
    if total_bytes is None:
        raise _error(field, value, "a percentage needs a known total, which this setting lacks")
    if total_bytes <= 0:
        raise _error(field, value, f"the total it is a percentage of is {total_bytes} bytes")
    percent = float(match.group(1))
    if not 0 < percent <= 100:
        raise _error(field, value, "a percentage must be above 0% and at most 100%")
    return int(total_bytes * percent / 100)


def _parse_with_unit(text: str, field: str, value: str) -> int:
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise _error(field, value, "not a size")
    number, unit = match.groups()
    if unit not in _UNITS:
        raise _error(field, value, f"unknown unit {unit!r}")
    if unit in ("", "b") and "." in number:
        raise _error(field, value, "a byte count must be a whole number")
    if "." not in number:  # exact integer arithmetic, no float rounding for large sizes
        return int(number) * _UNITS[unit]
    return int(float(number) * _UNITS[unit])


def _error(field: str, value: object, reason: str) -> ValueError:
    return ValueError(f"{field}: invalid size {value!r} ({reason}); {_ACCEPTED}")


def format_bytes(num_bytes: int) -> str:
    """Decimal units with at most one decimal place: 512 -> "512 B", 1_500_000_000 -> "1.5 GB"."""
    sign = "-" if num_bytes < 0 else ""
    size = float(abs(num_bytes))
    for unit in ("B", "KB", "MB", "GB"):
        if round(size, 1) < 1000:
            return f"{sign}{_one_decimal(size)} {unit}"
        size /= 1000
    return f"{sign}{_one_decimal(size)} TB"


def _one_decimal(x: float) -> str:
    return f"{x:.1f}".removesuffix(".0")
