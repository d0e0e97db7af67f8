"""Regressions from the AddressSanitizer/UBSan hunt over the offloading and pofo DPs
(csrc/dp/offload_dp.cpp, csrc/dp/pofo_dp.cpp), driven through the public planners."""
import math

import pytest

from scheduler import Chain, InfeasibleError, simulate
from scheduler.planners import offload, pofo


def _check(chain, plan, memory, bandwidth):
    sim = simulate(chain, plan, bandwidth if bandwidth > 0 else None, memory=memory)
    assert sim.peak_memory <= memory
    assert sim.makespan == pytest.approx(plan.predicted_time, rel=1e-12, abs=1e-12)
    assert sim.peak_memory == pytest.approx(plan.predicted_peak, rel=1e-12, abs=1e-12)
    return sim


# Exact units (slots=None) take a budget of up to 2**62 bytes. The DP's "move everything"
# cap was 4 * (sum of sizes + budget) + 4 in int64: signed overflow (UBSan) from about 2**61,
# which wrapped negative and made the relaxation report ~2e9 s of idle time on a chain that
# needs no offloading at all (relaxed_time far above the simulated time it must bound).
@pytest.mark.parametrize("memory", [2**61 + 5, 3 * 2**60, 2**62 - 2**51, 2**62, 10**19])
@pytest.mark.parametrize("bandwidth", [1e9, 1.0, math.inf])
def test_dynprog_exact_units_huge_budget(memory, bandwidth):
    c = Chain(fw=[1, 1], bw=[1, 1], x=[2**50, 0], xbar=[0, 2**50], delta=[0, 0],
              fw_tmp=[0, 0], bw_tmp=[0, 0])
    for improve in (False, True):
        plan = offload.dynprog(c, memory, bandwidth, slots=None, improve=improve)
        sim = _check(c, plan, memory, bandwidth)
        assert plan.meta["relaxed_time"] == c.total_compute() == sim.makespan
        assert offload.lower_bound(c, memory, bandwidth) <= plan.meta["relaxed_time"]


@pytest.mark.parametrize("memory", [2**61 + 5, 2**62])
def test_relaxed_idle_exact_units_huge_budget(memory):
    c = Chain(fw=[1, 2, 1], bw=[1, 1, 3], x=[2**50, 7, 0], xbar=[2**49, 2**50, 3],
              delta=[5, 2**50, 0], fw_tmp=[0, 1, 0], bw_tmp=[2**48, 0, 0])
    # nothing needs to move with this much memory: no idle whatever is offloaded first
    assert offload.relaxed_idle(c, memory, 1e9, []) == 0
    plan = offload.dynprog(c, memory, 1e9, slots=None)
    _check(c, plan, memory, 1e9)
    assert plan.meta["relaxed_time"] == c.total_compute()


def test_one_huge_activation_among_zeros():
    """The shape of rotor's out-of-bounds crash: both DPs run it to a valid plan."""
    c = Chain(fw=[0, 1, 0], bw=[0, 0, 1], x=[0, 20000, 0], xbar=[0, 0, 0],
              delta=[0, 0, 0], fw_tmp=[0, 0, 0], bw_tmp=[0, 0, 0])
    for bandwidth in (0, 1e-9, 1.0, 1e30, math.inf):
        for memory in (offload.min_memory(c) or 1, 20000, 20001):
            for slots in (None, 500, 50, 7):
                for solve in (offload.dynprog, pofo.solve):
                    try:
                        plan = solve(c, memory, bandwidth, slots=slots)
                    except InfeasibleError:
                        continue
                    _check(c, plan, memory, bandwidth)
