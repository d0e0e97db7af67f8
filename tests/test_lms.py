"""LMS (Le et al.): swap out when the next use is far, swap in a fixed distance ahead."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.planners import lms
from scheduler.planners.swap_schedule import VariableSequence, random_sequence, replay

CHAIN = VariableSequence(steps=tuple((v,) for v in (0, 1, 2, 3, 3, 2, 1, 0)),
                         sizes=(4, 4, 4, 4), phases="FFFFBBBB")


def test_fixed_distances_on_a_chain():
    s = lms.schedule(CHAIN, swapout_threshold=3, swapin_ahead=1)
    # 0 is next used 7 steps later, 1 five, 2 three: all swapped out; 3 is used next step
    assert s.swap_out[:4] == ((0,), (1,), (2,), ())
    assert s.release[1:4] == ((0,), (1,), (2,))
    # swap in one step before each use
    assert s.swap_in[6] == (0,) and s.swap_in[5] == (1,) and s.swap_in[4] == (2,)
    r = replay(CHAIN, s)
    assert r.swapped_out_bytes == 12 and r.resident == (4, 4, 4, 4, 8, 8, 8, 4)


def test_threshold_and_ahead_trade_memory_for_transfers():
    far = lms.schedule(CHAIN, swapout_threshold=6, swapin_ahead=1)
    assert far.swap_out[:4] == ((0,), (), (), ())
    early = lms.schedule(CHAIN, swapout_threshold=3, swapin_ahead=4)
    # swapping 1 in 4 steps before its use at 6 leaves no room after its release: skipped
    assert replay(CHAIN, early).swapped_out_bytes < replay(
        CHAIN, lms.schedule(CHAIN, 3, 1)).swapped_out_bytes


@pytest.mark.parametrize("kw", [dict(swapout_threshold=0, swapin_ahead=1),
                                dict(swapout_threshold=1, swapin_ahead=-2),
                                dict(swapout_threshold=1.5, swapin_ahead=1)])
def test_bad_parameters_are_named(kw):
    bad = next(k for k in kw if not (isinstance(kw[k], int) and kw[k] >= 1))
    with pytest.raises(ValueError, match=bad):
        lms.schedule(CHAIN, **kw)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 30), st.integers(0, 10_000), st.integers(1, 8), st.integers(1, 8))
def test_distances_hold_on_random_sequences(nvars, seed, threshold, ahead):
    seq = random_sequence(nvars, seed=seed, reuse=0.4)
    s = lms.schedule(seq, threshold, ahead)
    replay(seq, s)  # valid: every use finds its tensor on the device
    for i, outs in enumerate(s.swap_out):
        for v in outs:
            j = seq.next_use(v, i)
            assert j - i >= threshold
            assert v in s.swap_in[j - ahead]
            assert v in s.release[i + 1]
