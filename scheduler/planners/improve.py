"""Our own improvement step (not in seeds 000 / 001): a local search over where a plan's
transfers sit, scored by the simulator.

The papers' DPs assume transfers that release / reserve memory continuously and prefetches
placed as late as possible; the simulator (and a GPU) moves whole activations on one FIFO
channel. Converting the DP's sequence to whole-activation transfers therefore leaves idle
time the DP did not see: a prefetch issued after the backward that precedes its consumer
(seed 001's ``prefetch 2`` after ``B 3``, so ``B 2`` waits for data), a prefetch that
reserves memory too early and blocks compute, an offload started too late to free memory
in time. No placement rule fixes all of these, so this step searches: it looks at the
compute ops that wait in the simulation (longest wait first), tries moving each transfer
issued near them earlier or later by 1, 2, 4, ... compute ops or exchanging it with the
next transfer (the channel's order), and keeps the move that
shortens the simulated makespan most, until no move helps or the evaluation budget is
spent. The compute and transfer ops stay the same (the peak stays under ``memory``, which
the simulator enforces), only their interleaving changes; the result is never slower than
its input.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..chain import Chain
from ..errors import InvalidPlanError
from ..plan import TRANSFER_KINDS, Op, Plan
from ..simulate import SimResult, simulate

SHIFTS = (-1, -2, -4, -8, -16, 1, 2, 4, 8)
SWAP = "swap"       # the move that exchanges a transfer with the next one on the channel
NEAR = 4            # transfers tried on each side of a waiting op (in plan order)
OP_BUDGET = 40_000  # simulated ops per search (~1 s on L = 107): keeps long chains' solves short


def default_budget(plan: Plan) -> int:
    """Simulations one search may spend: a few moves per transfer on small chains, bounded
    by :data:`OP_BUDGET` simulated ops on long ones. A count, not a clock, so the same
    inputs give the same plan on every machine (ranks must agree on plans)."""
    n = sum(1 for op in plan.ops if op.kind in TRANSFER_KINDS)
    return max(20, min(400, 40 + 12 * n, OP_BUDGET // max(1, len(plan.ops))))


def _move(ops: Sequence[Op], j: int, shift: int) -> Optional[List[Op]]:
    """``ops`` with the transfer at index j moved ``shift`` compute ops later (earlier if
    negative); None if it cannot move that far."""
    rest = list(ops[:j]) + list(ops[j + 1:])
    compute = [i for i, op in enumerate(rest) if op.kind not in TRANSFER_KINDS]
    # its position among compute ops: how many compute ops precede it
    k = sum(1 for op in ops[:j] if op.kind not in TRANSFER_KINDS)
    target = k + shift
    if target < 0 or target > len(compute) or shift == 0:
        return None
    # right before the compute op number `target` (after the transfers already there)
    at = compute[target] if target < len(compute) else len(rest)
    return rest[:at] + [ops[j]] + rest[at:]


def _swap(ops: Sequence[Op], j: int, transfers: Sequence[int]) -> Optional[List[Op]]:
    """``ops`` with the transfer at index j and the next transfer exchanged: the channel
    is FIFO, so this reorders the copies (None if j is the last transfer)."""
    k = transfers.index(j)
    if k + 1 >= len(transfers):
        return None
    j2 = transfers[k + 1]
    out = list(ops)
    out[j], out[j2] = out[j2], out[j]
    return out if out != list(ops) else None


def improve_transfers(chain: Chain, plan: Plan, memory: Optional[float],
                      bandwidth: Optional[float], budget: Optional[int] = None
                      ) -> Tuple[Plan, SimResult, int]:
    """The local search above. Returns ``(plan, its simulation, simulations spent)``; the
    plan is a new Plan with the same planner, meta and limit and the simulation's time and
    peak as its prediction (``plan`` itself is unchanged; returned as is without transfers).
    ``budget``: simulations at most (default :func:`default_budget`)."""
    ops = list(plan.ops)
    chunk = plan.transfer_chunk
    sim = simulate(chain, Plan(ops, transfer_chunk=chunk), bandwidth, memory=memory)
    if not plan.has_transfers:
        return plan, sim, 1
    budget = default_budget(plan) if budget is None else budget
    spent = 1
    tol = 1e-12 * max(1.0, sim.makespan)
    while spent < budget:
        waits = sorted(((st.wait, st.index) for st in sim.steps
                        if st.kind not in TRANSFER_KINDS and st.wait > tol), reverse=True)
        if not waits and sim.makespan > sim.steps[-1].end + tol:
            waits = [(0.0, len(ops) - 1)]   # trailing transfers: try the last ones
        moved = False
        tried = set()
        for _, i in waits:
            near = [j for j in range(len(ops)) if ops[j].kind in TRANSFER_KINDS]
            before = [j for j in near if j < i][-NEAR:]
            after = [j for j in near if j > i][:NEAR]
            best: Optional[Tuple[float, List[Op], SimResult]] = None
            for j in before + after:
                for shift in SHIFTS + (SWAP,):
                    if spent >= budget:
                        break
                    cand = _swap(ops, j, near) if shift is SWAP else _move(ops, j, shift)
                    if cand is None:
                        continue
                    key = tuple(cand)
                    if key in tried:
                        continue
                    tried.add(key)
                    spent += 1
                    try:
                        r = simulate(chain, Plan(cand, transfer_chunk=chunk), bandwidth,
                                     memory=memory)
                    except InvalidPlanError:
                        continue
                    if r.makespan < sim.makespan - tol and (best is None or r.makespan < best[0]):
                        best = (r.makespan, cand, r)
            if best is not None:
                ops, sim = best[1], best[2]
                moved = True
                break
            if spent >= budget:
                break
        if not moved:
            break
    out = Plan(ops, planner=plan.planner, predicted_time=sim.makespan,
               predicted_peak=sim.peak_memory, meta=dict(plan.meta),
               memory_limit=plan.memory_limit, chain=plan.chain, transfer_chunk=chunk)
    return out, sim, spent
