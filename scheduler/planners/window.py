"""The byte-window swap scheduler (seed 003, section 3, Figure 2 (a)-(d)). Pure Python.

Slide a window over the *uses* of the variable sequence: at step ``f_i`` the window covers the
uses ``v[l : r]`` where ``l`` is the first use of step ``i`` and ``r`` the last index with
``sum(b[v_l..v_r]) <= window`` (the paper sums sizes over uses, repeats included; we keep that).
At each step, in order:

(a) schedule a swap-in for every variable entering the window (``v[r_prev+1 : r]``) that is on
    the host (or whose swap-out is still in flight: then the swap-out is simply cancelled);
(b) if the variables on the device would exceed the budget, complete (release) the oldest
    swap-outs still in flight, oldest first, until they fit;
(c) after the step, schedule a swap-out for each variable it used, then move the window on;
(d) skipping variables never used again (autograd frees them) and variables whose next use is
    already inside the window (they would be swapped straight back in).

Where the paper leaves things open we chose, and say so here:

* (d) uses the window *after* it moves to ``f_{i+1}``: a variable whose next use enters the
  window at the next step would otherwise be swapped out and immediately back in.
* A variable whose next use is a *pack* (forward) is not swapped out: under PyTorch the forward
  itself still holds that tensor, so the copy would free nothing (the paper's framework owns all
  memory; ours only owns what autograd saves).
* (b) when the oldest swap-outs are not enough (budget tighter than the window assumed): drop the
  optional swap-ins of this step (furthest next use first) and retry them at later steps; as a
  last resort evict a variable not used by this step (furthest next use first, Belady) with a
  swap-out after the previous step. Any budget >= the bytes one step uses is then met.
* Without a budget the paper never needs to wait; we release each swap-out one step after it is
  issued (``blocking_release=False``: the runtime frees the device copy once the copy completes
  and never blocks for it).
* A budget the whole sequence fits in without swapping returns the empty schedule.
* The window is a look-ahead, not a cap (the budget is the cap): ``r[i]`` never ends before the
  step's own last use, so a window smaller than a tensor (even 0 or 1 byte) still admits the
  next use; it only cannot prefetch past it. ``schedule`` then warns (``WindowWarning``, naming
  the tensor's size and the window) and records the note in ``meta["window_note"]``.
"""
from __future__ import annotations

import bisect
from typing import Dict, List, Optional, Set

from vmalloc import user_warning
from vmalloc.sizes import SizeLike, format_size, parse_optional_size, parse_size

from ..errors import InfeasibleError
from .swap_schedule import (DEVICE, FREED, HOST, IN, OUT, PACK, UNBORN, SwapSchedule,
                            VariableSequence, record_replay, replay)

NAME = "window"


class WindowWarning(UserWarning):
    """The window is smaller than a saved tensor: no look-ahead past it (not an error)."""


def window_shortfall(sequence: VariableSequence, window: int) -> Optional[str]:
    """None if ``window`` holds the largest saved tensor, else a warning that says the sizes.

    A smaller window is not an error: the window is a look-ahead, not a cap (the budget is the
    cap). The step about to run is always inside its own window (``window_ends``), so such a
    window still admits the next use; it only cannot look further ahead past that tensor."""
    largest, var = sequence.largest_tensor()
    if window >= largest:
        return None
    return (f"window={window} bytes ({format_size(window)}) is smaller than a saved tensor of "
            f"{largest} bytes ({format_size(largest)}, variable {var}): the window still admits "
            f"each step's next use but cannot prefetch past it; use window >= {largest} to "
            f"look ahead")


def check_budget(sequence: VariableSequence, budget: int) -> None:
    """A budget must hold what one step uses at once (InfeasibleError with the numbers)."""
    need, step = sequence.min_budget()
    if budget < need:
        raise InfeasibleError(
            f"budget={budget} bytes is below what one step needs: step {step} "
            f"({'forward' if sequence.phases[step] == PACK else 'backward'}) uses {need} bytes "
            f"of saved tensors at once; use budget >= {need}", min_memory=need)


def window_ends(sequence: VariableSequence, window: int) -> List[int]:
    """``r[i]``: the last use index (in the flattened uses) inside the window at step ``i``.
    Never before the step's own last use, so every step's variables are inside its window."""
    prefix = [0]
    starts = []
    for s in sequence.steps:
        starts.append(len(prefix) - 1)
        for v in s:
            prefix.append(prefix[-1] + sequence.sizes[v])
    ends = []
    for i, lo in enumerate(starts):
        own_last = lo + len(sequence.steps[i]) - 1
        # largest r with prefix[r + 1] - prefix[lo] <= window
        r = bisect.bisect_right(prefix, prefix[lo] + window) - 2
        ends.append(max(r, own_last))
    return ends


def schedule(sequence: VariableSequence, window: SizeLike,
             budget: Optional[SizeLike] = None, warn: bool = True) -> SwapSchedule:
    """Plan swaps for ``sequence`` with a look-ahead ``window`` (bytes) under ``budget`` (bytes
    of saved tensors resident on the device; ``None``: no limit). See the module docstring.
    ``warn``: say so (``WindowWarning``) when the window is smaller than a saved tensor."""
    window = parse_size(window, "window")
    budget = parse_optional_size(budget, "budget")
    n = len(sequence)
    meta = {"window": window, "budget": budget}
    if n == 0:
        return SwapSchedule.empty(0, NAME, **meta)
    short = window_shortfall(sequence, window)
    if short is not None:
        meta["window_note"] = short
        if warn:
            user_warning.warn(short, WindowWarning)
    if budget is not None:
        check_budget(sequence, budget)
        plain = replay(sequence, SwapSchedule.empty(n))
        if plain.peak <= budget:
            return SwapSchedule.empty(n, NAME, predicted_peak=plain.peak,
                                      note="fits the budget without swapping", **meta)

    steps, sizes, phases, free_after = (sequence.steps, sequence.sizes, sequence.phases,
                                        sequence.free_after)
    nvars = len(sizes)
    ends = window_ends(sequence, window)
    # per variable: the steps using it and the flat (window) index of each of those uses
    use_steps = sequence.use_steps
    use_flat: List[List[int]] = [[] for _ in range(nvars)]
    flat_var: List[int] = []
    for s in steps:
        for v in s:
            use_flat[v].append(len(flat_var))
            flat_var.append(v)
    frees: List[List[int]] = [[] for _ in range(n)]
    for v, f in enumerate(free_after):
        frees[f].append(v)

    INF = len(flat_var)

    def next_flat(v: int, step: int) -> int:
        """Flat index of the first use of ``v`` after ``step`` (INF if none)."""
        k = bisect.bisect_right(use_steps[v], step)
        return use_flat[v][k] if k < len(use_flat[v]) else INF

    state = [UNBORN] * nvars
    has_host = [False] * nvars
    on_device: Set[int] = set()            # state device or in
    pending: Dict[int, None] = {}          # swap-outs in flight, oldest first
    deferred: Dict[int, None] = {}         # host variables inside the window, swap-in postponed
    natural: List[List[int]] = [[] for _ in range(n + 1)]
    sw_in: List[List[int]] = [[] for _ in range(n)]
    sw_out: List[List[int]] = [[] for _ in range(n)]
    rel: List[List[int]] = [[] for _ in range(n)]
    dev = 0
    prev_end = -1

    def to_host(v: int, i: int) -> None:
        nonlocal dev
        state[v] = HOST
        on_device.discard(v)
        dev -= sizes[v]
        if next_flat(v, i - 1) <= ends[i]:  # still wanted inside the window: retry later
            deferred[v] = None

    for i in range(n):
        used = steps[i]
        used_set = set(used)
        for v in natural[i]:  # no budget: the copy issued after step i-1 is done by now
            if state[v] == OUT:
                rel[i].append(v)
                del pending[v]
                to_host(v, i)
        # (a) swap-in for variables entering the window, postponed ones first
        want = sorted(deferred, key=lambda v: next_flat(v, i - 1))
        deferred.clear()
        want += [flat_var[k] for k in range(prev_end + 1, ends[i] + 1)]
        prev_end = max(prev_end, ends[i])
        optional: List[int] = []
        cancelled: Set[int] = set()
        seen: Set[int] = set()
        for v in want:
            if v in seen:
                continue
            seen.add(v)
            if state[v] == OUT:        # (d) swap-out still in flight: keep the device copy
                del pending[v]
                state[v] = DEVICE
                on_device.add(v)
                sw_in[i].append(v)
                cancelled.add(v)
            elif state[v] == HOST:
                state[v] = IN
                on_device.add(v)
                dev += sizes[v]
                sw_in[i].append(v)
                if v not in used_set:
                    optional.append(v)
        for v in used:
            if state[v] == UNBORN:
                state[v] = DEVICE
                on_device.add(v)
                dev += sizes[v]
        # (b) keep within the budget
        if budget is not None and dev > budget:
            for v in list(pending):  # complete the oldest swap-outs first
                if dev <= budget:
                    break
                del pending[v]
                rel[i].append(v)
                to_host(v, i)
            if dev > budget:  # postpone optional swap-ins, furthest use first
                optional.sort(key=lambda v: -next_flat(v, i - 1))
                for v in optional:
                    if dev <= budget:
                        break
                    sw_in[i].remove(v)
                    to_host(v, i)
                    deferred[v] = None
            if dev > budget and i > 0:  # last resort: evict, furthest next use first
                victims = sorted((v for v in on_device if v not in used_set),
                                 key=lambda v: (-next_flat(v, i - 1), v))
                for v in victims:
                    if dev <= budget:
                        break
                    if v in cancelled:  # it was in flight out: un-cancel, release now
                        sw_in[i].remove(v)
                    else:
                        sw_out[i - 1].append(v)
                        has_host[v] = True
                    rel[i].append(v)
                    to_host(v, i)
            if dev > budget:  # pragma: no cover - excluded by check_budget
                raise InfeasibleError(f"step {i}: {dev} bytes needed, budget {budget}", dev)
        for v in used:
            if state[v] == IN:
                state[v] = DEVICE
        # (c) swap-out after the step, with the skips of (d)
        end_next = ends[i + 1] if i + 1 < n else ends[i]
        for v in used:
            if free_after[v] == i:
                continue  # never used again: autograd frees it
            j = sequence.next_use(v, i)
            if j is None or phases[j] == PACK:
                continue  # not read again, or the forward still holds the tensor
            if next_flat(v, i) <= end_next:
                continue  # already reserved: its next use is inside the window
            sw_out[i].append(v)
            state[v] = OUT
            pending[v] = None
            has_host[v] = True
            if budget is None:
                natural[i + 1].append(v)
        for v in frees[i]:
            if state[v] in (DEVICE, OUT, IN):
                dev -= sizes[v]
            state[v] = FREED
            on_device.discard(v)
            pending.pop(v, None)
            deferred.pop(v, None)

    result = SwapSchedule(tuple(map(tuple, sw_in)), tuple(map(tuple, sw_out)),
                          tuple(map(tuple, rel)), blocking_release=budget is not None,
                          planner=NAME, meta=meta)
    return record_replay(sequence, result)  # (also validates the schedule)
