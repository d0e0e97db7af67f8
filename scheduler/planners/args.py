"""The planners' argument checks: one place that says what a chain, a memory limit, a
bandwidth, a transfer chunk and a slot count may be, so every entry point accepts and
refuses the same things.

Each caller passes its own name (``where``, ``name``) so a refusal names the entry point the
user called; the wordings are the ones tests match, word for word. Torch-free.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from ..chain import Chain, Number
from ..units import parse_memory, parse_rate, shown

__all__ = ["Number", "check_chain", "memory_arg", "bandwidth_arg", "chunk_arg", "slots_arg",
           "SLOTS_MAX"]

# the most memory slots a DP takes: sizes in slots (each at most slots + a few) and sums of
# L + 4 of them stay inside the C++ side's int64, as exact units' sizes do (rotor.EXACT_MAX)
SLOTS_MAX = 1 << 50


def check_chain(chain: Any) -> Chain:
    """``chain`` itself if it is a :class:`~scheduler.Chain`."""
    if not isinstance(chain, Chain):
        raise ValueError(f"chain: expected a scheduler.Chain, got {type(chain).__name__}")
    return chain


def memory_arg(memory: Union[Number, str], name: str = "memory") -> Number:
    """A memory limit: positive finite bytes, a number or a size string (``"16GiB"``). Positive:
    a limit of 0 divided by zero in the slot grids (``min_memory`` is at least 1 for the same
    reason)."""
    got = parse_memory(memory, name)
    assert got is not None  # (allow_none is off)
    return got


def bandwidth_arg(bandwidth: Union[Number, str, None], allow_zero: bool = False,
                  where: str = "planner") -> float:
    """Bytes/s as ``units.parse_rate`` reads them (the runtimes' parser: ``"12GB/s"`` too);
    ``None`` is 0 (no transfer channel) where ``allow_zero``."""
    if bandwidth is None:
        if allow_zero:
            return 0.0
        raise ValueError(f"{where}: bandwidth must be bytes per second, got None")
    rate = parse_rate(bandwidth, where, allow_zero=allow_zero)
    assert rate is not None
    return rate


def chunk_arg(chunk: Union[Number, str, None]) -> Optional[float]:
    """``transfer_chunk``: None (whole-activation transfers) or a positive size in bytes."""
    return None if chunk is None else parse_memory(chunk, "transfer_chunk")


def slots_arg(slots: Any, *, hint: str = "") -> Optional[int]:
    """The DPs' memory discretisation: a positive int up to ``SLOTS_MAX``, or None (exact
    integer units). ``hint``: what the caller's message adds after "or None" (rotor's:
    " (exact units)")."""
    if slots is None:
        return None
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots: expected a positive int or None{hint}, got {shown(slots)}")
    if slots > SLOTS_MAX:
        raise ValueError(f"slots: at most 2**50 (the DPs count sizes in slots in 64-bit ints), "
                         f"got {shown(slots)}")
    return slots
