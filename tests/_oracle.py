"""Exhaustive oracle for the checkpointing planners: enumerate every valid persistent
sequence of a small chain and score each WITH THE SIMULATOR (no memory model here).

A persistent sequence for stages s..t (input of s stored, delta[t+1] stored) starts with
either F_all s (then a persistent sequence for s+1..t, then B s) or F_ck s followed by
F_none s+1..s'-1 for some s < s' <= t (then one for s'..t, then one for s..s'-1): the
definition of seed 002 section 4.2 (any checkpoint is kept until its backward). The
count grows like 1, 2, 6, 22, 90, 394, 1806 for 1..7 stages.
"""
from __future__ import annotations

import itertools
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from scheduler import Chain, InvalidPlanError, Plan, simulate
from scheduler.plan import Op

Ops = Tuple[Tuple[str, int], ...]


@lru_cache(maxsize=None)
def persistent_sequences(s: int, t: int, ad_model: bool = False) -> Tuple[Ops, ...]:
    """All persistent sequences of stages s..t. ``ad_model``: F_all only right before its
    B (revolve's space)."""
    if s == t:
        return ((("F_all", s), ("B", s)),)
    out: List[Ops] = []
    if not ad_model:
        for rest in persistent_sequences(s + 1, t, ad_model):
            out.append((("F_all", s),) + rest + (("B", s),))
    for sp in range(s + 1, t + 1):
        head = (("F_ck", s),) + tuple(("F_none", j) for j in range(s + 1, sp))
        for right in persistent_sequences(sp, t, ad_model):
            for left in persistent_sequences(s, sp - 1, ad_model):
                out.append(head + right + left)
    return tuple(out)


def scored_plans(chain: Chain, ad_model: bool = False) -> List[Tuple[float, float, Ops]]:
    """(simulated time, simulated peak, ops) for every persistent sequence of the chain."""
    res = []
    for ops in persistent_sequences(0, chain.L, ad_model):
        r = simulate(chain, Plan(list(ops)))
        res.append((r.makespan, r.peak_memory, ops))
    return res


def optimum_by_memory(chain: Chain, ad_model: bool = False) -> Dict[int, float]:
    """For every integer memory limit from the least feasible peak to the peak of the
    fastest plan: the least simulated time of a plan whose simulated peak fits."""
    scored = scored_plans(chain, ad_model)
    lo = min(p for _, p, _ in scored)
    hi = max(p for t, p, _ in scored if t == min(t for t, _, _ in scored))
    return {m: min(t for t, p, _ in scored if p <= m) for m in range(int(lo), int(hi) + 1)}


def pofo_class_optimum(c: Chain, M: float, bw: float) -> Optional[float]:
    """Least simulated time over pofo's class: every persistent sequence x every subset of
    the inputs it keeps through the forward phase to offload (each offload right before
    its head, prefetches placed by ``offload.with_prefetches`` as pofo's conversion does).
    None if nothing fits. Used by tests/test_pofo.py and ``bench/pofo.py --random``."""
    from scheduler.planners import offload
    best = None
    for ops, loss, sub in pofo_class(c):
        new, idx, pre = [], {}, []
        for i, op in enumerate(ops):
            if i in sub:
                new.append(Op("offload", op.stage))
            idx[i] = len(new)
            new.append(op)
        for i in sub:
            pre.append((ops[i].stage, idx[first_use(ops, loss, ops[i].stage)]))
        try:
            if pre:
                _, sim = offload.with_prefetches(c, new, sorted(pre, key=lambda p: p[1]),
                                                 M, bw, idx[loss] + 1, "oracle")
            else:
                sim = simulate(c, Plan(new), None, memory=M)
        except InvalidPlanError:
            continue
        best = sim.makespan if best is None else min(best, sim.makespan)
    return best


def pofo_class(c: Chain):
    """pofo's class on ``c``, unplaced: every persistent sequence (its ops, the index of the
    loss stage's F_all) x every subset of the indices of its forward-phase heads (F_all,
    F_ck) whose input is offloaded."""
    for seq in persistent_sequences(0, c.L):
        ops = [Op(k, s) for k, s in seq]
        loss = ops.index(Op("F_all", c.L))
        heads = [i for i in range(loss) if ops[i].kind in ("F_all", "F_ck")]
        for k in range(len(heads) + 1):
            for sub in itertools.combinations(heads, k):
                yield ops, loss, sub


def first_use(ops, loss: int, s: int) -> int:
    """The index of the first op of the backward phase that reads stage ``s``'s input."""
    return next(j for j in range(loss + 1, len(ops))
                if ops[j].stage == s and ops[j].kind != "F_none")
