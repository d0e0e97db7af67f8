"""The memory limits that bound pofo's search (seed 001): the smallest limit a pofo
sequence can meet (:func:`min_memory`), the store-all peak above which nothing needs
recomputing or offloading (:func:`max_memory`, M^high of section 5.2), and rotor's own
minimum on pofo's slot grid (:func:`_rotor_min`, for pofo's ``InfeasibleError``). Shared by
:mod:`~scheduler.planners.pofo` (the DP) and :mod:`~scheduler.planners.pofo_heuristics`.
"""
from __future__ import annotations

from typing import Optional

from ..chain import Chain, Number
from ..plan import checkpoint_plan
from ..simulate import simulate
from . import rotor
from .args import bandwidth_arg, check_chain

__all__ = ["min_memory", "max_memory"]


def min_memory(chain: Chain, bandwidth: float = 1.0) -> Number:
    """The smallest limit a pofo sequence can meet. With offloading: everything but the
    current stage's input on the host, each stage checkpointed with F_ck and recomputed
    alone (F_all s, B s). Without (``bandwidth`` 0): rotor's minimum, keeping x[0] and
    recomputing from it (what the DP finds; here computed by the DP in exact units when
    the chain is integer, else the offloading bound). A bound in exact units: ``solve`` at
    its default ``slots=50`` rounds sizes up and may need a little more (its
    ``InfeasibleError`` then names a limit that works)."""
    c = check_chain(chain)
    if bandwidth_arg(bandwidth, allow_zero=True, where="pofo.min_memory") == 0 and c.is_integer:
        return rotor.min_memory(c)
    L = c.L
    x = list(c.x) + [0]
    d = list(c.delta) + [0]
    need = 0
    for s in range(L + 1):
        # stage s runs some forward before B s: F_ck, or F_all where fck_tmp is the larger
        fwd = x[s] + (min(x[s + 1] + c.fck_tmp[s], c.xbar[s] + c.fw_tmp[s]) if s < L
                      else c.xbar[s] + c.fw_tmp[s])
        rec = x[s] + c.xbar[s] + d[s + 1] + c.fw_tmp[s]
        bwd = x[s] + c.xbar[s] + d[s + 1] + d[s] + c.bw_tmp[s]
        need = max(need, fwd, rec, bwd)
    # the store-all sequence is a pofo sequence too: where recomputing a stage needs more (its
    # xbar held with the gradient from above) than keeping everything, the limit is that peak
    # (and a limit is positive: 1 for a chain of zeros)
    return max(1, min(need, max_memory(c)))


def max_memory(chain: Chain) -> Number:
    """M^high of seed 001 section 5.2: the store-all sequence's peak (no recomputation,
    no offloading)."""
    c = check_chain(chain)
    return simulate(c, checkpoint_plan(c.L, (), planner="")).peak_memory  # (store-all)


def _rotor_min(chain: Chain, slots: Optional[int], memory: Number) -> Number:
    """Smallest limit for rematerialization only (rotor's, same discretisation)."""
    return rotor.min_memory(chain, slots if chain.is_integer or slots else 500, memory)
