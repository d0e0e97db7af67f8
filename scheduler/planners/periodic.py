"""Periodic checkpointing: what ``torch.utils.checkpoint.checkpoint_sequential`` does.

``checkpoint_sequential(functions, segments, input)`` runs the first ``segments - 1``
segments of ``len(functions) // segments`` blocks each under ``checkpoint`` (forward without
saving, the segment's input kept) and the rest normally. Here the functions are stages
0..L-1 and the loss (stage L) is computed after the model, in the last segment. As a Plan:

* each checkpointed segment [a, b]: ``F_ck a, F_none a+1 .. b`` (keeps x[a], produces x[b+1]);
* the last segment and the loss: ``F_all`` each;
* backward: ``B`` over the last segment, then for each checkpointed segment from the last
  one: recompute ``F_all a .. b`` from x[a], then ``B b .. a``.

The prediction comes from the simulator (no memory model of its own). ``solve`` plans for
no limit (``memory_limit`` None); ``best`` records the limit it chose for.
"""
from __future__ import annotations

import numbers
from typing import List, Optional, Tuple

from ..chain import Chain
from ..errors import InfeasibleError
from ..plan import Plan
from ..simulate import simulate
from ..units import format_bytes
from .args import check_chain, memory_arg


def segments_of(L: int, segments: int) -> List[Tuple[int, int]]:
    """The (first, last) stages of each checkpointed segment, as checkpoint_sequential cuts them."""
    size = L // segments
    return [(start, start + size - 1) for start in range(0, size * (segments - 1), size)]


def solve(chain: Chain, segments: int) -> Plan:
    """The plan of ``checkpoint_sequential(stages 0..L-1, segments)`` followed by the loss."""
    L = check_chain(chain).L
    # any integer, numpy's included (as the planners' memory limits); never a bool
    if isinstance(segments, bool) or not isinstance(segments, numbers.Integral) or \
            not 1 <= segments <= max(L, 1):
        raise ValueError(f"segments: expected an int in 1..{max(L, 1)} (the chain has {L} stages "
                         f"before the loss), got {segments!r}")
    segments = int(segments)
    segs = segments_of(L, segments) if L else []
    ops: List[Tuple[str, int]] = []
    for a, b in segs:
        ops.append(("F_ck", a))
        ops.extend(("F_none", j) for j in range(a + 1, b + 1))
    rest = segs[-1][1] + 1 if segs else 0
    ops.extend(("F_all", j) for j in range(rest, L + 1))
    ops.extend(("B", j) for j in range(L, rest - 1, -1))
    for a, b in reversed(segs):
        ops.extend(("F_all", j) for j in range(a, b + 1))
        ops.extend(("B", j) for j in range(b, a - 1, -1))
    plan = Plan(ops, planner="periodic", chain=chain, meta={"segments": segments})
    r = simulate(chain, plan)
    plan.predicted_time, plan.predicted_peak = r.makespan, r.peak_memory
    return plan


def best(chain: Chain, memory: Optional[float] = None) -> Plan:
    """The fastest segment count whose peak fits ``memory`` (None: any): what a user tuning
    ``checkpoint_sequential``'s ``segments`` by hand would settle on. Raises
    ``InfeasibleError`` with the smallest peak any segment count reaches."""
    check_chain(chain)
    if memory is not None:
        memory = memory_arg(memory)
    plans = [solve(chain, k) for k in range(1, max(chain.L, 1) + 1)]
    fitting = [p for p in plans if memory is None or p.predicted_peak <= memory]
    if not fitting:
        lowest = min(p.predicted_peak for p in plans)
        raise InfeasibleError(f"periodic: no segment count fits memory {format_bytes(memory)}; "
                              f"the smallest peak is {format_bytes(lowest)}", lowest)
    plan = min(fitting, key=lambda p: (p.predicted_time, p.predicted_peak))
    plan.memory_limit = memory
    return plan
