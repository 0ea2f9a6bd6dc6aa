"""Byte sizes, read and shown one way everywhere: binary units (KiB, MiB, GiB, TiB) on every screen,
and on input either binary (1GiB, 2G) or decimal (512MB) units, as a user types them."""

from __future__ import annotations

import re
from types import MappingProxyType

_BYTE_UNITS = MappingProxyType({"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                                "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
                                "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_SHOWN_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def parse_bytes(value: str | int) -> int:
    """'1073741824', '1GiB', '512MB', '1.5G' -> bytes (KiB/MiB/GiB and K/M/G are powers of 1024, KB/MB/GB of 1000)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"must be >= 0 bytes, got {value}")
        return value
    text = str(value).strip()
    if text.startswith("-"):
        raise ValueError(f"must be >= 0 bytes, got {text}")
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)", text)
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"byte size {value!r} is not understood: give bytes (1073741824) or a number with a "
                         "unit (512MB, 1GiB, 2G)")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def format_bytes(num_bytes: float | int | None) -> str:
    """'16.0 MiB', '41.9 GiB', '512 B' ('-' for None): the one way kvtool shows a size."""
    if num_bytes is None:
        return "-"
    num_bytes = float(num_bytes)
    for unit, size in _SHOWN_UNITS:
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:,.1f} {unit}"
    return f"{num_bytes:,.0f} B"


def format_byte_count(num_bytes: int) -> str:
    """'20,393,548,185 bytes (19.0 GiB)': an exact count a user may type back (error messages), with its size
    as format_bytes shows it."""
    exact = f"{num_bytes:,} byte{'' if num_bytes == 1 else 's'}"
    return exact if abs(num_bytes) < 1 << 10 else f"{exact} ({format_bytes(num_bytes)})"
