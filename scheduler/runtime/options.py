"""The chain runtimes' arguments (``scheduler.wrap``, ``scheduler.checkpoint``), checked
where they are given, with errors that name the entry point and the value: the planner, the
budget, the bandwidth; and Mimose's default input size."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

from vmalloc.sizes import parse_size

from ..chain import Chain
from ..plan import Plan

PLANNERS = ("rotor", "pofo", "periodic", "mimose", "none")

PlannerArg = Union[str, Plan, Callable[[Chain, Optional[int]], Plan]]
ChainArg = Union[None, Chain, Callable[..., Chain]]


def default_input_size(args: Sequence[Any]) -> int:
    """The input size Mimose and ``InputAwareChain`` key their estimates on by default:
    elements of the first input tensor (seed 004, section 3.1)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.numel()
    raise ValueError("the input size (planner='mimose', InputAwareChain): block 0's arguments "
                     f"have no tensor to size ({[type(a).__name__ for a in args]}); pass "
                     "input_size=, a callable from them to a number")


def parse_budget(budget: Any, where: str) -> Optional[int]:
    """``None`` (no limit) or a positive byte count (an int or a size string: "6GiB")."""
    if budget is None:
        return None
    value = parse_size(budget, "budget")
    if value <= 0:
        raise ValueError(f"{where}: budget must be a positive size (e.g. '6GiB') or None for "
                         f"no limit, got {budget!r}")
    return value


def parse_rate(bandwidth: Any, where: str) -> Optional[float]:
    if bandwidth is None:
        return None
    if isinstance(bandwidth, str):
        return float(parse_size(bandwidth.removesuffix("/s"), "bandwidth"))
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or \
            not bandwidth > 0:
        raise ValueError(f"{where}: bandwidth must be positive bytes/s (e.g. 12e9 or "
                         f"'12GB/s'), got {bandwidth!r}")
    return float(bandwidth)


def check_planner(planner: Any, where: str) -> None:
    if isinstance(planner, Plan) or (callable(planner) and not isinstance(planner, type)):
        return
    if not isinstance(planner, str) or planner not in PLANNERS:
        raise ValueError(f"{where}: planner must be one of {', '.join(PLANNERS)}, a Plan or a "
                         f"callable (chain, budget) -> Plan; got {planner!r}")
