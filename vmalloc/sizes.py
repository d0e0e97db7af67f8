"""Byte sizes as people write them: ``"2MiB"``, ``"40MB"``, ``"16GiB"``, ``1048576``.

One parser for every knob (``VMALLOC_CHUNK_SIZE``, ``VMALLOC_BUDGET``, ``VMALLOC_WINDOW``,
``chunk_size=``, ``budget=``, ``window=``), so they all accept and reject the same things.
"""
from __future__ import annotations

import numbers
import operator
import re
from typing import Optional, Tuple, Union

_PREFIXES = {"k": 1, "m": 2, "g": 3, "t": 4}
# Keys are lowercase; _unit_key refuses the spellings that read two ways before the look-up.
_UNITS = {"": 1, "b": 1,
          **{f"{p}b": 1000 ** e for p, e in _PREFIXES.items()},
          **{f"{p}ib": 1 << (10 * e) for p, e in _PREFIXES.items()}}
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


def _unit_key(unit: str) -> Optional[str]:
    """``unit``'s key in ``_UNITS`` (or an unknown key, refused by the caller); ``None`` when it
    reads two ways. Binary units pass in any case ("2mib" is MiB: nobody sizes memory in
    mebibits); a decimal one needs a capital B ("Gb", "gb": gigabits in networking); K/M/G/T
    alone are refused, since "16G" almost always means GiB and reading it as 10**9 loses 7%."""
    low = unit.lower()
    if low in _PREFIXES or (len(unit) == 2 and low[0] in _PREFIXES and unit[1] == "b"):
        return None
    return low


def _ambiguous(value: str, number: str, unit: str, name: str) -> None:
    """Raise for a unit that reads two ways, naming the input and both unambiguous spellings."""
    p = unit[0].upper()
    n = number if len(number) <= 20 else "N"   # a 5000-digit number is not repeated twice
    why = "a lowercase b means bits" if len(unit) == 2 else f"{p} alone: powers of 1024 or 1000?"
    raise ValueError(f"{name}: {_shown(value)!r} is ambiguous ({why}): write '{n}{p}iB' "
                     f"(powers of 1024) or '{n}{p}B' (powers of 1000)")


def _as_number(value: object) -> Optional[Union[int, float]]:
    """An integer-like (``__index__``: ``np.int64``, a 0-d integer tensor) or real number
    (``np.float32``) as a Python int or float; None for anything else (bools included)."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        pass
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def parse_size(value: SizeLike, name: str = "size") -> int:
    """Return ``value`` in bytes; raise ``ValueError`` naming ``name`` if it is not a size.

    Binary units (KiB, MiB, GiB, TiB; any case) are powers of 1024, decimal ones (kB, KB, MB,
    GB, TB; the B a capital) powers of 1000, ``B`` or no unit bytes. ``2G``, ``2m`` (decimal or
    binary?) and ``2Gb``, ``2mb`` (bits?) are refused, naming both readings. A fractional size
    must come to whole bytes.
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
        number = _as_number(value)  # numpy scalars, a 0-d integer tensor: read as their value
        if number is None:
            raise ValueError(f"{name}: expected a byte size such as '2MiB' or 2097152, "
                             f"got {value!r}")
        return parse_size(number, name)
    match = _SIZE.match(value)
    unit = _unit_key(match.group(2)) if match else None
    if match and unit is None:
        _ambiguous(value, match.group(1), match.group(2), name)
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


#: The least granularity CUDA maps physical memory in (``cuMemGetAllocationGranularity``,
#: MINIMUM) on every NVIDIA GPU so far: a CUDA chunk size is a multiple of it.
CUDA_GRANULARITY = 2 << 20


def parse_chunk_size(value: Optional[SizeLike], name: str = "chunk_size") -> int:
    """A CUDA chunk size (``None``: 2 MiB): positive and a multiple of ``CUDA_GRANULARITY``,
    checked where it is given. The allocator checks it against the device's own granularity
    too, but only at the first allocation, where the error would come out of whatever op
    allocated first (``model.cuda()``) and again from every later one."""
    if value is None:
        return CUDA_GRANULARITY
    n = parse_size(value, name)
    if n <= 0 or n % CUDA_GRANULARITY:
        low = n // CUDA_GRANULARITY * CUDA_GRANULARITY
        near = " or ".join(format_size_exact(k) for k in (low, low + CUDA_GRANULARITY) if k > 0)
        raise ValueError(f"{name}: {_shown(value)!r} ({n} bytes) is not a positive multiple of "
                         "2 MiB, the granularity CUDA maps physical memory in; the nearest "
                         f"chunk sizes are {near}")
    return n


def check_budget_holds_a_chunk(budget: Optional[int], chunk: int, budget_name: str = "budget",
                               chunk_name: str = "chunk_size", *, zero_is_no_cap: bool = True
                               ) -> None:
    """Refuse a budget (bytes; ``None``: no cap) below one chunk, naming both knobs: the
    allocator would refuse it at its first allocation, out of whatever op allocated first, and
    again from every later one. ``chunk`` is the chunk size in bytes (the default when not given).
    A budget of 0 is no cap too (``VMALLOC_BUDGET=0``, ``enable(budget=0)``), unless
    ``zero_is_no_cap`` is False (``vmalloc.Allocator``, whose no cap is ``None`` only)."""
    if budget is None or (budget == 0 and zero_is_no_cap):
        return
    if budget < chunk:
        raise ValueError(f"{budget_name}: {format_size_exact(budget)} ({budget} bytes) is smaller "
                         f"than one chunk ({chunk_name}: {format_size_exact(chunk)}), so nothing "
                         "could be allocated; give at least one chunk, or no budget")


def parse_chunk_and_budget(chunk_size: Optional[SizeLike], budget: Optional[SizeLike]
                           ) -> Tuple[int, int]:
    """A CUDA allocator's ``chunk_size`` and ``budget`` arguments (``enable``, ``pool``,
    ``vmalloc.cupy.enable``), checked: ``(chunk bytes, budget bytes or 0 for no cap)``."""
    chunk = parse_chunk_size(chunk_size)
    cap = parse_optional_size(budget, "budget") or 0
    check_budget_holds_a_chunk(cap, chunk)
    return chunk, cap


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


def format_size_exact(nbytes: int) -> str:
    """``format_size``'s unit with its number exact, without trailing zeros (``"2 MiB"``,
    ``"1.5 MiB"``, ``"100 TiB"``): two different sizes never print alike."""
    unit = format_size(nbytes).split()[-1]
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[unit]
    return f"{nbytes / scale:.10f}".rstrip("0").rstrip(".") + f" {unit}"
