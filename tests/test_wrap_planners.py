"""scheduler.wrap with the real planners (rotor, periodic, pofo) on chains measured on the CPU:
gradients bit-identical to plain training at several budgets, activation bytes held within
the plan's predicted peak, infeasible budgets rejected with the smallest feasible one."""
from __future__ import annotations

import pytest
import torch

import scheduler
from scheduler import InfeasibleError, simulate
from scheduler.planners.mimose import plan_from_checkpoints
from scheduler.profile import measure_chain

from wrap_models import one_thread  # noqa: F401  (autouse fixture)
from wrap_models import mlp_blocks, plain_step, token_batch, transformer_blocks, twins, wrapped_step

D = 32
L = 8
FAST = {"repeat": 1, "warmup": 0}


def input_allowance(plan, *args) -> int:
    """A plan may offload the network input x[0]; the caller holds that tensor, so the runner
    does not move it (it would free nothing) and it stays in the bytes held."""
    if not any(op.kind == "offload" and op.stage == 0 for op in plan):
        return 0
    return sum(a.numel() * a.element_size() for a in args)


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.fixture(scope="module")
def full_peak():
    x = torch.randn(16, D, requires_grad=True)
    chain = measure_chain(mlp_blocks(L, D), x, loss="sum", **FAST)
    return simulate(chain, plan_from_checkpoints(L, [])).peak_memory


@pytest.mark.parametrize("planner", ["rotor", "periodic", "pofo"])
@pytest.mark.parametrize("frac", [1.0, 0.6, 0.4])
def test_planner_matches_plain_training_within_budget(planner, frac, full_peak):
    budget = int(full_peak * frac)
    blocks, ref = twins(lambda: mlp_blocks(L, D))
    x = torch.randn(16, D, requires_grad=True)
    try:
        model = scheduler.wrap(blocks, budget, planner=planner, track_memory=True,
                               bandwidth=2e9 if planner == "pofo" else None, sample_input=x,
                               measure_options=FAST)
    except InfeasibleError as e:
        assert planner == "periodic" and e.min_memory > budget  # periodic cannot go that low
        return
    assert same(wrapped_step(model, (x,)), plain_step(ref, (x,)))
    plan = model.last_plan
    peak = model.stats()["last_peak_bytes"]
    assert plan.predicted_peak <= budget
    assert 0 < peak <= plan.predicted_peak + input_allowance(plan, x)
    if frac < 1:
        kinds = {op.kind for op in plan}
        assert kinds & {"F_ck", "F_none", "offload"}  # it had to save memory somehow


def test_rotor_on_transformer_tuples_and_int_inputs():
    blocks, ref = twins(lambda: transformer_blocks(4, D))
    ids = token_batch(4, 16)
    probe = measure_chain(transformer_blocks(4, D), ids, loss="sum", input_grad=False, **FAST)
    full = simulate(probe, plan_from_checkpoints(len(blocks), [])).peak_memory
    model = scheduler.wrap(blocks, int(full * 0.6), track_memory=True, measure_options=FAST)
    assert same(wrapped_step(model, (ids,)), plain_step(ref, (ids,)))
    assert model.stats()["last_peak_bytes"] <= model.last_plan.predicted_peak <= int(full * 0.6)
    assert model.last_stats.recomputed_forwards > 0


def test_infeasible_budget_names_the_minimum_and_the_minimum_works():
    blocks = mlp_blocks(L, D)
    x = torch.randn(16, D)
    with pytest.raises(InfeasibleError) as e:
        scheduler.wrap(blocks, 1000, sample_input=x, measure_options=FAST)
    need = e.value.min_memory
    assert need > 1000
    model = scheduler.wrap(blocks, int(need) + 1, sample_input=x, track_memory=True,
                           measure_options=FAST)
    wrapped_step(model, (x,))
    assert model.stats()["last_peak_bytes"] <= int(need) + 1


def test_new_shape_replans_and_measuring_leaves_training_unchanged():
    blocks, ref = twins(lambda: mlp_blocks(4, D))
    model = scheduler.wrap(blocks, "20KiB", measure_options=FAST)
    for step, batch in enumerate([8, 16, 8]):
        x = torch.randn(batch, D)
        for b in ref:
            b.zero_grad(set_to_none=True)
        # the first step on a shape measures the chain: RNG, buffers, grads must be unaffected
        assert same(wrapped_step(model, (x,), seed=step), plain_step(ref, (x,), seed=step))
    assert (model.stats()["misses"], model.stats()["hits"]) == (2, 1)


def test_pofo_bandwidth_default_and_validation():
    from scheduler.runtime.bandwidth import CPU_DEFAULT, default_bandwidth
    assert default_bandwidth("cpu") == CPU_DEFAULT == 12e9
    model = scheduler.wrap(mlp_blocks(2, D), "1MiB", planner="pofo",
                           sample_input=torch.randn(2, D), measure_options=FAST)
    assert model.last_plan is None and model.cache.misses == 1  # planned without bandwidth=
    with pytest.raises(ValueError, match="bandwidth"):
        scheduler.wrap(mlp_blocks(2, D), "1MiB", planner="pofo", bandwidth=-1)


@pytest.mark.parametrize("frac", [0.55, 0.45])
def test_pofo_prefetches_wait_for_memory_as_simulated(frac):
    """pofo predicts its peak with the simulator enforcing the budget (a prefetch waits until
    a backward frees memory); the runner issues such prefetches as late as the simulation
    does, so the bytes it holds stay within the prediction."""
    from bench.models import gpt2
    zoo = gpt2(batch=2, seq_len=64, n_layer=4, n_embd=64, n_head=4, vocab=500, dropout=0.1)
    blocks, ref = twins(lambda: (torch.manual_seed(0), gpt2(
        batch=2, seq_len=64, n_layer=4, n_embd=64, n_head=4, vocab=500).blocks)[1])
    ids = zoo.sample_input()
    chain = measure_chain(blocks, ids, loss="sum", input_grad=False, **FAST)
    full = simulate(chain, plan_from_checkpoints(len(blocks), [])).peak_memory
    model = scheduler.wrap(blocks, int(full * frac), planner="pofo", bandwidth=12e9, chain=chain,
                           track_memory=True, sample_input=ids)
    assert same(wrapped_step(model, (ids,)), plain_step(ref, (ids,)))
    assert model.stats()["last_peak_bytes"] <= \
        model.last_plan.predicted_peak + input_allowance(model.last_plan, ids)
