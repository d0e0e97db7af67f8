"""rotor's refinement (issue 13): slot rounding must not hide a plan that fits the limit.

Sizes rounded up to slots make every plan of the rounded problem fit, but a plan whose exact
peak fits can look a few slots too large. ``refine=True`` (the default) rebuilds the plans at
the budgets above the limit from one wider table and keeps the fastest that fits exactly.
Oracles: the exact-units optimum (slots=None) is never slower, the unrefined plan never
faster, and the simulator agrees with every prediction and never sees the limit exceeded.
"""
import pytest
from hypothesis import given, settings, strategies as st

from scheduler import Chain, InfeasibleError, simulate
from scheduler.plan import checkpoint_plan
from scheduler.planners import periodic, revolve, rotor


def check(chain, plan, memory, exact=True):
    """``exact``: the predictions equal the simulator's to the bit (integer sizes); else to
    float rounding (fractional sizes are summed in another order)."""
    r = simulate(chain, plan)            # no memory=: the plan's own limit, enforced
    assert plan.memory_limit == memory and plan.meta["memory"] == memory
    if exact:
        assert (plan.predicted_time, plan.predicted_peak) == (r.makespan, r.peak_memory)
        assert simulate(chain, plan, memory=None).peak_memory == plan.predicted_peak
    else:
        assert plan.predicted_time == pytest.approx(r.makespan, rel=1e-12)
        assert plan.predicted_peak == pytest.approx(r.peak_memory, rel=1e-12)
    assert r.peak_memory <= rotor.fit_limit(chain, memory)   # (the simulator's rule)
    return r


def test_refined_plan_is_strictly_faster_and_fits_exactly():
    # 20 slots of 6.7: every size rounds up, the store-all-but-one plan (peak 134 == the
    # limit) looks like 23 slots and the rounded problem settles for a recomputation more
    chain = Chain.random(2, seed=1, max_size=40)
    base = rotor.solve(chain, 134, slots=20, refine=False)
    fine = rotor.solve(chain, 134, slots=20)
    check(chain, base, 134)
    check(chain, fine, 134)
    assert (base.predicted_time, fine.predicted_time) == (66, 58)
    assert fine.predicted_peak == 134
    assert fine.predicted_time == rotor.solve(chain, 134, slots=None).predicted_time  # optimal
    assert fine.meta["rounding_refined"] and fine.meta["dp_budget_units"] > 20
    assert fine.meta["budget_units"] == 20 and fine.meta["refine"]
    assert not base.meta["rounding_refined"] and base.meta["dp_budget_units"] == 20
    assert sum(o.kind != "B" for o in fine.ops) < sum(o.kind != "B" for o in base.ops)


def test_refine_is_checked_and_exact_units_need_none():
    chain = Chain.random(4, seed=3)
    with pytest.raises(ValueError, match="refine"):
        rotor.solve(chain, 100, refine=1)
    with pytest.raises(ValueError, match="refine"):
        revolve.solve(chain, 100, refine="yes")
    p = rotor.solve(chain, 100, slots=None)   # exact units: nothing to win back
    assert not p.meta["refine"] and not p.meta["rounding_refined"]


def _rounded_peak(chain, plan, memory, slots):
    """The plan's peak in the rounded problem (slots of memory / slots, no cap)."""
    units = rotor.discretize(chain, memory, slots, headroom=10 ** 9)[0]
    f = dict(zip(rotor.SIZE_FIELDS, units))
    rounded = chain.replace(x=f["x"][:-1], delta=f["delta"][:-1], xbar=f["xbar"],
                            fw_tmp=f["fw_tmp"], bw_tmp=f["bw_tmp"], fck_tmp=f["fck_tmp"])
    return simulate(rounded, plan, memory=None).peak_memory


CASE = dict(L=st.integers(0, 7), seed=st.integers(0, 10 ** 6), max_size=st.sampled_from([10, 40, 1000]),
            split=st.booleans(), slots=st.sampled_from([10, 20, 50, 500]),
            frac=st.floats(0, 1.2))


@settings(max_examples=150, deadline=None)
@given(**CASE)
def test_refined_never_slower_never_over_and_never_beats_the_exact_optimum(L, seed, max_size, split,
                                                                           slots, frac):
    chain = Chain.random(L, seed=seed, max_size=max_size, split_tmp=split)
    full = simulate(chain, periodic.solve(chain, 1)).peak_memory
    least = rotor.min_memory(chain)
    memory = int(least + frac * (full - least))
    exact = rotor.solve(chain, memory, slots=None)
    # the bound the refinement relies on: a plan that fits exactly is within the headroom
    assert _rounded_peak(chain, exact, memory, slots) <= slots + rotor.rounding_headroom(chain, memory)
    for planner in (rotor, revolve):
        try:
            base = planner.solve(chain, memory, slots=slots, refine=False)
        except InfeasibleError as e:   # the rounding rules the budget's own plan out ...
            assert e.min_memory > memory
            check(chain, planner.solve(chain, e.min_memory, slots=slots), e.min_memory)
            try:   # ... but a plan whose exact peak fits may still be within the headroom
                fine = planner.solve(chain, memory, slots=slots)
            except InfeasibleError as again:
                assert again.min_memory == e.min_memory
                continue
            check(chain, fine, memory)
            assert fine.meta["rounding_refined"]
            assert planner.solve(chain, memory, slots=None).predicted_time <= fine.predicted_time
            continue
        except ValueError:   # too few slots for the chain at any memory
            with pytest.raises(ValueError):
                planner.solve(chain, memory, slots=slots)
            continue
        fine = planner.solve(chain, memory, slots=slots)
        check(chain, base, memory)
        check(chain, fine, memory)
        assert fine.predicted_time <= base.predicted_time
        opt = planner.solve(chain, memory, slots=None)
        assert opt.predicted_time <= fine.predicted_time
        if fine.predicted_time < base.predicted_time:
            assert fine.meta["rounding_refined"]


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 30), seed=st.integers(0, 10 ** 6), frac=st.floats(0, 1))
def test_refined_byte_chains_fit_and_predict_the_simulator(L, seed, frac):
    # fractional times, MiB-scale sizes (the float table; sizes far above a slot)
    c = Chain.random(L, seed=seed, max_size=100)
    chain = c.replace(**{f: [(v << 20) + 17 * s for s, v in enumerate(getattr(c, f))]
                         for f in rotor.SIZE_FIELDS},
                      fw=[v / 1e3 for v in c.fw], bw=[v / 1e3 for v in c.bw])
    full = simulate(chain, periodic.solve(chain, 1)).peak_memory
    least = rotor.min_memory(chain, slots=500, memory=full)   # may exceed full (rounding)
    memory = least + frac * max(full - least, 0)
    base = rotor.solve(chain, memory, refine=False)
    fine = rotor.solve(chain, memory)
    check(chain, fine, memory)
    assert fine.predicted_time <= base.predicted_time


def _mib_chain(L, seed):
    """Chain.random with its sizes in MiB (integer times): the reviewer's shape, where the
    every-block plan's rounded peak is a slot or two above the budget at its own peak."""
    c = Chain.random(L, seed=seed)
    return c.replace(**{f: [v << 20 for v in getattr(c, f)] for f in rotor.SIZE_FIELDS})


def test_every_block_peak_is_not_refused():
    # the budget's rounded problem is infeasible there (its least limit is 41073254): rotor
    # refused the limit before refining, though the every-block plan fits it exactly
    c = _mib_chain(2, 0)
    eb = simulate(c, checkpoint_plan(c.L, range(c.L)), memory=None)
    assert eb.peak_memory == 40894464
    with pytest.raises(InfeasibleError) as e:
        rotor.solve(c, eb.peak_memory, refine=False)
    assert e.value.min_memory == 41073254
    p = rotor.solve(c, eb.peak_memory)
    check(c, p, eb.peak_memory)
    assert p.predicted_time == eb.makespan == rotor.solve(c, eb.peak_memory, slots=None).predicted_time
    assert p.meta["rounding_refined"] and p.meta["dp_budget_units"] > p.meta["budget_units"]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(L=st.integers(1, 12), seed=st.integers(0, 10 ** 6))
def test_every_block_and_store_all_peaks_get_a_plan(L, seed):
    """A limit at which a plan of the DP's class fits exactly (the every-block plan: both
    planners' class; store-all: rotor's) is never refused with the default slots."""
    c = _mib_chain(L, seed)
    cases = [(rotor, checkpoint_plan(L, range(L))), (revolve, checkpoint_plan(L, range(L))),
             (rotor, checkpoint_plan(L, ()))]
    for planner, ref in cases:
        r = simulate(c, ref, memory=None)
        check(c, planner.solve(c, r.peak_memory), r.peak_memory)


def test_store_all_peak_of_a_fractional_chain_keeps_store_all():
    # the DP sums the peak in another order than the simulator: 6.345 against the limit
    # 6.344999999999999, one ulp over, was compared with no tolerance and store-all lost
    c = Chain(fw=[2.971, 0.751, 0.0], bw=[0.751, 0.0, 0.751], x=[0.751, 0.0, 0.0],
              xbar=[0.0, 1.1209999999999998, 1.1209999999999998],
              delta=[1.4909999999999999, 1.1209999999999998, 1.4909999999999999],
              fw_tmp=[2.231, 0.381, 2.971], bw_tmp=[2.601, 0.0, 1.861])
    sa = simulate(c, checkpoint_plan(c.L, ()), memory=None)
    assert sa.peak_memory == 6.344999999999999
    for slots in (500, 5000):
        p = rotor.solve(c, sa.peak_memory, slots=slots)
        check(c, p, sa.peak_memory, exact=False)
        assert p.predicted_time == sa.makespan == 5.224


@settings(max_examples=60, deadline=None, derandomize=True)
@given(L=st.integers(1, 8), seed=st.integers(0, 10 ** 6),
       scale=st.sampled_from([0.1, 0.3, 0.371, 0.751, 1.121, 1e-3]))
def test_store_all_peak_of_fractional_chains_is_store_all_time(L, seed, scale):
    """At the simulator's own store-all peak of a fractional chain, rotor's plan is as fast
    as store-all (the refinement's top plan is store-all; it fits by the simulator's rule)."""
    c0 = Chain.random(L, seed=seed)
    c = c0.replace(**{f: [v * scale for v in getattr(c0, f)] for f in rotor.SIZE_FIELDS},
                   fw=[v * scale for v in c0.fw], bw=[v * scale for v in c0.bw])
    sa = simulate(c, checkpoint_plan(L, ()), memory=None)
    p = rotor.solve(c, sa.peak_memory)
    check(c, p, sa.peak_memory, exact=False)
    assert p.predicted_time <= sa.makespan * (1 + 1e-12)


def test_fit_limit_is_the_simulators_rule():
    c, f = Chain.random(3, seed=0), _mib_chain(3, 0).replace(fw_tmp=[0.5] * 4)
    assert rotor.fit_limit(c, 100) == 100 and rotor.fit_limit(c, 100.0) == 100
    assert rotor.fit_limit(c, 100.5) == 100.5 + 100.5e-9
    assert rotor.fit_limit(f, 2 << 20) == (2 << 20) * (1 + 1e-9)
    assert rotor.fit_limit(f, 0.5) == 0.5 + 1e-9
