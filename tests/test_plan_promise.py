"""Plans keep their promise (issues 13.5 and 14), property-tested on random integer chains:

* a plan records the limit it was planned for, JSON keeps it, and ``simulate`` enforces it
  by default (``memory=`` overrides, ``memory=None`` lifts it);
* every planner's simulated time and peak (under that default) equal its prediction, and
  the peak respects the limit;
* the DP planners record ``meta["dp_value"]``;
* ``improve_transfers`` never slows a plan down and keeps its ops;
* ``best.solve`` is never slower than any single planner's valid plan.
"""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Chain, InfeasibleError, InvalidPlanError, Plan, simulate
from scheduler.plan import TRANSFER_KINDS
from scheduler.planners import best, offload, periodic, pofo, revolve, rotor
from scheduler.planners.improve import _swap, improve_transfers

SETTINGS = settings(max_examples=8, deadline=None, derandomize=True)


@st.composite
def cases(draw):
    """(chain, memory, bandwidth): a small random chain, a limit between the least any
    offloading sequence needs and the store-all peak, a slow or fast link."""
    L = draw(st.integers(1, 5))
    c = Chain.random(L, seed=draw(st.integers(0, 10 ** 6)))
    lo, hi = pofo.min_memory(c), pofo.max_memory(c)
    M = lo + (hi - lo) * draw(st.integers(0, 4)) // 4
    return c, M, draw(st.sampled_from([0.5, 2.0, 8.0]))


PLANNERS = {
    "rotor": lambda c, M, bw: rotor.solve(c, M, slots=None),
    "revolve": lambda c, M, bw: revolve.solve(c, M, slots=None),
    "periodic": lambda c, M, bw: periodic.best(c, M),
    "greedy": lambda c, M, bw: offload.greedy(c, M, bw),
    "dynprog": lambda c, M, bw: offload.dynprog(c, M, bw, slots=None),
    "dynprog-paper": lambda c, M, bw: offload.dynprog(c, M, bw, slots=None, improve=False),
    "vdnn": lambda c, M, bw: offload.vdnn(c, M, bw),
    "pofo": lambda c, M, bw: pofo.solve(c, M, bw, slots=None),
    "pofo-paper": lambda c, M, bw: pofo.solve(c, M, bw, slots=None, improve=False,
                                              model="paper"),
    "autocapper": lambda c, M, bw: pofo.autocapper(c, M, bw, slots=None),
    "opportunist": lambda c, M, bw: pofo.opportunist(c, M, bw, slots=None),
}
DP_PLANNERS = ("rotor", "revolve", "dynprog", "dynprog-paper", "pofo", "pofo-paper")


def _plans(c, M, bw):
    out = {}
    for name, f in PLANNERS.items():
        try:
            out[name] = f(c, M, bw)
        except (InfeasibleError, InvalidPlanError):
            pass
    return out


@SETTINGS
@given(cases())
def test_every_plan_keeps_its_prediction_and_limit_under_the_default_simulation(case):
    c, M, bw = case
    plans = _plans(c, M, bw)
    assert "pofo" in plans      # M >= pofo.min_memory: pofo always finds a sequence
    for name, p in plans.items():
        assert p.memory_limit == M, name
        r = simulate(c, p, bw)            # no memory=: the plan's own limit
        assert r.memory_limit == M
        assert r.peak_memory <= M, name
        assert r.makespan == pytest.approx(p.predicted_time, rel=1e-12, abs=1e-12), name
        assert r.peak_memory == pytest.approx(p.predicted_peak, rel=1e-12, abs=1e-12), name
        if name in DP_PLANNERS:
            v = p.meta["dp_value"]
            assert v is None or (isinstance(v, float) or isinstance(v, int)) and v > 0, name
        back = Plan.from_json(p.to_json())
        assert back.memory_limit == M and back.ops == p.ops


@SETTINGS
@given(cases())
def test_the_default_choice_is_never_slower_than_any_single_planner(case):
    c, M, bw = case
    plans = _plans(c, M, bw)
    chosen = best.solve(c, M, bw)
    r = simulate(c, chosen, bw)
    assert chosen.memory_limit == M and r.peak_memory <= M
    assert chosen.meta["chosen_by"] == "best" and chosen.planner
    assert r.makespan == pytest.approx(chosen.predicted_time, rel=1e-12)
    for name, p in plans.items():
        assert r.makespan <= simulate(c, p, bw).makespan * (1 + 1e-9), name
    # remat-only: no bandwidth, rotor (at 500 slots) or better
    if M >= rotor.min_memory(c):
        no_bw = best.solve(c, M)
        assert not any(op.kind in TRANSFER_KINDS for op in no_bw.ops)
        assert simulate(c, no_bw).makespan <= plans["rotor"].predicted_time


@SETTINGS
@given(cases())
def test_transfer_search_never_slows_a_plan_and_keeps_its_ops(case):
    c, M, bw = case
    try:
        p = pofo.solve(c, M, bw, slots=None, improve=False)
    except InfeasibleError:
        return
    before = simulate(c, p, bw)
    q, r, spent = improve_transfers(c, p, M, bw)
    assert sorted(q.ops) == sorted(p.ops) and spent >= 1
    assert r.makespan <= before.makespan and r.peak_memory <= M
    assert simulate(c, q, bw).makespan == r.makespan


def test_memory_argument_overrides_or_lifts_the_plan_limit():
    c = Chain.random(5, seed=4)
    lo, hi = pofo.min_memory(c), pofo.max_memory(c)
    M = (lo + hi) // 2
    p = offload.greedy(c, M, 0.5)
    assert p.memory_limit == M
    limited, free = simulate(c, p, 0.5), simulate(c, p, 0.5, memory=None)
    assert limited.memory_limit == M and free.memory_limit is None
    assert free.makespan <= limited.makespan
    assert simulate(c, p, 0.5, memory=hi).memory_limit == hi
    # a plan without a recorded limit is not limited
    bare = Plan(p.ops)
    assert bare.memory_limit is None and simulate(c, bare, 0.5).memory_limit is None
    with pytest.raises(ValueError, match="memory_limit"):
        Plan(p.ops, memory_limit=-1)
    with pytest.raises(ValueError, match="memory_limit"):
        Plan(p.ops, memory_limit=math.inf)


def test_pofo_finds_the_issue_case_faster_than_its_paper_conversion_or_equal():
    """The improvement step and the whole-activation DP are on top: never slower than the
    paper's version (its DP, its conversion)."""
    for seed in range(4):
        c = Chain.random(6, seed=seed)
        lo, hi = pofo.min_memory(c), pofo.max_memory(c)
        for M in (lo, (lo + hi) // 2):
            for bw in (0.5, 2.0):
                ours = pofo.solve(c, M, bw, slots=None)
                paper = pofo.solve(c, M, bw, slots=None, improve=False, model="paper")
                assert ours.predicted_time <= paper.predicted_time + 1e-9
                assert ours.meta["paper_time"] == pytest.approx(paper.predicted_time)
                assert ours.meta["paper_dp_value"] == paper.meta["dp_value"]
                # the whole DP's value is one the plan reaches; the paper's may not be
                if ours.meta["dp_model"] == "whole":
                    assert ours.predicted_time <= ours.meta["dp_value"] * (1 + 1e-12)


def test_best_rejects_bad_arguments():
    c = Chain.random(3, seed=1)
    with pytest.raises(ValueError, match="planners"):
        best.solve(c, 100, 1.0, planners=["nope"])
    with pytest.raises(InfeasibleError):
        best.solve(c, 1, 1.0)


def test_transfer_search_moves_a_late_prefetch_ahead_of_the_backward_before_its_consumer():
    """The issue's pattern: ``prefetch`` issued right before its consumer, after the
    backward that precedes it, so the consumer waits for the whole copy."""
    c = Chain(fw=[1] * 4, bw=[2] * 4, x=[4] * 4, xbar=[4] * 4, delta=[4] * 4)
    ops = [("offload", 0), ("F_all", 0), ("F_all", 1), ("F_all", 2), ("F_all", 3),
           ("B", 3), ("B", 2), ("B", 1), ("prefetch", 0), ("B", 0)]
    late = Plan(ops, memory_limit=None)
    before = simulate(c, late, 1.0)
    assert before.steps[-1].wait == 4          # B 0 waits for the 4-second copy
    better, r, _ = improve_transfers(c, late, None, 1.0)
    assert r.makespan == c.total_compute() < before.makespan
    assert better.ops.index(("prefetch", 0)) < better.ops.index(("B", 1))


def test_dp_never_offloads_a_barred_stage_and_barring_all_is_recompute_only():
    """``pofo.dp(no_offload=...)`` (our recompute-instead-of-transfer move's DP)."""
    for seed in range(6):
        c = Chain.random(4, seed=seed)
        lo, hi = pofo.min_memory(c), pofo.max_memory(c)
        for M in (lo, (lo + hi) // 2):
            full = pofo.dp(c, M, 0.5, None)
            if full is None:
                continue
            offloaded = sorted({op.stage for op in full[1] if op.kind == "offload"})
            for s in offloaded:
                got = pofo.dp(c, M, 0.5, None, no_offload=(s,))
                if got is not None:
                    assert all(op != ("offload", s) for op in got[1])
                    assert got[0] >= full[0] - 1e-9     # a restriction of the same DP
            every = pofo.dp(c, M, 0.5, None, no_offload=range(c.L + 1))
            remat = pofo.dp(c, M, 0.5, None, offload=False)
            assert (every is None) == (remat is None)
            if every is not None:
                assert every[0] == pytest.approx(remat[0])
                assert not any(op.kind == "offload" for op in every[1])


def test_transfer_search_reorders_the_channel():
    """Two prefetches issued together in the wrong order: the consumer of the second copy
    runs first, so exchanging them on the (FIFO) channel removes the wait."""
    c = Chain(fw=[1] * 4, bw=[4] * 4, x=[4, 1, 4, 4], xbar=[4, 4, 4, 4], delta=[4] * 4)
    ops = [("offload", 0), ("F_all", 0), ("offload", 1), ("F_all", 1), ("F_all", 2),
           ("F_all", 3), ("B", 3), ("prefetch", 0), ("prefetch", 1), ("B", 2), ("B", 1),
           ("B", 0)]
    plan = Plan(ops, memory_limit=None)
    before = simulate(c, plan, 1.0)
    transfers = [j for j, op in enumerate(plan.ops) if op.kind in TRANSFER_KINDS]
    swapped = _swap(plan.ops, 7, transfers)       # the move itself: same slots, new order
    assert swapped[7:9] == [("prefetch", 1), ("prefetch", 0)]
    assert swapped[:7] == plan.ops[:7] and swapped[9:] == plan.ops[9:]
    assert _swap(plan.ops, 8, transfers) is None  # the last transfer has no next one
    moved = simulate(c, Plan(swapped), 1.0)
    assert moved.makespan < before.makespan
    better, r, _ = improve_transfers(c, plan, None, 1.0)
    assert r.makespan <= moved.makespan
    assert r.makespan == pytest.approx(simulate(c, better, 1.0).makespan)
    assert sorted(better.ops) == sorted(plan.ops)
