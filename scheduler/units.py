"""Rates and memory sizes as the entry points take them, one parser each, so they all
accept and reject the same things.

* :func:`parse_rate`: transfer rates: ``scheduler.wrap``/``checkpoint``'s ``bandwidth``, the
  swap runtime's ``planner_options["bandwidth"]``, the offload, pofo and best planners.
* :func:`parse_memory`: memory sizes in bytes: the simulator's ``memory``, the planners'
  limits (``planners.args.memory_arg``) and transfer chunks.
* :func:`format_bytes`: a byte count in an error message, exact and readable.

Torch-free: the planners import it (sizes are ``vmalloc.sizes``', also torch-free).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional

from .chain import Number, float_or_none  # (float_or_none: served from here too)


def parse_rate(bandwidth: Any, where: str = "parse_rate", *, name: str = "bandwidth",
               allow_zero: bool = False) -> Optional[float]:
    """``None`` (the caller's default) passes; else bytes per second as a float: a number
    (``inf``: an instant channel), as a string too (``"12e9"``), or a size per second,
    ``"12GB/s"`` (``"12GB"`` too).
    ``where``: the entry point a bad value's ``ValueError`` starts with (``"scheduler.wrap"``);
    ``name``: the argument it names. ``allow_zero``: 0 means no transfer channel (the
    planners); the runtimes need a rate."""
    if bandwidth is None:
        return None
    rate: Any = bandwidth
    why = ""
    if isinstance(bandwidth, str):
        from vmalloc.sizes import parse_size  # torch-free; lazily, as the planners do
        text = bandwidth.strip().removesuffix("/s").strip()
        try:  # a plain number, as the message below suggests ('12e9', 'inf'), or a size
            rate = float(text)
            if math.isinf(rate) and text.lower().lstrip("+") not in ("inf", "infinity"):
                rate, why = None, " (too large for a float)"  # ('1e400')
        except ValueError:
            try:
                rate = parse_size(text, name)
            except ValueError as exc:  # the message below names the entry point and forms
                rate, why = None, f" ({exc})"
    ok = isinstance(rate, numbers.Real) and not isinstance(rate, bool) and \
        (rate > 0 or (allow_zero and rate == 0))  # (NaN fails both)
    value = float_or_none(rate) if ok else None
    if value is None:  # (a rate past float's range, 10**400, overflowed float() here)
        why = why or (" (too large for a float)" if ok else "")
        raise ValueError(f"{where}: {name} must be {'non-negative' if allow_zero else 'positive'}"
                         f" bytes/s (e.g. 12e9 or '12GB/s'), got {shown(bandwidth)}{why}")
    return value


def format_bytes(nbytes: Any) -> str:
    """A byte count as errors print it: exact (``%g`` would hide the bytes that matter) and, from
    1 KiB up, readable: ``format_bytes(3145728) == '3145728 B (3.00 MiB)'``. Whole numbers print
    as ints, others as their ``repr`` (a chain's sizes may be fractional)."""
    from vmalloc.sizes import format_size  # torch-free; lazily, as parse_rate does
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real):
        return repr(nbytes)
    value = float(nbytes)
    if not math.isfinite(value):
        return f"{value} B"
    exact = exact_number(nbytes)
    return f"{exact} B" if abs(value) < 1024 else f"{exact} B ({format_size(value)})"


def exact_number(x: Any) -> str:
    """A number in a message as it is, without an exponent where it is whole: an int prints as
    one, a float as an int when whole, else its ``repr``."""
    if isinstance(x, numbers.Integral):
        return str(int(x))
    value = float(x)
    return str(int(value)) if value.is_integer() and abs(value) < 2 ** 63 else repr(value)


def parse_memory(value: Any, name: str, *, allow_zero: bool = False,
                 allow_none: bool = False) -> Optional[Number]:
    """Bytes as a number (ints stay ints) from a number or a size string (``"16GiB"``, read by
    ``vmalloc.sizes.parse_size``). Any real number, numpy's included (an integral one comes
    back a Python int, the others a float); finite, within a float's range, and positive
    (``allow_zero``: 0 too); ``None`` passes where ``allow_none`` (the caller's default)."""
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        from vmalloc.sizes import parse_size  # torch-free; lazily, as parse_rate does
        value = parse_size(value, name)
    # any real number, numpy's scalars included (as Chain and the rates take them); a bool
    # (numpy's is no numbers.Real) is no size
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    as_float = float_or_none(value)
    if as_float is None or math.isnan(as_float) or math.isinf(as_float) or as_float < 0 or \
            (as_float == 0 and not allow_zero):
        raise ValueError(f"{name}: must be a {'non-negative' if allow_zero else 'positive'} "
                         f"finite number of bytes, got {shown(value)}"
                         + (" (too large for a float)" if as_float is None else ""))
    # ints stay ints (the exact-unit DPs and byte-exact limits need them), other reals floats
    return int(value) if isinstance(value, numbers.Integral) else as_float


def shown(value: Any, width: int = 60) -> str:
    """``repr(value)`` for a message, a long one (a 400-digit int) cut to its first digits
    and its length."""
    text = repr(value)
    return text if len(text) <= width else f"{text[:width - 20]}... ({len(text)} characters)"


def limit_tolerance(limit: float, integer: bool) -> float:
    """How far above a memory ``limit`` a peak may be and still fit it: nothing when the sizes
    summed are ``integer`` and so is the limit (sums of integers are exact in floats, below
    2**53), else a relative float tolerance of 1e-9 (sums of fractional sizes are not). The
    simulator's rule, which the planners that compare exact peaks follow too."""
    if integer and float(limit).is_integer():
        return 0.0
    return 1e-9 * max(1.0, float(limit))
