"""Offloading planners (seed 000): lower bound, GREEDY, DYNPROG, VDNN.

Every plan is scored by the simulator (the one memory model); DYNPROG's search is checked
against an exhaustive enumeration of offload subsets under its own relaxation, and that
relaxation against the simulator on every subset."""
import itertools
import math
import random

import pytest

from scheduler import Chain, InfeasibleError, InvalidPlanError, simulate
from scheduler.planners import offload

PLANNERS = {
    "greedy": lambda c, M, bw: offload.greedy(c, M, bw),
    "dynprog": lambda c, M, bw: offload.dynprog(c, M, bw, slots=None),
    "vdnn": lambda c, M, bw: offload.vdnn(c, M, bw),
}


def _cases(n, max_L=5, seed0=0):
    for seed in range(seed0, seed0 + n):
        rng = random.Random(seed)
        c = Chain.random(rng.randint(1, max_L), seed=seed)
        lo, hi = offload.min_memory(c), offload.peak_memory(c)
        for M in sorted({lo, hi, *(rng.randint(lo, hi) for _ in range(3))}):
            yield c, M, rng.choice([1, 2, 3, 5])


def test_lower_bound_by_hand():
    # |x| = (x0, xbar0, xbar1) = (2, 4, 3), delta = (1, 1), tmp 0
    c = Chain(fw=[1, 2], bw=[3, 4], x=[2, 1], xbar=[4, 3], delta=[1, 1])
    # m_F0 = 2+4, m_B0 = 2+4+1+1, m_F1 = 2+4+3, m_B1 = 2+4+3+1(+delta[2]=0)
    assert offload.peak_memory(c) == 10
    assert offload.min_memory(c) == max(2 + 4 + 1 + 1, 4 + 3 + 1)
    assert offload.lower_bound(c, 10, 1) == 10           # compute only
    assert offload.lower_bound(c, 8, 0.25) == 2 * 2 / 0.25  # Prop. 3: 16 > 10
    with pytest.raises(InfeasibleError) as e:
        offload.lower_bound(c, 7, 1)
    assert e.value.min_memory == 8


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_plans_run_within_memory_and_above_the_lower_bound(name):
    for c, M, bw in _cases(25):
        p = PLANNERS[name](c, M, bw)
        r = simulate(c, p, bw, memory=M)
        assert r.makespan == pytest.approx(p.predicted_time, rel=1e-12, abs=1e-12)
        assert r.peak_memory == p.predicted_peak and r.peak_memory <= M
        assert offload.lower_bound(c, M, bw) <= r.makespan + 1e-9
        assert p.count("offload") == p.count("prefetch")
        # the F and B ops run exactly once each: offloading only
        assert p.count("F_all") == p.count("B") == c.L + 1 and p.count("F_ck") == 0


def test_no_offload_when_everything_fits():
    for c, _, bw in _cases(8):
        M = offload.peak_memory(c)
        for name, f in PLANNERS.items():
            p = f(c, M, bw)
            assert p.count("offload") == 0, name
            assert p.predicted_time == c.total_compute()


def test_dynprog_search_is_exhaustive_and_its_relaxation_is_a_lower_bound():
    """Algorithm 1 == min over all 2^(L+1) offload subsets of its recurrence; and for every
    subset, the recurrence's (relaxed) time <= the simulated time of the whole-activation
    no-wait ordered plan offloading that subset (so it is a true relaxation)."""
    checked = 0
    for c, M, bw in _cases(12, max_L=4, seed0=100):
        best = math.inf
        for k in range(c.L + 2):
            for S in itertools.combinations(range(c.L + 1), k):
                idle = offload.relaxed_idle(c, M, bw, S)
                if idle is not None:
                    best = min(best, c.total_compute() + idle)
                try:
                    _, sim = offload.schedule(c, S, M, bw)
                except InvalidPlanError:
                    continue
                checked += 1
                assert idle is not None and c.total_compute() + idle <= sim.makespan + 1e-9
        d = offload.dynprog(c, M, bw, slots=None)
        assert d.meta["relaxed_time"] == pytest.approx(best, abs=1e-9)
        assert offload.lower_bound(c, M, bw) <= d.meta["relaxed_time"] + 1e-9
        assert d.meta["relaxed_time"] <= d.predicted_time + 1e-9
    assert checked > 200


def test_dynprog_with_slots_is_valid():
    c = Chain.random(30, seed=7, max_size=1000)
    lo, hi = offload.min_memory(c), offload.peak_memory(c)
    for M in (lo + (hi - lo) // 4, (lo + hi) // 2):
        p = offload.dynprog(c, M, 50.0, slots=100)
        r = simulate(c, p, 50.0, memory=M)
        assert r.peak_memory <= M and r.makespan == pytest.approx(p.predicted_time)
        assert p.meta["relaxed_time"] >= offload.lower_bound(c, M, 50.0) - 1e-9


def test_infeasible_names_the_smallest_memory():
    for c, _, bw in _cases(6):
        need = offload.min_memory(c)
        for f in PLANNERS.values():
            with pytest.raises(InfeasibleError) as e:
                f(c, need - 1, bw)
            assert e.value.min_memory == need
            p = f(c, need, bw)   # and that limit works
            assert simulate(c, p, bw, memory=need).peak_memory <= need


def test_bad_arguments_name_the_parameter():
    c = Chain.random(3, seed=1)
    with pytest.raises(ValueError, match="memory"):
        offload.greedy(c, -1, 1)
    with pytest.raises(ValueError, match="bandwidth"):
        offload.dynprog(c, 100, "fast")
    with pytest.raises(ValueError, match="slots"):
        offload.dynprog(c, 100, 1, slots=0)
    with pytest.raises(ValueError, match="chain"):
        offload.vdnn("chain", 100, 1)
    assert offload.lower_bound(c, 10 ** 6, "12GB") == c.total_compute()
