"""Byte sizes as people write them: ``"2MiB"``, ``"40MB"``, ``"16GiB"``, ``1048576``.

One parser for every knob (``VMALLOC_CHUNK_SIZE``, ``VMALLOC_BUDGET``, ``VMALLOC_WINDOW``,
``chunk_size=``, ``budget=``, ``window=``), so they all accept and reject the same things.
"""
from __future__ import annotations

import re
from typing import Optional, Union

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")

SizeLike = Union[int, str]

#: Sizes are unsigned 64-bit in the C++ core: anything from here up cannot be a size.
SIZE_LIMIT = 1 << 64


def _shown(value: object) -> object:
    """``value`` for an error message, cut when it is a very long string."""
    if isinstance(value, str) and len(value) > 40:
        return f"{value[:20]}...({len(value)} characters)"
    return value


def _bounded(nbytes: int, value: object, name: str) -> int:
    if nbytes >= SIZE_LIMIT:
        raise ValueError(f"{name}: {_shown(value)!r} is too large: a byte size must be below 2**64 "
                         f"({SIZE_LIMIT} bytes)")
    return nbytes


def parse_size(value: SizeLike, name: str = "size") -> int:
    """Return ``value`` in bytes; raise ``ValueError`` naming ``name`` if it is not a size.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB)
    powers of 1024; units are case-insensitive. A fractional size must come to whole bytes.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a byte size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}: a byte size cannot be negative, got {value}")
        return _bounded(value, value, name)
    if isinstance(value, float):
        if value < 0 or not value.is_integer():
            raise ValueError(f"{name}: expected a whole number of bytes, got {value!r}")
        return _bounded(int(value), value, name)
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected a byte size such as '2MiB' or 2097152, got {value!r}")
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(
            f"{name}: cannot read {value!r} as a byte size "
            "(examples: 2097152, '2MiB', '40MB', '16GiB')")
    number = match.group(1)
    scale = _UNITS[unit]
    if len(number.split(".")[0].lstrip("0")) > 20:  # 2**64 has 20 digits; int() of thousands
        return _bounded(SIZE_LIMIT, value, name)     # of digits is slow (and capped) anyway
    if "." in number:
        whole, frac = (number.split(".") + [""])[:2]
        if len(frac) > 30:  # no unit needs more than 12 decimals to come to whole bytes
            frac = frac.rstrip("0")
            if len(frac) > 30:
                raise ValueError(f"{name}: {_shown(value)!r} is not a whole number of bytes "
                                 f"({len(frac)} decimals)")
        numerator = int(whole or "0") * 10 ** len(frac) + int(frac or "0")
        nbytes, rest = divmod(numerator * scale, 10 ** len(frac))
        if rest:
            raise ValueError(f"{name}: {value!r} is not a whole number of bytes")
        return _bounded(nbytes, value, name)
    return _bounded(int(number) * scale, value, name)


def parse_optional_size(value: Optional[SizeLike], name: str) -> Optional[int]:
    """``parse_size`` that lets ``None`` (no limit) through."""
    return None if value is None else parse_size(value, name)


def format_size(nbytes: Union[int, float]) -> str:
    """Binary units for reports: ``format_size(3 << 20) == '3.00 MiB'``."""
    n = float(nbytes)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if unit == "B":
            if n < 1024:
                return f"{sign}{int(n)} B"
        # compare what is printed: 1048575 B is 1023.999 KiB, shown as "1.00 MiB", not "1024.00 KiB"
        elif float(f"{n:.2f}") < 1024 or unit == "TiB":
            return f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
