"""Byte sizes as users write them: ints, or strings like "6GiB", "500MB" (accelerate's convention)."""

from __future__ import annotations

import re

from .errors import ArgumentError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Return a size in bytes from an int (bytes) or a string such as "6GiB", "500MB", "1.5GB".

    Decimal units (KB, MB, GB, TB) are powers of 1000; binary units (KiB, MiB, GiB, TiB) powers of 1024.
    Raises ArgumentError (a ValueError) for anything else.
    """
    if isinstance(size, bool):
        raise ArgumentError(f"size must be an int of bytes or a string like '6GiB', got {size!r}")
    if isinstance(size, int):
        if not 0 <= size < 2**63:
            raise ArgumentError(f"size {size} is out of range: give a number of bytes from 0 to 2**63 - 1")
        return size
    if isinstance(size, str):
        match = _SIZE.match(size)
        if match and match.group(2).upper() in _UNITS:
            if _UNITS[match.group(2).upper()] == 1 and "." in match.group(1):
                raise ArgumentError(
                    f"cannot read {size!r} as a size: bytes come whole; give a size with its unit, like "
                    "'6GiB' or '500MB' (a share of the weights, such as 25%, is not a size here)")
            value = float(match.group(1)) * _UNITS[match.group(2).upper()]
            if value < 2**63:  # an int64 byte count; "1e400"-sized strings would be infinite
                return int(value)
    raise ArgumentError(
        f"cannot read {size!r} as a size: give an int of bytes or a string like '6GiB', '500MB', '1.5GB'"
    )


def format_size(nbytes: int) -> str:
    """Return nbytes as a short human string with binary units, e.g. "1.50 GiB"."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
