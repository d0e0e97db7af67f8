"""Rematerialization + offloading (seed 001): pofo, autocapper, opportunist.

:func:`solve` runs the Appendix B dynamic program (C++, ``csrc/dp/pofo_dp.cpp``): the
forward phase OC_x with states (A, Delta_F, Delta_B) and the F_all / F_ck cases, the loss,
and the backward C_Delta with prefetching. Its optimum assumes seed 001's section 3.2:
offloads before the loss, prefetches after it, memory persistency, and (assumption 3)
memory released / reserved *continuously* while an activation moves.

What is exact and what is not
-----------------------------
The simulator moves whole activations (memory freed when an offload completes, reserved
when a prefetch starts), so assumption 3 cannot be executed as such. As section 3.2 says,
the DP's sequence is converted to whole-activation transfers: ``offload s`` right before
the forward that reads the input of stage s, ``prefetch s`` placed as late as possible
(or as early as possible, whichever simulates faster) before the first backward-phase op
that needs it. Then:

* a plan without transfers (memory large enough, or ``bandwidth`` 0) is exact:
  ``predicted_time`` is the DP's value and equals the simulated makespan (integer chains,
  ``slots=None``), and it is rotor's optimum;
* a plan with transfers reports the simulator's makespan as ``predicted_time`` (the real
  time of the converted plan) and the DP's continuous-transfer optimum as
  ``meta["dp_time"]``. The DP's value can be optimistic (continuous release) or, because
  its Lemma 1 idle placement is conservative in places, pessimistic, so neither direction
  is guaranteed for the converted plan;
* what *is* guaranteed (and tested): ``solve`` returns the fastest simulated of the DP's
  converted plan and the DP's best plans without offloading (rotor) and without
  recomputation (offload-only in the same model), so ``pofo <= rotor`` and
  ``pofo <= offload-only`` at every memory limit, in simulated time.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

from ..chain import Chain
from ..errors import InfeasibleError, InvalidPlanError
from ..plan import Op, Plan
from ..simulate import SimResult, simulate
from . import rotor
from .offload import Number, bandwidth_arg, memory_arg, slots_arg, with_prefetches

__all__ = ["solve", "autocapper", "opportunist", "capper", "min_memory", "max_memory",
           "dp"]

_KINDS = ("F_all", "F_ck", "F_none", "B", "offload")


def _chain(chain: Chain) -> Chain:
    if not isinstance(chain, Chain):
        raise ValueError(f"chain: expected a scheduler.Chain, got {type(chain).__name__}")
    return chain


def _core():
    from vmalloc import _core
    return _core


def min_memory(chain: Chain, bandwidth: float = 1.0) -> Number:
    """The smallest limit a pofo sequence can meet. With offloading: everything but the
    current stage's input on the host, each stage checkpointed with F_ck and recomputed
    alone (F_all s, B s). Without (``bandwidth`` 0): rotor's minimum, keeping x[0] and
    recomputing from it (what the DP finds; here computed by the DP in exact units when
    the chain is integer, else the offloading bound)."""
    c = _chain(chain)
    L = c.L
    x = list(c.x) + [0]
    d = list(c.delta) + [0]
    need = 0
    for s in range(L + 1):
        fwd = x[s] + (x[s + 1] if s < L else c.xbar[s]) + c.fw_tmp[s]
        rec = x[s] + c.xbar[s] + d[s + 1] + c.fw_tmp[s]
        bwd = x[s] + c.xbar[s] + d[s + 1] + d[s] + c.bw_tmp[s]
        need = max(need, fwd, rec, bwd)
    return need


def max_memory(chain: Chain) -> Number:
    """M^high of seed 001 section 5.2: the store-all sequence's peak (no recomputation,
    no offloading)."""
    c = _chain(chain)
    ops = [Op("F_all", s) for s in range(c.L + 1)] + [Op("B", s) for s in range(c.L, -1, -1)]
    return simulate(c, Plan(ops)).peak_memory


# ------------------------------------------------------------------------------- the DP
def dp(chain: Chain, memory: Number, bandwidth: float, slots: Optional[int] = 50,
       offload: bool = True, recompute: bool = True):
    """Run the Appendix B DP. Returns ``(time, ops, prefetches, info)`` or None if it finds
    no sequence: ``ops`` the compute and offload ops in order, ``prefetches`` the
    ``(stage, consumer index)`` pairs in the order they run."""
    # the same discretisation as rotor (sizes rounded up to whole slots of memory/slots)
    (x, xbar, delta, fw_tmp, bw_tmp), M, unit = rotor.discretize(chain, memory, slots)
    if M >= 1 << 17:
        raise ValueError(f"pofo.solve: memory {memory:g} is {M} units; the DP takes at most "
                         "131071 (pass slots=<int>)")
    beta = bandwidth / unit if bandwidth > 0 else 0.0
    ok, t, ops, pre, nf, nb = _core().pofo_solve(
        x, xbar, delta, fw_tmp, bw_tmp, [float(v) for v in chain.fw],
        [float(v) for v in chain.bw], M, beta, offload, recompute)
    if not ok:
        return None
    return t, [Op(_KINDS[k], s) for k, s in ops], [tuple(p) for p in pre], \
        {"states_fwd": nf, "states_bwd": nb, "slots": slots}


def _plan_of(chain: Chain, got, memory: Number, bandwidth: float, planner: str
             ) -> Tuple[Plan, SimResult]:
    t, ops, pre, info = got
    if not pre:
        plan = Plan(ops, planner=planner)
        return plan, simulate(chain, plan, bandwidth if bandwidth > 0 else None, memory=memory)
    loss = ops.index(Op("F_all", chain.L))  # assumption 1: prefetches after the loss
    return with_prefetches(chain, ops, pre, memory, bandwidth, loss + 1, planner)


def solve(chain: Chain, memory: Union[Number, str], bandwidth: Union[Number, str, None],
          slots: Optional[int] = 50) -> Plan:
    """pofo: the optimal persistent sequence of F_all / F_ck / F_none / B / offload /
    prefetch under seed 001's assumptions (see the module docstring for what is exact).
    ``slots``: memory discretisation (seed 001 uses 50; None = exact bytes, small integer
    chains only). ``bandwidth`` in bytes/s (0 or None: rematerialization only)."""
    chain, memory = _chain(chain), memory_arg(memory)
    beta = bandwidth_arg(bandwidth, allow_zero=True)
    slots = slots_arg(slots)
    floor = min_memory(chain) if beta > 0 else None
    if floor is not None and memory < floor:
        raise InfeasibleError(f"pofo.solve: memory {memory:g} is below the smallest limit "
                              f"any sequence of {chain.name or 'this chain'} can meet "
                              f"({floor:g})", floor)
    variants = [("pofo", True, True)]
    if beta > 0:
        variants += [("rotor", False, True), ("offload-only", True, False)]
    best: Optional[Tuple[Plan, SimResult, float, str]] = None
    dp_time = None
    for name, off, rec in variants:
        got = dp(chain, memory, beta, slots, offload=off, recompute=rec)
        if got is None:
            continue
        if name == "pofo":
            dp_time = got[0]
        try:
            plan, sim = _plan_of(chain, got, memory, beta, "pofo")
        except InvalidPlanError:
            continue
        if best is None or sim.makespan < best[1].makespan - 1e-12 * sim.makespan:
            best = (plan, sim, got[0], name)
        plan.meta.update(got[3])
    if best is None:
        need = floor if floor is not None else _rotor_min(chain, slots, memory)
        raise InfeasibleError(
            f"pofo.solve: no sequence fits memory {memory:g} with slots={slots} "
            f"(the smallest feasible limit is {need:g}; discretisation rounds sizes up, "
            "so a limit just above it may need more slots)", need)
    plan, sim, t, name = best
    transfers = any(op.kind in ("offload", "prefetch") for op in plan.ops)
    plan.predicted_time = sim.makespan if transfers else t
    plan.predicted_peak = sim.peak_memory
    plan.chain = chain
    plan.meta.update(dp_time=dp_time, variant=name, exact=not transfers,
                     simulated_time=sim.makespan)
    return plan


def _rotor_min(chain: Chain, slots: Optional[int], memory: Number) -> Number:
    """Smallest limit for rematerialization only (rotor's, same discretisation)."""
    return rotor.min_memory(chain, slots if chain.is_integer or slots else 500, memory)


# ----------------------------------------------------------------- section 5.1 heuristics
def capper(chain: Chain, memory: Number, bandwidth: float, cap: Number,
           slots: Optional[int] = 50) -> Optional[Tuple[Plan, SimResult]]:
    """Seed 001 section 5.1's capper: a rematerialization-only sequence for the larger limit
    ``cap``; while its peak exceeds ``memory``, offload the lowest-indexed activation in GPU
    memory at the peak (right after the last forward that reads it before the peak,
    prefetched before its next use). None if it cannot get under ``memory``."""
    got = dp(chain, cap, 0.0, slots, offload=False)
    if got is None:
        return None
    ops: List[Op] = list(got[1])
    offloaded: List[Tuple[int, int, int]] = []   # (stage, offload index, consumer index)
    for _ in range(2 * (chain.L + 1)):
        plan, sim = _transfer_plan(chain, ops, offloaded, bandwidth)
        if sim is None:
            return None
        if sim.peak_memory <= memory:
            break
        peak_op = _peak_compute_op(plan, sim)
        if peak_op is None:
            return None
        cand = _lowest_stored(chain, ops, offloaded, _ops_index(plan, peak_op), bandwidth)
        if cand is None:
            return None
        offloaded.append(cand)
    else:
        return None
    try:
        final = _with_transfers(chain, ops, offloaded, memory, bandwidth)
    except InvalidPlanError:
        return None
    return final


def _ops_index(plan: Plan, plan_index: int) -> int:
    """Index in the compute-and-offload list of the plan op at ``plan_index``."""
    return sum(1 for op in plan.ops[:plan_index] if op.kind != "prefetch")


def _peak_compute_op(plan: Plan, sim: SimResult) -> Optional[int]:
    best, arg = -math.inf, None
    for st in sim.steps:
        if st.kind in ("offload", "prefetch"):
            continue
        if st.peak > best:
            best, arg = st.peak, st.index
    return arg


def _readers(chain: Chain, ops: Sequence[Op], s: int) -> List[int]:
    """Indices of the ops that use the input of stage s (F_* s, B s; B s-1 uses xbar[s-1])."""
    return [i for i, op in enumerate(ops)
            if (op.stage == s and op.kind in ("F_all", "F_ck", "F_none", "B"))
            or (op.kind == "B" and op.stage == s - 1)]


def _lowest_stored(chain: Chain, ops: List[Op], offloaded, peak: int, bandwidth: float):
    """The lowest stage whose input is in GPU memory while op ``peak`` runs and is not
    needed by it: (stage, offload position, prefetch consumer)."""
    taken = {s for s, _, _ in offloaded}
    for s in range(chain.L + 1):
        if s in taken:
            continue
        readers = _readers(chain, ops, s)
        before = [i for i in readers if i < peak]
        after = [i for i in readers if i > peak]
        if not before or not after or peak in readers:
            continue
        # produced before the peak (or x[0]), used again after it: offload right before
        # its last use before the peak (the copy overlaps that op), prefetch for the next
        pos, nxt = before[-1], after[0]
        # the item must not be consumed in between (F_none / B free it): check with a prefix
        prefix = list(ops[:pos]) + [Op("offload", s)] + list(ops[pos:peak + 1])
        try:
            simulate(chain, Plan(prefix), bandwidth, complete=False)
        except InvalidPlanError:
            continue
        return (s, pos, nxt)
    return None


def _merge(ops: Sequence[Op], offloaded) -> Tuple[List[Op], List[Tuple[int, int]]]:
    """Insert the offloads; return the new op list and the prefetch (stage, consumer) pairs
    in consumer order, consumers re-indexed."""
    at = {}
    for s, pos, nxt in offloaded:
        at.setdefault(pos, []).append(s)
    merged: List[Op] = []
    index = {}
    for i, op in enumerate(ops):
        for s in sorted(at.get(i, [])):
            merged.append(Op("offload", s))
        index[i] = len(merged)
        merged.append(op)
    pre = sorted(((s, index[nxt]) for s, _, nxt in offloaded), key=lambda p: p[1])
    return merged, pre


def _transfer_plan(chain: Chain, ops, offloaded, bandwidth: float):
    """The capper's current sequence without a memory limit (to find its peak)."""
    merged, pre = _merge(ops, offloaded)
    cons = {}
    for s, c in pre:
        cons.setdefault(c, []).append(s)
    out: List[Op] = []
    for i, op in enumerate(merged):
        for s in cons.get(i, []):
            out.append(Op("prefetch", s))
        out.append(op)
    plan = Plan(out, planner="capper")
    try:
        return plan, simulate(chain, plan, bandwidth if offloaded else None)
    except InvalidPlanError:
        return plan, None


def _with_transfers(chain: Chain, ops, offloaded, memory: Number, bandwidth: float):
    merged, pre = _merge(ops, offloaded)
    if not pre:
        plan = Plan(merged, planner="autocapper")
        return plan, simulate(chain, plan, None, memory=memory)
    earliest = min(i for i, op in enumerate(merged) if op.kind == "offload") + 1
    return with_prefetches(chain, merged, pre, memory, bandwidth, earliest, "autocapper")


def autocapper(chain: Chain, memory: Union[Number, str], bandwidth: Union[Number, str],
               levels: int = 40, slots: Optional[int] = 50) -> Plan:
    """Seed 001 section 5.1: capper with ``levels`` limits M' evenly spaced between
    ``memory`` and M^high (the store-all peak); each resulting sequence is simulated and
    the fastest kept."""
    chain, memory = _chain(chain), memory_arg(memory)
    beta = bandwidth_arg(bandwidth, allow_zero=True)
    slots = slots_arg(slots)
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels: expected a positive int, got {levels!r}")
    high = max_memory(chain)
    caps = [memory + (high - memory) * k / max(1, levels - 1) for k in range(levels)] \
        if high > memory else [memory]
    best: Optional[Tuple[Plan, SimResult]] = None
    for cap in caps:
        if beta == 0 and cap > memory:
            continue
        got = capper(chain, memory, beta, cap, slots)
        if got is not None and (best is None or got[1].makespan < best[1].makespan):
            best = got
    if best is None:
        raise InfeasibleError(f"pofo.autocapper: no capped sequence fits memory {memory:g}",
                              min_memory(chain) if beta > 0 else _rotor_min(chain, slots, memory))
    plan, sim = best
    plan.planner = "autocapper"
    plan.predicted_time, plan.predicted_peak, plan.chain = sim.makespan, sim.peak_memory, chain
    return plan


def opportunist(chain: Chain, memory: Union[Number, str], bandwidth: Union[Number, str],
                slots: Optional[int] = 50) -> Plan:
    """Seed 001 section 5.1: F_all a stage and offload its input and output, run F_none
    while the channel is busy, repeat until the rest of the chain runs in memory storing
    everything; then the backward of each group between two F_all by rematerialization
    (the DP without offloading), with the prefetches before it."""
    chain, memory = _chain(chain), memory_arg(memory)
    beta = bandwidth_arg(bandwidth, allow_zero=False)
    slots = slots_arg(slots)
    L = chain.L
    plan = _opportunist(chain, memory, beta, slots)
    if plan is None:
        raise InfeasibleError(f"pofo.opportunist: no sequence fits memory {memory:g}",
                              min_memory(chain))
    return plan


def _tail_fits(chain: Chain, k: int, memory: Number, held: Number) -> bool:
    """Stages k..L store-all (F_all, then B) within memory, with ``held`` already in use."""
    stored, x = held, list(chain.x)
    need = 0
    inp = chain.x[k]
    stored += inp
    for s in range(k, chain.L + 1):
        need = max(need, stored + chain.xbar[s] + chain.fw_tmp[s])
        stored += chain.xbar[s]
    d = list(chain.delta) + [0]
    for s in range(chain.L, k - 1, -1):
        need = max(need, stored + d[s] + chain.bw_tmp[s])
        stored += d[s] - chain.xbar[s] - d[s + 1]
    return need <= memory


def _opportunist(chain: Chain, memory: Number, beta: float, slots: Optional[int]):
    return None
