"""Let the swap runtime follow offload plans (``offload.greedy`` / ``offload.dynprog``, seed 000).

The offload planners work on a ``Chain``; the swap runtime measures a ``VariableSequence``.
``chain_from_sequence`` builds the chain the planners see, ``schedule_from_plan`` turns their
``Plan`` back into a ``SwapSchedule`` on the same sequence. No torch here.

The mapping (stage ``s`` = the ``s``-th saved variable created in the forward, ``L`` = their
number, stage ``L`` = the loss):

* ``x[s]`` = bytes of variable ``s`` (what the offload planners move: "what is stored as the
  input of stage s"); ``xbar[s] = x[s+1]`` (each forward keeps the next saved variable), so the
  chain's stored memory after the forward is exactly the saved bytes; ``x[L] = xbar[L-1] = 0``.
* ``delta = fw_tmp = bw_tmp = 0``: the budget the runtime enforces counts saved tensors only.
* ``fw[s]``: measured time from variable ``s``'s creation to the next creation (the last stage
  up to the turn); ``fw[L]``: the turn from forward to backward (the loss); ``bw[s]``: measured
  time before the later backward steps that read variable ``s``. Without measured times, bytes / 1 GB/s (the seed 003 assumption that compute
  and transfers scale with bytes).

A real network is a DAG, not a chain, so the chain is an approximation; the schedule the plan
turns into is validated by ``replay`` on the true sequence, which is what the runtime executes.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..chain import Chain
from ..plan import TRANSFER_KINDS, Plan
from .swap_schedule import (PACK, UNPACK, SwapSchedule, VariableSequence,
                            record_replay)

BYTES_PER_SECOND_IF_UNTIMED = 1e9


def stage_variables(sequence: VariableSequence) -> List[int]:
    """The saved variables in order of creation by the forward: stage ``s`` is ``result[s]``."""
    seen = set()
    order = []
    for s, phase in zip(sequence.steps, sequence.phases):
        if phase != PACK:
            continue
        for v in s:
            if v not in seen:
                seen.add(v)
                order.append(v)
    return order


def chain_from_sequence(sequence: VariableSequence) -> Tuple[Chain, List[int]]:
    """``(chain, stage_vars)``: the chain the offload planners see, and the variable of each
    stage (``stage_vars[s]``; the loss stage ``L`` has none)."""
    stage_vars = stage_variables(sequence)
    L = len(stage_vars)
    if L == 0:
        raise ValueError("chain_from_sequence: the sequence saves nothing in the forward")
    stage_of = {v: s for s, v in enumerate(stage_vars)}
    created = {}
    for i, s in enumerate(sequence.steps):
        for v in s:
            created.setdefault(v, i)
    times = sequence.times or tuple(sequence.step_bytes(i) / BYTES_PER_SECOND_IF_UNTIMED
                                    for i in range(len(sequence)))
    first_b = next((i for i, p in enumerate(sequence.phases) if p == UNPACK), len(sequence))
    # times[i] is the time before step i: the forward of stage s runs from its creation to the
    # next creation; the step that turns to the backward carries the loss (stage L); the time
    # before each later backward step goes to the stage whose variable it reads
    starts = [created[v] for v in stage_vars] + [first_b - 1]
    fw = [float(sum(times[starts[s] + 1: starts[s + 1] + 1])) for s in range(L)]
    fw.append(float(times[first_b]) if first_b < len(sequence) else 0.0)
    bw = [0.0] * (L + 1)
    for i in range(first_b + 1, len(sequence)):
        stages = [stage_of[v] for v in sequence.steps[i] if v in stage_of]
        bw[min(stages) if stages else L] += times[i]
    x = [sequence.sizes[v] for v in stage_vars] + [0]
    xbar = x[1:L] + [0, 0]
    zeros = [0] * (L + 1)
    chain = Chain(fw=fw, bw=bw, x=x, xbar=xbar, delta=zeros, fw_tmp=zeros, bw_tmp=zeros,
                  name="swap-sequence", meta={"stage_vars": list(stage_vars)})
    return chain, stage_vars


def _compute_steps(sequence: VariableSequence, stage_vars: Sequence[int]) -> Dict[Tuple[str, int], int]:
    """The sequence step each compute op of a plan stands for: ``F_* s`` = the step creating
    variable ``s``; ``B s`` = the last backward step using it (its last use if none); the loss
    ``B L`` = the first backward step."""
    steps: Dict[Tuple[str, int], int] = {}
    L = len(stage_vars)
    first_b = next((i for i, p in enumerate(sequence.phases) if p == UNPACK), len(sequence) - 1)
    for s, v in enumerate(stage_vars):
        uses = sequence.use_steps[v]
        steps[("F", s)] = uses[0]
        back = [i for i in uses if sequence.phases[i] == UNPACK]
        steps[("B", s)] = back[-1] if back else uses[-1]
    steps[("F", L)] = max(first_b - 1, 0)
    steps[("B", L)] = first_b
    return steps


def schedule_from_plan(sequence: VariableSequence, plan: Plan,
                       stage_vars: Optional[Sequence[int]] = None) -> SwapSchedule:
    """Follow ``plan``'s offload / prefetch decisions on ``sequence``.

    ``offload s`` after the compute op before it becomes a swap-out of variable ``s`` after that
    op's step, moved later to the variable's last use before its prefetch (a swap-out between two
    uses would make the second one wait); ``prefetch s`` becomes a swap-in before the step of the
    compute op after it (no later than the variable's next use). The device copy is released as
    soon as its copy completes (planned at the next step), which is the simulator's semantics
    ("memory freed when an offload completes"). Pairs left with no room between swap-out and
    swap-in are dropped. Recomputation ops (``F_ck``/``F_none``) are not executed by the swap
    runtime: only the transfers are followed.
    """
    if stage_vars is None:
        stage_vars = stage_variables(sequence)
    n = len(sequence)
    L = len(stage_vars)
    where = _compute_steps(sequence, stage_vars)
    ops = list(plan.ops)
    # the step of the compute op before / after each op position
    before: List[int] = []
    last = -1
    for op in ops:
        before.append(last)
        if op.kind not in TRANSFER_KINDS:
            last = where[("B" if op.kind == "B" else "F", min(op.stage, L))]
    after: List[int] = [n] * len(ops)
    nxt = n
    for idx in range(len(ops) - 1, -1, -1):
        after[idx] = nxt
        op = ops[idx]
        if op.kind not in TRANSFER_KINDS:
            nxt = where[("B" if op.kind == "B" else "F", min(op.stage, L))]
    pairs: Dict[int, List[List[Optional[int]]]] = {}
    for idx, op in enumerate(ops):
        if op.kind not in TRANSFER_KINDS or op.stage >= L:
            continue
        v = stage_vars[op.stage]
        if op.kind == "offload":
            pairs.setdefault(v, []).append([before[idx], None])
        elif v in pairs and pairs[v][-1][1] is None:
            pairs[v][-1][1] = after[idx]
    sw_in: List[List[int]] = [[] for _ in range(n)]
    sw_out: List[List[int]] = [[] for _ in range(n)]
    rel: List[List[int]] = [[] for _ in range(n)]
    busy_until = {}  # variable -> step of the last swap-in scheduled (pairs must not overlap)
    for v, ps in pairs.items():
        uses = sequence.use_steps[v]
        for out_at, in_before in ps:
            out_at = max(out_at, uses[0], busy_until.get(v, -1))
            if in_before is None:
                nu = sequence.next_use(v, out_at)
                in_before = nu if nu is not None else n
            # swap out after the last use before the swap-in, and in no later than the next use
            earlier = [u for u in uses if u < in_before]
            out_at = max(out_at, earlier[-1]) if earlier else out_at
            nu = sequence.next_use(v, out_at)
            if nu is None or sequence.phases[nu] == PACK or sequence.free_after[v] == out_at:
                continue
            in_before = min(in_before, nu)
            if in_before <= out_at + 1:
                continue
            sw_out[out_at].append(v)
            rel[out_at + 1].append(v)
            sw_in[in_before].append(v)
            busy_until[v] = in_before
    result = SwapSchedule(tuple(map(tuple, sw_in)), tuple(map(tuple, sw_out)),
                          tuple(map(tuple, rel)), blocking_release=False,
                          planner=plan.planner or "plan",
                          meta={"plan_predicted_time": plan.predicted_time,
                                "plan_predicted_peak": plan.predicted_peak})
    return record_replay(sequence, result)  # (also validates the schedule)
