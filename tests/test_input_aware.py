"""Input-aware plans (issue 13 item 4): a whole chain predicted from the estimator learnt on the
first samples, rotor planning the prediction for shapes never profiled; no profiling after
the collection; gradients unchanged; plans (and the bytes actually held) within the budget."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import scheduler
from scheduler import Chain, simulate
from scheduler.chain import FIELDS
from scheduler.planners.mimose import ChainEstimator, plan_from_checkpoints
from scheduler.profile import measure_chain
from scheduler.runtime import options
from scheduler.runtime.input_aware import InputAwareChain

from wrap_models import one_thread  # noqa: F401  (autouse fixture)
from wrap_models import plain_step, token_batch, transformer_blocks, twins, wrapped_step

FAST = {"repeat": 1, "warmup": 0}
BATCH = 2


def poly_chain(L: int, n: int, coef: np.ndarray) -> Chain:
    """A chain whose every value is a quadratic in the input size n (coef: fields x stages x 3,
    integers; xbar[s] includes x[s+1] by construction)."""
    vals = coef[..., 0] * n * n + coef[..., 1] * n + coef[..., 2]
    f = {name: vals[k].tolist() for k, name in enumerate(FIELDS)}
    f["xbar"] = [f["xbar"][s] + (f["x"][s + 1] if s < L else 0) for s in range(L + 1)]
    return Chain(**f)


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 12), seed=st.integers(0, 10_000))
def test_quadratic_chains_are_predicted_on_held_out_sizes(L, seed):
    rng = np.random.default_rng(seed)
    coef = rng.integers(0, 50, size=(len(FIELDS), L + 1, 3))
    est = ChainEstimator(L, samples=4)
    for n in (10, 20, 40, 80):
        est.observe(n, poly_chain(L, n, coef))
    assert est.ready
    for n in (15, 33, 64, 100):
        got, want = est.predict(n), poly_chain(L, n, coef)
        for name in FIELDS[:2]:   # times: floats, fitted exactly up to rounding
            assert np.allclose(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-6)
        for name in FIELDS[2:]:   # sizes: whole bytes, rounded up, at most one byte off
            assert all(abs(a - b) <= 1 for a, b in zip(getattr(got, name), getattr(want, name)))
        assert all(got.xbar[s] >= got.x[s + 1] for s in range(L))


def test_a_measured_size_gives_its_measured_chain_and_bad_input_is_named():
    c = Chain.random(3, seed=1)
    est = ChainEstimator(3, samples=3)
    est.observe(7, c)
    assert est.predict(7) is c
    with pytest.raises(ValueError, match="Chain of 3 stages"):
        est.observe(8, Chain.random(4))
    with pytest.raises(ValueError, match="samples"):
        ChainEstimator(3, samples=2)


@pytest.fixture(scope="module")
def transformer_chains():
    """Chains of a small transformer (attention: quadratic in the sequence length) measured on
    several sequence lengths."""
    blocks = transformer_blocks(3, 32)
    return {s: measure_chain(blocks, token_batch(BATCH, s), loss="sum", input_grad=False, **FAST)
            for s in (8, 16, 24, 32, 48, 20, 40)}


def test_sizes_of_a_real_model_predicted_within_one_percent(transformer_chains):
    est = ChainEstimator(len(transformer_blocks(3, 32)), samples=5)
    for s in (8, 16, 24, 32, 48):
        est.observe(BATCH * s, transformer_chains[s])
    for s in (20, 40):
        err = est.relative_error(BATCH * s, transformer_chains[s])
        for name in ("x", "xbar", "delta"):
            assert err[name] < 0.01, (s, name, err)


class CountingMeasure:
    def __init__(self, monkeypatch):
        import scheduler.profile as prof
        self.calls = 0
        real = prof.measure_chain

        def counted(*a, **k):
            self.calls += 1
            return real(*a, **k)
        monkeypatch.setattr(prof, "measure_chain", counted)


def test_after_collection_nothing_is_profiled_and_training_is_unchanged(monkeypatch,
                                                                         transformer_chains):
    counter = CountingMeasure(monkeypatch)
    blocks, ref = twins(lambda: transformer_blocks(3, 32))
    probe = transformer_chains[48]
    full = simulate(probe, plan_from_checkpoints(probe.L, [])).peak_memory
    floor = simulate(probe, plan_from_checkpoints(probe.L, range(probe.L))).peak_memory
    budget = int((full + floor) / 2)
    source = InputAwareChain(blocks, samples=4, measure_options=FAST)
    model = scheduler.wrap(blocks, budget, planner="rotor", chain=source, track_memory=True)
    lens = [8, 16, 32, 48] + random.Random(0).sample(range(9, 48), 10)
    for k, s in enumerate(lens):
        ids = token_batch(BATCH, s, seed=k)
        for b in ref:
            b.zero_grad(set_to_none=True)
        got, want = wrapped_step(model, (ids,), seed=k), plain_step(ref, (ids,), seed=k)
        assert torch.equal(got[0], want[0]) and all(map(torch.equal, got[1], want[1])), s
        plan = model.last_plan
        assert plan.predicted_peak <= budget
        # the bytes really held stay within the budget on sizes never profiled
        assert model.stats()["last_peak_bytes"] <= budget, (s, model.stats())
    assert counter.calls == source.measurements == 4
    assert source.predictions == len(lens) - 4 and not source.collecting


def test_predicted_chain_plans_like_the_measured_one(transformer_chains):
    """rotor on the prediction keeps the measured chain's memory within the budget."""
    from scheduler.planners import rotor
    est = ChainEstimator(transformer_chains[8].L, samples=5)
    for s in (8, 16, 24, 32, 48):
        est.observe(BATCH * s, transformer_chains[s])
    for s in (20, 40):
        real = transformer_chains[s]
        full = simulate(real, plan_from_checkpoints(real.L, [])).peak_memory
        budget = int(full * 0.7)
        plan = rotor.solve(est.predict(BATCH * s), budget)
        assert simulate(real, plan).peak_memory <= budget * 1.01


def test_bad_blocks_are_named():
    with pytest.raises(TypeError, match="InputAwareChain"):
        InputAwareChain("not blocks")
    assert options.default_input_size((3, torch.zeros(2, 5))) == 10


def test_a_new_shape_is_planned_without_simulating_it_again(monkeypatch):
    # rotor's prediction is the simulator's (tests/test_plan_promise.py): the runner records it
    # instead of running the simulator on every new shape
    from scheduler.runtime import planning
    calls = []
    monkeypatch.setattr(planning, "simulate", lambda *a, **k: calls.append(a) or simulate(*a, **k))
    c = Chain.random(12, seed=3)
    c = c.replace(**{f: [v << 20 for v in getattr(c, f)] for f in ("x", "xbar", "delta", "fw_tmp", "bw_tmp", "fck_tmp")})
    full = simulate(c, plan_from_checkpoints(c.L, [])).peak_memory
    plan = planning.make_plan(c, int(full * 0.6), "rotor")
    assert calls == []
    r = simulate(c, plan)
    assert (plan.meta["simulated_peak"], plan.meta["simulated_time"]) == (r.peak_memory, r.makespan)
    assert r.peak_memory <= int(full * 0.6)
    planning.make_plan(c, None, "rotor")          # no limit: plain, simulated for its numbers
    assert len(calls) == 1
