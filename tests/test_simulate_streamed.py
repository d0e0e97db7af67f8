"""Streamed transfers (Plan.transfer_chunk): an offload frees its item chunk by chunk, a
prefetch reserves it chunk by chunk; hand-computed cases, properties, and DYNPROG on them."""
import math
import os

import pytest
from hypothesis import given, settings, strategies as st

from scheduler import Chain, InvalidPlanError, Plan, simulate
from scheduler.planners import offload

from test_simulate import replay_peak

CHAINS = os.path.join(os.path.dirname(__file__), "..", "bench", "chains")


def _seq(chunk):
    # x0 (8) is offloaded at bandwidth 0.5 (16 s) while F_ck 0 and F_none 1..3 run (t 0..4);
    # the loss's F_all needs its xbar (3) on top of x4 (1) and what is left of x0
    c = Chain(fw=[1] * 5, bw=[1] * 5, x=[8, 1, 1, 1, 1], xbar=[1, 1, 1, 1, 3], delta=[1] * 5)
    ops = [("offload", 0), ("F_ck", 0)] + [("F_none", s) for s in (1, 2, 3)] + [("F_all", 4)]
    return c, Plan(ops, transfer_chunk=chunk)


@pytest.mark.parametrize("chunk, memory, start", [
    (None, 10, 16),    # whole: x0 is freed when its copy ends (seed 000's Lemma 1)
    (1, 10, 4),        # streamed: 2 of x0's 8 bytes are gone by t = 4: no wait at all
    # M = 9: F_none 1 (x0 + x1 + x2) waits for one chunk; F_all 4 for x0's rest to be <= 5
    (1, 9, 6),         # 1-byte chunks end at t = 2, 4, 6, ...: F_none 1..3 run 2..5
    (3, 9, 9),         # chunks 3, 3, 2 end at t = 6, 12, 16: F_none 1..3 run 6..9
    (4, 9, 11),        # chunks 4, 4 end at t = 8, 16: F_none 1..3 run 8..11
])
def test_offload_frees_chunk_by_chunk(chunk, memory, start):
    c, p = _seq(chunk)
    r = simulate(c, p, bandwidth=0.5, memory=memory, complete=False)
    assert r.steps[-1].start == start
    assert r.steps[0].end == 16 and r.makespan == max(16, start + 1)
    assert r.transfer_time == 16 and r.peak_memory <= memory
    assert replay_peak(r.alloc_trace) == r.peak_memory


def test_offload_timeline_steps_down():
    c, p = _seq(2)
    r = simulate(c, p, bandwidth=0.5, complete=False)
    held = dict(r.timeline)
    # 2-byte chunks take 4 s: x0 steps down 8 -> 6 -> 4 -> 2 while one x[s] (1) is held,
    # and xbar4 (3) joins from t = 4
    assert [held[t] for t in (4, 8, 12)] == [6 + 1 + 3, 4 + 1 + 3, 2 + 1 + 3]
    assert r.final_memory == 1 + 3          # x4 and xbar4 (no backward: complete=False)


def test_prefetch_reserves_chunk_by_chunk():
    c = Chain(fw=[1, 1, 1], bw=[1, 1, 1], x=[1, 1, 1], xbar=[4, 4, 4], delta=[1, 1, 1])
    ops = [("F_all", 0), ("offload", 1), ("F_all", 1), ("F_all", 2), ("prefetch", 1),
           ("B", 2), ("B", 1), ("B", 0)]
    # whole (test_simulate): F_all 2 waits for xbar0's copy to end (t = 3), the prefetch (4)
    # for B 2 to free xbar2 (t = 5), B 1 for the copy until 7: idle 3. Streamed in 1-byte
    # chunks (0.5 s each): xbar0 is half gone at t = 2, so F_all 2 runs 2..3; the first
    # prefetch chunk fits beside B 2 at t = 3, the second waits for B 2's end (t = 4), and
    # the copy is complete at 5.5: idle 1.5
    r = simulate(c, Plan(ops, transfer_chunk=1), bandwidth=2, memory=11)
    pre, b2, b1 = r.steps[4], r.steps[5], r.steps[6]
    assert r.steps[3].start == 2 and (pre.start, pre.end) == (3, 5.5) and b2.start == 3
    assert b1.start == 5.5 and r.idle_time == 1.5 and r.peak_memory == 11
    assert replay_peak(r.alloc_trace) == 11


def test_read_after_the_first_chunk_is_copied_is_invalid():
    # F_all 1 reads xbar0 (its input) but only fits once 2 of xbar0's chunks are copied:
    # part of its input would be gone, so the plan is refused (as with a whole copy)
    c = Chain(fw=[1, 1, 1], bw=[1, 1, 1], x=[2, 1, 1], xbar=[4, 4, 1], delta=[1, 1, 1])
    p = Plan([("F_all", 0), ("offload", 1), ("F_all", 1)], transfer_chunk=1)
    with pytest.raises(InvalidPlanError, match="began freeing it"):
        simulate(c, p, bandwidth=2, memory=8, complete=False)
    r = simulate(c, p, bandwidth=2, memory=10, complete=False)   # fits at once: allowed
    assert r.steps[2].start == 1


def test_a_chunk_that_never_fits_is_named():
    c = Chain(fw=[1, 1], bw=[1, 1], x=[4, 1], xbar=[1, 1], delta=[1, 2])
    # after B 1, xbar0 and delta1 (3) are held; x0 (4) comes back in two chunks of 2: the
    # first fits under 6, the second never does, and B 0 waits for the prefetch
    p = Plan([("offload", 0), ("F_all", 0), ("F_all", 1), ("B", 1), ("prefetch", 0),
              ("B", 0)], transfer_chunk=2)
    with pytest.raises(InvalidPlanError, match=r"op 4 \(prefetch 0\) can never copy its "
                                               r"chunk 2 of 2"):
        simulate(c, p, bandwidth=1, memory=6)
    assert simulate(c, p, bandwidth=1, memory=8).peak_memory == 8


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, True, "2MiB"])
def test_bad_chunk_is_named(bad):
    with pytest.raises(ValueError, match="transfer_chunk"):
        Plan([("F_all", 0), ("B", 0)], transfer_chunk=bad)


def test_json_roundtrip_keeps_the_chunk_and_old_plans_read_as_whole():
    p = Plan([("F_all", 0), ("B", 0)], transfer_chunk=4096)
    assert Plan.from_json(p.to_json()).transfer_chunk == 4096
    assert "transfer_chunk" not in Plan([("F_all", 0), ("B", 0)]).to_dict()
    assert Plan.from_dict({"ops": [["F_all", 0], ["B", 0]]}).transfer_chunk is None


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 7), seed=st.integers(0, 10**6), frac=st.floats(0, 1),
       chunk=st.integers(1, 40), data=st.data())
def test_streamed_plans_are_consistent(L, seed, frac, chunk, data):
    c = Chain.random(L, seed)
    lo, hi = offload.min_memory(c), offload.peak_memory(c)
    M = lo + frac * (hi - lo)
    act = offload.activations(c)
    chosen = data.draw(st.sets(st.sampled_from(range(L + 1))))
    beta = sum(act) / max(1e-9, c.total_compute())
    try:
        plan, sim = offload.schedule(c, sorted(chosen), M, beta, chunk=chunk)
    except InvalidPlanError:
        return
    assert plan.transfer_chunk == chunk
    r = simulate(c, plan, beta, memory=M)
    assert r.makespan == sim.makespan and r.peak_memory <= M * (1 + 1e-9)
    assert replay_peak(r.alloc_trace) == pytest.approx(r.peak_memory, abs=2 * len(plan))
    # a chunk as large as the largest item is a whole transfer
    whole = Plan(plan.ops, transfer_chunk=max(act) + 1)
    r1, r2 = simulate(c, whole, beta), simulate(c, Plan(plan.ops), beta)
    assert (r1.makespan, r1.peak_memory, r1.timeline) == (r2.makespan, r2.peak_memory,
                                                          r2.timeline)


def test_dynprog_streamed_reaches_its_relaxation_on_resnet18():
    # ResNet-18's 98 MB activations take most of a forward to copy: whole-activation plans
    # wait for memory the DP's relaxation already had (1.52 x the lower bound at 50%);
    # streamed, the plan is within 3% of the DP's own value
    chain = Chain.from_json(os.path.join(CHAINS, "resnet18-i224-b32.json"))
    lo, hi = offload.min_memory(chain), offload.peak_memory(chain)
    M, bw = (lo + hi) / 2, 12.2e9
    p = offload.dynprog(chain, M, bw, transfer_chunk="8MiB")
    whole = offload.dynprog(chain, M, bw)
    r = simulate(chain, p, bw)
    assert p.transfer_chunk == 8 << 20 and p.meta["transfer_chunk"] == 8 << 20
    assert r.makespan == p.predicted_time and r.peak_memory <= M
    assert p.predicted_time <= 1.03 * p.meta["relaxed_time"] < whole.predicted_time
    assert p.predicted_time <= 1.3 * offload.lower_bound(chain, M, bw)


def test_chain_runtime_refuses_streamed_transfers():
    from scheduler.runtime.compiled_plan import CompiledPlan
    ops = [("F_all", 0), ("offload", 1), ("F_all", 1), ("prefetch", 1), ("B", 1), ("B", 0)]
    with pytest.raises(InvalidPlanError, match="transfer_chunk=None"):
        CompiledPlan.of(Plan(ops, transfer_chunk=1 << 20), 1)
    CompiledPlan.of(Plan(ops), 1)
    CompiledPlan.of(Plan([("F_all", 0), ("F_all", 1), ("B", 1), ("B", 0)],
                         transfer_chunk=1 << 20), 1)   # no transfers: nothing to stream


def test_chunks_are_never_empty_and_their_count_is_bounded():
    from scheduler.simulate import MAX_CHUNKS, _chunks
    for size, chunk in ((8.4, 0.3), (1.0, 0.1), (0.7, 0.1), (1e5 + 0.5, 7.0)):
        got = _chunks(size, chunk, "t")
        assert all(0 < c <= chunk * (1 + 1e-12) for c in got), (size, chunk, got[-3:])
        assert sum(got) == pytest.approx(size, rel=1e-12)
    c = Chain(fw=[1, 1], bw=[1, 1], x=[1 << 30, 1], xbar=[1, 1], delta=[1, 1])
    p = Plan([("offload", 0), ("F_all", 0), ("F_all", 1), ("B", 1), ("prefetch", 0),
              ("B", 0)], transfer_chunk=1)
    with pytest.raises(ValueError, match=f"at most {MAX_CHUNKS}"):
        simulate(c, p, bandwidth=1)
