"""The automatic-differentiation baseline of seed 002 section 5.3 ("revolve").

In the AD model a backward step needs its stage's input but cannot reuse a forward's taped
intermediates from earlier in the sequence: the paper runs the optimal heterogeneous AD
algorithm [13, 14] and makes it valid "by saving only activations a to memory, and performing
a F_all step before each backward step". That is exactly rotor's dynamic program restricted to
schedules where F_all s comes right before B s (no F_all case in Theorem 1), so every stage
but the loss is computed at least twice. We solve that restricted DP in the same C++ code
(``allow_all=False``) with the simulator's memory model, so unlike the paper's conversion the
plan always respects the limit and its prediction equals the simulator.
"""
from __future__ import annotations

from typing import Any, Optional

from ..chain import Chain
from ..plan import Plan
from .rotor import min_memory as _min_memory, solve_dp


def solve(chain: Chain, memory: Any, slots: Optional[int] = 500, refine: bool = True) -> Plan:
    """Fastest AD-model (revolve) schedule within ``memory`` bytes; ``InfeasibleError`` if
    none. ``refine`` as in rotor.solve."""
    return solve_dp(chain, memory, slots, allow_all=False, planner="revolve", refine=refine)


def min_memory(chain: Chain, slots: Optional[int] = None, memory: Optional[float] = None):
    """The least memory limit for which ``solve`` finds a revolve plan (see rotor.min_memory)."""
    return _min_memory(chain, slots, memory, _allow_all=False)
