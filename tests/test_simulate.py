"""The simulator on hand-computed cases: every op kind, transfers, Lemma 1 idle times, errors."""
import gzip
import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from scheduler import Chain, InvalidPlanError, Plan, simulate

# distinct primes so every sum below identifies what is in memory
C = Chain(fw=[1, 2, 3], bw=[2, 3, 4], x=[5, 7, 11], xbar=[13, 17, 19], delta=[23, 29, 31],
          fw_tmp=[1, 2, 3], bw_tmp=[4, 5, 6], name="primes")


def store_all(chain: Chain) -> Plan:
    L = chain.L
    return Plan([("F_all", s) for s in range(L + 1)] + [("B", s) for s in range(L, -1, -1)])


def replay_peak(trace) -> int:
    cur = best = 0
    live = {}
    for e in trace["events"]:
        if e["action"] == "alloc":
            assert e["id"] not in live
            live[e["id"]] = e["size"]
            cur += e["size"]
        else:
            assert live.pop(e["id"]) == e["size"]
            cur -= e["size"]
        best = max(best, cur)
    return best


def test_checkpoint_ops_hand_computed():
    # F_ck keeps its input, F_none frees it, F_all on xbar[s-1], B frees per Table 1
    p = Plan([("F_ck", 0), ("F_none", 1), ("F_all", 2), ("B", 2), ("F_all", 0), ("F_all", 1),
              ("B", 1), ("B", 0)])
    r = simulate(C, p)
    # (peak during, memory after) worked out by hand from DESIGN.md's rules
    expect = [(5 + 7 + 1, 5 + 7),                 # F_ck 0: x0 kept, + x1, + fw_tmp
              (12 + 11 + 2, 5 + 11),              # F_none 1: + x2, then x1 freed
              (16 + 19 + 3, 35),                  # F_all 2: + xbar2
              (35 + 31 + 6, 5 + 31),              # B 2 (loss): + delta2, frees xbar2 and x2
              (36 + 13 + 1, 49),                  # F_all 0: + xbar0 (holds x1)
              (49 + 17 + 2, 66),                  # F_all 1 reads xbar0: + xbar1
              (66 + 29 + 5, 5 + 13 + 29),         # B 1: frees xbar1, delta2; input xbar0 kept
              (47 + 23 + 4, 23)]                  # B 0: frees xbar0, delta1, x0
    assert [(s.peak, s.memory_after) for s in r.steps] == expect
    assert r.peak_memory == 100 and r.peak_index == 6
    assert r.makespan == r.compute_time == 1 + 2 + 3 + 4 + 1 + 2 + 3 + 2
    assert r.idle_time == 0 and r.final_memory == 23
    assert [s.end for s in r.steps] == [1, 3, 6, 10, 11, 13, 16, 18]
    assert replay_peak(r.alloc_trace) == 100
    assert max(m for _, m in r.timeline) == 100


def test_forwards_that_keep_nothing_hold_fck_tmp():
    # F_ck / F_none hold fck_tmp (the no-grad forward's transient), F_all holds fw_tmp
    c = C.replace(fck_tmp=[100, 200, 300])
    p = Plan([("F_ck", 0), ("F_none", 1), ("F_all", 2), ("B", 2), ("F_all", 0), ("F_all", 1),
              ("B", 1), ("B", 0)])
    peaks = [s.peak for s in simulate(c, p).steps]
    base = [s.peak for s in simulate(C, p).steps]
    assert peaks[0] == base[0] - 1 + 100 and peaks[1] == base[1] - 2 + 200
    assert peaks[2:] == base[2:]
    assert simulate(C.replace(fck_tmp=C.fw_tmp), p).steps == simulate(C, p).steps


def test_store_all_and_x0_counts():
    r = simulate(C, store_all(C))
    # F_all 0,1,2 keep everything; the loss's backward is the peak
    assert r.steps[2].peak == 5 + 13 + 17 + 19 + 3
    assert r.steps[3].peak == 5 + 13 + 17 + 19 + 31 + 6
    assert r.makespan == C.total_compute()
    tiny = Chain(fw=[1], bw=[1], x=[9], xbar=[1], delta=[2])
    r = simulate(tiny, Plan([("F_all", 0), ("B", 0)]))
    assert r.peak_memory == 9 + 1 + 2 and r.final_memory == 2


def test_offload_prefetch_overlap_and_prefetch_idle():
    p = Plan([("F_all", 0), ("offload", 1), ("F_all", 1), ("F_all", 2), ("B", 2),
              ("prefetch", 1), ("B", 1), ("B", 0)])
    # bandwidth 13: xbar[0] (13) moves in 1 s; the offload overlaps F_all 1 (t 1..2), the
    # prefetch is issued when B 2 ends (t=10) and B 1 waits for it until t=11
    r = simulate(C, p, bandwidth=13)
    off, pre, b1 = r.steps[1], r.steps[5], r.steps[6]
    assert (off.start, off.end, off.item) == (1, 2, "xbar[0]")
    assert r.steps[2].peak == 5 + 13 + 17 + 2       # xbar0 still counts while in flight
    assert r.steps[2].memory_after == 5 + 17         # ... and is gone once the copy is done
    assert (pre.start, pre.end) == (10, 11) and pre.memory_after == 5 + 31 + 17 + 13
    assert (b1.start, b1.wait) == (11, 1)
    assert r.makespan == 16 and r.idle_time == 1 and r.compute_time == 15
    assert r.transfer_time == 2
    # slow link: the offload (6.5 s) is still in flight during B 2
    r = simulate(C, p, bandwidth=2)
    assert r.steps[4].peak == 5 + 13 + 17 + 19 + 31 + 6
    assert r.steps[5].start == 10 and r.steps[5].end == 16.5 and r.idle_time == 6.5
    # infinitely fast: no idle, and xbar0 is gone before F_all 1 allocates
    r = simulate(C, p, bandwidth=math.inf)
    assert r.idle_time == 0 and r.steps[2].peak == 5 + 17 + 2
    # the trace has the prefetch buffer on the transfer stream
    assert any(e["stream"] == 1 and e["action"] == "alloc" for e in r.alloc_trace["events"])
    assert replay_peak(simulate(C, p, bandwidth=2).alloc_trace) == simulate(C, p, bandwidth=2).peak_memory


def test_channel_is_fifo_one_transfer_at_a_time():
    c = Chain(fw=[1, 1, 1, 1], bw=[1, 1, 1, 1], x=[4, 4, 4, 4], xbar=[4, 4, 4, 4],
              delta=[1, 1, 1, 1])
    p = Plan([("F_ck", 0), ("offload", 1), ("F_ck", 1), ("offload", 2), ("F_ck", 2),
              ("F_all", 3), ("B", 3), ("prefetch", 2), ("prefetch", 1),
              ("F_all", 2), ("B", 2), ("F_all", 1), ("B", 1), ("F_all", 0), ("B", 0)])
    r = simulate(c, p, bandwidth=1)   # each transfer takes 4 s
    o1, o2, p2, p1 = (r.steps[i] for i in (1, 3, 7, 8))
    assert (o1.start, o1.end) == (1, 5)
    assert (o2.start, o2.end) == (5, 9) and o2.wait == 3    # issued at t=2, channel busy
    # F_ck 1 and F_ck 2 read x1 / x2 while their copies are in flight (allowed)
    assert r.steps[6].end == 5                              # B 3 ends at 5: prefetches issued
    assert (p2.start, p2.end) == (9, 13) and (p1.start, p1.end) == (13, 17)
    assert r.steps[9].start == 13 and r.steps[11].start == 17
    assert r.makespan == 17 + 1 + 1 + 1 + 1
    assert r.idle_time == r.makespan - r.compute_time == 21 - 11


def test_lemma1_offload_idle_under_a_memory_limit():
    # x0 (2) + xbar0 (4) stored; xbar0 is offloaded at beta = 2 (t = 1..3); F_all 1 needs 4.
    c = Chain(fw=[1, 1, 1], bw=[1, 1, 1], x=[2, 1, 1], xbar=[4, 4, 1], delta=[1, 1, 1])
    ops = Plan([("F_all", 0), ("offload", 1), ("F_all", 1)])
    # M = 10: fits on top of the in-flight xbar0, no wait
    r = simulate(c, ops, bandwidth=2, memory=10, complete=False)
    assert r.steps[2].start == 1 and r.steps[2].wait == 0 and r.peak_memory == 10
    assert r.makespan == 3 and r.idle_time == 1   # the trailing copy counts in the makespan
    # M = 6 or 8: F_all 1 fits only once xbar0 is gone, but xbar0 holds its input x[1]:
    # the op would read an item the completed copy has freed (issue 5 fix), so the plan is
    # invalid (offload an earlier item instead; Lemma 1 idle: test_offload_idle_over_a_sequence)
    for M in (6, 8):
        with pytest.raises(InvalidPlanError, match="copy completed"):
            simulate(c, ops, bandwidth=2, memory=M, complete=False)
    # without a limit nothing waits, the peak is just reported
    r = simulate(c, ops, bandwidth=2, complete=False)
    assert r.steps[2].wait == 0 and r.peak_memory == 2 + 4 + 4


def test_offload_idle_over_a_sequence():
    # a forward of F_none while x0 (size 8) is offloaded at beta = 1 (t = 0..8): the F_none
    # ops fit beside x0; the loss's F_all (xbar 3 on top of x0 + x4 = 9) does not fit under
    # M = 10 until x0's copy completes at t = 8, i.e. idle 8 - d_o with d_o = 4 s of compute
    L = 4
    c = Chain(fw=[1] * (L + 1), bw=[1] * (L + 1), x=[8, 1, 1, 1, 1], xbar=[1, 1, 1, 1, 3],
              delta=[1] * (L + 1))
    ops = Plan([("offload", 0), ("F_ck", 0)] + [("F_none", s) for s in range(1, L)]
               + [("F_all", L)])
    r = simulate(c, ops, bandwidth=1, memory=12, complete=False)
    assert [st.wait for st in r.steps if st.kind != "offload"] == [0] * (L + 1)
    r = simulate(c, ops, bandwidth=1, memory=10, complete=False)
    assert r.steps[-1].start == 8 and r.steps[-1].wait == 8 - L and r.idle_time == 8 - L
    assert r.peak_memory <= 10


def test_prefetch_waits_for_memory_then_compute_waits_for_prefetch():
    c = Chain(fw=[1, 1, 1], bw=[1, 1, 1], x=[1, 1, 1], xbar=[4, 4, 4], delta=[1, 1, 1])
    p = Plan([("F_all", 0), ("offload", 1), ("F_all", 1), ("F_all", 2), ("prefetch", 1),
              ("B", 2), ("B", 1), ("B", 0)])
    # unlimited: offload t = 1..3, the prefetch is issued at 3 (F_all 2 done): 3..5; B 1 waits 1
    r = simulate(c, p, bandwidth=2)
    assert (r.steps[1].start, r.steps[1].end) == (1, 3)
    assert (r.steps[4].start, r.steps[4].end) == (3, 5)
    assert r.steps[6].start == 5 and r.idle_time == 1
    # M = 11: F_all 2 (+4 on x0 + in-flight xbar0 + xbar1 = 9) waits for the offload (t=3),
    # runs 3..4; then the prefetch (4 on 9) does not fit, B 2 (+1) does and frees xbar2 at 5;
    # the prefetch runs 5..7 and B 1 waits for it until 7
    r = simulate(c, p, bandwidth=2, memory=11)
    assert (r.steps[3].start, r.steps[3].wait) == (3, 1)
    assert r.steps[5].start == 4 and (r.steps[4].start, r.steps[4].end) == (5, 7)
    assert r.steps[6].start == 7 and r.idle_time == 1 + 2 and r.peak_memory == 11


@pytest.mark.parametrize("ops, match, index", [
    ([("B", 0)], r"op 0 \(B 0\): xbar\[0\] is not in memory", 0),
    ([("F_all", 1)], r"op 0 \(F_all 1\): its input is not in memory", 0),
    ([("F_all", 0), ("F_all", 1), ("F_all", 2), ("B", 2), ("B", 0)],
     r"op 4 \(B 0\): delta\[1\] is not in memory", 4),
    ([("F_all", 0), ("prefetch", 1)], r"op 1 \(prefetch 1\): nothing .* was offloaded", 1),
    ([("F_all", 0), ("F_all", 0)], r"op 1 \(F_all 0\): xbar\[0\] is already in memory", 1),
    ([("F_all", 5)], r"op 0 \(F_all 5\): stage 5 is out of range", 0),
    ([("F_all", 0), ("F_all", 1), ("F_all", 2), ("B", 2), ("B", 1)], r"ends before B 0", 5),
    ([("offload", 0), ("F_none", 0)], r"op 1 \(F_none 0\): x\[0\] was offloaded by op 0", 1),
])
def test_invalid_plans_name_the_op(ops, match, index):
    with pytest.raises(InvalidPlanError, match=match) as e:
        simulate(C, Plan(ops), bandwidth=1)
    assert e.value.index == index


def test_transfer_rules():
    p = Plan([("offload", 0), ("F_ck", 0)])
    with pytest.raises(InvalidPlanError, match="need a bandwidth"):
        simulate(C, p, complete=False)
    with pytest.raises(InvalidPlanError, match="bandwidth is 0"):
        simulate(C, p, bandwidth=0, complete=False)
    # reading an item whose copy finished before the op starts is an error
    with pytest.raises(InvalidPlanError, match=r"op 3 \(F_all 0\): x\[0\] was offloaded .* prefetch it first"):
        simulate(C, Plan([("F_ck", 0), ("offload", 0), ("F_ck", 1), ("F_all", 0)]),
                 bandwidth=100, complete=False)
    with pytest.raises(ValueError, match="bandwidth"):
        simulate(C, store_all(C), bandwidth=-1)
    assert simulate(C, store_all(C), bandwidth="12GB").bandwidth == 12e9
    # plans without transfers don't need (or care about) a bandwidth
    assert simulate(C, store_all(C), bandwidth=0).makespan == C.total_compute()
    with pytest.raises(InvalidPlanError, match="can never start"):
        simulate(C, store_all(C), memory=50)


def test_trace_json_roundtrip(tmp_path):
    p = Plan([("F_all", 0), ("offload", 1), ("F_all", 1), ("F_all", 2), ("B", 2),
              ("prefetch", 1), ("B", 1), ("B", 0)])
    r = simulate(C, p, bandwidth=13)
    path = tmp_path / "t.json.gz"
    r.trace_json(str(path))
    with gzip.open(path, "rt") as f:
        d = json.load(f)
    assert d["meta"]["source"] == "scheduler.simulate" and d["meta"]["units"]["size"] == "bytes"
    ev = d["events"]
    assert all(set(e) == {"action", "id", "size", "stream", "time"} for e in ev)
    assert [e["time"] for e in ev] == sorted(e["time"] for e in ev)
    live = {e["id"] for e in ev if e["action"] == "alloc"} - {e["id"] for e in ev if e["action"] == "free"}
    assert sorted(live) == d["meta"]["live_at_end"] and len(live) == 1   # delta[0]
    assert replay_peak(d) == r.peak_memory


def test_describe_shows_running_memory():
    text = store_all(C).describe(C)
    assert "F_all" in text and "mem" in text and len(text.splitlines()) == 7


@settings(max_examples=40, deadline=None)
@given(L=st.integers(0, 8), seed=st.integers(0, 10**6))
def test_store_all_properties(L, seed):
    c = Chain.random(L, seed)
    r = simulate(c, store_all(c))
    assert r.makespan == c.total_compute() and r.idle_time == 0
    assert r.peak_memory == replay_peak(r.alloc_trace) == max(m for _, m in r.timeline)
    # the loss's backward holds every xbar plus x0, delta[L] and its tmp
    assert r.steps[L + 1].peak == c.x[0] + sum(c.xbar) + c.delta[L] + c.bw_tmp[L]
    assert r.final_memory == c.delta[0]


@pytest.mark.parametrize("seed", range(3))
def test_every_persistent_sequence_is_consistent(seed):
    # all 90 persistent sequences of a 5-stage chain: the trace, the timeline and the steps
    # tell the same story, and time is the sum of the op times (no transfers: no idle)
    from _oracle import persistent_sequences
    c = Chain.random(4, seed=seed)
    for ops in persistent_sequences(0, c.L):
        r = simulate(c, Plan(list(ops)))
        assert r.idle_time == 0 and r.makespan == sum(
            c.fw[s] if k != "B" else c.bw[s] for k, s in ops)
        assert r.peak_memory == replay_peak(r.alloc_trace) == max(st.peak for st in r.steps)
        assert r.final_memory == c.delta[0] and r.alloc_trace["meta"]["live_at_end"] != []

