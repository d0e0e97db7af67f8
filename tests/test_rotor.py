"""rotor (seed 002 Theorem 1): optimal against an exhaustive oracle, predictions equal the
simulator, discretization keeps plans feasible, baselines never beat it."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from _oracle import optimum_by_memory
from scheduler import Chain, InfeasibleError, simulate
from scheduler.planners import periodic, revolve, rotor

# tmp "split": F_ck / F_none have their own transient (Chain.fck_tmp), unlike F_all's
ORACLE_CASES = [(L, seed, tmp) for L in range(0, 6) for seed in range(2)
                for tmp in (True, False, "split")]
ORACLE_CASES += [(6, seed, tmp) for seed in range(3) for tmp in (True, False, "split")]


def check_prediction(chain, plan, memory=None, exact=True):
    r = simulate(chain, plan)
    if exact:
        assert (plan.predicted_time, plan.predicted_peak) == (r.makespan, r.peak_memory)
    else:
        assert plan.predicted_time == pytest.approx(r.makespan, rel=1e-9)
        assert plan.predicted_peak == pytest.approx(r.peak_memory, rel=1e-9)
    if memory is not None:
        assert r.peak_memory <= rotor.fit_limit(chain, memory)   # (the simulator's rule)
    return r


@pytest.mark.parametrize("L, seed, tmp", ORACLE_CASES)
def test_optimal_for_every_memory_limit(L, seed, tmp):
    chain = Chain.random(L, seed=100 * L + seed, tmp=bool(tmp), split_tmp=tmp == "split")
    best = optimum_by_memory(chain)
    least = min(best)
    for m, t in best.items():
        plan = rotor.solve(chain, m, slots=None)
        assert plan.predicted_time == t, f"memory {m}"
        check_prediction(chain, plan, memory=m)
    with pytest.raises(InfeasibleError) as e:
        rotor.solve(chain, least - 1, slots=None)
    assert e.value.min_memory == least
    assert rotor.min_memory(chain) == least


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 12), seed=st.integers(0, 10**6))
def test_monotone_in_memory_and_above_the_lower_bound(L, seed):
    chain = Chain.random(L, seed=seed)
    least = rotor.min_memory(chain)
    full = simulate(chain, periodic.solve(chain, 1)).peak_memory   # store everything
    prev = math.inf
    for m in sorted({least, (least + full) // 2, full - 1, full, full + 5}):
        if m < least:
            continue
        plan = rotor.solve(chain, m, slots=None)
        check_prediction(chain, plan, memory=m)
        assert chain.total_compute() <= plan.predicted_time <= prev
        prev = plan.predicted_time
    assert prev == chain.total_compute()   # with room for everything nothing is recomputed


@settings(max_examples=25, deadline=None)
@given(L=st.integers(2, 16), seed=st.integers(0, 10**6))
def test_never_worse_than_periodic_or_revolve(L, seed):
    chain = Chain.random(L, seed=seed)
    for k in range(1, L + 1):
        p = periodic.solve(chain, k)
        m = p.predicted_peak
        r = rotor.solve(chain, m, slots=None)
        assert r.predicted_time <= p.predicted_time
        try:
            v = revolve.solve(chain, m, slots=None)
        except InfeasibleError:
            continue
        assert r.predicted_time <= v.predicted_time


def byte_chain(L, seed, scale=1 << 20):
    """A random chain in 'bytes' (sizes in MiB-ish) and fractional seconds."""
    c = Chain.random(L, seed=seed)
    return c.replace(**{f: [v * scale + 17 * s for s, v in enumerate(getattr(c, f))]
                        for f in ("x", "xbar", "delta", "fw_tmp", "bw_tmp", "fck_tmp")},
                     fw=[v / 1000 for v in c.fw], bw=[v / 1000 for v in c.bw])


@pytest.mark.parametrize("slots", [50, 500])
def test_slots_keep_plans_feasible_and_predictions_exact(slots):
    for seed in range(4):
        chain = byte_chain(20, seed)
        full = simulate(chain, periodic.solve(chain, 1)).peak_memory
        least = rotor.min_memory(chain, slots=slots, memory=full / 10)
        for frac in (0.0, 0.2, 0.5, 1.0):
            m = least + frac * (full - least)
            plan = rotor.solve(chain, m, slots=slots)
            check_prediction(chain, plan, memory=m)   # exact: the plan sums times in sim order


def test_slot_rounding_bound():
    # rounding costs less than one slot per item in memory: slots=S at M is never slower
    # than the exact optimum at M - (L + 4) * M / S
    for seed in range(6):
        chain = Chain.random(7, seed=seed, max_size=40)
        S = 200
        full = simulate(chain, periodic.solve(chain, 1)).peak_memory
        for m in range(rotor.min_memory(chain), full + 1, 7):
            m_exact = math.floor(m - (chain.L + 4) * m / S)
            try:
                exact = rotor.solve(chain, m_exact, slots=None)
            except InfeasibleError:
                continue
            assert rotor.solve(chain, m, slots=S).predicted_time <= exact.predicted_time


def test_infeasible_with_slots_reports_a_limit_that_works():
    chain = byte_chain(10, 3)
    with pytest.raises(InfeasibleError) as e:
        rotor.solve(chain, 1000, slots=100)
    need = e.value.min_memory
    assert need > 1000 and f"the smallest memory that works is {need} B" in str(e.value)
    check_prediction(chain, rotor.solve(chain, need, slots=100), memory=need)
    # need is the least limit whose rounded problem is feasible; just below it only the
    # refinement can find a plan (one whose exact peak fits), and any it finds fits
    with pytest.raises(InfeasibleError):
        rotor.solve(chain, need - 1, slots=100, refine=False)
    try:
        check_prediction(chain, rotor.solve(chain, need - 1, slots=100), memory=need - 1)
    except InfeasibleError as below:
        assert below.min_memory == need
    assert isinstance(e.value, ValueError)


def test_paper_shape_and_bad_input():
    chain = Chain.random(5, seed=0)
    plan = rotor.solve(chain, 10**6, slots=None)     # unlimited: store everything
    assert [k for k, _ in plan.ops] == ["F_all"] * 6 + ["B"] * 6
    assert plan.planner == "rotor" and plan.meta["slots"] is None
    assert "F_all" in str(plan) and "mem" in str(plan)
    with pytest.raises(ValueError, match="memory"):
        rotor.solve(chain, -5)
    with pytest.raises(ValueError, match="slots"):
        rotor.solve(chain, 100, slots=0)
    with pytest.raises(ValueError, match="integer sizes"):
        rotor.solve(byte_chain(3, 0).replace(x=[0.5] * 4), 10**9, slots=None)
    assert rotor.solve(byte_chain(3, 0), "1GiB").meta["memory"] == 1 << 30


def test_min_memory_with_slots_is_the_least_limit_that_works():
    for chain in (byte_chain(12, 5), byte_chain(12, 5).replace(x=[v + 0.5 for v in byte_chain(12, 5).x])):
        for hint in (1.0, 1e12):   # far below and far above: same answer
            need = rotor.min_memory(chain, slots=64, memory=hint)
            assert need == pytest.approx(rotor.min_memory(chain, slots=64, memory=need * 3), rel=1e-5)
        rotor.solve(chain, need, slots=64)
        with pytest.raises(InfeasibleError):   # (the rounded problem: refinement may fit)
            rotor.solve(chain, need * (1 - 1e-5) - 1, slots=64, refine=False)
        assert rotor.min_memory(chain) <= need if chain.is_integer else True
    chain = Chain.random(6, seed=2)
    assert revolve.min_memory(chain) >= rotor.min_memory(chain)


def test_refine_wins_back_rounding_and_still_fits():
    chain = byte_chain(60, 1)
    full = simulate(chain, periodic.solve(chain, 1)).peak_memory
    for m in (0.4 * full, full):
        base = rotor.solve(chain, m, slots=50, refine=False)
        fine = rotor.solve(chain, m, slots=50)   # refine=True is the default
        check_prediction(chain, fine, memory=m)
        assert fine.predicted_time <= base.predicted_time and fine.meta["memory"] == m
        assert fine.memory_limit == m and not base.meta["rounding_refined"]
    assert fine.predicted_time < base.predicted_time   # at full memory the rounding cost shows
    with pytest.raises(ValueError, match="refine"):
        rotor.solve(chain, full, refine=4)


def _units_by_fractions(chain, memory, slots):
    """The reference rounding: exact rationals, ceil(v * slots / memory), capped at slots + 1."""
    from fractions import Fraction
    m = Fraction(memory)
    return tuple([min(math.ceil(Fraction(v) * slots / m), slots + 1)
                  for v in rotor._padded(chain, f)] for f in rotor.SIZE_FIELDS)


@settings(max_examples=300, deadline=None)
@given(L=st.integers(0, 5), seed=st.integers(0, 10 ** 6), scale=st.sampled_from([1, 10 ** 3, 10 ** 12]),
       fractional=st.booleans(), slots=st.sampled_from([1, 7, 500, 4096]),
       memory=st.one_of(st.integers(1, 10 ** 13), st.floats(1e-3, 1e13)))
def test_discretize_in_integers_equals_exact_rational_rounding(L, seed, scale, fractional, slots,
                                                               memory):
    c = Chain.random(L, seed=seed, max_size=10 * scale)
    if fractional:  # float sizes round through their exact binary value as well
        c = c.replace(x=[v / 3 for v in c.x], fw_tmp=[v * 0.7 for v in c.fw_tmp])
    units, budget, unit = rotor.discretize(c, memory, slots)
    assert units == _units_by_fractions(c, memory, slots)
    assert budget == slots and unit == float(memory) / slots


def _solved(chain, memory, slots, allow_all, refine, whole_table):
    try:
        p = rotor.solve_dp(chain, memory, slots, allow_all, "rotor", refine,
                           whole_table=whole_table)
    except InfeasibleError as e:
        return "infeasible", e.min_memory
    return [tuple(o) for o in p.ops], p.predicted_time, p.predicted_peak, p.meta


@settings(max_examples=80, deadline=None)
@given(L=st.integers(1, 30), seed=st.integers(0, 10 ** 6), frac=st.floats(0.05, 1.2),
       slots=st.sampled_from([None, 13, 100, 500]), refine=st.booleans(),
       allow_all=st.booleans(), split=st.booleans())
def test_reached_cells_give_the_whole_tables_answer(L, seed, frac, slots, refine, allow_all,
                                                     split):
    # the DP tabulates only the cells its answer reads (reach() in csrc/dp/rotor.cpp): the
    # same plan, value, peak, refinement and infeasibility as the whole table below the limit
    c = Chain.random(L, seed=seed, max_size=40, split_tmp=split)
    memory = max(1, int(simulate(c, periodic.solve(c, 1)).peak_memory * frac))
    assert _solved(c, memory, slots, allow_all, refine, False) == \
        _solved(c, memory, slots, allow_all, refine, True)


@pytest.mark.parametrize("B", [1000, 10 ** 6])
@pytest.mark.parametrize("allow_all", [True, False])
def test_rebuild_reads_only_cells_the_table_holds(B, allow_all):
    # a checkpoint candidate whose second half is infeasible at m: rebuild() read its first
    # half's cell, which reach() never tabulated (past the table's end: a crash at B = 10**6)
    c = Chain(fw=[1, 1, 1], bw=[1, 1, 1], x=[0, 0, B], xbar=[B, 0, 0], delta=[0, 0, B],
              fw_tmp=[1, 0, 0], bw_tmp=[0, 0, 1])
    for slots in (None, 500):
        got = _solved(c, 2 * B, slots, allow_all, True, False)
        assert got == _solved(c, 2 * B, slots, allow_all, True, True)
        if got[0] != "infeasible":
            check_prediction(c, rotor.solve_dp(c, 2 * B, slots, allow_all, "rotor", True),
                             2 * B)


@pytest.mark.parametrize("frac", [0.1, 0.3, 0.6, 1.0])
def test_reached_cells_give_the_whole_tables_answer_on_long_chains(frac):
    c = byte_chain(60, 2)
    memory = simulate(c, periodic.solve(c, 1)).peak_memory * frac
    for slots in (50, 500):
        assert _solved(c, memory, slots, True, True, False) == \
            _solved(c, memory, slots, True, True, True)
