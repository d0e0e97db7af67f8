"""Offloading-only planners (seed 000): every stage runs ``F_all`` once, and chosen stored
activations go to host memory during the forward phase and come back for the backward.

In the seed-000 view of our chain, the activation ``x_i`` of the paper is *what is stored
as the input of stage i*: ``x[0]`` for i = 0, ``xbar[i-1]`` after; ``offload i`` moves it.

* :func:`lower_bound` — Propositions 2-3.
* :func:`greedy` — Theorem 2 rounded to whole activations (offload the first k).
* :func:`dynprog` — Algorithm 1 (C++, ``csrc/dp/offload_dp.cpp``), then the no-wait ordered
  schedule with its decisions.
* :func:`vdnn` — the VDNN heuristic of section 6.1.

Shared with pofo: :func:`with_prefetches` (a compute-and-offload sequence made a plan by
placing its prefetches) and :func:`stamp` (a finished plan's prediction from its simulation).

What is exact and what is not
-----------------------------
Algorithm 1 solves the *fractional communications* relaxation (memory released/reserved
continuously while an activation moves, prefetches as late as possible). The simulator
moves whole activations (seed 000 assumption D). So a plan's ``predicted_time`` /
``predicted_peak`` are the simulator's numbers for the plan returned (the no-wait ordered
schedule with those decisions, as seed 000 defines DYNPROG's output), and the DP's own
optimum is ``plan.meta["relaxed_time"]``. Tested (exact units, small integer chains): the
DP's search equals the minimum of its recurrence over all offload subsets; for every subset
that recurrence is <= the simulated time of the whole-activation plan (a true relaxation);
and ``lower_bound <= relaxed_time <= simulated time`` for DYNPROG, ``lower_bound <=
simulated time`` for every planner. With ``slots``, sizes are first rounded to the nearest
slot (rounding ~L activations up inflates the apparent need by up to L slots: seed 000
section 6.2's DenseNet discretisation error), so ``relaxed_time`` is then an estimate.

With ``transfer_chunk`` (our own extension) the plans stream their transfers
(:attr:`Plan.transfer_chunk`): the simulator then frees and reserves memory as a copy
proceeds, as the relaxation does, and DYNPROG's plan comes close to ``relaxed_time``.

All sizes in bytes, times in seconds, ``bandwidth`` in bytes per second (a number or a
rate string such as ``"12GB/s"``; ``"12GB"`` too: ``scheduler.units.parse_rate``).
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from .._native import core
from ..chain import Chain, Number
from ..errors import InfeasibleError, InvalidPlanError
from ..plan import TRANSFER_KINDS, Op, Plan
from ..simulate import SimResult, simulate
from ..units import format_bytes
from . import rotor
# the argument checks live in planners.args; bandwidth_arg & co. stay importable from here
from .args import bandwidth_arg, check_chain, chunk_arg, memory_arg, slots_arg
from .improve import improve_transfers

__all__ = ["lower_bound", "greedy", "dynprog", "vdnn", "min_memory", "peak_memory",
           "schedule", "activations", "with_prefetches", "stamp", "Number", "bandwidth_arg",
           "chunk_arg", "memory_arg", "slots_arg"]


# ------------------------------------------------------------------ the seed-000 view
def activations(chain: Chain) -> List[Number]:
    """Seed 000's |x_i| for i = 0..L+1: what the store-all schedule keeps as the input of
    stage i (``x[0]``, then ``xbar[i-1]``); the last, ``xbar[L]``, is never offloaded."""
    return [chain.x[0]] + list(chain.xbar)


def _grads(chain: Chain) -> List[Number]:
    return list(chain.delta) + [0]


def peak_memory(chain: Chain) -> Number:
    """M_peak of seed 000 section 3.2: the store-all schedule's peak (data on both devices)."""
    act, grad = activations(check_chain(chain)), _grads(chain)
    peak, stored = 0, 0
    for i in range(chain.L + 1):
        stored += act[i] if i == 0 else 0
        held = stored + act[i + 1]                    # sum_{j <= i+1} |x_j|
        peak = max(peak, held + chain.fw_tmp[i], held + grad[i] + grad[i + 1] + chain.bw_tmp[i])
        stored += act[i + 1]
    return peak


def min_memory(chain: Chain) -> Number:
    """The smallest limit an offloading schedule can meet: each op with only its own input
    and output on the GPU (all else offloaded, waiting as long as it takes)."""
    act, grad = activations(check_chain(chain)), _grads(chain)
    return max(1, max(max(act[i] + act[i + 1] + chain.fw_tmp[i],
                          act[i] + act[i + 1] + grad[i] + grad[i + 1] + chain.bw_tmp[i])
                      for i in range(chain.L + 1)))


def _check_feasible(chain: Chain, memory: Number, who: str) -> None:
    need = min_memory(chain)
    if memory < need:
        raise InfeasibleError(
            f"{who}: memory {format_bytes(memory)} is below the smallest limit any offloading "
            f"schedule of {chain.name or 'this chain'} can meet ({format_bytes(need)})", need)


# ------------------------------------------------------------------------ lower bound
def lower_bound(chain: Chain, memory: Union[Number, str],
                bandwidth: Union[Number, str]) -> float:
    """Proposition 3: max(sum of compute times, 2 (M_peak - M) / bandwidth)."""
    chain, memory = check_chain(chain), memory_arg(memory)
    beta = bandwidth_arg(bandwidth, allow_zero=True, where="offload.lower_bound")
    _check_feasible(chain, memory, "offload.lower_bound")
    extra = peak_memory(chain) - memory      # Proposition 2: data any schedule must offload
    comm = 0.0 if extra <= 0 else (math.inf if beta == 0 else 2 * extra / beta)
    return max(chain.total_compute(), comm)


# -------------------------------------------------- building the no-wait ordered plan
def _nominal_starts(chain: Chain, ops: Sequence[Op]) -> List[float]:
    """Start time of each op if compute never waited (transfers get their issue time)."""
    t, out = 0.0, []
    for op in ops:
        out.append(t)
        if op.kind in ("F_all", "F_ck", "F_none"):
            t += chain.fw[op.stage]
        elif op.kind == "B":
            t += chain.bw[op.stage]
    return out


def _item_size(chain: Chain, ops: Sequence[Op], stage: int, before: int) -> Number:
    """Size of what is stored as the input of ``stage`` when op ``before`` runs: the
    store-all view unless a checkpointing forward made it ``x[stage]``."""
    for op in reversed(ops[:before]):
        if op.stage == stage - 1 and op.kind in ("F_ck", "F_none"):
            return chain.x[stage]
        if op.stage == stage - 1 and op.kind == "F_all":
            return chain.xbar[stage - 1]
    return chain.x[stage]


def with_prefetches(chain: Chain, ops: Sequence[Op], prefetches: Sequence[Tuple[int, int]],
                    memory: Number, bandwidth: float, earliest: int, planner: str,
                    chunk: Optional[float] = None) -> Tuple[Plan, SimResult]:
    """Insert ``prefetch s`` ops into ``ops`` (compute and offload ops, in order) and return
    the best plan the simulator accepts, with its simulation.

    ``prefetches``: ``(s, i)`` pairs in the order they run, ``i`` the index in ``ops`` of the
    first op that needs the input of s back. Each prefetch is tried *as late as possible*
    (the DPs' assumption: it ends when its consumer or the next prefetch starts, on the
    nominal compute timeline) and *as early as possible* (right after ``earliest`` and the
    previous prefetch: seed 000's no-wait policy). A prefetch whose reservation would block
    the compute stream for good (the simulator's InvalidPlanError) is moved after the
    blocked op until the plan runs. The faster of the two is returned. ``chunk``: the
    plan's ``transfer_chunk`` (None: whole-activation transfers).
    """
    ops = list(ops)
    if not prefetches:
        plan = Plan(ops, planner=planner, transfer_chunk=chunk)
        return plan, simulate(chain, plan, bandwidth if bandwidth > 0 else None, memory=memory)
    starts = _nominal_starts(chain, ops)
    compute_idx = [i for i, op in enumerate(ops) if op.kind not in TRANSFER_KINDS]
    sizes = [_item_size(chain, ops, s, i) for s, i in prefetches]

    # ALAP positions: walk the prefetches from the last one
    alap: List[int] = [0] * len(prefetches)
    nxt = math.inf
    for k in range(len(prefetches) - 1, -1, -1):
        s, i = prefetches[k]
        end = min(starts[i], nxt)
        start = end - (sizes[k] / bandwidth if not math.isinf(bandwidth) else 0.0)
        nxt = start
        pos = 0
        for j in compute_idx:   # the compute op running at `start`: issue right before it
            if j > i:
                break
            if starts[j] <= start:
                pos = j
        alap[k] = pos
    asap = [earliest] * len(prefetches)

    best: Optional[Tuple[Plan, SimResult]] = None
    for positions in (alap, asap):
        pos = [max(p, earliest) for p in positions]
        for k in range(1, len(pos)):         # the channel is FIFO: keep the order
            pos[k] = max(pos[k], pos[k - 1])
        got = _repair(chain, ops, prefetches, pos, memory, bandwidth, planner, chunk)
        if got is not None and (best is None or got[1].makespan < best[1].makespan):
            best = got
    if best is None:
        raise InvalidPlanError(f"{planner}: no placement of the prefetches runs under "
                               f"memory {format_bytes(memory)}", None)
    return best


# Past GALLOP_AFTER simulations, a prefetch blocked again right where the last move put it moves
# twice as far each time, up to GALLOP_MAX ops: an early placement (the no-wait policy's) under a
# tight limit otherwise walks one op per simulation through the forward (ResNet-50's 700 ops: 280
# simulations, 76 s on an H100 machine's host for the swap runtime's ``dynprog``). A long move
# that gets the prefetch past its block is then bisected back to the first position that does
# (a few simulations more), where the one-op walk would have stopped when blocks only ever move
# later with the prefetch
GALLOP_AFTER = 32
GALLOP_MAX = 16

# what one placement of the prefetches gives: the plan and its simulation, or where it blocks
# for good (the prefetch to move and the op, an index into ``ops``), or None (no move helps)
_Attempt = Union[Tuple[Plan, SimResult], Tuple[int, int], None]


def _attempt(chain: Chain, ops: List[Op], prefetches: Sequence[Tuple[int, int]],
             pos: Sequence[int], memory: Number, bandwidth: float, planner: str,
             chunk: Optional[float]) -> _Attempt:
    """Simulate the plan with the prefetches issued before ``ops[pos[k]]``: the plan and its
    simulation; else, for the op blocked for good, the prefetch that blocks it and the op's
    index in ``ops`` (a prefetch that never fits blocks itself; an op waiting for memory is
    blocked by the last prefetch issued before it whose data is for a later op); None when no
    prefetch is to blame."""
    merged: List[Op] = []
    where: Dict[int, int] = {}           # plan index of each prefetch
    k = 0
    for i, op in enumerate(ops):
        while k < len(pos) and pos[k] <= i:
            where[len(merged)] = k
            merged.append(Op("prefetch", prefetches[k][0]))
            k += 1
        merged.append(op)
    plan = Plan(merged, planner=planner, transfer_chunk=chunk)
    try:
        return plan, simulate(chain, plan, bandwidth, memory=memory)
    except InvalidPlanError as err:
        bad = err.index
        if bad is None or bad >= len(merged):
            return None
        blocked_op = sum(1 for j in range(bad) if j not in where)
        if bad in where:                 # a prefetch that never fits: issue it later
            return where[bad], blocked_op
        cands = [where[j] for j in range(bad) if j in where
                 and prefetches[where[j]][1] > blocked_op]
        return (max(cands), blocked_op) if cands else None


def _blocked_again(got: _Attempt, culprit: int, at: int) -> Optional[int]:
    """The op ``got`` is blocked at, when ``culprit`` (moved to ``at``) still blocks it there
    or later; else None."""
    if got is None or isinstance(got[0], Plan) or got[0] != culprit or got[1] < at:
        return None
    return int(got[1])


def _first_past_block(attempt: Callable[[int], _Attempt], culprit: int, lo: int, hi: int,
                      got: _Attempt) -> Tuple[int, _Attempt]:
    """Bisect (lo, hi] for the first position of prefetch ``culprit`` that gets it past its
    block (``attempt(at)``: the placement with it moved to ``at``; ``lo`` is blocked, ``hi``
    is past it with ``got``): the position and what it gives. A position where no move helps
    counts as blocked, so what was found at ``hi`` is not given up for a dead end."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        trial = attempt(mid)
        still = mid if trial is None else _blocked_again(trial, culprit, mid)
        if still is None:
            hi, got = mid, trial
        else:
            lo = min(still, hi - 1)
    return hi, got


def _repair(chain: Chain, ops: List[Op], prefetches: Sequence[Tuple[int, int]],
            pos: List[int], memory: Number, bandwidth: float, planner: str,
            chunk: Optional[float]) -> Optional[Tuple[Plan, SimResult]]:
    """Simulate the plan with the prefetches at ``pos``; while an op is blocked for good, move
    the prefetch that blocks it past it (and those after it, keeping the channel's order) and
    try again. The plan and its simulation, or None when a prefetch would have to move past
    its consumer."""
    def moved_to(culprit: int, at: int) -> Optional[List[int]]:
        """``pos`` with ``culprit`` moved to ``at``; None if a prefetch would pass its consumer."""
        new = pos[:culprit] + [max(p, at) for p in pos[culprit:]]
        return None if any(p > prefetches[j][1] for j, p in enumerate(new)) else new

    def attempt(p: Optional[List[int]]) -> _Attempt:
        return None if p is None else \
            _attempt(chain, ops, prefetches, p, memory, bandwidth, planner, chunk)

    got = attempt(pos)
    moved: Optional[Tuple[int, int]] = None  # the last move: (prefetch, position)
    step = 1
    for tries in range(4 * len(ops) + 8):
        if got is None or isinstance(got[0], Plan):
            return got  # type: ignore[return-value]
        culprit, blocked_op = got
        again = moved is not None and moved[0] == culprit and blocked_op >= moved[1]
        step = min(2 * step, GALLOP_MAX) if again and tries >= GALLOP_AFTER else 1
        at = min(blocked_op + step, prefetches[culprit][1])
        if at <= blocked_op:  # it would have to move past its consumer
            return None
        got = attempt(moved_to(culprit, at))
        if got is None and at - blocked_op > 1:
            # a long move to a dead end (or past a later prefetch's consumer): one op, and
            # walk from there
            at, step = blocked_op + 1, 1
            got = attempt(moved_to(culprit, at))
        elif at - blocked_op > 1 and _blocked_again(got, culprit, at) is None:
            # past its block: back to the first position that is
            at, got = _first_past_block(lambda a: attempt(moved_to(culprit, a)), culprit,
                                        blocked_op, at, got)
        if got is None:
            return None
        pos[:] = moved_to(culprit, at)  # type: ignore[assignment]
        moved = (culprit, at)
    return got if got is not None and isinstance(got[0], Plan) else None  # type: ignore


def schedule(chain: Chain, offloaded: Sequence[int], memory: Number, bandwidth: float,
             planner: str = "offload", first: Sequence[int] = (),
             chunk: Optional[float] = None) -> Tuple[Plan, SimResult]:
    """The ordered no-wait plan that offloads the inputs of the given stages: ``offload i``
    right before ``F_all i`` (the copy overlaps the forward that reads it), prefetches in
    reverse order before the backward that needs them (see :func:`with_prefetches`).
    ``first``: offloaded stages whose prefetches go to the front of the channel, in that
    order (our own variant, used by :func:`dynprog`'s search: a small activation needed
    last can ride in an early gap instead of delaying the end). ``chunk``: the plan's
    ``transfer_chunk``."""
    act = activations(chain)
    if any(not isinstance(i, int) or i < 0 or i > chain.L for i in offloaded):
        raise ValueError(f"offloaded: stages must be ints in 0..{chain.L}, got {list(offloaded)}")
    chosen = sorted({i for i in offloaded if act[i] > 0})
    if any(i not in chosen for i in first) or len(set(first)) != len(first):
        raise ValueError(f"first: expected distinct offloaded stages of {chosen}, got "
                         f"{list(first)}")
    ops: List[Op] = []
    for i in range(chain.L + 1):
        if i in chosen:
            ops.append(Op("offload", i))
        ops.append(Op("F_all", i))
    first_b = len(ops)
    b_index: Dict[int, int] = {}
    for i in range(chain.L, -1, -1):
        b_index[i] = len(ops)
        ops.append(Op("B", i))
    order = list(first) + [i for i in sorted(chosen, reverse=True) if i not in first]
    prefetches = [(i, b_index[i]) for i in order]
    # seed 000 eq. (10): prefetches may start in the forward phase, after the offloads
    earliest = (ops.index(Op("offload", chosen[-1])) + 1) if chosen else first_b
    return with_prefetches(chain, ops, prefetches, memory, bandwidth, earliest, planner, chunk)


def stamp(plan: Plan, sim: SimResult, chain: Chain, memory: Number, bandwidth: float,
          planner: Optional[str] = None) -> Plan:
    """Record on ``plan`` (returned) what it was planned for and what its simulation ``sim``
    says: the chain, the limit, the bandwidth its transfers were timed at (None without
    transfers, or with no channel), the simulated time and peak as its prediction, and
    ``planner`` when given. Shared by the offload and pofo planners."""
    plan.memory_limit = memory
    # the rate its transfers were timed at: simulate() and describe() default to it
    plan.bandwidth = bandwidth if plan.has_transfers and bandwidth > 0 else None
    plan.predicted_time = sim.makespan
    plan.predicted_peak = sim.peak_memory
    plan.chain = chain
    if planner is not None:
        plan.planner = planner
    return plan


def _finish(plan: Plan, sim: SimResult, chain: Chain, memory: Number, bandwidth: float,
            **meta) -> Plan:
    stamp(plan, sim, chain, memory, bandwidth)
    plan.meta.update(meta)
    plan.meta["offloaded"] = sorted(op.stage for op in plan.ops if op.kind == "offload")
    return plan


def _best_of(chain: Chain, sets: Sequence[Sequence[int]], memory: Number, bandwidth: float,
             planner: str, chunk: Optional[float] = None) -> Tuple[Plan, SimResult]:
    best: Optional[Tuple[Plan, SimResult]] = None
    seen = set()
    for s in sets:
        key = tuple(sorted(s))
        if key in seen:
            continue
        seen.add(key)
        try:
            got = schedule(chain, key, memory, bandwidth, planner, chunk=chunk)
        except InvalidPlanError:
            continue
        if best is None or got[1].makespan < best[1].makespan:
            best = got
    if best is None:
        raise InfeasibleError(f"{planner}: no candidate schedule fits memory "
                              f"{format_bytes(memory)}", min_memory(chain))
    return best


def _setup(chain: Chain, memory: Union[Number, str], bandwidth: Union[Number, str],
           who: str) -> Tuple[Chain, Number, float]:
    chain, memory = check_chain(chain), memory_arg(memory)
    beta = bandwidth_arg(bandwidth, allow_zero=True, where=who)
    # (no channel first: the offloading bound below is no limit that works without one)
    if beta == 0 and peak_memory(chain) > memory:
        raise InfeasibleError(f"{who}: bandwidth 0 cannot offload, and the chain needs "
                              f"{format_bytes(peak_memory(chain))} > {format_bytes(memory)} "
                              "without offloading", peak_memory(chain))
    _check_feasible(chain, memory, who)
    return chain, memory, beta


# ------------------------------------------------------------------------------ GREEDY
def _greedy_set(chain: Chain, memory: Number) -> List[int]:
    """The first k stages, k the smallest with sum_{i <= k} |x_i| >= M_peak - M."""
    need = peak_memory(chain) - memory
    act = activations(chain)
    chosen: List[int] = []
    total = 0
    for i in range(chain.L + 1):
        if total >= need:
            break
        chosen.append(i)
        total += act[i]
    return chosen


def greedy(chain: Chain, memory: Union[Number, str], bandwidth: Union[Number, str],
           transfer_chunk: Union[Number, str, None] = None) -> Plan:
    """Theorem 2 rounded up: offload entirely the first k activations, k the smallest index
    with sum_{i <= k} |x_i| >= M_peak - M; the no-wait ordered schedule.
    ``transfer_chunk``: stream transfers in chunks of this many bytes (see :func:`dynprog`)."""
    chain, memory, beta = _setup(chain, memory, bandwidth, "offload.greedy")
    chunk = chunk_arg(transfer_chunk)
    plan, sim = _best_of(chain, [_greedy_set(chain, memory)], memory, beta, "offload.greedy",
                         chunk)
    return _finish(plan, sim, chain, memory, beta, lower_bound=lower_bound(chain, memory, beta))


# ----------------------------------------------------------------------------- DYNPROG
def _dp_inputs(chain: Chain, memory: Number, bandwidth: float, slots: Optional[int],
               nearest: bool = False):
    """Algorithm 1's arguments in memory units: rotor's discretisation (sizes rounded up to
    whole slots of memory/slots), or with ``nearest`` rounded to the nearest slot: rounding
    up ~L activations inflates the apparent need by up to L slots (seed 000 section 6.2's
    DenseNet discretisation error); the plan is simulated with the real sizes anyway.
    Exact units (``slots=None``): the data a stage moves stays fractional (``exact``,
    csrc/dp/offload_dp.hpp), so the recurrence is the relaxation itself; on the slot grid the
    DP rounds it to whole slots (fewer states). Returns the arguments, then ``exact``."""
    if nearest and slots is not None:
        unit = memory / slots
        x, xbar, delta, fw_tmp, bw_tmp = ([int(round(v / unit)) for v in vals] for vals in (
            list(chain.x) + [0], chain.xbar, list(chain.delta) + [0], chain.fw_tmp,
            chain.bw_tmp))
        M = slots
    else:
        (x, xbar, delta, fw_tmp, bw_tmp, _), M, unit = rotor.discretize(chain, memory, slots)
    act = [x[0]] + list(xbar)
    beta = float(bandwidth) / unit
    args = (act, list(delta), fw_tmp, bw_tmp, [float(v) for v in chain.fw],
            [float(v) for v in chain.bw], M, beta)
    return args, slots is None


def relaxed_idle(chain: Chain, memory: Number, bandwidth: float, offloaded: Sequence[int],
                 slots: Optional[int] = None) -> Optional[float]:
    """Algorithm 1's recurrence along fixed decisions: the relaxed idle time of the ordered
    schedule offloading ``offloaded`` (None: infeasible). For testing the DP's search."""
    args, exact = _dp_inputs(chain, memory, bandwidth, slots)
    flags = [1 if i in set(offloaded) else 0 for i in range(chain.L + 1)]
    ok, idle, _, _ = core().offload_evaluate(*args, flags, exact)
    return idle if ok else None


def dynprog(chain: Chain, memory: Union[Number, str], bandwidth: Union[Number, str],
            slots: Optional[int] = 500, improve: bool = True,
            transfer_chunk: Union[Number, str, None] = None) -> Plan:
    """Seed 000 Algorithm 1 (hash tables of (M_F, Delta_F, Delta_B) per stage, equations
    1-10 including the idle time between the phases), then the no-wait ordered schedule
    with its offload decisions. ``slots``: memory discretisation (None = exact bytes, for
    small integer chains). ``meta["relaxed_time"]`` (= ``meta["dp_value"]``) is the DP's
    optimum of the relaxation.

    ``improve`` (default True) adds our own step on top, not seed 000's: the DP's decisions
    (sizes rounded to the nearest slot, and on chains of at most ``ROUNDED_UP_MAX_L`` stages
    rounded up) and GREEDY's are converted and the fastest kept, then
    :func:`~scheduler.planners.improve.improve_transfers` moves the transfers where the
    simulator says they cost less idle time (whole-activation transfers of a few large
    activations, as on ResNets, are where the relaxation's plan loses most); on chains of
    at most ``DERATED_MAX_L`` stages, the DP's decisions for links ``DERATE`` times as fast
    (its relaxation then frees memory later, closer to whole-activation copies) compete
    too, and every candidate's transfers are re-placed (on longer chains: the fastest's).
    On chains of at most ``DERATED_MAX_L`` stages a hill climb over the decisions
    themselves (:func:`_search_sets`: one activation added, removed or swapped, one
    prefetch moved to the front of the channel; every subset on tiny chains) starts from
    each candidate. Why whole-activation plans stay above the relaxation: Algorithm 1
    frees memory as a copy progresses; the simulator frees an activation when its copy
    ends (8 ms for ResNet-18's 98 MB activations at 12.2 GB/s, most of the 11 ms forward),
    so compute waits for memory the relaxation already had.
    ``meta["paper_time"]`` is the simulated time of the paper's plan, ``meta["variant"]``
    which decisions won. ``improve=False`` returns the paper's plan.

    ``transfer_chunk`` (bytes, or a size string such as ``"2MiB"``; default None: whole
    activations, seed 000 assumption D) streams every transfer in chunks of that size
    (:attr:`Plan.transfer_chunk`, our own extension): memory is released and reserved as
    a copy progresses, which is Algorithm 1's own relaxation, so the plan's time comes
    close to ``relaxed_time``. Only a runtime that can release part of an activation
    (page-level mappings) can run such a plan; the chain runtime refuses it."""
    chain, memory, beta = _setup(chain, memory, bandwidth, "offload.dynprog")
    slots = slots_arg(slots)
    chunk = chunk_arg(transfer_chunk)
    # Rounding sizes up to whole slots can make a limit just above min_memory look too
    # small: retry with finer slots, then fall back to GREEDY's decisions (feasible at any
    # limit >= min_memory; meta["fallback"] says so).
    fallback = False
    # first sizes rounded to the nearest slot (less discretisation error), then rounded up
    # (what the DP then finds is feasible in the model), then finer slots
    attempts = [(slots, True), (slots, False)] + ([(slots * 4, False), (slots * 16, False)]
                                                  if slots else [])
    got = None
    for sl, nearest in attempts:
        args, exact = _dp_inputs(chain, memory, beta, sl, nearest)
        ok, idle, flags, states = core().offload_dynprog(*args, exact)
        if not ok:
            continue
        chosen = [i for i, f in enumerate(flags) if f]
        # with sizes rounded to the nearest slot the decisions may fall just short in the
        # real sizes: complete them with the earliest other activations (GREEDY's order)
        rest = [i for i in range(chain.L + 1) if i not in chosen]
        for k in ([0, 1, 2, 4, 8, 16, 32] if nearest else [0]):
            try:
                got = _best_of(chain, [chosen + rest[:k]], memory, beta, "offload.dynprog",
                               chunk)
                break
            except InfeasibleError:
                continue
        if got is not None:
            break
    if got is None:
        if slots is None:
            raise InfeasibleError(
                f"offload.dynprog: no schedule fits memory {format_bytes(memory)} (the smallest "
                f"limit is {format_bytes(min_memory(chain))})", min_memory(chain))
        fallback, idle, states = True, math.nan, 0
        got = _best_of(chain, [_greedy_set(chain, memory)], memory, beta, "offload.dynprog",
                       chunk)
    plan, sim = got
    paper_time, variant = sim.makespan, "greedy-fallback" if fallback else "dp"
    if improve and beta > 0:
        plan, sim, variant = _improved(chain, plan, sim, memory, beta, variant, slots, chunk)
    relaxed = chain.total_compute() + idle
    return _finish(plan, sim, chain, memory, beta,
                   relaxed_time=relaxed if math.isfinite(relaxed) else None,  # (strict JSON)
                   paper_time=paper_time,
                   variant=variant, improve=improve,
                   dp_value=None if fallback else relaxed,
                   dp_states=states, slots=slots, fallback=fallback, transfer_chunk=chunk,
                   lower_bound=lower_bound(chain, memory, beta))


ROUNDED_UP_MAX_L = 40
DERATED_MAX_L = 24                    # ... and the derated ones below (5 solves each)
DERATE = (0.25, 0.4, 0.5, 0.6, 0.8)   # the slower links the DP is also solved for


def _improved(chain: Chain, plan: Plan, sim: SimResult, memory: Number, beta: float,
              variant: str, slots: Optional[int], chunk: Optional[float]
              ) -> Tuple[Plan, SimResult, str]:
    """dynprog's own step on top of the paper (see its docstring)."""
    short = slots is not None and chain.L <= DERATED_MAX_L
    cands: List[Tuple[str, Plan, SimResult]] = [(variant, plan, sim)]
    if variant == "dp":
        sets = [("greedy-set", _greedy_set(chain, memory))]
        # the decisions with sizes rounded up (the paper rounds to nearest): one more DP
        # solve, affordable on short chains (on ResNet-152 it costs seconds)
        if slots is not None and chain.L <= ROUNDED_UP_MAX_L:
            sets.append(("dp-rounded-up", _dp_set(chain, memory, beta, slots)))
        if short:
            # the DP's decisions for a slower link: its relaxation frees memory as a copy
            # progresses, whole activations free it at the end, so a slower link in the
            # DP is closer to what the simulator does
            sets += [(f"dp@{k:g}bw", _dp_set(chain, memory, beta * k, slots)) for k in DERATE]
        for name, chosen in sets:
            if chosen is None:
                continue
            try:
                g = _best_of(chain, [chosen], memory, beta, "offload.dynprog", chunk)
            except InfeasibleError:
                continue
            cands.append((name, g[0], g[1]))
    if chain.L <= DERATED_MAX_L and beta > 0:
        # the neighbours of each candidate's decisions, the fastest's first (whole-activation
        # plans lose most on a few large activations: which ones and in which order
        # decides; one climb alone gets stuck in a local optimum); tiny chains: every set.
        # One budget and one memory of what was scored for all of it.
        seen: set = set()
        budget = [max(20, SET_SEARCH_OPS // max(1, chain.L))]
        act = activations(chain)
        movable = [i for i in range(chain.L + 1) if act[i] > 0]
        if 2 ** len(movable) <= budget[0]:
            budget[0] -= 2 ** len(movable)
            subsets = [list(s) for k in range(len(movable) + 1)
                       for s in itertools.combinations(movable, k)]
            try:
                g = _best_of(chain, subsets, memory, beta, "offload.dynprog", chunk)
                cands.append(("every-set", g[0], g[1]))
            except InfeasibleError:
                pass
        fastest = min(c[2].makespan for c in cands)
        for name, p, psim in sorted(cands, key=lambda c: c[2].makespan):
            got = _search_sets(chain, _offloaded(p), memory, beta, fastest, seen, budget,
                               chunk)
            if got is not None:
                cands.append((name + "+sets", got[0], got[1]))
                fastest = got[1].makespan
    if not short:   # long chains: the search re-places the fastest candidate's transfers
        cands = [min(cands, key=lambda c: c[2].makespan)]
    for name, p, psim in cands:  # short chains: every candidate's, then the fastest wins
        if psim.makespan < sim.makespan:
            plan, sim, variant = p, psim, name
        better, bsim, _ = improve_transfers(chain, p, memory, beta)
        if bsim.makespan < sim.makespan:
            plan, sim, variant = better, bsim, name + "+placement"
    return plan, sim, variant


SET_SEARCH_OPS = 1500     # schedules all climbs of one solve may build, times L (~1 s)


def _offloaded(plan: Plan) -> List[int]:
    return sorted(op.stage for op in plan.ops if op.kind == "offload")


def _search_sets(chain: Chain, start: Sequence[int], memory: Number, beta: float,
                 to_beat: float, seen: set, budget: List[int], chunk: Optional[float] = None
                 ) -> Optional[Tuple[Plan, SimResult]]:
    """Our own step (not seed 000): a hill climb over whole-activation decisions scored by
    the simulator. Neighbours of the current set: one activation added, removed or swapped
    for another, and the set with one of its prefetches moved to the front of the channel
    (:func:`schedule`'s ``first``). Stops when no neighbour is faster or after
    :data:`SET_SEARCH_OPS` / L schedules in all; returns the fastest plan found if it beats
    ``to_beat``, else None. ``seen``: the (set, first) pairs already scored, ``budget``:
    ``[schedules left]``; both shared by the climbs of one solve and updated. A count,
    not a clock: the same inputs give the same plan on every machine."""
    act = activations(chain)
    movable = [i for i in range(chain.L + 1) if act[i] > 0]
    cur: Tuple[Tuple[int, ...], Tuple[int, ...]] = (tuple(sorted(start)), ())
    best: Optional[Tuple[Plan, SimResult]] = None
    best_t = to_beat
    seen.add(cur)
    while budget[0] > 0:
        chosen, _ = cur
        rest = [i for i in movable if i not in chosen]
        neigh: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
        neigh += [(chosen, (i,)) for i in chosen]
        neigh += [(tuple(sorted(chosen + (i,))), ()) for i in rest]
        neigh += [(tuple(j for j in chosen if j != i), ()) for i in chosen]
        neigh += [(tuple(sorted([j for j in chosen if j != i] + [k])), ())
                  for i in chosen for k in rest]
        step: Optional[Tuple[float, Tuple, Tuple[Plan, SimResult]]] = None
        for cand in neigh:
            if cand in seen or budget[0] <= 0:
                continue
            seen.add(cand)
            budget[0] -= 1
            try:
                got = schedule(chain, cand[0], memory, beta, "offload.dynprog", cand[1],
                               chunk)
            except InvalidPlanError:
                continue
            if got[1].makespan < best_t * (1 - 1e-12) and (step is None
                                                           or got[1].makespan < step[0]):
                step = (got[1].makespan, cand, got)
        if step is None:
            break
        best_t, cur, best = step
    return best


def _dp_set(chain: Chain, memory: Number, beta: float, slots: int) -> Optional[List[int]]:
    """Algorithm 1's offload decisions with sizes rounded up (None if it finds none)."""
    args, exact = _dp_inputs(chain, memory, beta, slots, False)
    ok, _, flags, _ = core().offload_dynprog(*args, exact)
    return [i for i, f in enumerate(flags) if f] if ok else None


# -------------------------------------------------------------------------------- VDNN
def vdnn(chain: Chain, memory: Union[Number, str], bandwidth: Union[Number, str],
         transfer_chunk: Union[Number, str, None] = None) -> Plan:
    """Seed 000 section 6.1: rank the activations by u_F_i / |x_i|; for every threshold,
    the no-wait ordered schedule offloading all activations at or above it, and the one
    offloading every other of them (VDNN++'s two policies); the best of these.
    ``transfer_chunk``: stream transfers in chunks of this many bytes (see :func:`dynprog`)."""
    chain, memory, beta = _setup(chain, memory, bandwidth, "offload.vdnn")
    chunk = chunk_arg(transfer_chunk)
    act = activations(chain)
    cands = [i for i in range(chain.L + 1) if act[i] > 0]
    ratio = {i: chain.fw[i] / act[i] for i in cands}
    sets: List[List[int]] = [[]]
    for thr in sorted(set(ratio.values()), reverse=True) if beta > 0 else ():  # (no channel)
        above = [i for i in cands if ratio[i] >= thr]
        sets.append(above)
        sets.append(above[::2])
    plan, sim = _best_of(chain, sets, memory, beta, "offload.vdnn", chunk)
    return _finish(plan, sim, chain, memory, beta, lower_bound=lower_bound(chain, memory, beta))
