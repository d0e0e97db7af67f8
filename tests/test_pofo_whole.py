"""pofo's whole-activation DP (ours, issue 14): its value is what its plan simulates to, at
most (the DP times transfers as the simulator does: an offload frees its item when its copy
completes, a prefetch reserves it when it starts, one channel in plan order), and
``pofo.solve`` never returns a plan slower than its ``meta["dp_value"]`` when that value is
the whole DP's."""
import pytest
from hypothesis import given, settings, strategies as st

from scheduler import Chain, Plan, simulate
from scheduler.errors import InfeasibleError
from scheduler.planners import pofo


def _case(L, seed, frac):
    c = Chain.random(L, seed=seed)
    lo, hi = pofo.min_memory(c), pofo.max_memory(c)
    return c, lo + int(frac * (hi - lo))


@settings(max_examples=60, deadline=None)
@given(L=st.integers(0, 6), seed=st.integers(0, 10_000), frac=st.floats(0, 1),
       bw=st.sampled_from([0.25, 0.5, 1.0, 2.0, 8.0]))
def test_whole_dp_value_is_achieved_by_its_plan(L, seed, frac, bw):
    c, M = _case(L, seed, frac)
    got = pofo.dp(c, M, bw, None, whole=True)
    if got is None:
        return
    t, ops, pre, _ = got
    assert not pre    # the prefetches are in ops, where the DP timed them
    r = simulate(c, Plan(ops), bw, memory=M)
    assert r.peak_memory <= M
    assert r.makespan <= t + 1e-9 * t
    # no worse than keeping everything on the GPU when that fits (its space includes it)
    if pofo.max_memory(c) <= M:
        assert t <= c.total_compute() + 1e-9


@settings(max_examples=25, deadline=None)
@given(L=st.integers(0, 5), seed=st.integers(0, 10_000), frac=st.floats(0, 1),
       bw=st.sampled_from([0.5, 2.0]))
def test_solve_keeps_the_whole_dp_promise(L, seed, frac, bw):
    c, M = _case(L, seed, frac)
    try:
        p = pofo.solve(c, M, bw, slots=None)
    except InfeasibleError as exc:
        # min_memory is a lower bound, not always met (random-L4-seed623: 28, a plan at 32):
        # the error names a limit that works
        assert exc.min_memory is not None and exc.min_memory > M, (M, exc)
        pofo.solve(c, exc.min_memory, bw, slots=None)
        return
    r = simulate(c, p, bw)
    assert r.makespan == p.predicted_time and r.peak_memory <= M
    if p.meta["dp_model"] == "whole":
        assert r.makespan <= p.meta["dp_value"] * (1 + 1e-12)
    # the paper's model stays available, and the default is never slower than it
    q = pofo.solve(c, M, bw, slots=None, model="paper")
    assert q.meta["dp_model"] == "paper" and q.meta["dp_value"] == q.meta["paper_dp_value"]
    assert r.makespan <= q.predicted_time * (1 + 1e-12)


def test_whole_dp_on_the_issue_case():
    """seed 7 (L = 2, M = 35, bandwidth 0.5): the paper's DP says 46 but every plan of its
    class simulates in >= 52 (x[0]'s offload holds memory until it completes, xbar[0]'s
    prefetch cannot overlap B 2); the whole DP's value is one its plan reaches."""
    c = Chain.random(2, seed=7)
    paper = pofo.dp(c, 35, 0.5, None)
    whole = pofo.dp(c, 35, 0.5, None, whole=True)
    assert paper[0] == 46
    sim = simulate(c, Plan(whole[1]), 0.5, memory=35).makespan
    assert paper[0] < sim <= whole[0]


def test_whole_dp_with_slots_on_real_sizes():
    """Sizes rounded up to slots make the whole DP pessimistic, never optimistic."""
    c = Chain.random(8, seed=5, max_size=1000).replace(
        fw=tuple(0.001 * v for v in Chain.random(8, seed=5).fw))
    lo, hi = pofo.min_memory(c), pofo.max_memory(c)
    for M in (lo * 1.1, (lo + hi) / 2):
        got = pofo.dp(c, M, 2e5, 50, whole=True)
        assert got is not None
        r = simulate(c, Plan(got[1]), 2e5, memory=M)
        assert r.peak_memory <= M and r.makespan <= got[0] * (1 + 1e-9)
        p = pofo.solve(c, M, 2e5)
        assert p.meta["dp_model"] == "whole"
        assert simulate(c, p, 2e5).makespan <= p.meta["dp_value"] * (1 + 1e-9)


def test_whole_dp_needs_few_units():
    c = Chain.random(3, seed=1)
    with pytest.raises(ValueError, match="whole"):
        pofo.dp(c, 5000, 1.0, None, whole=True)
    with pytest.raises(ValueError, match="model"):
        pofo.solve(c, 100, 1.0, slots=None, model="exact")


def test_min_memory_is_never_above_the_store_all_peak():
    """Found by hypothesis: recomputing stage 0 (its xbar held with the gradient from above)
    needs 27 on this chain, but storing everything peaks at 25, and min_memory said 27, so
    solve refused a budget the store-all sequence meets."""
    c = Chain.random(1, seed=1239)
    assert pofo.min_memory(c) == pofo.max_memory(c) == 25
    p = pofo.solve(c, 25, 0.5, slots=None)
    assert simulate(c, p, 0.5).peak_memory <= 25
