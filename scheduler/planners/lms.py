"""Large Model Support (Le et al., 2019): the fixed-distance swap rule, seed 003's baseline.

Seed 003, section 2: LMS swaps out a variable used at ``f_i`` when the next function using it,
``f_j``, is at distance ``d(f_i, f_j) >= swapout_threshold`` and swaps it back in right before
``f_k`` with ``d(f_k, f_j) = swapin_ahead``, ``k < j``. (The converted text reads
"``d(f_i, f) <= SwapOut threshold``"; that would swap out exactly the tensors needed soon, the
opposite of what LMS's documentation describes — "the number of topological levels a tensor's
consumer must be away from its producer for the tensor to be swapped" — so we read ``>=``.)

Distances are counted in steps of the variable sequence (one step per saved-tensor use), the
closest thing to graph hops that saved-tensor hooks can see. LMS has no memory budget: every
device copy is released once its copy completes (planned one step after the swap-out, never
blocking). As in the window planner, a variable whose next use is a forward pack is not swapped
out (the forward still holds it), and one never read again is left to autograd.
"""
from __future__ import annotations

from typing import List

from .swap_schedule import PACK, SwapSchedule, VariableSequence, record_replay

NAME = "lms"


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive number of steps, got {value!r}")
    return value


def schedule(sequence: VariableSequence, swapout_threshold: int,
             swapin_ahead: int) -> SwapSchedule:
    """Swap out after a use when the next use is ``>= swapout_threshold`` steps away; swap in
    ``swapin_ahead`` steps before that use (skipped when there is no room for both)."""
    swapout_threshold = _count("swapout_threshold", swapout_threshold)
    swapin_ahead = _count("swapin_ahead", swapin_ahead)
    n = len(sequence)
    sw_in: List[List[int]] = [[] for _ in range(n)]
    sw_out: List[List[int]] = [[] for _ in range(n)]
    rel: List[List[int]] = [[] for _ in range(n)]
    for i, used in enumerate(sequence.steps):
        for v in used:
            if sequence.free_after[v] == i:
                continue
            j = sequence.next_use(v, i)
            if j is None or sequence.phases[j] == PACK or j - i < swapout_threshold:
                continue
            k = j - swapin_ahead
            if k <= i + 1:  # the swap-in would come before the release: nothing to gain
                continue
            sw_out[i].append(v)
            rel[i + 1].append(v)
            sw_in[k].append(v)
    result = SwapSchedule(tuple(map(tuple, sw_in)), tuple(map(tuple, sw_out)),
                          tuple(map(tuple, rel)), blocking_release=False, planner=NAME,
                          meta={"swapout_threshold": swapout_threshold,
                                "swapin_ahead": swapin_ahead})
    return record_replay(sequence, result)  # (also validates the schedule)
