"""Which planner turns a recorded variable sequence into the swap runtime's ``SwapSchedule``:
the window planner (seed 003), LMS, the offload planners on the chain measured from the
sequence, or a callable. Plans are made once per sequence signature (``SwapSequence``)."""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ..plan import Plan
from ..planners import lms as lms_planner
from ..planners import window as window_planner
from ..planners.offload_follow import chain_from_sequence, schedule_from_plan
from ..planners.swap_schedule import SwapSchedule, VariableSequence
from .bandwidth import default_bandwidth

PLANNERS = ("window", "lms", "greedy", "dynprog")
PlannerLike = Union[str, Callable[[VariableSequence], SwapSchedule]]


@dataclass
class Entry:
    """A cached plan: the sequence it was made for, its schedule, the events to compare."""

    sequence: VariableSequence
    schedule: SwapSchedule
    expected: List[Tuple[int, str, int]]


class SwapPlanner:
    """``planner`` with its settings; ``entry(sequence)`` plans and checks the result."""

    def __init__(self, planner: PlannerLike, window: int, budget: Optional[int],
                 options: Dict[str, Any]):
        if not (callable(planner) or planner in PLANNERS):
            raise ValueError(f"planner: expected one of {', '.join(PLANNERS)} or a callable "
                             f"sequence -> SwapSchedule, got {planner!r}")
        self.planner = planner
        self.window = window
        self.budget = budget
        self.options = options
        self._offload: Any = None
        self._window_warned = False
        if planner in ("greedy", "dynprog"):
            if budget is None:
                raise ValueError(f"planner={planner!r} needs a budget (the memory it plans for)")
            try:
                self._offload = importlib.import_module("scheduler.planners.offload")
            except ImportError as exc:
                raise ValueError(f"planner={planner!r} needs scheduler.planners.offload, which "
                                 f"cannot be imported ({exc})") from None

    @property
    def name(self) -> str:
        return self.planner if isinstance(self.planner, str) else "custom"

    def entry(self, seq: VariableSequence) -> Entry:
        sched = self.plan(seq)
        if len(sched) != len(seq):
            raise ValueError(f"planner {self.planner!r} returned {len(sched)} steps for a "
                             f"sequence of {len(seq)}")
        expected = [(s[0], p, seq.sizes[s[0]]) for s, p in zip(seq.steps, seq.phases)]
        return Entry(seq, sched, expected)

    def plan(self, seq: VariableSequence) -> SwapSchedule:
        opts = self.options
        if callable(self.planner):
            return self.planner(seq)
        if self.planner == "window":
            # a window smaller than a saved tensor is fine (no look-ahead past it): say so once
            sched = window_planner.schedule(seq, self.window, self.budget, warn=False)
            note = sched.meta.get("window_note")
            if note is not None and not self._window_warned:
                self._window_warned = True
                warnings.warn(note, window_planner.WindowWarning, stacklevel=2)
            return sched
        if self.planner == "lms":
            return lms_planner.schedule(seq, int(opts.get("swapout_threshold", 1)),
                                        int(opts.get("swapin_ahead", 1)))
        chain, stage_vars = chain_from_sequence(seq)
        # one default for every transferring planner: measured on a GPU, 12e9 on the CPU
        bandwidth = float(opts["bandwidth"]) if "bandwidth" in opts else default_bandwidth()
        solve = getattr(self._offload, self.planner)
        kwargs = {"slots": opts["slots"]} if "slots" in opts and self.planner == "dynprog" else {}
        plan: Plan = solve(chain, self.budget, bandwidth, **kwargs)
        return schedule_from_plan(seq, plan, stage_vars)
