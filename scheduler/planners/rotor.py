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

Refinement (``refine=True``, the default with slots). The rounding hides plans: one whose
exact peak fits ``M`` can need up to ``k`` slots more than ``S`` once rounded (issue 13: on a
6-layer Llama, HF's every-block plan fit with 32 KB to spare and rotor, at 500 slots, ran one
forward more). So the DP tabulates up to ``S + h`` slots (one table, the same slot size;
``h = rounding_headroom(chain, M) <= L + 4`` bounds that excess), the plans at the limits
where its value drops are rebuilt with the exact sizes, and the fastest one whose exact peak
is at most ``M`` is returned (ties: the lower peak; on long chains the drops are bisected,
see csrc/dp/rotor.cpp). The plan at ``S`` itself always fits, so refining is never slower.
A limit whose rounded problem is infeasible is refined too when its least feasible budget is
within ``h`` slots of ``S`` (at the every-block plan's own peak the rounded plan can need a
slot or two more than ``S``): it is refused only if no plan rebuilt there fits, and its
``InfeasibleError.min_memory`` is then the least limit whose rounded problem is feasible
(a limit that works: the plan at its own budget fits). "Fits" is the simulator's rule
(:func:`fit_limit`). ``refine=False``: the rounded problem's optimum alone.

``predicted_time`` is the DP's value at the limit the plan was rebuilt at;
``predicted_peak`` the exact peak of the plan (x[0] included) from the same recurrences with
the exact sizes. Both equal ``scheduler.simulate`` on the plan (exactly for integer chains).
"""
from __future__ import annotations

import math
from bisect import bisect_right
from fractions import Fraction
from itertools import accumulate
from typing import Any, Dict, List, Optional, Tuple, Union

from .._native import core
from ..chain import Chain
from ..errors import InfeasibleError
from ..plan import KINDS, Op, Plan
from ..units import format_bytes, limit_tolerance
from .args import check_chain, memory_arg, slots_arg

# the DP emits (kind, stage) with kind an index into plan.KINDS (csrc/dp/rotor.hpp RotorKind)
assert KINDS[:4] == ("F_all", "F_ck", "F_none", "B")
_OPS: Dict[Tuple[int, int], Op] = {}  # (kind, stage) from the DP -> its Op, made once
SIZE_FIELDS = ("x", "xbar", "delta", "fw_tmp", "bw_tmp", "fck_tmp")
_SLOTS_HINT = " (exact units)"  # what rotor's slots message says None means


def _op(kind_stage: Tuple[int, int]) -> Op:
    op = _OPS.get(kind_stage)
    if op is None:
        op = _OPS[kind_stage] = Op(KINDS[kind_stage[0]], kind_stage[1])
    return op


def _padded(chain: Chain, name: str) -> Tuple[Any, ...]:
    v = getattr(chain, name)
    return v + (0,) if name in ("x", "delta") else v   # x[L+1], delta[L+1]: nothing


EXACT_MAX = 1 << 50  # exact units: sums of L + 4 sizes must stay inside the DP's int64


def _units_up(v: Union[int, float], num: int, den: int, cap: int) -> int:
    """min(ceil(v * num / den), cap), exactly, for a non-integer v."""
    a, b = v.as_integer_ratio()
    return min(-(-a * num // (b * den)), cap)


def discretize(chain: Chain, memory: Union[int, float], slots: Optional[int],
               headroom: int = 0) -> Tuple[Tuple[List[int], ...], int, float]:
    """Sizes in memory units (rounded up), the budget in units, and the unit in bytes.
    ``headroom``: units the DP may tabulate above the budget (refinement); sizes are capped
    above that instead of just above the budget."""
    if slots is None:
        if not chain.is_integer:
            raise ValueError("slots=None (exact units) needs integer sizes; this chain has "
                             "fractional ones: pass slots=500")
        units = tuple(list(_padded(chain, f)) for f in SIZE_FIELDS)
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
    num, cap = slots * q, slots + headroom + 1
    units = tuple([(u if (u := -(-v * num // p)) < cap else cap) if type(v) is int
                   else _units_up(v, num, p, cap) for v in _padded(chain, f)]
                  for f in SIZE_FIELDS)
    return units, slots, float(memory) / slots


def _check_enough_slots(chain: Chain, slots: int, allow_all: bool) -> None:
    """ValueError if no limit makes the rounded problem feasible with ``slots``."""
    # however large the limit, every size still takes one slot at least
    ones = tuple([1 if v > 0 else 0 for v in _padded(chain, f)] for f in SIZE_FIELDS)
    fewest = core().rotor_min_units(ones, allow_all)
    if fewest > slots:
        raise ValueError(f"slots={slots} is too few for this chain at any memory: every stored "
                         f"item takes one slot at least and a schedule holds {fewest} at once; "
                         f"use slots >= {fewest} (500 is the default)")


def _min_memory(chain: Chain, slots: Optional[int], allow_all: bool, memory: float
                ) -> Union[int, float]:
    """Smallest memory limit for which the (discretized) problem is feasible."""
    ext = core()
    if slots is None:  # (at least 1: a limit must be positive, even for a chain of zeros)
        return max(1, ext.rotor_min_units(discretize(chain, memory, None)[0], allow_all))
    _check_enough_slots(chain, slots, allow_all)

    def ok(m: float) -> bool:
        units, budget, _ = discretize(chain, m, slots)
        return ext.rotor_min_units(units, allow_all) <= budget

    # feasibility is monotone in the limit (sizes in slots only shrink as it grows): bracket
    # it, then bisect. With integer sizes the exact minimum is a lower bound to start from.
    integer = chain.is_integer
    if integer:
        lo = max(ext.rotor_min_units(discretize(chain, 1, None)[0], allow_all) - 1, 0)
        # whole bytes (a fractional hint made the bisection's mid stick at lo for good);
        # lo >= 0: it never tries a limit of 0
        hi = max(int(math.ceil(memory)), lo + 1)
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


def rounding_headroom(chain: Chain, memory: Union[int, float]) -> int:
    """Slots by which the rounded peak of a plan that fits ``memory`` exactly can exceed the
    budget: less than one per item held at once (each is rounded up by less than a slot).
    A schedule holds at most L + 4 items; and those it holds at once fit in ``memory``: at
    most the smallest stored sizes (x, xbar, delta) that do, plus one op's tmp."""
    # sizes are >= 0: the positive ones are the non-zero ones, and their running sums only grow
    held = bisect_right(list(accumulate(sorted(filter(None, chain.x + chain.xbar + chain.delta)))),
                        memory)
    return min(chain.L + 4, held + 1)


def fit_limit(chain: Chain, memory: Union[int, float]) -> float:
    """The largest exact peak that fits ``memory``, by ``scheduler.simulate``'s rule: to the
    byte for an integer chain under an integer limit (float sums of integers are exact), else
    with its relative tolerance of 1e-9 (float sums of fractional sizes are not)."""
    return float(memory) + limit_tolerance(memory, chain.is_integer)


def check_refine(refine: Any) -> bool:
    if not isinstance(refine, bool):
        raise ValueError(f"refine: expected True or False, got {refine!r}")
    return refine


def solve_dp(chain: Chain, memory: Any, slots: Any, allow_all: bool, planner: str,
             refine: bool = True, *, whole_table: bool = False) -> Plan:
    """Shared by rotor (allow_all=True) and revolve (the AD model: allow_all=False).
    ``refine`` (slots only): win back the rounding from one wider table (module docstring).
    ``whole_table``: the DP tabulates every cell below the limit, not only those its answer
    reads (the same plan, slower: for tests)."""
    check_chain(chain)
    memory = memory_arg(memory)
    slots = slots_arg(slots, hint=_SLOTS_HINT)
    extra = rounding_headroom(chain, memory) if check_refine(refine) and slots is not None else 0
    units, budget, unit = discretize(chain, memory, slots, headroom=extra)
    limit = fit_limit(chain, memory)   # what a refined plan's exact peak may reach
    # (the extension converts the exact sizes and times to double itself, as float() does)
    feasible, time, peak, min_units, ops, used, tried, steps = core().rotor_solve(
        chain.fw, chain.bw, units, tuple(_padded(chain, f) for f in SIZE_FIELDS), budget, allow_all,
        slots is None,  # exact units: a double table; slots: float (twice as fast)
        extra, limit, whole_table)
    if not feasible:
        need = _min_memory(chain, slots, allow_all, memory)
        how = "exact units" if slots is None else f"{slots} slots"
        raise InfeasibleError(
            f"{planner}: no schedule of {'chain ' + chain.name if chain.name else 'the chain'} "
            f"fits in memory={format_bytes(memory)} with {how}; the smallest memory that works "
            f"is {format_bytes(need)}", need)
    if used != budget and not peak <= limit:  # the C++ side compared in double: say so loudly
        raise AssertionError(f"{planner}: refined plan's peak {peak!r} exceeds memory={memory!r}")
    if min_units > budget:  # refined from below the rounded minimum: too few slots stay an error
        _check_enough_slots(chain, slots, allow_all)
    if float(peak).is_integer() and chain.is_integer:
        peak = int(peak)
    if float(time).is_integer() and all(isinstance(v, int) for v in chain.fw + chain.bw):
        time = int(time)
    meta = {"memory": memory, "slots": slots, "unit": unit, "budget_units": budget,
            "dp_value": time, "refine": bool(extra),
            # refinement: the budget (slots) the plan was rebuilt at, whether it is above the
            # budget's own, and how many of the DP's drops in [budget, budget + extra] there
            # were and were rebuilt
            "dp_budget_units": used, "rounding_refined": used != budget,
            "refine_steps": steps, "refine_tried": tried}
    return Plan([_OPS.get(o) or _op(o) for o in ops], planner=planner, predicted_time=time,
                predicted_peak=peak, chain=chain, memory_limit=memory, meta=meta)


def solve(chain: Chain, memory: Any, slots: Optional[int] = 500, refine: bool = True) -> Plan:
    """The fastest persistent schedule of ``chain`` whose peak memory is at most ``memory``
    bytes (x[0] included). Raises ``InfeasibleError`` (with ``.min_memory``) if none fits.
    ``refine``: win back the slot rounding (default; see the module docstring); False gives
    the rounded problem's optimum."""
    return solve_dp(chain, memory, slots, allow_all=True, planner="rotor", refine=refine)


def min_memory(chain: Chain, slots: Optional[int] = None, memory: Optional[float] = None,
               *, _allow_all: bool = True) -> Union[int, float]:
    """A memory limit (bytes, x[0] included) at which ``solve`` finds a plan: the least one
    with ``slots=None``; else the least at which that slot count's rounded problem is
    feasible (the slot size scales with the limit; ``solve``'s refinement may find a plan a
    little below it too), searched from ``memory`` (a hint; any positive value works)."""
    check_chain(chain)
    slots = slots_arg(slots, hint=_SLOTS_HINT)
    hint = memory_arg(memory) if memory is not None \
        else max(1.0, float(sum(chain.xbar)))
    return _min_memory(chain, slots, _allow_all, hint)
