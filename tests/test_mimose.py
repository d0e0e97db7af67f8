"""Mimose (seed 004): Algorithm 1, the quadratic estimator, the shuttling collector and
``wrap(planner="mimose")`` on a model whose attention memory grows with seq_len^2."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import scheduler
from scheduler import InfeasibleError, simulate
from scheduler.planners import mimose as M

from wrap_models import one_thread  # noqa: F401  (autouse fixture)
from wrap_models import plain_step, token_batch, transformer_blocks, twins, wrapped_step

D = 32
BATCH = 4


# ------------------------------------------------------------------------ Algorithm 1
def test_buckets_within_ten_percent_in_forward_order():
    est = [100, 50, 95, 91, 49, 10, 89]
    assert M.buckets_of(est) == [[0, 2, 3], [6], [1, 4], [5]]


def test_greedy_nearest_bucket_then_earliest_block():
    est = [100, 50, 95, 91, 49, 10]
    # excess 40: the smallest bucket still larger than 40 is {50, 49}; earliest block first
    assert M.greedy_checkpoints(est, sum(est) - 40) == [1]
    # excess 120: no block covers it, take the largest bucket's earliest (0), then 20 is left:
    # nearest bucket above 20 is {50, 49} -> block 1
    assert M.greedy_checkpoints(est, sum(est) - 120) == [0, 1]
    assert M.greedy_checkpoints(est, sum(est)) == []
    assert sorted(M.greedy_checkpoints(est, 0)) == list(range(6))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=30), st.floats(0, 1))
def test_greedy_covers_the_excess_without_waste(est, frac):
    budget = frac * sum(est)
    chosen = M.greedy_checkpoints(est, budget)
    assert len(set(chosen)) == len(chosen)
    kept = sum(est) - sum(est[i] for i in chosen)
    assert kept <= budget or len(chosen) == len(est)
    # the last pick was needed: without it the excess was not covered
    if chosen:
        assert kept + est[chosen[-1]] > budget


# ------------------------------------------------------------------------ estimator
def test_estimator_recovers_quadratics_exactly():
    e = M.Estimator(3, samples=10)
    f = lambda n: (4 * n, [2 * n * n + 3 * n + 7, 5 * n, 11.0], [n, n, 1.0], [1e-3 * n] * 3)
    for n in range(10, 110, 10):
        e.observe(n, *f(n))
    assert e.ready
    for n in (15, 95, 300):
        ib, xbar, out, fw = f(n)
        assert e.predict(n) == pytest.approx(xbar, rel=1e-9)
        est = e.estimate(n)
        assert est.input_bytes == pytest.approx(ib) and est.out == pytest.approx(out)


def test_tail_is_learnt_and_becomes_the_loss_stage():
    e = M.Estimator(2, samples=3)
    tail = lambda n: [40.0 * n, 8.0 * n, 30.0 * n, 1e-3, 2e-3]  # TAIL_FIELDS
    for n in (10, 20, 30):
        e.observe(n, 4 * n, [8 * n, 8 * n], [4 * n, 4 * n], [1e-3, 1e-3], tail(n))
    est = e.estimate(25)
    assert est.tail == pytest.approx(tail(25), rel=1e-9)
    c = M.chain_from_estimate(est)
    assert (c.xbar[2], c.fw_tmp[2], c.bw_tmp[2]) == (1000, 200, 750)
    assert c.fw[2] == pytest.approx(1e-3) and c.bw[2] == pytest.approx(2e-3)
    assert c.fw_tmp[:2] == (0, 0) and c.meta["tail"] == "estimated"
    # the verified plan counts it: at the budget that fits without the tail, it no longer fits
    m = M.Mimose(2, samples=3)
    m.estimator = e
    free = M.chain_from_estimate(M.Estimate(est.input_bytes, est.xbar, est.out, est.fw))
    assert free.xbar[2] == 0 and free.meta["tail"] == "not measured"
    budget = simulate(free, M.plan_from_checkpoints(2, [])).peak_memory
    plan = m.plan(25, budget + 1000 + 750)   # room for the tail's saved bytes and transient
    assert plan.predicted_peak <= budget + 1750
    assert plan.predicted_peak == simulate(plan.chain, plan).peak_memory
    with pytest.raises(InfeasibleError):
        m.plan(25, budget)
    # what the step holds outside the chain is learnt too and carried by every op
    e.observe(40, 160, [320, 320], [160, 160], [1e-3, 1e-3], tail(40), [64, 16])
    e.observe(50, 200, [400, 400], [200, 200], [1e-3, 1e-3], tail(50), [64, 16])
    c = M.chain_from_estimate(e.measured(40))
    assert c.meta["outside"]["forward"] == 64 and c.meta["outside"]["tied_grads"] == 16
    assert c.fw_tmp == (64, 64, 320 + 64) and c.bw_tmp == (80, 80, 1200 + 80)


def test_block_transients_are_learnt_and_never_mixed_with_samples_without():
    e = M.Estimator(2, samples=3)
    tmp = lambda n: {"fw_tmp": [2 * n, 3 * n], "bw_tmp": [5 * n * n, 7 * n],  # noqa: E731
                     "fck_tmp": [11 * n, 13 * n]}
    for n in (10, 20, 30):
        e.observe(n, 4 * n, [8 * n, 8 * n], [4 * n, 4 * n], [1e-3, 1e-3], tmp=tmp(n))
    est = e.estimate(25)
    for k, v in tmp(25).items():
        assert est.tmp[k] == pytest.approx(v, rel=1e-9)
    c = M.chain_from_estimate(e.measured(20))
    assert c.bw_tmp == (2000, 140, 0) and c.fw_tmp == (40, 60, 0)
    assert c.fck_tmp == (220, 260, 0) and c.meta["transients"] == "estimated"
    # the check counts them: every block's backward peaks with its bw_tmp on top
    free = M.chain_from_estimate(M.Estimate(est.input_bytes, est.xbar, est.out, est.fw))
    every = M.plan_from_checkpoints(2, [0, 1])
    assert simulate(c, every).peak_memory > simulate(free, every).peak_memory
    with pytest.raises(ValueError, match="do not carry|does not"):
        e.observe(40, 160, [320, 320], [160, 160], [1e-3, 1e-3])   # mixed: loud
    with pytest.raises(ValueError, match="exactly"):
        e.observe(40, 160, [320, 320], [160, 160], [1e-3, 1e-3], tmp={"fw_tmp": [1, 1]})
    e.observe(10, 40, [80, 80], [40, 40], [1e-3, 1e-3], tmp=tmp(10))  # a size again: fine
    # the positional form (the swap runtime's) learns no transients
    plain = M.Mimose(2, samples=3)
    plain.observe(10, 40, [80, 80], [40, 40], [1e-3, 1e-3])
    assert plain.estimator.measured(10).tmp is None
    with pytest.raises(ValueError, match="do not carry"):
        plain.observe(20, 80, [160, 160], [80, 80], [1e-3, 1e-3], None, None, tmp(20))


def test_collector_transients_are_the_profilers():
    """One implementation: the transients a Mimose collection step learns are the ones
    measure_chain measures for rotor's chains (the same per-stage measurement)."""
    from scheduler.profile import measure_chain
    blocks = transformer_blocks(2, D)
    model = scheduler.wrap(blocks, None, planner="mimose")
    ids = token_batch(BATCH, 16)
    wrapped_step(model, (ids,))
    got = model.mimose.estimator.measured(ids.numel())
    chain = measure_chain(blocks, ids, loss="sum", repeat=1, warmup=0, input_grad=False)
    for k in M.BLOCK_TMP_FIELDS:
        assert got.tmp[k].tolist() == list(getattr(chain, k)[:-1]), k
    assert got.xbar.tolist() == list(chain.xbar[:-1])
    assert max(got.tmp["fck_tmp"]) > 0  # (the attention scores of a no-grad forward)


def test_a_failed_transient_measurement_drops_its_sample(monkeypatch):
    """Measuring must not break training: the step trains (bit-identical), says so, and its
    sample is not learnt without the transients the first sample had."""
    from scheduler.profile import measure
    blocks, ref = twins(lambda: transformer_blocks(2, D))
    model = scheduler.wrap(blocks, None, planner="mimose")
    ids = [token_batch(BATCH, s, seed=s) for s in (8, 12)]
    wrapped_step(model, (ids[0],))
    real = measure.stage_memory

    def broken(*a, **k):
        raise RuntimeError("no tracer today")
    monkeypatch.setattr(measure, "stage_memory", broken)
    with pytest.warns(UserWarning, match="no tracer today"):
        with pytest.warns(UserWarning, match="transients not measured.*dropped"):
            got = wrapped_step(model, (ids[1],), seed=3)
    exp = plain_step(ref, (ids[1],), seed=3)
    assert torch.equal(got[0], exp[0]) and all(torch.equal(a, b) for a, b in zip(got[1], exp[1]))
    est = model.mimose.estimator
    assert est.has(ids[0].numel()) and not est.has(ids[1].numel())
    monkeypatch.setattr(measure, "stage_memory", real)
    wrapped_step(model, (ids[1],))  # collected again
    assert est.measured(ids[1].numel()).tmp is not None


def test_blocks_with_backward_hooks_are_measured_with_the_hooks_silent():
    """A module backward hook runs once per step, as in plain training: the collector measures
    the block's transients with its hooks silenced (``_trace.hooks_silenced``)."""
    blocks = transformer_blocks(2, D)
    calls = []
    blocks[1].register_full_backward_hook(lambda m, gi, go: calls.append(1))
    model = scheduler.wrap(blocks, None, planner="mimose")
    ids = token_batch(BATCH, 8)
    wrapped_step(model, (ids,))
    assert len(calls) == 1
    assert model.mimose.estimator.measured(ids.numel()).tmp is not None


def test_estimator_rejects_bad_input():
    with pytest.raises(ValueError, match="samples"):
        M.Estimator(2, samples=2)
    e = M.Estimator(2)
    with pytest.raises(ValueError, match="xbar"):
        e.observe(10, 1, [1], [1, 1], [1, 1])
    with pytest.raises(ValueError, match="distinct"):
        e.fit()


def _three_sizes() -> M.Mimose:
    m = M.Mimose(2, samples=3)
    for s in (1, 2, 3):
        m.observe(s, 10, [s, s], [s, s], [1e-3, 1e-3])
    return m


@pytest.mark.parametrize("size", [math.inf, math.nan, 10 ** 400, -1.0, 0])
def test_observe_refuses_a_size_that_is_not_positive_and_finite(size):
    """observe(inf) was taken, and every later fit failed with numpy's LinAlgError (and
    LAPACK's complaints on stderr)."""
    m = _three_sizes()
    with pytest.raises(ValueError, match=r"Estimator\.observe: input_size must be a positive "
                                         r"number, got "):
        m.observe(size, 10, [4, 4], [4, 4], [1e-3, 1e-3])
    assert m.plan(6, 100).meta["input_size"] == 6.0   # the fits are untouched
    with pytest.raises(ValueError, match="ChainEstimator.observe: input_size must be a positive"):
        M.ChainEstimator(1, samples=3).observe(size, scheduler.Chain.random(1))


@pytest.mark.parametrize("field, kwargs, shown", [
    ("input_bytes", dict(input_bytes=math.inf), r"input_bytes\[0\]=inf"),
    ("xbar", dict(xbar=[1, math.nan]), r"xbar\[1\]=nan"),
    ("fw", dict(fw=[1e-3, 10 ** 400]), r"fw\[1\]=1000+\.\.\."),
    ("out", dict(out=[1, "x"]), r"out\[1\]='x'"),
    ("tail", dict(tail=[1, 1, math.inf, 1, 1]), r"tail\[2\]=inf"),
    ("outside", dict(outside=[math.nan, 0]), r"outside\[0\]=nan"),
    ("tmp", dict(tmp={"fw_tmp": [1, 1], "bw_tmp": [1, math.inf], "fck_tmp": [1, 1]}),
     r"tmp\['bw_tmp'\]\[1\]=inf"),
])
def test_observe_names_the_measurement_that_is_not_finite(field, kwargs, shown):
    args = dict(input_size=4, input_bytes=10, xbar=[4, 4], out=[4, 4], fw=[1e-3, 1e-3])
    args.update(kwargs)
    with pytest.raises(ValueError, match=r"Estimator\.observe: measurements at input size 4 "
                                         r"must be finite, .*; got " + shown):
        M.Estimator(2, samples=3).observe(**args)


def test_plan_far_beyond_the_fit_or_past_a_float_says_so():
    m = _three_sizes()
    # (was "cannot convert float NaN to integer": the fit's powers overflowed)
    with pytest.raises(ValueError, match=r"Estimator: the fit is not finite at input size "
                                         r"1e\+160, far beyond the sizes observed \(1 to 3\)"):
        m.plan(1e160, 1e300)
    # (were OverflowError: int too large to convert to float)
    with pytest.raises(ValueError, match=r"Mimose\.plan: budget must be a positive number of "
                                         r"bytes .* got 1000+\.\.\."):
        m.plan(5, 10 ** 400)
    with pytest.raises(ValueError, match=r"Mimose\.plan: input_size must be a positive number"):
        m.plan(10 ** 400, 100)
    assert m.plan(5, 100).meta["input_size"] == 5.0


# ------------------------------------------------------------------------ wrap(mimose)
SEQ = [8, 12, 16, 20, 24, 28, 32, 36, 40, 44]   # the 10 collection sizes


def trained(budget, blocks=None, ref=None, check=True):
    """A mimose-wrapped transformer after the 10 collection steps (checking each against plain
    training when ``ref`` is given)."""
    if blocks is None:
        blocks, ref = twins(lambda: transformer_blocks(3, D))
    model = scheduler.wrap(blocks, budget, planner="mimose", track_memory=True)
    for i, s in enumerate(SEQ):
        ids = token_batch(BATCH, s, seed=i)
        got = wrapped_step(model, (ids,), seed=i)
        if ref is not None and check:
            for b in ref:
                b.zero_grad(set_to_none=True)
            exp = plain_step(ref, (ids,), seed=i)
            assert torch.equal(got[0], exp[0]) and all(
                torch.equal(a, b) for a, b in zip(got[1], exp[1])), f"collection step {i}"
    return model, blocks, ref


def test_collection_then_plans_match_plain_training_and_fit_the_budget():
    budget = 700_000  # no recomputation needed below seq ~35, every block at seq ~72
    model, blocks, ref = trained(budget)
    assert model.mimose.ready and model.stats()["mimose_collections"] == 10
    for i, s in enumerate([48, 16, 60, 8, 48]):
        ids = token_batch(BATCH, s, seed=100 + i)
        got = wrapped_step(model, (ids,), seed=i)
        for b in ref:
            b.zero_grad(set_to_none=True)
        exp = plain_step(ref, (ids,), seed=i)
        assert torch.equal(got[0], exp[0]) and all(torch.equal(a, b) for a, b in zip(got[1], exp[1]))
        plan = model.last_plan
        assert plan.planner == "mimose"
        peak = model.stats()["last_peak_bytes"]
        assert peak <= budget
        assert peak <= plan.predicted_peak * 1.01  # prediction from the fit, within 1%
    ck = {s: len(model.mimose.plan(BATCH * s, budget).meta["checkpointed"]) for s in (8, 48, 60)}
    assert ck[8] == 0 and 0 < ck[48] <= ck[60]  # small inputs run without recomputation


def test_estimator_error_below_one_percent_after_ten_samples():
    model, blocks, _ = trained(None)
    est = model.mimose.estimator
    assert len(est.sizes) == 10
    # the truth for unseen lengths: measure them with a fresh collector
    probe = scheduler.wrap(blocks, None, planner="mimose", samples=50)
    for i, s in enumerate([10, 50, 64, 80]):
        ids = token_batch(BATCH, s, seed=200 + i)
        wrapped_step(probe, (ids,), seed=i)
        truth = probe.mimose.estimator.measured(ids.numel())
        assert est.relative_error(ids.numel(), truth.xbar) < 0.01
        pred = est.predict(ids.numel())
        for p, t in zip(pred, truth.xbar):
            assert abs(p - t) <= 0.01 * t
    # the attention blocks really are quadratic: a straight line would miss
    lin = M.Estimator(len(blocks), samples=10, order=1)
    for s in est.sizes:
        m = est.measured(s)
        lin.observe(s, m.input_bytes, m.xbar, m.out, m.fw)
    assert lin.relative_error(BATCH * 80, probe.mimose.estimator.measured(BATCH * 80).xbar) > 0.01


def test_plan_cache_hits_for_repeated_sizes():
    model, _, _ = trained(700_000)
    before = model.mimose.cache.stats()
    for s in [48, 16, 48, 48, 16, 52]:
        wrapped_step(model, (token_batch(BATCH, s),))
    after = model.mimose.cache.stats()
    assert after["misses"] - before["misses"] == 3     # 48, 16, 52
    assert after["hits"] - before["hits"] == 3
    assert model.stats()["hits"] == after["hits"]


def test_infeasible_budget_raises_with_the_minimum():
    model, _, _ = trained(300_000, check=False)
    wrapped_step(model, (token_batch(BATCH, 200),))  # beyond the fit's reach: collected first
    with pytest.raises(InfeasibleError) as e:
        wrapped_step(model, (token_batch(BATCH, 200),))
    assert e.value.min_memory > 300_000
    # the minimum it names is enough
    model.budget = int(e.value.min_memory)
    wrapped_step(model, (token_batch(BATCH, 200),))
    assert model.last_plan.predicted_peak <= e.value.min_memory


def test_plan_is_simulator_valid_and_prediction_agrees():
    model, _, _ = trained(700_000, check=False)
    for s in (30, 50, 64):
        plan = model.mimose.plan(BATCH * s, 700_000)
        res = simulate(plan.chain, plan)
        assert res.peak_memory == plan.predicted_peak <= 700_000
        assert res.makespan == pytest.approx(plan.predicted_time)


def test_shared_planner_instance_and_budget_change():
    m = M.Mimose(5)
    blocks, _ = twins(lambda: transformer_blocks(3, D))
    model = scheduler.wrap(blocks, "1MiB", planner="mimose", mimose=m)
    for i, s in enumerate(SEQ):
        wrapped_step(model, (token_batch(BATCH, s, seed=i),))
    assert m.ready and m.estimate_activation_bytes(BATCH * 64) > 0
    p1 = model.plan_for(token_batch(BATCH, 64))
    model.budget = 600_000
    p2 = model.plan_for(token_batch(BATCH, 64))
    assert len(p2.meta["checkpointed"]) > len(p1.meta["checkpointed"])
    with pytest.raises(ValueError, match="mimose="):
        scheduler.wrap(blocks, "1MiB", planner="mimose", mimose=M.Mimose(3))


@settings(max_examples=60, deadline=None)
@given(L=st.integers(2, 8), per_block=st.integers(1_000, 100_000), frac=st.floats(0.0, 1.0))
def test_the_simulator_check_finds_the_fewest_equal_blocks_that_fit(L, per_block, frac):
    """Equal blocks: Algorithm 1 checkpoints them in forward order, so the plans it can make
    are the first k blocks; the best that fits is the smallest k whose peak is within the
    budget. Where Algorithm 1's first plan was over the budget on the simulator, its target
    went down by the excess each round and often did not reach the next k within the rounds:
    every block was checkpointed (a new user's Llama: all 4 blocks where 3 fit)."""
    from scheduler.simulate import simulate_checkpointed
    m = M.Mimose(L, samples=3)
    for n in (10, 20, 30):   # the bytes linear in the size
        m.observe(n, 4 * n, [per_block * n / 10] * L, [per_block * n / 40] * L, [1e-3] * L)
    chain = M.chain_from_estimate(m.estimator.measured(20))
    peaks = [simulate_checkpointed(chain, range(k))[1] for k in range(L + 1)]
    budget = int(peaks[L] + frac * (peaks[0] - peaks[L])) + 1
    fewest = next(k for k in range(L + 1) if peaks[k] <= budget)
    plan = m.plan(20, budget)
    assert plan.predicted_peak <= budget
    assert len(plan.meta["checkpointed"]) == fewest, (peaks, budget)


def _papers_tightening(m, est, chain, budget):
    """The reference: Algorithm 1's target down by the simulated excess each round, the
    first plan that fits (else every block checkpointed), as Mimose planned before."""
    from scheduler.simulate import simulate_checkpointed
    target = budget - est.input_bytes
    for _ in range(m.rounds):
        ck = M.greedy_checkpoints(est.xbar, target, m.bucket_ratio)
        time, peak = simulate_checkpointed(chain, ck)
        if peak <= budget:
            return time
        if len(ck) == m.n:
            break
        target -= peak - budget
    time, peak = simulate_checkpointed(chain, range(m.n))
    return time if peak <= budget else None


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(1_000, 100_000), min_size=2, max_size=9),
       rounds=st.sampled_from([1, 2, 3, 8]), ratio=st.sampled_from([0.0, 0.1, 0.3]),
       frac=st.floats(0.0, 1.1))
def test_the_plan_is_never_slower_than_the_papers_tightening(sizes, rounds, ratio, frac):
    """Unequal blocks, any rounds and bucket ratio: the plan fits the budget on the simulator,
    is feasible exactly where the paper's tightening is, and is never slower than it (it
    tries the paper's targets first, then searches on, keeping the fastest that fits)."""
    from scheduler.simulate import simulate_checkpointed
    L = len(sizes)
    m = M.Mimose(L, samples=3, rounds=rounds, bucket_ratio=ratio)
    for n in (10, 20, 30):
        m.observe(n, 4 * n, [x * n / 10 for x in sizes], [x * n / 80 for x in sizes],
                  [1e-3 * (1 + i % 3) for i in range(L)])
    est = m.estimator.measured(20)
    chain = M.chain_from_estimate(est)
    lo, hi = simulate_checkpointed(chain, range(L))[1], simulate_checkpointed(chain, ())[1]
    budget = lo + frac * (hi - lo)
    reference = _papers_tightening(m, est, chain, budget)
    if reference is None:
        with pytest.raises(InfeasibleError):
            m.plan(20, budget)
        return
    plan = m.plan(20, budget)
    assert plan.predicted_peak <= budget
    assert plan.predicted_time <= reference * (1 + 1e-12)
