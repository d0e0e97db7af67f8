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
from scheduler.planners import periodic, revolve, rotor


def check(chain, plan, memory):
    r = simulate(chain, plan)            # no memory=: the plan's own limit, enforced
    assert plan.memory_limit == memory and plan.meta["memory"] == memory
    assert (plan.predicted_time, plan.predicted_peak) == (r.makespan, r.peak_memory)
    assert r.peak_memory <= memory
    assert simulate(chain, plan, memory=None).peak_memory == plan.predicted_peak
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
        except (InfeasibleError, ValueError):   # the rounding (or too few slots) rules it out
            with pytest.raises((InfeasibleError, ValueError)):
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
