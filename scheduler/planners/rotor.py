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
from typing import Any, Dict, List, Optional, Tuple, Union

from ..chain import Chain
from ..errors import InfeasibleError
from ..plan import Op, Plan

KIND_NAMES = ("F_all", "F_ck", "F_none", "B")
_OPS: Dict[Tuple[int, int], Op] = {}  # (kind, stage) from the DP -> its Op, made once


def _op(kind_stage: Tuple[int, int]) -> Op:
    op = _OPS.get(kind_stage)
    if op is None:
        op = _OPS[kind_stage] = Op(KIND_NAMES[kind_stage[0]], kind_stage[1])
    return op
SIZE_FIELDS = ("x", "xbar", "delta", "fw_tmp", "bw_tmp", "fck_tmp")


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


EXACT_MAX = 1 << 50  # exact units: sums of L + 4 sizes must stay inside the DP's int64


def _units_up(v: Union[int, float], num: int, den: int, cap: int) -> int:
    """min(ceil(v * num / den), cap), exactly, for a non-integer v."""
    a, b = v.as_integer_ratio()
    return min(-(-a * num // (b * den)), cap)


def discretize(chain: Chain, memory: Union[int, float], slots: Optional[int]
               ) -> Tuple[Tuple[List[int], ...], int, float]:
    """Sizes in memory units (rounded up), the budget in units, and the unit in bytes."""
    if slots is None:
        if not chain.is_integer:
            raise ValueError("slots=None (exact units) needs integer sizes; this chain has "
                             "fractional ones: pass slots=500")
        units = tuple(_padded(chain, f) for f in SIZE_FIELDS)
        for f, values in zip(SIZE_FIELDS, units):
            for s, v in enumerate(values):
                if v > EXACT_MAX:
                    raise ValueError(f"slots=None (exact units): Chain.{f}[{s}]={v} is too "
                                     f"large for exact units (at most 2**50); pass slots=500")
        # a budget above every size together fits as much as that sum does
        return units, int(min(math.floor(memory), 1 << 62)), 1.0
    # exact rational rounding in integers: memory = p / q and a size v = a / b exactly (ints
    # and floats alike), so ceil(v * slots / memory) = ceil(a * slots * q / (b * p)); a size
    # never comes out smaller than it is. One above the budget cannot be held whatever its
    # size, so it is capped there (the DP's ints stay small).
    p, q = (memory if isinstance(memory, (int, float)) else Fraction(memory)).as_integer_ratio()
    num, cap = slots * q, slots + 1
    units = tuple([(u if (u := -(-v * num // p)) < cap else cap) if type(v) is int
                   else _units_up(v, num, p, cap) for v in _padded(chain, f)]
                  for f in SIZE_FIELDS)
    return units, slots, float(memory) / slots


def _min_memory(chain: Chain, slots: Optional[int], allow_all: bool, memory: float
                ) -> Union[int, float]:
    """Smallest memory limit for which the (discretized) problem is feasible."""
    core = _core()
    if slots is None:
        return core.rotor_min_units(discretize(chain, memory, None)[0], allow_all)
    # however large the limit, every size still takes one slot at least
    ones = tuple([1 if v > 0 else 0 for v in _padded(chain, f)] for f in SIZE_FIELDS)
    fewest = core.rotor_min_units(ones, allow_all)
    if fewest > slots:
        raise ValueError(f"slots={slots} is too few for this chain at any memory: every stored "
                         f"item takes one slot at least and a schedule holds {fewest} at once; "
                         f"use slots >= {fewest} (500 is the default)")

    def ok(m: float) -> bool:
        units, budget, _ = discretize(chain, m, slots)
        return core.rotor_min_units(units, allow_all) <= budget

    # feasibility is monotone in the limit (sizes in slots only shrink as it grows): bracket
    # it, then bisect. With integer sizes the exact minimum is a lower bound to start from.
    integer = chain.is_integer
    if integer:
        lo = core.rotor_min_units(discretize(chain, 1, None)[0], allow_all) - 1
        hi = max(memory, lo + 1)
    else:
        lo = hi = memory
        while ok(lo) and lo > 1e-12:
            hi, lo = lo, lo / 2
    if not ok(hi):  # no limit below the largest size can work: start the doubling there
        lo, hi = hi, max(hi * 2, max(max(getattr(chain, f)) for f in SIZE_FIELDS))
    while not ok(hi):
        lo, hi = hi, hi * 2
    while (hi - lo > 1) if integer else (hi - lo > 1e-6 * hi):
        mid = (lo + hi) // 2 if integer else (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return int(math.ceil(hi)) if integer else hi


def _solve_once(chain: Chain, memory: Any, slots: Any, allow_all: bool, planner: str) -> Plan:
    if not isinstance(chain, Chain):
        raise ValueError(f"chain: expected a scheduler.Chain, got {type(chain).__name__}")
    memory = check_memory(memory)
    slots = check_slots(slots)
    units, budget, unit = discretize(chain, memory, slots)
    feasible, time, peak, min_units, ops = _core().rotor_solve(
        list(map(float, chain.fw)), list(map(float, chain.bw)), units,
        tuple(list(map(float, _padded(chain, f))) for f in SIZE_FIELDS), budget, allow_all,
        slots is None)  # exact units: a double table; slots: float (twice as fast)
    if not feasible:
        need = _min_memory(chain, slots, allow_all, memory)
        how = "exact units" if slots is None else f"{slots} slots"
        raise InfeasibleError(
            f"{planner}: no schedule of {'chain ' + chain.name if chain.name else 'the chain'} fits in memory={memory:g} "
            f"({how}); the smallest memory that works is {need:g}", need)
    if float(peak).is_integer() and chain.is_integer:
        peak = int(peak)
    if float(time).is_integer() and all(isinstance(v, int) for v in chain.fw + chain.bw):
        time = int(time)
    return Plan([_OPS.get(o) or _op(o) for o in ops], planner=planner, predicted_time=time,
                predicted_peak=peak, chain=chain, memory_limit=memory,
                meta={"memory": memory, "slots": slots, "unit": unit, "budget_units": budget,
                      "dp_value": time})


def solve_dp(chain: Chain, memory: Any, slots: Any, allow_all: bool, planner: str,
             refine: int = 0) -> Plan:
    """Shared by rotor (allow_all=True) and revolve (the AD model: allow_all=False).

    ``refine=n`` (slots only) spends n more solves winning back the rounding: it bisects a
    nominal limit between ``memory`` and ``memory * (1 + (L + 4) / slots)`` and keeps the
    fastest plan whose exact peak still fits in ``memory`` (so the guarantee is unchanged).
    """
    if isinstance(refine, bool) or not isinstance(refine, int) or refine < 0:
        raise ValueError(f"refine: expected a non-negative int, got {refine!r}")
    plan = _solve_once(chain, memory, slots, allow_all, planner)
    if slots is None or refine == 0:
        return plan
    limit = plan.meta["memory"]
    lo, hi = float(limit), float(limit) * (1 + (chain.L + 4) / slots)
    for _ in range(refine):
        mid = (lo + hi) / 2
        cand = _solve_once(chain, mid, slots, allow_all, planner)
        if cand.predicted_peak <= limit:
            lo = mid
            if cand.predicted_time < plan.predicted_time:
                plan = cand
        else:
            hi = mid
    plan.meta.update(memory=limit, nominal_memory=plan.meta["memory"], refine=refine)
    plan.memory_limit = limit
    return plan


def solve(chain: Chain, memory: Any, slots: Optional[int] = 500, refine: int = 0) -> Plan:
    """The fastest persistent schedule of ``chain`` whose peak memory is at most ``memory``
    bytes (x[0] included). Raises ``InfeasibleError`` (with ``.min_memory``) if none fits.
    ``refine``: see :func:`solve_dp` (default 0: one solve)."""
    return solve_dp(chain, memory, slots, allow_all=True, planner="rotor", refine=refine)


def min_memory(chain: Chain, slots: Optional[int] = None, memory: Optional[float] = None,
               *, _allow_all: bool = True) -> Union[int, float]:
    """The least memory limit (bytes, x[0] included) for which ``solve`` finds a plan:
    exact with ``slots=None``; else for that slot count (the slot size scales with the
    limit), searched from ``memory`` (a hint; any positive value works)."""
    if not isinstance(chain, Chain):
        raise ValueError(f"chain: expected a scheduler.Chain, got {type(chain).__name__}")
    slots = check_slots(slots)
    hint = check_memory(memory) if memory is not None else max(1.0, float(sum(chain.xbar)))
    return _min_memory(chain, slots, _allow_all, hint)
