"""Optimal persistent checkpointing (seed 002, "rotor"): Theorem 1 / Algorithms 1-2.

The dynamic program lives in C++ (``csrc/dp/rotor.cpp``, ``vmalloc._core.rotor_solve``);
this module discretizes memory, calls it, and turns its answer into a :class:`Plan`.

Discretization (seed 002 section 5.2). ``slots=S``: the memory limit ``M`` is cut into S
slots of ``M / S`` bytes and every size (x, xbar, delta, fw_tmp, bw_tmp) is rounded UP to
whole slots, so a plan that fits in S slots fits in M bytes. The cost of rounding: each of
the at most ``k`` items in memory at once (stored items + an op's outputs + its tmp;
``k <= L + 4``) is overestimated by less than one slot, so ``solve(c, M, S)`` is never
slower than the exact optimum at ``M - k * M / S``. ``slots=None``: exact integer units (the
sizes must be integers; the table has ``M + 1`` columns, so keep ``M`` small).

``predicted_time`` is the DP's optimum ``C(0, L, M - x[0])``; ``predicted_peak`` the exact
peak of the plan (x[0] included) from the same recurrences with the exact sizes. Both equal
``scheduler.simulate`` on the plan (exactly for integer chains).
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, List, Optional, Tuple, Union

from ..chain import Chain
from ..errors import InfeasibleError
from ..plan import Plan

KIND_NAMES = ("F_all", "F_ck", "F_none", "B")
SIZE_FIELDS = ("x", "xbar", "delta", "fw_tmp", "bw_tmp")


def _core():
    from vmalloc import _core  # the extension module (scripts/dev-build or pip install)
    return _core


def check_memory(memory: Any, name: str = "memory") -> Union[int, float]:
    """A positive memory limit in bytes: a number or a size string ('16GiB')."""
    if isinstance(memory, str):
        from vmalloc.sizes import parse_size
        memory = parse_size(memory, name)
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not math.isfinite(memory) \
            or memory <= 0:
        raise ValueError(f"{name}: expected a positive finite number of bytes, got {memory!r}")
    return memory


def check_slots(slots: Any) -> Optional[int]:
    if slots is None:
        return None
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots: expected a positive int or None (exact units), got {slots!r}")
    return slots


def _padded(chain: Chain, name: str) -> List[Any]:
    v = list(getattr(chain, name))
    return v + [0] if name in ("x", "delta") else v   # x[L+1], delta[L+1]: nothing


def discretize(chain: Chain, memory: Union[int, float], slots: Optional[int]
               ) -> Tuple[Tuple[List[int], ...], int, float]:
    """Sizes in memory units (rounded up), the budget in units, and the unit in bytes."""
    if slots is None:
        if not chain.is_integer:
            raise ValueError("slots=None (exact units) needs integer sizes; this chain has "
                             "fractional ones: pass slots=500")
        units = tuple(_padded(chain, f) for f in SIZE_FIELDS)
        return units, int(math.floor(memory)), 1.0
    m = Fraction(memory)
    # exact rational rounding: a size never comes out smaller than it is
    units = tuple([math.ceil(Fraction(v) * slots / m) for v in _padded(chain, f)]
                  for f in SIZE_FIELDS)
    return units, slots, float(memory) / slots


def _min_memory(chain: Chain, slots: Optional[int], allow_all: bool, memory: float
                ) -> Union[int, float]:
    """Smallest memory limit for which the (discretized) problem is feasible."""
    core = _core()
    if slots is None:
        return core.rotor_min_units(discretize(chain, memory, None)[0], allow_all)

    def ok(m: float) -> bool:
        units, budget, _ = discretize(chain, m, slots)
        return core.rotor_min_units(units, allow_all) <= budget

    lo, hi = memory, memory
    while not ok(hi):
        lo, hi = hi, hi * 2
    integer = chain.is_integer
    while (hi - lo > 1) if integer else (hi - lo > 1e-6 * hi):
        mid = (lo + hi) // 2 if integer else (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return int(math.ceil(hi)) if integer else hi


def solve_dp(chain: Chain, memory: Any, slots: Any, allow_all: bool, planner: str) -> Plan:
    """Shared by rotor (allow_all=True) and revolve (the AD model: allow_all=False)."""
    if not isinstance(chain, Chain):
        raise ValueError(f"chain: expected a scheduler.Chain, got {type(chain).__name__}")
    memory = check_memory(memory)
    slots = check_slots(slots)
    units, budget, unit = discretize(chain, memory, slots)
    feasible, time, peak, min_units, ops = _core().rotor_solve(
        list(map(float, chain.fw)), list(map(float, chain.bw)), units,
        tuple(list(map(float, _padded(chain, f))) for f in SIZE_FIELDS), budget, allow_all)
    if not feasible:
        need = _min_memory(chain, slots, allow_all, memory)
        how = "exact units" if slots is None else f"{slots} slots"
        raise InfeasibleError(
            f"{planner}: no schedule of chain {chain.name or '?'} fits in memory={memory:g} "
            f"({how}); the smallest memory that works is {need:g}", need)
    if chain.is_integer and float(peak).is_integer():
        peak = int(peak)
    if all(isinstance(v, int) for v in chain.fw + chain.bw) and float(time).is_integer():
        time = int(time)
    return Plan([(KIND_NAMES[k], s) for k, s in ops], planner=planner, predicted_time=time,
                predicted_peak=peak, chain=chain,
                meta={"memory": memory, "slots": slots, "unit": unit, "budget_units": budget})


def solve(chain: Chain, memory: Any, slots: Optional[int] = 500) -> Plan:
    """The fastest persistent schedule of ``chain`` whose peak memory is at most ``memory``
    bytes (x[0] included). Raises ``InfeasibleError`` (with ``.min_memory``) if none fits."""
    return solve_dp(chain, memory, slots, allow_all=True, planner="rotor")


def min_memory(chain: Chain, slots: Optional[int] = None, memory: Optional[float] = None) -> float:
    """The least memory any rotor plan needs (slots=None: exact; else for that slot count,
    searched upward from ``memory``)."""
    slots = check_slots(slots)
    if slots is None:
        return _min_memory(chain, None, True, 1)
    return _min_memory(chain, slots, True, check_memory(memory if memory is not None else 1))
