"""periodic: torch's checkpoint_sequential as a Plan."""
import pytest

from scheduler import Chain, simulate
from scheduler.planners import periodic


def test_plan_matches_checkpoint_sequential():
    chain = Chain.random(7, seed=1)
    plan = periodic.solve(chain, 3)      # segment size 7 // 3 = 2: [0,1], [2,3], then 4..6 + loss
    assert [tuple(o) for o in plan.ops] == [
        ("F_ck", 0), ("F_none", 1), ("F_ck", 2), ("F_none", 3),
        ("F_all", 4), ("F_all", 5), ("F_all", 6), ("F_all", 7),
        ("B", 7), ("B", 6), ("B", 5), ("B", 4),
        ("F_all", 2), ("F_all", 3), ("B", 3), ("B", 2),
        ("F_all", 0), ("F_all", 1), ("B", 1), ("B", 0)]
    r = simulate(chain, plan)
    assert (plan.predicted_time, plan.predicted_peak) == (r.makespan, r.peak_memory)
    assert plan.predicted_time == chain.total_compute() + sum(chain.fw[:4])


def test_segment_cuts_follow_torch():
    # checkpoint_sequential: segment_size = n // segments; segments - 1 checkpointed chunks
    assert periodic.segments_of(10, 4) == [(0, 1), (2, 3), (4, 5)]
    assert periodic.segments_of(10, 1) == []
    assert periodic.segments_of(5, 5) == [(0, 0), (1, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize("L", [1, 4, 9])
def test_every_segment_count_is_valid(L):
    chain = Chain.random(L, seed=L)
    one = periodic.solve(chain, 1)
    assert one.predicted_time == chain.total_compute()
    for k in range(1, L + 1):
        p = periodic.solve(chain, k)
        assert simulate(chain, p).makespan == p.predicted_time


def test_bad_segments():
    chain = Chain.random(4, seed=0)
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match="segments"):
            periodic.solve(chain, bad)
