"""The memory limits that bound pofo's search (seed 001): a lower bound on the limit a
pofo sequence can meet (:func:`min_memory`), the store-all peak above which nothing needs
recomputing or offloading (:func:`max_memory`, M^high of section 5.2), and rotor's own
minimum on pofo's slot grid (:func:`_rotor_min`, for pofo's ``InfeasibleError``). Shared by
:mod:`~scheduler.planners.pofo` (the DP) and :mod:`~scheduler.planners.pofo_heuristics`.
"""
from __future__ import annotations

from typing import Optional

from ..chain import Chain, Number
from ..simulate import simulate_checkpointed
from . import rotor
from .args import bandwidth_arg, check_chain

__all__ = ["min_memory", "max_memory"]


def min_memory(chain: Chain, bandwidth: float = 1.0) -> Number:
    """A lower bound on the limit a pofo sequence can meet (any plan the simulator runs, in
    fact). With offloading: every stage s runs F_all s (B s needs xbar[s], which only F_all s
    makes) and B s, each with the input of stage s held (``x[s]``, or the ``xbar[s-1]`` that
    holds it: the smaller counts) and everything else possibly on the host. F_all s may run
    in the forward phase, before delta[s+1] exists, so only B s counts gradients. (A no-grad
    forward of s need not run, so its memory bounds nothing.) Not always met: a plan can need
    more (what offloading a stage costs the ops beside it is not counted), and ``solve``'s
    ``InfeasibleError`` names a limit checked to work. Without offloading (``bandwidth`` 0):
    rotor's minimum, keeping x[0] and recomputing from it (exact on integer chains, else the
    offloading bound). In exact units: ``solve`` at its default ``slots=50`` rounds sizes up
    and may need a little more."""
    c = check_chain(chain)
    if bandwidth_arg(bandwidth, allow_zero=True, where="pofo.min_memory") == 0 and c.is_integer:
        return rotor.min_memory(c)
    L = c.L
    d = list(c.delta) + [0]   # delta[L+1]: the loss's backward consumes nothing
    need = 0
    for s in range(L + 1):
        inp = c.x[0] if s == 0 else min(c.x[s], c.xbar[s - 1])
        need = max(need, inp + c.xbar[s] + max(c.fw_tmp[s], d[s + 1] + d[s] + c.bw_tmp[s]))
    # (a limit is positive: 1 for a chain of zeros; the store-all peak holds every term
    # above, so the bound never exceeds it)
    return max(1, need)


def max_memory(chain: Chain) -> Number:
    """M^high of seed 001 section 5.2: the store-all sequence's peak (no recomputation,
    no offloading)."""
    c = check_chain(chain)
    return simulate_checkpointed(c, ())[1]  # (store-all)


def _rotor_min(chain: Chain, slots: Optional[int], memory: Number) -> Number:
    """Smallest limit for rematerialization only (rotor's, same discretisation)."""
    return rotor.min_memory(chain, slots if chain.is_integer or slots else 500, memory)
