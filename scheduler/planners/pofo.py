"""Rematerialization + offloading (seed 001): pofo's dynamic program and :func:`solve`.

The section 5.1 heuristics (capper, autocapper, opportunist) live in
:mod:`~scheduler.planners.pofo_heuristics`, the memory bounds (:func:`min_memory`,
:func:`max_memory`) in :mod:`~scheduler.planners.pofo_bounds`; both are re-exported here.

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
* ``improve=True`` (the default) adds our own step on top of the paper (:func:`_improve`:
  more candidates, among them the DP's plans for a slower link, then a simulator-scored
  search over transfer placement and, on short chains, recomputation instead of offloads);
  ``meta["paper_time"]`` is the simulated time of the paper's plan, ``improve=False`` returns it;
* ``model="whole"`` (the default) is our own model, not seed 001's (issue 14): the same DP
  solved under the simulator's transfer semantics instead of assumption 3
  (:func:`dp` ``whole=True``, csrc/dp/pofo_dp.cpp "whole-activation mode"): an offload holds
  its item until its copy completes, a prefetch reserves it when it starts, one channel in
  plan order; the DP places the prefetches itself (right before the consumer, before the op
  before it, or before the recomputed sub-chain before it). Every op starts in the DP no
  earlier than in the simulator, so its plan simulates in at most its value (equal in all
  but a few random cases). ``solve`` weighs that plan after the paper's pipeline, and
  ``meta["dp_value"]`` is its value (``meta["dp_model"] == "whole"``) on chains of at most
  ``WHOLE_MAX_L`` stages in at most ``WHOLE_MAX_UNITS`` units: a value the returned plan
  reaches or beats. Elsewhere, and with ``model="paper"``, ``dp_value`` is the paper's
  (``meta["paper_dp_value"]`` either way), which can promise a time no whole-activation plan
  reaches (up to 1.17x below the best plan of its class on random chains);
* what *is* guaranteed (and tested): ``solve`` returns the fastest simulated of the DP's
  converted plan and the DP's best plans without offloading (rotor) and without
  recomputation (offload-only in the same model), plus rotor's own plan at 500 slots when
  ``slots`` is coarser and the store-all sequence when it fits, so ``pofo <= rotor`` and ``pofo <= offload-only`` at every memory
  limit, in simulated time (``meta["variant"]`` says which one won). Where the DPs' slot grid
  (sizes rounded up) leaves no sequence, :func:`_improve`'s candidates (DYNPROG, GREEDY,
  opportunist, autocapper) are weighed before giving up, ``improve`` or not (``dp_time``,
  ``dp_value`` and ``paper_dp_value`` are then None), so pofo plans at every limit where an
  offload-only planner does; its ``InfeasibleError`` names a limit at which it was checked
  to find a plan (in exact units, the least whole one; :func:`min_memory` is a lower bound,
  not always met).
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple, Union

from .._native import core
from ..chain import Chain, Number
from ..errors import InfeasibleError, InvalidPlanError
from ..plan import KINDS, Op, Plan, checkpoint_plan
from ..simulate import SimResult, simulate
from ..units import format_bytes, shown
from . import offload, rotor
from .args import bandwidth_arg, check_chain, memory_arg, slots_arg
from .improve import improve_transfers
from .limits import least_working
from .offload import stamp, with_prefetches
from .pofo_bounds import _rotor_min, max_memory, min_memory
from .pofo_heuristics import _autocapper, autocapper, capper, opportunist

__all__ = ["solve", "autocapper", "opportunist", "capper", "min_memory", "max_memory",
           "dp", "auto_delta_step"]

WHOLE_MAX_L = 16        # solve() runs the whole-activation DP (ours) up to this length
WHOLE_MAX_UNITS = 1023  # ... and memory units (its state packs 10-bit sizes)
AUTOCAPPER_MAX_L = 70   # solve(improve=True) weighs autocapper's plan up to this length
REMAT_MAX_L = 16        # ... and tries recomputation instead of each offload up to this one
REMAT_SOLVES = 24       # DP solves that move may spend
DERATE = (0.25, 0.4, 0.5, 0.6, 0.8)   # ... and weighs the DP's plans for these slower links
DELTA_STEP_MAX = (1 << 31) - 1        # the DP takes delta_step as a C int
# the DP emits (kind, stage) with kind an index into plan.KINDS (csrc/dp/pofo_dp.hpp, Op::kind)
assert KINDS == ("F_all", "F_ck", "F_none", "B", "offload", "prefetch")


# ------------------------------------------------------------------------------- the DP
def dp(chain: Chain, memory: Number, bandwidth: float, slots: Optional[int] = 50,
       offload: bool = True, recompute: bool = True, budget: float = math.inf,
       delta_step: int = 1, no_offload: Sequence[int] = (), whole: bool = False):
    """Run the Appendix B DP (``no_offload``: stages whose input it may not offload; our
    improvement step's restriction, not the paper's). ``whole=True``: our model, not the
    paper's (issue 14): the DP under the simulator's whole-activation transfers (an offload
    frees its item when its copy completes, a prefetch reserves it when it starts, one
    channel in plan order), so its value is achievable: ``ops`` then include the prefetches
    where it timed them, and the plan simulates in at most ``time`` (csrc/dp/pofo_dp.cpp,
    "whole-activation mode"; at most ``WHOLE_MAX_UNITS`` units). Returns ``(time, ops, prefetches, info)`` or None if it finds
    no sequence (faster than ``budget`` seconds, if given):
    ``ops`` the compute and offload ops in order, ``prefetches`` the ``(stage, consumer
    index)`` pairs in the order they run."""
    # the same discretisation as rotor (sizes rounded up to whole slots of memory/slots)
    (x, xbar, delta, fw_tmp, bw_tmp, fck_tmp), M, unit = rotor.discretize(chain, memory, slots)
    if M >= 1 << 17:
        raise ValueError(f"pofo.solve: memory {format_bytes(memory)} is {M} units; the DP "
                         "takes at most 131071 (pass slots=<int>)")
    if whole and (M > WHOLE_MAX_UNITS or chain.L >= 64):
        raise ValueError(f"pofo.dp(whole=True): memory {format_bytes(memory)} is {M} units "
                         f"and the chain has L={chain.L}; the whole-activation DP takes at most "
                         f"{WHOLE_MAX_UNITS} units and L <= 63 (pass fewer slots)")
    beta = bandwidth / unit if bandwidth > 0 else 0.0
    ok, t, ops, pre, nf, nb = core().pofo_solve(
        x, xbar, delta, fw_tmp, bw_tmp, [float(v) for v in chain.fw],
        [float(v) for v in chain.bw], M, beta, offload, recompute, float(budget),
        int(delta_step), [int(s in set(no_offload)) for s in range(chain.L + 1)], whole,
        fck_tmp)
    if not ok:
        return None
    return t, [Op(KINDS[k], s) for k, s in ops], [tuple(p) for p in pre], \
        {"states_fwd": nf, "states_bwd": nb, "slots": slots}


def _plan_of(chain: Chain, got, memory: Number, bandwidth: float, planner: str
             ) -> Tuple[Plan, SimResult]:
    t, ops, pre, info = got
    if not pre:   # no transfers, or the whole-activation DP's (prefetches already placed)
        plan = Plan(ops, planner=planner)
        return plan, simulate(chain, plan, bandwidth if bandwidth > 0 else None, memory=memory)
    loss = ops.index(Op("F_all", chain.L))  # assumption 1: prefetches after the loss
    return with_prefetches(chain, ops, pre, memory, bandwidth, loss + 1, planner)


def auto_delta_step(chain: Chain, slots: Optional[int]) -> int:
    """The forward states' Delta grid :func:`solve` uses by default: exact (1) for exact
    units; else one unit per ~14 stages (ResNet-101, L = 39: 3; DenseNet-201, L = 107: 8),
    which keeps the state count, and the solve time, roughly flat in L."""
    return 1 if slots is None else max(1, -(-chain.L // 14))


def solve(chain: Chain, memory: Union[Number, str], bandwidth: Union[Number, str, None],
          slots: Optional[int] = 50, delta_step: Optional[int] = None,
          improve: bool = True, model: str = "whole") -> Plan:
    """pofo: the optimal persistent sequence of F_all / F_ck / F_none / B / offload /
    prefetch under seed 001's assumptions (see the module docstring for what is exact).
    ``slots``: memory discretisation (seed 001 uses 50; None = exact bytes, small integer
    chains only). ``bandwidth`` in bytes/s (0 or None: rematerialization only).
    ``delta_step``: the forward states' Delta_F / Delta_B are rounded up to multiples of this
    many slots (1 = the DP exactly as written; None = :func:`auto_delta_step`): the DP's
    state space is cubic in the slots, and this trades a little optimism for speed.
    ``improve`` (default True): our own step on top of seed 001 (see :func:`_improve`);
    ``improve=False`` is the paper's DP and conversion alone (where that finds nothing, the
    candidates are still weighed before ``InfeasibleError``).
    ``model``: ``"whole"`` (default; ours, issue 14) also runs the DP under the simulator's
    whole-activation model (:func:`dp` ``whole=True``) on chains of at most ``WHOLE_MAX_L``
    stages, its plan joins the candidates and ``meta["dp_value"]`` is its value (or an exact
    transfer-free candidate's, if lower): a value some candidate reaches, so the returned
    plan simulates in at most it. ``"paper"``: seed 001's continuous-transfer DP alone, whose
    value can promise a time no whole-activation plan reaches (``meta["paper_dp_value"]``
    is that value either way)."""
    if model not in ("whole", "paper"):
        raise ValueError(f"model: expected 'whole' or 'paper', got {model!r}")
    chain, memory = check_chain(chain), memory_arg(memory)
    beta = bandwidth_arg(bandwidth, allow_zero=True, where="pofo.solve")
    slots = slots_arg(slots)
    if delta_step is None:
        delta_step = auto_delta_step(chain, slots)
    if isinstance(delta_step, bool) or not isinstance(delta_step, int) or delta_step < 1:
        raise ValueError(f"delta_step: expected a positive int or None, got {delta_step!r}")
    if delta_step > DELTA_STEP_MAX:
        raise ValueError(f"delta_step: at most 2**31 - 1 (the DP's C int), got "
                         f"{shown(delta_step)}")
    floor = min_memory(chain) if beta > 0 else None
    if floor is not None and memory < floor:
        # a bound, not always met (and in exact units: the slot grid rounds sizes up), so
        # the error names a limit solve is checked to find a plan at
        need = _working_limit(chain, memory, beta, slots, delta_step, floor, ())
        raise InfeasibleError(f"pofo.solve: memory {format_bytes(memory)} is below "
                              f"{format_bytes(floor)}, a lower bound on the limit any sequence "
                              f"of {chain.name or 'this chain'} can meet; {_at(need)}", need)
    needs: List[Optional[Number]] = []   # what the candidates that failed reported
    plan = _search(chain, memory, beta, slots, delta_step, improve, model, needs)
    if plan is None:
        # the limit, or the slot grid's rounding: a limit that works is one of the failed
        # candidates' (or the bounds', rotor's on its grid, the store-all peak), checked
        need = _working_limit(chain, memory, beta, slots, delta_step, floor, needs)
        grid = (f" with slots={slots} (the slot grid rounds sizes up: more slots may fit this "
                "limit)" if slots is not None else "")
        raise InfeasibleError(f"pofo.solve: no sequence of {chain.name or 'this chain'} fits "
                              f"memory {format_bytes(memory)}{grid}; {_at(need)}", need)
    return plan


def _at(need: Optional[Number]) -> str:
    """What an ``InfeasibleError`` says of the limit it names."""
    return (f"at {format_bytes(need)} a sequence fits" if need is not None else
            "no limit that works is known")


def _search(chain: Chain, memory: Number, beta: float, slots: Optional[int], delta_step: int,
            improve: bool, model: str, needs: List[Optional[Number]]) -> Optional[Plan]:
    """:func:`solve` on checked arguments: its plan, or None when no candidate fits
    (``needs`` gets the limits the candidates that failed reported)."""
    # rotor's and offload-only's optima lie in pofo's space: solved first (cheap), their
    # converted plans are candidates beside the full DP's
    variants = [("rotor", False, True), ("offload-only", True, False), ("pofo", True, True)] \
        if beta > 0 else [("pofo", True, True)]
    best: Optional[Tuple[Plan, SimResult, float, str]] = None
    dp_time = math.inf
    exact_time = math.inf   # the least value of a candidate the simulator reproduces exactly
    whole = model == "whole" and 0 < beta < math.inf and chain.L <= WHOLE_MAX_L
    if whole:
        variants.append(("pofo-whole", True, True))
    whole_time = math.inf
    whole_best: Optional[Tuple[Plan, SimResult]] = None   # weighed after the paper's pipeline
    for name, off, rec in variants:
        is_whole = name == "pofo-whole"
        if is_whole and rotor.discretize(chain, memory, slots)[1] > WHOLE_MAX_UNITS:
            continue  # the whole DP's state needs at most WHOLE_MAX_UNITS units
        got = dp(chain, memory, beta, slots, offload=off, recompute=rec,
                 delta_step=1 if is_whole else delta_step, whole=is_whole)
        if got is None:
            continue
        if not is_whole:
            dp_time = min(dp_time, got[0])
        try:
            plan, sim = _plan_of(chain, got, memory, beta, "pofo")
        except InvalidPlanError:
            continue
        if is_whole:   # its value counts only with the plan that reaches it
            whole_time = got[0]
        if not got[2] and not plan.has_transfers:
            exact_time = min(exact_time, sim.makespan)
        plan.meta.update(got[3])
        if is_whole:
            whole_best = (plan, sim)
        elif best is None or sim.makespan < best[1].makespan - 1e-12 * sim.makespan:
            best = (plan, sim, got[0], name)
    # storing everything, when it fits in the real sizes, is optimal (no idle, no
    # recomputation); slot rounding can hide that from the DPs
    if best is None or best[1].makespan > chain.total_compute():
        store_all = Plan(checkpoint_plan(chain.L, ()).ops, planner="pofo")
        sim = simulate(chain, store_all)
        if sim.peak_memory <= memory:
            best = (store_all, sim, sim.makespan, "store-all")
            dp_time = min(dp_time, sim.makespan)
            exact_time = min(exact_time, sim.makespan)
    # rotor itself (its own, finer discretisation): in pofo's space, and a coarse slot grid
    # must not make pofo lose to it
    if slots is not None and slots < 500 and (best is None or best[3] != "store-all"):
        try:
            r = rotor.solve(chain, memory, slots=500)
            sim = simulate(chain, r, None, memory=memory)
            if best is None or sim.makespan < best[1].makespan - 1e-12 * sim.makespan:
                best = (r, sim, r.predicted_time, "rotor-500")
            dp_time = min(dp_time, r.predicted_time)
            exact_time = min(exact_time, sim.makespan)
        except InfeasibleError as err:
            needs.append(err.min_memory)
    if best is None and whole_best is not None:
        best = (whole_best[0], whole_best[1], whole_time, "pofo-whole")
        whole_best = None
    tried = False   # whether the heuristics' plans were weighed already
    if best is None and beta > 0:
        # the DPs round sizes up to whole slots and can miss a limit their heuristics' plans
        # meet (offload-only ones among them: pofo <= offload-only at every limit)
        got = _fastest_candidate(chain, memory, beta, _candidates(chain, slots, delta_step),
                                 None, needs)
        tried = True
        if got is not None:
            best = (got[0], got[1], got[1].makespan, got[2])
    if best is None:
        return None
    plan, sim, _, name = best
    paper_time = sim.makespan
    if improve and beta > 0:
        plan, sim, name = _improve(chain, plan, sim, name, memory, beta, slots, delta_step,
                                   candidates=not tried)
    # the whole-activation DP's plan (ours) after the paper's pipeline, so the result is
    # never slower than either
    if whole_best is not None and whole_best[1].makespan < sim.makespan - 1e-12 * sim.makespan:
        plan, sim = whole_best
        name = "pofo-whole"
    # the simulation of the plan returned (the DP's value may be an earlier candidate's)
    stamp(plan, sim, chain, memory, beta, "pofo")
    # the whole-activation DP's value (ours) is reached by its own plan; the paper's may not be
    dp_value = min(whole_time, exact_time) if math.isfinite(whole_time) else dp_time
    # (None where no DP found a sequence, a heuristic's plan won: strict JSON has no inf)
    plan.meta.update(dp_time=_finite(dp_time), dp_value=_finite(dp_value),
                     paper_dp_value=_finite(dp_time), whole_dp_value=_finite(whole_time),
                     dp_model="whole" if math.isfinite(whole_time) else "paper",
                     variant=name, exact=not plan.has_transfers,
                     delta_step=delta_step, simulated_time=sim.makespan,
                     paper_time=paper_time, improve=improve)
    return plan


def _finite(value: float) -> Optional[float]:
    """A DP value for ``meta``: None where there is none (inf)."""
    return value if math.isfinite(value) else None


def _improve(chain: Chain, plan: Plan, sim: SimResult, name: str, memory: Number,
             beta: float, slots: Optional[int], delta_step: int, candidates: bool = True
             ) -> Tuple[Plan, SimResult, str]:
    """Our own step, not seed 001's. The DP's transfers release and reserve memory
    continuously (assumption 3); whole activations wait for their copies, so the converted
    plan can lose to plans the DP ranks lower. Here: the offload-only plans of seed 000
    (DYNPROG, with its own improvement on short chains, and GREEDY), seed 001's
    opportunist and, on chains of at most ``AUTOCAPPER_MAX_L`` stages, its autocapper join
    the candidates (all lie in pofo's space:
    the DP at 50 slots can miss them; autocapper's 40 rotor solves cost tens of seconds
    at tight limits on longer chains); on chains of at most ``REMAT_MAX_L`` stages so do
    the DP's plans for links ``DERATE`` times as fast (its continuous release then frees
    memory later, as whole-activation offloads do). The winner's transfers are re-placed by
    the simulator-scored local search (:mod:`scheduler.planners.improve`), and on those
    short chains :func:`_recompute_instead` tries recomputation instead of each offload.

    Why not more: on random chains with L <= 4 the exhaustive best plan of pofo's class
    (every persistent sequence x offload subset, whole-activation transfers; tests/_oracle.py)
    is itself up to 1.17x the DP's value (``bench/pofo.py --random``): that part of the gap
    is the relaxation's, and no conversion or placement can close it.

    ``candidates=False``: those candidates were weighed already (:func:`solve` weighs them
    before giving up where the DP finds no sequence)."""
    starts = [(plan, sim, name)]   # the plans the placement search starts from
    if candidates:
        got = _fastest_candidate(chain, memory, beta, _candidates(chain, slots, delta_step),
                                 (plan, sim, name), [])
        assert got is not None  # (the current plan is one)
        if got[0] is not plan:
            # the DP's plan too: its transfers re-placed can beat the fastest candidate (a
            # limit one byte higher dropped a 33 s plan for a 34 s one)
            starts.insert(0, got)
        plan, sim, name = got
    for start, ssim, sname in starts:
        if start.has_transfers:
            better, bsim, _ = improve_transfers(chain, start, memory, beta)
            if bsim.makespan < sim.makespan - 1e-12 * sim.makespan:
                plan, sim, name = better, bsim, sname + "+placement"
    if chain.L <= REMAT_MAX_L:
        plan, sim, name = _recompute_instead(chain, plan, sim, name, memory, beta, slots,
                                             delta_step)
    return plan, sim, name


Candidate = Tuple[str, Callable[[Chain, Number, float], Plan]]


def _candidates(chain: Chain, slots: Optional[int], delta_step: int) -> List[Candidate]:
    """The plans :func:`_improve` weighs beside the DP's (see there), as (name, planner)."""
    # the same units as this solve: exact (slots=None) or each planner's default grid
    exact = {"slots": None} if slots is None else {}
    short = chain.L <= AUTOCAPPER_MAX_L   # where the extra candidates are cheap
    cands: List[Candidate] = [
        ("dynprog", lambda c, m, b: offload.dynprog(c, m, b, improve=short, **exact)),
        ("greedy", offload.greedy),
        ("opportunist", lambda c, m, b: opportunist(c, m, b, slots=slots))]
    if short:   # (its failure names no limit: finding one costs more autocapper runs)
        cands.append(("autocapper", lambda c, m, b: _autocapper(c, m, b, slots=slots)))
    if chain.L <= REMAT_MAX_L:
        # the DP solved for a slower link: its memory then frees later, as whole-activation
        # offloads free it (at their end), so it can pick sequences that wait less
        for k in DERATE:
            cands.append((f"pofo@{k:g}bw", lambda c, m, b, k=k: _derated(c, m, b, k, slots,
                                                                         delta_step)))
    return cands


def _fastest_candidate(chain: Chain, memory: Number, beta: float, cands: List[Candidate],
                       current: Optional[Tuple[Plan, SimResult, str]],
                       needs: List[Optional[Number]]
                       ) -> Optional[Tuple[Plan, SimResult, str]]:
    """The fastest simulated of ``current`` and the candidates' plans under ``memory``
    (None if there is none); ``needs`` gets the limits the candidates that failed named."""
    best = current
    for who, f in cands:
        try:
            cand = f(chain, memory, beta)
        except InfeasibleError as err:
            needs.append(err.min_memory)
            continue
        except InvalidPlanError:
            continue
        csim = simulate(chain, cand, beta, memory=memory)
        if best is None or csim.makespan < best[1].makespan - 1e-12 * best[1].makespan:
            best = (cand, csim, who)
    return best


def _working_limit(chain: Chain, memory: Number, beta: float, slots: Optional[int],
                   delta_step: int, floor: Optional[Number],
                   needs: Sequence[Optional[Number]]) -> Optional[Number]:
    """The least limit above ``memory`` at which :func:`solve` is checked to find a plan (it
    passes solve's own checks: at least ``floor``, pofo's bound, and a plan found there),
    among that bound, offload-only's, rotor's least limit on the grid pofo tries it on, the
    limits its failed candidates named and the store-all peak (where storing everything
    fits, so some limit is named); None if none of them works (a DP past its units). In
    exact units (``slots=None``), the least whole limit that works, bisected below that one.
    A check is one :func:`_search` without the improvement step: a few DP solves, and the
    heuristics' plans where those find nothing; limits are checked from the least up."""
    limits = list(needs) + [floor, max_memory(chain)]
    if beta > 0:
        limits.append(offload.min_memory(chain))
    try:
        limits.append(_rotor_min(chain, 500 if slots is not None and slots < 500 else slots,
                                 memory))
    except ValueError:   # (too few slots for this chain at any limit)
        pass

    def works(limit: Number) -> bool:
        if floor is not None and limit < floor:
            return False   # (solve refuses it before searching)
        # the feasibility of the full solve: improvement and the whole-activation DP only
        # make a plan faster, and the heuristics are weighed whenever the DP fails
        try:
            return _search(chain, limit, beta, slots, delta_step, False, "paper", []) is not None
        except ValueError:   # (past what the DP takes in these units: no limit for solve)
            return False
    need = least_working(limits, memory, works)
    if need is None or slots is not None or not isinstance(need, int):
        return need
    # exact units: the least whole limit that works (the bounds above are not always met;
    # a DP's feasibility grows with the limit), by bisection between a refused limit and it
    lo = math.floor(max(memory, floor - 1 if floor is not None else memory))
    while need - lo > 1:
        mid = (lo + need) // 2
        lo, need = (lo, mid) if works(mid) else (mid, need)
    return need


def _derated(chain: Chain, memory: Number, beta: float, factor: float, slots: Optional[int],
             delta_step: int) -> Plan:
    """The DP's plan for bandwidth ``factor * beta``, converted for the real ``beta``."""
    got = dp(chain, memory, factor * beta, slots, delta_step=delta_step)
    if got is None:
        raise InfeasibleError(f"pofo: no sequence at {factor:g} x the bandwidth", None)
    plan, _ = _plan_of(chain, got, memory, beta, "pofo")
    plan.meta.update(got[3])
    return plan


def _recompute_instead(chain: Chain, plan: Plan, sim: SimResult, name: str, memory: Number,
                       beta: float, slots: Optional[int], delta_step: int
                       ) -> Tuple[Plan, SimResult, str]:
    """Our own move (issue 14, not seed 001): replace an offload by recomputation where the
    simulator says it is faster. A whole-activation offload keeps its item in memory until
    the copy completes and a whole prefetch reserves it when the copy starts, so a transfer
    the DP found free can cost idle time that recomputing the value would not. For each
    stage the current plan offloads, the DP is solved again with that stage's input barred
    from offloading (it then keeps or recomputes it, whichever its model prefers); the
    converted plan, with its transfers re-placed, replaces the current one when it
    simulates faster. Greedy, until no single stage helps or ``REMAT_SOLVES`` DP solves
    are spent (a count, so ranks agree on plans)."""
    banned: Tuple[int, ...] = ()
    solves = 0
    tol = 1e-12 * sim.makespan
    while solves < REMAT_SOLVES:
        best = None
        for s in sorted({op.stage for op in plan.ops if op.kind == "offload"}):
            if solves >= REMAT_SOLVES:
                break
            solves += 1
            got = dp(chain, memory, beta, slots, delta_step=delta_step,
                     no_offload=banned + (s,))
            if got is None:
                continue
            try:
                cand, csim = _plan_of(chain, got, memory, beta, "pofo")
            except InvalidPlanError:
                continue
            if cand.has_transfers:
                cand, csim, _ = improve_transfers(chain, cand, memory, beta)
            cand.meta.update(got[3])
            if csim.makespan < sim.makespan - tol and (best is None
                                                       or csim.makespan < best[1].makespan):
                best = (cand, csim, s)
        if best is None:
            break
        plan, sim, s = best
        banned += (s,)
        name = f"pofo+recompute{list(banned)}"
    return plan, sim, name
