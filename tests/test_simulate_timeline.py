"""SimResult.timeline against peak_memory: a zero-length op's memory (its outputs and
transient, freed at the instant they are allocated) was merged away, so a timeline could
peak at 14 where peak_memory said 112."""
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Chain, Plan, simulate
from scheduler.plan import checkpoint_plan
from scheduler.planners import offload


def test_a_zero_length_ops_peak_is_in_the_timeline():
    c = Chain(fw=[1, 0], bw=[1, 1], x=[3, 2], xbar=[4, 5], delta=[3, 2], fw_tmp=[0, 100],
              bw_tmp=[0, 0])
    r = simulate(c, Plan([("F_all", 0), ("F_all", 1), ("B", 1), ("B", 0)]), memory=None)
    assert r.peak_memory == max(m for _, m in r.timeline) == 112
    # both points at t = 1: the peak, then what is held from then on
    assert r.timeline == [(0, 7), (1, 112), (1, 14), (2, 12), (3, 3)]


@st.composite
def chains(draw):
    L = draw(st.integers(0, 5))
    n = L + 1
    col = lambda hi: draw(st.lists(st.integers(0, hi), min_size=n, max_size=n))  # noqa: E731
    times = lambda: draw(st.lists(st.sampled_from([0, 0, 1, 2]), min_size=n, max_size=n))  # noqa
    x = col(10)
    return Chain(fw=times(), bw=times(), x=x, xbar=[max(v, x[s + 1]) if s < L else v
                                                   for s, v in enumerate(col(15))],
                 delta=col(10), fw_tmp=col(50), bw_tmp=col(50), fck_tmp=col(50))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(c=chains(), data=st.data())
def test_the_timelines_max_is_the_peak(c, data):
    """Checkpointing plans and GREEDY's offloading ones (zero-length ops and transfers): the
    timeline's max is peak_memory, its times never go back, and its last point (the last at
    its time: what is held from then on) is the memory held at the end."""
    ck = data.draw(st.sets(st.integers(0, max(0, c.L - 1)))) if c.L else set()
    plans = [(checkpoint_plan(c.L, ck), None)]
    bw = data.draw(st.sampled_from([0.5, 1.0, float("inf")]))
    M = data.draw(st.integers(offload.min_memory(c), max(offload.min_memory(c),
                                                          offload.peak_memory(c))))
    plans.append((offload.greedy(c, M, bw), bw))
    for plan, b in plans:
        r = simulate(c, plan, b, memory=None)
        times = [t for t, _ in r.timeline]
        assert times == sorted(times)
        assert max(m for _, m in r.timeline) == r.peak_memory
        assert r.timeline[-1][1] == dict(r.timeline)[times[-1]] == r.final_memory
