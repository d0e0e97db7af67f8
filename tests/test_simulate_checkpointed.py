"""``simulate_checkpointed``, the one-pass peak and makespan of a checkpoint plan (Mimose's
check per new input size), gives the very floats ``simulate`` gives on that plan: random
chains of ints and of floats (zero sizes, an x[L] held or not, xbar[s] below x[s+1]), and the
bundled measured chains."""
from __future__ import annotations

import glob
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Chain, simulate
from scheduler.plan import checkpoint_plan
from scheduler.simulate import simulate_checkpointed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def same(chain: Chain, checkpointed) -> None:
    res = simulate(chain, checkpoint_plan(chain.L, checkpointed))
    got = simulate_checkpointed(chain, checkpointed)
    want = (res.makespan, res.peak_memory)
    assert got == want, (chain.name, sorted(checkpointed), got, want)
    if chain.is_integer:   # integer sizes (and times) stay ints: exact past 2**53 too
        assert [type(v) for v in got] == [type(v) for v in want], (got, want)


@st.composite
def chains(draw):
    L = draw(st.integers(0, 8))
    n = L + 1
    num = st.floats(0, 1e9, allow_nan=False) if draw(st.booleans()) else \
        st.integers(0, 10**18)   # (past 2**53: exact as ints)
    col = st.lists(num, min_size=n, max_size=n)
    x = draw(col)
    # (xbar[s] below x[s+1] too: the model takes a chain as given)
    chain = Chain(fw=draw(col), bw=draw(col), x=x, xbar=draw(col), delta=draw(col),
                  fw_tmp=draw(col), bw_tmp=draw(col), fck_tmp=draw(col), name=f"drawn-L{L}")
    return chain, draw(st.sets(st.integers(0, max(L - 1, 0)), max_size=L) if L else st.just(set()))


@settings(max_examples=400, deadline=None)
@given(chains())
def test_random_chains(drawn):
    chain, checkpointed = drawn
    same(chain, checkpointed)


def test_bundled_chains():
    paths = sorted(glob.glob(os.path.join(ROOT, "bench", "chains", "*.json")))
    assert paths
    for path in paths:
        chain = Chain.from_json(path)
        L = chain.L
        for ck in ((), range(L), range(0, L, 2), range(1, L, 3), (L - 1,)):
            same(chain, list(ck))


def test_blocks_outside_the_chain_are_refused():
    chain = Chain.random(3, seed=1)
    for bad in ([3], [-1], [5], ["1"]):
        with pytest.raises(ValueError, match=r"simulate_checkpointed: checkpointed blocks .* not "
                                             r"in 0\.\.2"):
            simulate_checkpointed(chain, bad)
