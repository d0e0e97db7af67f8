"""The default choice: the fastest valid plan any planner finds for a memory limit.

:func:`solve` runs the remat-only planner (rotor), and with a transfer channel the
offload-only (DYNPROG, GREEDY) and combined ones (pofo, autocapper, opportunist), simulates
every plan they return under the limit, and keeps the fastest (ties: the first in that
order, so rotor, which needs no transfer channel, wins ties). Each runs with its default
memory slots, or in exact units for small integer chains (limit <= ``EXACT_UNITS``).
Cost: the sum of the planners' solve times (autocapper's 40 rotor solves dominate on long
chains; pass ``planners=`` to restrict). The winner's ``planner`` is
its own; ``meta["chosen_by"] = "best"`` and ``meta["candidates"]`` (planner -> simulated
seconds, or the reason it has none) say how it was chosen.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple, Union

from ..chain import Chain, Number
from ..errors import InfeasibleError, InvalidPlanError
from ..plan import Plan
from ..simulate import simulate
from ..units import format_bytes
from . import offload, pofo, rotor
from .args import bandwidth_arg, check_chain, memory_arg
from .limits import least_working

__all__ = ["solve", "PLANNERS"]

EXACT_UNITS = 2048   # integer chains with a limit up to this many bytes: DPs in exact units

# planner(chain, memory, bandwidth, slots); slots None = exact units, else each one's default
Planner = Callable[[Chain, Number, float, Optional[int]], Plan]


def _slots(slots: Optional[int], default: int) -> dict:
    return {"slots": default if slots == -1 else slots}


PLANNERS: Tuple[Tuple[str, bool, Planner], ...] = (   # (name, needs transfers, planner)
    ("rotor", False, lambda c, m, b, s: rotor.solve(c, m, **_slots(s, 500))),
    ("pofo", True, lambda c, m, b, s: pofo.solve(c, m, b, **_slots(s, 50))),
    ("dynprog", True, lambda c, m, b, s: offload.dynprog(c, m, b, **_slots(s, 500))),
    ("greedy", True, lambda c, m, b, s: offload.greedy(c, m, b)),
    ("autocapper", True, lambda c, m, b, s: pofo.autocapper(c, m, b, **_slots(s, 50))),
    ("opportunist", True, lambda c, m, b, s: pofo.opportunist(c, m, b, **_slots(s, 50))),
)


def solve(chain: Chain, memory: Union[Number, str],
          bandwidth: Union[Number, str, None] = None,
          planners: Optional[List[str]] = None) -> Plan:
    """The fastest plan (simulated, under ``memory``) among the planners; ``bandwidth`` in
    bytes/s (None or 0: no transfer channel, remat-only). ``planners``: restrict to these
    names (default: all of :data:`PLANNERS`). Raises ``InfeasibleError`` when none fits,
    whose ``min_memory`` is the least limit one of them named at which that one is checked
    to find a plan (None, and the message says so, if none is)."""
    check_chain(chain)
    memory = memory_arg(memory)
    beta = bandwidth_arg(bandwidth, allow_zero=True, where="best.solve")
    names = [n for n, _, _ in PLANNERS]
    if planners is not None:
        ok = isinstance(planners, (list, tuple, set, frozenset))
        bad = [p for p in planners if p not in names] if ok else []
        if not ok or bad or not planners:
            raise ValueError(f"planners: expected a non-empty list of {', '.join(names)}, "
                             f"got {planners!r}")
    slots = _slots_for(chain, memory)
    best: Optional[Tuple[float, Plan]] = None
    report: Dict[str, Union[float, str]] = {}
    needs: List[Tuple[float, Planner]] = []   # (the limit a failed planner named, it)
    for name, transfers, plan_for in PLANNERS:
        if planners is not None and name not in planners:
            continue
        if transfers and beta == 0:
            report[name] = "no transfer channel"
            continue
        try:
            plan = plan_for(chain, memory, beta, slots)
            sim = simulate(chain, plan, beta if beta > 0 else None, memory=memory)
        except InfeasibleError as err:
            report[name] = f"infeasible: {err}"
            if getattr(err, "min_memory", None) is not None:
                needs.append((err.min_memory, plan_for))
            continue
        except InvalidPlanError as err:
            report[name] = f"invalid plan: {err}"
            continue
        report[name] = sim.makespan
        if sim.peak_memory > memory * (1 + 1e-9):   # cannot happen: the limit is enforced
            report[name] = f"peak {format_bytes(sim.peak_memory)} over the limit"
            continue
        if best is None or sim.makespan < best[0] - 1e-12 * max(1.0, sim.makespan):
            best = (sim.makespan, plan)
            plan.predicted_time, plan.predicted_peak = sim.makespan, sim.peak_memory
    if best is None:
        need = _least_working(chain, memory, beta, needs)
        least = (f" (the smallest limit one of them can meet is {format_bytes(need)})"
                 if need is not None else " (none of them named a limit that works)")
        raise InfeasibleError(
            f"best.solve: no planner found a plan of {chain.name or 'the chain'} under memory "
            f"{format_bytes(memory)}{least}; "
            + "; ".join(f"{k}: {v}" for k, v in report.items()), need)
    plan = best[1]
    plan.memory_limit, plan.chain = memory, chain
    plan.meta.update(chosen_by="best", candidates=report)
    return plan


def _slots_for(chain: Chain, memory: Number) -> Optional[int]:
    """The planners' units at this limit: exact ones (None) for small integer chains, where
    the DPs' exact units (no slot rounding) are cheap and better, else each one's default."""
    return None if chain.is_integer and memory <= EXACT_UNITS else -1


def _least_working(chain: Chain, memory: Number, beta: float,
                   needs: List[Tuple[float, Planner]]) -> Optional[float]:
    """The least of the limits the failed planners named at which the one that named it
    finds a plan that fits, as :func:`solve` would run it there (some name bounds, not
    limits that work; a limit at or below ``memory`` was just refused); None if none does."""
    namers: Dict[Number, List[Planner]] = {}
    for need, plan_for in needs:
        namers.setdefault(need, []).append(plan_for)

    def works(limit: Number) -> bool:
        for plan_for in namers[limit]:
            try:
                plan = plan_for(chain, limit, beta, _slots_for(chain, limit))
                sim = simulate(chain, plan, beta if beta > 0 else None, memory=limit)
            except (InfeasibleError, InvalidPlanError):
                continue
            if sim.peak_memory <= limit:
                return True
        return False
    return least_working(namers, memory, works)
