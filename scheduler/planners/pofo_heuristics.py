"""Seed 001 section 5.1's heuristics beside pofo's DP: :func:`capper` (rotor's sequence for
a larger limit, then offloads until its peak fits), :func:`autocapper` (capper over evenly
spaced limits, the fastest kept) and :func:`opportunist` (offload while the channel is free,
then rotor on each group in the backward). Their plans are converted to whole-activation
transfers with :func:`~scheduler.planners.offload.with_prefetches`, as the DP's are.
``pofo.solve`` weighs them as candidates; ``pofo`` re-exports them.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

from ..chain import Chain, Number
from ..errors import InfeasibleError, InvalidPlanError
from ..plan import TRANSFER_KINDS, Op, Plan
from ..simulate import SimResult, simulate
from ..units import format_bytes
from . import rotor
from .args import bandwidth_arg, check_chain, memory_arg, slots_arg
from .limits import least_working
from .offload import stamp, with_prefetches
from .pofo_bounds import _rotor_min, max_memory, min_memory

__all__ = ["capper", "autocapper", "opportunist"]


# -------------------------------------------------------------------------------- capper
def capper(chain: Chain, memory: Number, bandwidth: float, cap: Number,
           slots: Optional[int] = 50, _cache: Optional[dict] = None
           ) -> Optional[Tuple[Plan, SimResult]]:
    """Seed 001 section 5.1's capper: rotor's sequence for the larger limit ``cap``; while
    its peak (simulated, transfers included) exceeds ``memory``, offload the lowest-indexed
    activation in GPU memory at the peak and not used by the peak op (the copy starts right
    before its last use before the peak; the prefetch comes before its next use). None if
    it cannot get under ``memory``."""
    try:
        base = rotor.solve(chain, cap, slots=slots)
    except InfeasibleError:
        return None
    ops: List[Op] = list(base.ops)
    key = tuple(ops)
    if _cache is not None and key in _cache:
        return _cache[key]
    offloaded: List[Tuple[int, int, int]] = []   # (stage, offload position, consumer)
    result = None
    for _ in range(chain.L + 2):
        plan, sim = _transfer_plan(chain, ops, offloaded, bandwidth)
        if sim is None:
            break
        if sim.peak_memory <= memory:   # runs under the limit without ever waiting
            result = _best_placement(chain, ops, offloaded, memory, bandwidth, plan)
            break
        if bandwidth <= 0:
            break
        peak = max((st for st in sim.steps if st.kind not in TRANSFER_KINDS),
                   key=lambda st: st.peak).index
        cand = _lowest_stored(chain, ops, offloaded, _ops_index(plan, peak), bandwidth)
        if cand is None:
            break
        offloaded.append(cand)
    if _cache is not None:
        _cache[key] = result
    return result


def _ops_index(plan: Plan, plan_index: int) -> int:
    """Index in the compute-and-offload list (capper's ``ops``) of a plan op."""
    return sum(1 for op in plan.ops[:plan_index] if op.kind not in TRANSFER_KINDS)


def _readers(ops: Sequence[Op], s: int) -> List[int]:
    """Indices of the ops that use the input of stage s (F_* s, B s; B s-1 uses xbar[s-1])."""
    return [i for i, op in enumerate(ops)
            if (op.stage == s and op.kind in ("F_all", "F_ck", "F_none", "B"))
            or (op.kind == "B" and op.stage == s - 1)]


def _lowest_stored(chain: Chain, ops: List[Op], offloaded, peak: int, bandwidth: float):
    """The lowest stage whose input is in GPU memory while op ``peak`` runs, not used by it:
    (stage, offload position, prefetch consumer), or None."""
    taken = {s for s, _, _ in offloaded}
    for s in range(chain.L + 1):
        if s in taken:
            continue
        readers = _readers(ops, s)
        before = [i for i in readers if i < peak]
        after = [i for i in readers if i > peak]
        if (not before and s > 0) or not after or peak in readers:
            continue
        pos = before[-1] if before else 0
        # stored from its last use before the peak until its next use? ask the simulator:
        # offloading it there is valid exactly when nothing in between consumes it
        trial = list(ops[:pos]) + [Op("offload", s)] + list(ops[pos:after[0]])
        try:
            simulate(chain, Plan(trial), bandwidth, complete=False)
        except InvalidPlanError:
            continue
        return (s, pos, after[0])
    return None


def _merge(ops: Sequence[Op], offloaded) -> Tuple[List[Op], List[Tuple[int, int]]]:
    """Insert the offloads; the new op list and the (stage, consumer) prefetch pairs in
    consumer order, re-indexed."""
    at: dict = {}
    for s, pos, _ in offloaded:
        at.setdefault(pos, []).append(s)
    merged: List[Op] = []
    index = {}
    for i, op in enumerate(ops):
        for s in sorted(at.get(i, [])):
            merged.append(Op("offload", s))
        index[i] = len(merged)
        merged.append(op)
    return merged, sorted(((s, index[c]) for s, _, c in offloaded), key=lambda p: p[1])


def _transfer_plan(chain: Chain, ops, offloaded, bandwidth: float):
    """The sequence with its offloads and each prefetch right before its consumer,
    simulated without a limit (to find its peak)."""
    merged, pre = _merge(ops, offloaded)
    cons: dict = {}
    for s, c in pre:
        cons.setdefault(c, []).append(s)
    out: List[Op] = []
    for i, op in enumerate(merged):
        out.extend(Op("prefetch", s) for s in cons.get(i, []))
        out.append(op)
    plan = Plan(out, planner="autocapper")
    try:
        return plan, simulate(chain, plan, bandwidth if offloaded else None)
    except InvalidPlanError:
        return plan, None


def _best_placement(chain: Chain, ops, offloaded, memory: Number, bandwidth: float,
                    fallback: Plan) -> Optional[Tuple[Plan, SimResult]]:
    """The capped sequence under the limit: the better of the prefetch placements of
    :func:`with_prefetches` and the prefetch-right-before-use one (which fits as is)."""
    merged, pre = _merge(ops, offloaded)
    cands = []
    try:
        cands.append((fallback, simulate(chain, fallback, bandwidth if pre else None,
                                         memory=memory)))
    except InvalidPlanError:
        pass
    if pre:
        earliest = min(i for i, op in enumerate(merged) if op.kind == "offload") + 1
        try:
            cands.append(with_prefetches(chain, merged, pre, memory, bandwidth, earliest,
                                         "autocapper"))
        except InvalidPlanError:
            pass
    return min(cands, key=lambda ps: ps[1].makespan) if cands else None


def autocapper(chain: Chain, memory: Union[Number, str], bandwidth: Union[Number, str],
               levels: int = 40, slots: Optional[int] = 50) -> Plan:
    """Seed 001 section 5.1: capper with ``levels`` limits M' evenly spaced between
    ``memory`` and M^high (the store-all peak); each resulting sequence is simulated and
    the fastest kept. Without recomputation it is GREEDY-like (seed 000)."""
    chain, memory = check_chain(chain), memory_arg(memory)
    beta = bandwidth_arg(bandwidth, allow_zero=True, where="pofo.autocapper")
    slots = slots_arg(slots)
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels: expected a positive int, got {levels!r}")
    try:
        return _autocapper(chain, memory, beta, levels, slots)
    except InfeasibleError as err:
        need = _autocapper_limit(chain, memory, beta, levels, slots)
        raise InfeasibleError(f"{err}; " + (f"at {format_bytes(need)} one does" if need is not None
                                            else "no limit that works is known"), need) from None


def _autocapper(chain: Chain, memory: Number, beta: float, levels: int = 40,
                slots: Optional[int] = 50) -> Plan:
    """:func:`autocapper` on checked arguments; its ``InfeasibleError`` names no limit
    (``pofo.solve`` weighs it as a candidate and asks for none)."""
    high = max_memory(chain)
    caps = [memory + (high - memory) * k / max(1, levels - 1) for k in range(levels)] \
        if high > memory else [memory]
    best: Optional[Tuple[Plan, SimResult]] = None
    cache: dict = {}
    for cap in caps:
        got = capper(chain, memory, beta, cap, slots, cache)
        if got is not None and (best is None or got[1].makespan < best[1].makespan):
            best = got
    if best is None:
        raise InfeasibleError(f"pofo.autocapper: no capped sequence fits memory "
                              f"{format_bytes(memory)}", None)
    plan, sim = best
    stamp(plan, sim, chain, memory, beta, "autocapper")
    plan.meta["offloaded"] = sorted(op.stage for op in plan.ops if op.kind == "offload")
    return plan


def _autocapper_limit(chain: Chain, memory: Number, beta: float, levels: int,
                      slots: Optional[int]) -> Optional[Number]:
    """The least limit above ``memory`` at which autocapper finds a plan (checked), among
    pofo's bound with offloading, rotor's least limit on its slot grid (autocapper's first
    cap, the limit itself, is then rotor's plan, which fits without offloading) and the
    store-all peak (where that plan stores everything); None if none does. A check costs one
    rotor solve where the limit's own cap fits, else a full autocapper run (``levels``
    cappers: a rotor solve and up to L + 2 simulations each); three checks at most."""
    def works(limit: Number) -> bool:
        if capper(chain, limit, beta, limit, slots) is not None:
            return True   # (autocapper's first cap: it finds this plan or a faster one)
        try:
            _autocapper(chain, limit, beta, levels, slots)
            return True
        except InfeasibleError:
            return False
    return least_working(_limits(chain, memory, beta, slots), memory, works)


def _limits(chain: Chain, memory: Number, beta: float, slots: Optional[int]
            ) -> List[Optional[Number]]:
    """The limits the heuristics' errors try (each checked before it is named): pofo's bound
    with offloading, rotor's least limit on the slot grid (searched from ``memory``; None
    where the grid has too few slots for this chain at any limit), the store-all peak."""
    try:
        rotor_least: Optional[Number] = _rotor_min(chain, slots, memory)
    except ValueError:
        rotor_least = None
    return [min_memory(chain) if beta > 0 else None, rotor_least, max_memory(chain)]


# ---------------------------------------------------------------------------- opportunist
def opportunist(chain: Chain, memory: Union[Number, str], bandwidth: Union[Number, str],
                slots: Optional[int] = 50) -> Plan:
    """Seed 001 section 5.1: F_all a stage and offload its input and output; F_none the
    next stages while the channel is busy (at least one); repeat until the rest of the
    chain runs storing everything; then the backward of each group between two F_all by
    rematerialization (rotor on the group), with the two prefetches before it."""
    chain, memory = check_chain(chain), memory_arg(memory)
    beta = bandwidth_arg(bandwidth, allow_zero=True, where="pofo.opportunist")
    slots = slots_arg(slots)
    try:
        return _opportunist(chain, memory, beta, slots)
    except InfeasibleError as err:
        need = _opportunist_limit(chain, memory, beta, slots)
        raise InfeasibleError(f"{err}; " + (f"at {format_bytes(need)} one does" if need is not None
                                            else "no limit that works is known"), need) from None


def _opportunist_limit(chain: Chain, memory: Number, beta: float,
                       slots: Optional[int]) -> Optional[Number]:
    """A limit above ``memory`` at which opportunist finds a plan (checked), or None: the
    least of pofo's bound with offloading, rotor's least limit on its slot grid and the
    store-all peak (where opportunist's first try, storing everything, fits). The heuristic
    can miss limits other planners meet (seed 001 section 5: it sometimes finds no solution)."""
    def works(limit: Number) -> bool:
        try:
            _opportunist(chain, limit, beta, slots)
            return True
        except InfeasibleError:
            return False
    return least_working(_limits(chain, memory, beta, slots), memory, works)


def _opportunist(chain: Chain, memory: Number, beta: float, slots: Optional[int]) -> Plan:
    """:func:`opportunist` on checked arguments; its ``InfeasibleError`` names no limit."""
    L = chain.L
    fwd: List[Op] = []
    groups: List[Tuple[int, int]] = []           # (head h, last F_none e)
    k = 0
    while True:
        got = _opportunist_plan(chain, fwd, groups, k, memory, beta, slots)
        if got is not None:
            plan, sim = got
            break
        if beta <= 0 or k >= L - 1:
            raise InfeasibleError(f"pofo.opportunist: no sequence fits memory "
                                  f"{format_bytes(memory)}", None)
        # a new group: F_all k with its input (x[k]) and output (xbar[k]) offloaded
        h = k
        fwd += [Op("offload", h), Op("F_all", h), Op("offload", h + 1)]
        k = h + 1
        while k < L:
            fwd.append(Op("F_none", k))
            k += 1
            r = simulate(chain, Plan(fwd), beta, complete=False)
            last = max(st.end for st in r.steps if st.kind not in TRANSFER_KINDS)
            if r.makespan <= last:              # the channel is idle: next group
                break
        groups.append((h, k - 1))
    stamp(plan, sim, chain, memory, beta, "opportunist")
    plan.meta["groups"] = groups
    return plan


def _group_backward(chain: Chain, h: int, e: int, memory: Number,
                    slots: Optional[int]) -> Optional[List[Op]]:
    """Rotor's sequence for stages h+1..e of a group (input xbar[h] on the GPU, x[h] and
    delta[e+1] held beside it), stages renumbered back; then B h."""
    if e == h:
        return [Op("B", h)]
    idx = range(h + 1, e + 1)
    sub = Chain(fw=[chain.fw[s] for s in idx], bw=[chain.bw[s] for s in idx],
                x=[chain.xbar[h]] + [chain.x[s] for s in range(h + 2, e + 1)],
                xbar=[chain.xbar[s] for s in idx], delta=[chain.delta[s] for s in idx],
                fw_tmp=[chain.fw_tmp[s] for s in idx], bw_tmp=[chain.bw_tmp[s] for s in idx],
                fck_tmp=[chain.fck_tmp[s] for s in idx], name=f"{chain.name}[{h + 1}..{e}]")
    budget = memory - chain.x[h] - chain.delta[e + 1]
    if budget <= 0:
        return None
    try:
        p = rotor.solve(sub, budget, slots=slots if slots or not sub.is_integer else 500)
    except InfeasibleError:
        return None
    return [Op(op.kind, op.stage + h + 1) for op in p.ops] + [Op("B", h)]


def _opportunist_plan(chain: Chain, fwd: List[Op], groups, k: int, memory: Number,
                      beta: float, slots: Optional[int]):
    """The full sequence with stages k..L stored entirely (F_all, then B), or None."""
    L = chain.L
    ops = list(fwd) + [Op("F_all", s) for s in range(k, L + 1)] \
        + [Op("B", s) for s in range(L, k - 1, -1)]
    try:   # cheap necessary check: the forward groups and the stored tail fit
        simulate(chain, Plan(ops), beta if groups else None, memory=memory, complete=False)
    except InvalidPlanError:
        return None
    loss = ops.index(Op("F_all", L))
    pre: List[Tuple[int, int]] = []
    for h, e in reversed(groups):
        back = _group_backward(chain, h, e, memory, slots)
        if back is None:
            return None
        pre.append((h + 1, len(ops)))             # xbar[h], for the group's first op
        pre.append((h, len(ops) + len(back) - 1))  # x[h], for B h
        ops += back
    if not pre:
        plan = Plan(ops, planner="opportunist")
        try:
            return plan, simulate(chain, plan, None, memory=memory)
        except InvalidPlanError:
            return None
    try:
        return with_prefetches(chain, ops, pre, memory, beta, loss + 1, "opportunist")
    except InvalidPlanError:
        return None
