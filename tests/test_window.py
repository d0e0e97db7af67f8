"""The byte-window scheduler (seed 003, Figure 2 (a)-(d)); memory is checked with the one
accounting function, ``replay``."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.errors import InfeasibleError
from scheduler.planners import window
from scheduler.planners.swap_schedule import (SwapSchedule, VariableSequence, random_sequence,
                                              replay)

# a chain of four activations: forward packs 0..3, backward unpacks 3..0
CHAIN = VariableSequence(steps=tuple((v,) for v in (0, 1, 2, 3, 3, 2, 1, 0)),
                         sizes=(4, 4, 4, 4), phases="FFFFBBBB")


def plain_peak(seq):
    return replay(seq, SwapSchedule.empty(len(seq))).peak


def test_figure2_on_a_chain_without_budget():
    s = window.schedule(CHAIN, window=8)  # the window holds two uses
    # (c) swap out after each forward use unless (d) the next use is inside the next window
    assert s.swap_out[:4] == ((0,), (1,), (2,), ())
    # no budget: each device copy is released one step later, without blocking
    assert s.release[1:4] == ((0,), (1,), (2,)) and not s.blocking_release
    # (a) swap in when the use enters the 8-byte window: one use ahead of the current one
    assert s.swap_in[4:7] == ((2,), (1,), (0,))
    r = replay(CHAIN, s)
    assert r.resident == (4, 4, 4, 4, 8, 8, 8, 4)  # a release comes before its step
    assert r.peak == 8 < plain_peak(CHAIN) == 16
    assert r.swapped_out_bytes == r.swapped_in_bytes == 12


def test_a_window_holding_everything_swaps_nothing():
    s = window.schedule(CHAIN, window="1KiB")
    assert s.counts() == {"swap_in": 0, "swap_out": 0, "release": 0}


def test_figure2b_budget_waits_for_the_oldest_swap_outs():
    s = window.schedule(CHAIN, window=4, budget=8)
    assert s.blocking_release
    r = replay(CHAIN, s)
    assert r.peak <= 8
    # swap-outs are released lazily, only when the budget needs room, oldest first
    releases = [v for step in s.release for v in step]
    assert releases[:2] == [0, 1]


def test_figure2d_skips_variables_never_used_again_and_forward_repacks():
    # 0 is packed twice in the forward (a skip connection), 1 is never unpacked
    seq = VariableSequence(steps=((0,), (1,), (0,), (2,), (2,), (0,)), sizes=(4, 4, 4),
                           phases="FFFFBB", free_after=(5, 5, 4))
    s = window.schedule(seq, window=4)
    assert 0 not in s.swap_out[0]   # next use is a forward pack: the forward still holds it
    assert 0 in s.swap_out[2]       # after its last forward use it goes
    assert all(1 not in step for step in s.swap_out)  # never read again
    assert all(2 not in step for step in s.swap_out)  # freed right after its last use
    replay(seq, s)


def test_budget_that_fits_everything_gives_the_empty_schedule():
    s = window.schedule(CHAIN, window=4, budget=plain_peak(CHAIN))
    assert s.counts()["swap_out"] == 0 and "without swapping" in s.meta["note"]


def test_errors_say_the_numbers():
    with pytest.warns(window.WindowWarning, match=r"window=3 bytes \(3 B\) is smaller than a "
                                                   r"saved tensor of 4 bytes"):
        s = window.schedule(CHAIN, window=3)
    replay(CHAIN, s)  # a valid schedule: the window still admits each step's next use
    with pytest.raises(InfeasibleError, match=r"budget=3 bytes is below what one step needs: "
                                              r"step 0 \(forward\) uses 4 bytes") as err:
        window.schedule(CHAIN, window=8, budget=3)
    assert err.value.min_memory == 4
    with pytest.raises(ValueError, match="window"):
        window.schedule(CHAIN, window="lots")
    with pytest.raises(ValueError, match="budget"):
        window.schedule(CHAIN, window=8, budget=-1)


def test_sizes_as_strings():
    seq = VariableSequence(steps=((0,), (0,)), sizes=(2 << 20,), phases="FB")
    assert len(window.schedule(seq, "2MiB", "4MiB")) == 2


def test_every_budget_from_the_minimum_to_the_plain_peak_is_met():
    """Exhaustive over budgets on small random sequences: the smallest budget the sequence
    reports is always enough, and the planner's own prediction is the replay's peak."""
    for seed in range(25):
        seq = random_sequence(8, seed=seed, max_size=6)
        low, _ = seq.min_budget()
        for budget in range(low, plain_peak(seq) + 1):
            for w in (seq.largest_tensor()[0], 12, 40):
                s = window.schedule(seq, w, budget)
                r = replay(seq, s)
                assert r.peak <= budget, (seed, budget, w)
                assert s.meta["predicted_peak"] == r.peak


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 30), st.integers(0, 10_000), st.integers(1, 50), st.integers(0, 60),
       st.booleans())
def test_random_sequences_stay_valid_and_under_budget(nvars, seed, extra_window, extra_budget,
                                                      with_budget):
    seq = random_sequence(nvars, seed=seed, max_size=20, reuse=0.4)
    w = seq.largest_tensor()[0] + extra_window
    budget = seq.min_budget()[0] + extra_budget if with_budget else None
    s = window.schedule(seq, w, budget)
    r = replay(seq, s)  # raises on any use of a tensor that is only on the host
    if budget is not None:
        assert r.peak <= budget
    # a swap-in only ever brings back what was swapped out
    assert r.swapped_in_bytes == 0 or r.swapped_out_bytes > 0


def test_larger_sequences_plan_quickly_enough_to_stay_out_of_the_way():
    seq = random_sequence(3000, seed=1, max_size=1 << 20)
    s = window.schedule(seq, window=8 << 20, budget=seq.min_budget()[0] * 4)
    assert replay(seq, s).peak <= seq.min_budget()[0] * 4


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 30), st.integers(0, 10_000), st.integers(0, 19), st.integers(0, 60),
       st.booleans())
def test_windows_smaller_than_a_tensor_still_plan_valid_schedules(nvars, seed, window_bytes,
                                                                  extra_budget, with_budget):
    # issue 13 item 2: never raises; the budget (not the window) is the cap
    seq = random_sequence(nvars, seed=seed, max_size=20, reuse=0.4)
    budget = seq.min_budget()[0] + extra_budget if with_budget else None
    s = window.schedule(seq, window_bytes, budget, warn=False)
    r = replay(seq, s)
    if budget is not None:
        assert r.peak <= budget
    assert s.meta["predicted_peak"] == r.peak
    assert ("window_note" in s.meta) == (window_bytes < seq.largest_tensor()[0])
