"""Offloading planners (seed 000): lower bound, GREEDY, DYNPROG, VDNN.

Every plan is scored by the simulator (the one memory model); DYNPROG's search is checked
against an exhaustive enumeration of offload subsets under its own relaxation, and that
relaxation against the simulator on every subset."""
import itertools
import math
from typing import Tuple
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _every_subset(c: Chain, M: int, bw: float) -> Tuple[float, int]:
    """Algorithm 1's recurrence along every offload subset: its least time, and how many
    subsets' plans ran; for each of those, the recurrence's time <= the plan's simulated time
    (the relaxation holds)."""
    best, ran = math.inf, 0
    for k in range(c.L + 2):
        for S in itertools.combinations(range(c.L + 1), k):
            idle = offload.relaxed_idle(c, M, bw, S)
            if idle is not None:
                best = min(best, c.total_compute() + idle)
            try:
                _, sim = offload.schedule(c, S, M, bw)
            except InvalidPlanError:
                continue
            ran += 1
            assert idle is not None and c.total_compute() + idle <= sim.makespan + 1e-9, S
    return best, ran


def test_dynprog_search_is_exhaustive_and_its_relaxation_is_a_lower_bound():
    """Algorithm 1 == min over all 2^(L+1) offload subsets of its recurrence; and for every
    subset, the recurrence's (relaxed) time <= the simulated time of the whole-activation
    no-wait ordered plan offloading that subset (so it is a true relaxation)."""
    checked = 0
    for c, M, bw in _cases(12, max_L=4, seed0=100):
        best, ran = _every_subset(c, M, bw)
        checked += ran
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


def test_dynprog_beats_every_subset_on_tiny_chains():
    """Exhaustive oracle of our own step: on chains this small dynprog scores every offload
    subset (the no-wait ordered plan of each), so it is never slower than any of them."""
    checked = 0
    for c, M, bw in _cases(15, max_L=3, seed0=300):
        best = math.inf
        for k in range(c.L + 2):
            for S in itertools.combinations(range(c.L + 1), k):
                try:
                    best = min(best, offload.schedule(c, S, M, bw)[1].makespan)
                    checked += 1
                except InvalidPlanError:
                    continue
        d = offload.dynprog(c, M, bw, slots=None)
        assert d.predicted_time <= best + 1e-9
        assert offload.dynprog(c, M, bw, slots=None, improve=False).predicted_time \
            >= d.predicted_time - 1e-9
    assert checked > 100


def test_prefetch_order_first():
    c = Chain.random(5, seed=11, max_size=100)
    lo, hi = offload.min_memory(c), offload.peak_memory(c)
    M = (lo + hi) // 2
    for first in ((), (0,), (2, 0)):
        try:
            plan, sim = offload.schedule(c, [0, 1, 2], M, 10.0, first=first)
        except InvalidPlanError:
            continue
        pre = [op.stage for op in plan.ops if op.kind == "prefetch"]
        assert pre[:len(first)] == list(first) and sorted(pre) == [0, 1, 2]
        assert simulate(c, plan, 10.0, memory=M).makespan == sim.makespan
    with pytest.raises(ValueError, match="first"):
        offload.schedule(c, [0, 1], M, 10.0, first=(3,))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(L=st.integers(1, 8), seed=st.integers(0, 10 ** 6), frac=st.floats(0, 1),
       bw=st.sampled_from([0.5, 2.0, 10.0, 100.0]), slots=st.sampled_from([None, 40]))
def test_dynprog_property_limit_and_prediction(L, seed, frac, bw, slots):
    """Random chains: DYNPROG's plan (paper's and ours) runs under its limit in the
    simulator, which reproduces its predicted time and peak; dp_value is the relaxation's."""
    c = Chain.random(L, seed=seed, max_size=200)
    lo, hi = offload.min_memory(c), offload.peak_memory(c)
    M = lo + round(frac * (hi - lo))
    for improve in (False, True):
        p = offload.dynprog(c, M, bw, slots=slots, improve=improve)
        r = simulate(c, p, bw)            # the plan's own limit
        assert p.memory_limit == M and r.peak_memory <= M
        assert r.makespan == pytest.approx(p.predicted_time, rel=1e-12, abs=1e-12)
        assert r.peak_memory == p.predicted_peak
        assert offload.lower_bound(c, M, bw) <= r.makespan + 1e-9
        if not p.meta["fallback"]:
            assert p.meta["dp_value"] == p.meta["relaxed_time"]


def test_relaxation_moves_fractions_of_a_byte():
    # 0.4 B/s moves 0.4 B in a 1 s stage: the DP rounded that to 0 B, charged both whole
    # transfers as idle and put relaxed_time (12) above its own plan's simulated time (10)
    c = Chain(fw=[1, 1], bw=[1, 4], x=[1, 1], xbar=[1, 2], delta=[1, 1], fw_tmp=[1, 0],
              bw_tmp=[0, 0])
    p = offload.dynprog(c, 4, 0.4, slots=None)
    assert p.meta["dp_value"] == p.meta["relaxed_time"] <= simulate(c, p).makespan == 10
    assert c.total_compute() + offload.relaxed_idle(c, 4, 0.4, [0]) \
        <= offload.schedule(c, [0], 4, 0.4)[1].makespan


@settings(max_examples=60, deadline=None, derandomize=True)
@given(L=st.integers(1, 3), seed=st.integers(0, 10 ** 6), frac=st.floats(0, 1),
       bw=st.sampled_from([0.1, 0.2, 0.3, 0.4, 0.7, 1.0, 1 / 3, 2.5, 10.0]))
def test_relaxation_is_a_lower_bound_at_any_bandwidth(L, seed, frac, bw):
    """Slow links too (less than a byte per stage): for every offload subset whose plan
    runs, the recurrence's time <= that plan's simulated time; DYNPROG's dp value is the
    least of them and <= the simulated time of its own plan."""
    c = Chain.random(L, seed=seed)
    lo, hi = offload.min_memory(c), offload.peak_memory(c)
    M = lo + round(frac * (hi - lo))
    best, _ = _every_subset(c, M, bw)
    for improve in (False, True):
        p = offload.dynprog(c, M, bw, slots=None, improve=improve)
        assert p.meta["dp_value"] == pytest.approx(best, abs=1e-9)
        assert p.meta["dp_value"] <= simulate(c, p).makespan + 1e-9


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_without_a_channel_the_error_names_the_store_all_peak(name):
    """Bandwidth 0 (no channel) below the offloading bound named that bound, where the
    planner then said "bandwidth 0 cannot offload, and the chain needs 75 B": it names the
    store-all peak, where it plans."""
    c = Chain.random(4, seed=1)
    peak = offload.peak_memory(c)
    for M in (offload.min_memory(c) - 1, offload.min_memory(c), peak - 1):
        with pytest.raises(InfeasibleError, match="bandwidth 0 cannot offload") as e:
            PLANNERS[name](c, M, 0)
        assert e.value.min_memory == peak == 75
    assert simulate(c, PLANNERS[name](c, peak, 0), None).peak_memory <= peak


@pytest.mark.parametrize("name,planner", [("resnet152-i224-b4", "greedy"),
                                          ("resnet152-i224-b32", "greedy"),
                                          ("resnet152-i224-b32", "dynprog")])
def test_a_galloping_repair_finds_the_one_op_walks_plan(name, planner, monkeypatch):
    """Past GALLOP_AFTER simulations the prefetch repair moves a blocked prefetch by growing
    steps, then bisects back to the first position past its block: on these bundled chains
    (at 30% of store-all, where galloping alone gave plans up to 1.4% slower) the plan is the
    one-op walk's. (The simulations it saves show on longer sequences: ResNet-50's 700 ops in
    the swap runtime, 295 down to about 200.)"""
    from pathlib import Path
    chain = Chain.from_json(Path(__file__).parents[1] / "bench" / "chains" / f"{name}.json")
    memory = 0.3 * (sum(chain.xbar) + sum(chain.x))
    bisected = []
    real = offload._first_past_block
    monkeypatch.setattr(offload, "_first_past_block",
                        lambda *a: (bisected.append(1), real(*a))[1])
    gallop_after = offload.GALLOP_AFTER

    def plan(after):
        monkeypatch.setattr(offload, "GALLOP_AFTER", after)
        bisected.clear()
        return getattr(offload, planner)(chain, memory, 12e9), len(bisected)

    walk, walk_bisections = plan(10 ** 9)
    fast, fast_bisections = plan(gallop_after)
    assert walk_bisections == 0 and fast_bisections > 0   # it galloped, and bisected
    assert fast.ops == walk.ops and fast.predicted_time == walk.predicted_time
    assert simulate(chain, fast, 12e9, memory=memory).makespan == fast.predicted_time


@pytest.mark.parametrize("clear_at", [45, 55, 58])
def test_the_repair_walks_on_where_a_gallop_would_pass_a_consumer(clear_at, monkeypatch):
    """A galloped move of prefetch 0 that would push prefetch 1 past its consumer (op 60,
    before prefetch 0's: ``schedule(first=...)`` orders them so) falls back to one op and walks
    on: the repair finds the placement the one-op walk finds (it gave up there before).
    Simulations stubbed: prefetch 0 blocks itself at its own position until ``clear_at``."""
    from scheduler.plan import Op, Plan
    done = Plan([Op("F_all", 0), Op("B", 0)])

    def attempt(chain, ops, prefetches, pos, *rest):
        return (done, "simulated") if pos[0] >= clear_at else (0, pos[0])

    monkeypatch.setattr(offload, "_attempt", attempt)
    monkeypatch.setattr(offload, "GALLOP_AFTER", 2)
    pos = [0, 0]
    got = offload._repair(None, [Op("F_all", 0)] * 120, [(0, 100), (1, 60)], pos, 0, 1.0,
                          "test", None)
    assert got == (done, "simulated") and pos == [clear_at, clear_at]
