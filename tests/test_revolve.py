"""revolve (seed 002 section 5.3, the AD model): optimal within its restricted space."""
import pytest

from _oracle import optimum_by_memory
from scheduler import Chain, InfeasibleError, simulate
from scheduler.planners import revolve, rotor


@pytest.mark.parametrize("L, seed", [(L, s) for L in range(0, 6) for s in range(2)])
def test_optimal_in_the_ad_model_for_every_memory(L, seed):
    chain = Chain.random(L, seed=7 * L + seed)
    best = optimum_by_memory(chain, ad_model=True)
    for m, t in best.items():
        plan = revolve.solve(chain, m, slots=None)
        assert plan.predicted_time == t
        r = simulate(chain, plan)
        assert (r.makespan, r.peak_memory) == (plan.predicted_time, plan.predicted_peak)
        assert r.peak_memory <= m
        assert rotor.solve(chain, m, slots=None).predicted_time <= t
    with pytest.raises(InfeasibleError) as e:
        revolve.solve(chain, min(best) - 1, slots=None)
    assert e.value.min_memory == min(best)


def test_every_forward_but_the_loss_runs_twice():
    chain = Chain.random(8, seed=4)
    plan = revolve.solve(chain, 10**6, slots=None)
    for s in range(chain.L):
        assert sum(1 for k, j in plan.ops if j == s and k.startswith("F")) >= 2
    assert plan.predicted_time == 2 * sum(chain.fw) - chain.fw[-1] + sum(chain.bw)
    assert all(plan.ops[i + 1] == ("B", s) for i, (k, s) in enumerate(plan.ops) if k == "F_all")
