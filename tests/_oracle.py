"""Exhaustive oracle for the checkpointing planners: enumerate every valid persistent
sequence of a small chain and score each WITH THE SIMULATOR (no memory model here).

A persistent sequence for stages s..t (input of s stored, delta[t+1] stored) starts with
either F_all s (then a persistent sequence for s+1..t, then B s) or F_ck s followed by
F_none s+1..s'-1 for some s < s' <= t (then one for s'..t, then one for s..s'-1): the
definition of seed 002 section 4.2 (any checkpoint is kept until its backward). The
count grows like 1, 2, 6, 22, 90, 394, 1806 for 1..7 stages.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, List, Tuple

from scheduler import Chain, Plan, simulate

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
