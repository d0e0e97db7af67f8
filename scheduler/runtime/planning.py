"""A Plan from a planner's name (or a Plan, or a callable) for a chain and a budget, with
its predicted peak and time the simulator's: what the chain runner caches per input shape."""
from __future__ import annotations

from typing import Optional, Sequence

from ..chain import Chain
from ..plan import Plan, checkpoint_plan
from ..simulate import simulate, simulate_checkpointed
from .bandwidth import default_bandwidth
from .compiled_plan import transfer_timing
from .options import PLANNERS, PlannerArg


def make_plan(chain: Chain, budget: Optional[int], planner: PlannerArg = "rotor",
              bandwidth: Optional[float] = None) -> Plan:
    """The Plan the named planner makes for ``chain`` under ``budget`` bytes (``None``: no
    limit, everything saved). ``bandwidth`` (bytes/s) for plans with transfers: default
    ``bandwidth.default_bandwidth()`` (measured on a GPU, 12e9 on the CPU)."""
    if isinstance(planner, Plan):
        return planner
    if callable(planner):
        return planner(chain, budget)
    if budget is None or planner == "none":
        plan = checkpoint_plan(chain.L, [], planner="none")
    elif planner == "rotor":
        from ..planners import rotor
        plan = rotor.solve(chain, budget)
    elif planner == "pofo":
        if bandwidth is None:
            bandwidth = default_bandwidth()
        from ..planners import pofo
        plan = pofo.solve(chain, budget, bandwidth)
    elif planner == "periodic":
        from ..planners import periodic
        plan = periodic.best(chain, budget)
    else:
        raise ValueError(f"scheduler.wrap: planner must be one of {', '.join(PLANNERS)}, a Plan "
                         f"or a callable (chain, budget) -> Plan; got {planner!r}")
    transfers = any(op.kind in ("offload", "prefetch") for op in plan.ops)
    if transfers and bandwidth is None:
        bandwidth = default_bandwidth()
    if not transfers and plan.predicted_peak is not None and plan.predicted_time is not None:
        # the planners predict with the simulator's own rules (equal to ``simulate``:
        # tests/test_plan_promise.py, test_rotor.py): running it again would only cost a new
        # shape's planning time (1-3 ms at 48 blocks, more than rotor's solve)
        plan.meta["simulated_peak"] = plan.predicted_peak
        plan.meta["simulated_time"] = plan.predicted_time
    else:
        res = simulate(chain, plan, bandwidth=bandwidth)
        if transfers and budget is not None:
            # pofo predicts with the simulator enforcing the budget (prefetches wait for
            # memory): the runtime follows that timing
            plan.meta["transfer_timing"] = transfer_timing(
                simulate(chain, plan, bandwidth=bandwidth, memory=budget))
        plan.meta["simulated_peak"] = res.peak_memory
        plan.meta["simulated_time"] = res.makespan
    if plan.predicted_peak is None:
        plan.predicted_peak = res.peak_memory
    if plan.predicted_time is None:
        plan.predicted_time = res.makespan
    if plan.chain is None:
        plan.chain = chain
    return plan


def profiling_peak(chain: Chain, weight_grads: Sequence[int] = ()) -> float:
    """The peak of the step that measured ``chain``: the chain model's, every block
    checkpointed (the plan a profiling step runs), and beside it what measuring a block holds
    at once, the most over the blocks: its input's copy, its output's gradient and its
    weights' gradients (``weight_grads[s]`` bytes; the model frees each once made). A 4-block
    GPT-2's first step held 3.98 MB (CPU) where the model's figure alone was 3.60 MB."""
    measuring = max((chain.x[s] + chain.delta[s + 1] +
                     (weight_grads[s] if s < len(weight_grads) else 0) for s in range(chain.L)),
                    default=0)
    return simulate_checkpointed(chain, range(chain.L))[1] + measuring
