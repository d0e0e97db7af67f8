"""Which planner turns a recorded variable sequence into the swap runtime's ``SwapSchedule``:
the window planner (seed 003), LMS, the offload planners on the chain measured from the
sequence, or a callable. Plans are made once per sequence signature (``SwapSequence``).

Under a budget every plan is checked: a step that needs more than the budget on its own is
refused (``InfeasibleError``), and a schedule whose replay passes the budget is followed with
its prefetches cut to the budget, said once per context (``PlanOverBudgetWarning``). LMS and
callables do not plan for a budget; greedy and dynprog plan for it on the chain measured from
the sequence, an approximation of the real graph, so the schedule their plan turns into
(``offload_follow.schedule_from_plan``) can pass it too (a 3-layer GPT-2: 196608 bytes against
budgets of 131072 and 170393); the window planner's schedules keep it."""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from vmalloc import user_warning
from ..errors import InfeasibleError, InvalidPlanError
from ..plan import Plan
from ..planners import lms as lms_planner
from ..planners import window as window_planner
from ..planners.offload_follow import chain_from_sequence, schedule_from_plan
from ..planners.swap_schedule import PACK, UNPACK, SwapSchedule, VariableSequence, replay
from ..units import parse_rate
from .bandwidth import default_bandwidth

PLANNERS = ("window", "lms", "greedy", "dynprog")
PlannerLike = Union[str, Callable[[VariableSequence], SwapSchedule]]
WHERE = "scheduler.swap"
# followed iterations in a row before one is kept in place (``Entry.in_place_after``), and the
# most that doubling it after pressure makes of it
IN_PLACE_AFTER = 2
IN_PLACE_AFTER_MAX = 64


class PlanOverBudgetWarning(RuntimeWarning):
    """A schedule whose replay passes the saved-tensor budget (LMS's and a callable's, which do
    not plan for one; greedy's and dynprog's, planned on an approximate chain): the runtime
    keeps the budget anyway (prefetches that do not fit are skipped, their tensors come back on
    demand)."""


# the planner_options each planner reads (the window planner and a callable read none)
OPTIONS: Dict[str, Tuple[str, ...]] = {"lms": ("swapout_threshold", "swapin_ahead"),
                                       "greedy": ("bandwidth",),
                                       "dynprog": ("bandwidth", "slots")}


def check_options(planner: PlannerLike, options: Any) -> Dict[str, Any]:
    """``planner_options`` checked for ``planner`` when the context is made (they are read
    only at the end of the first backward): every key one it reads, every value valid.
    Returns them with the bandwidth parsed (``units.parse_rate``: ``12e9``, ``"12GB/s"``)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"{WHERE}: planner_options must be a dict, got {options!r}")
    name = f"planner={planner!r}" if isinstance(planner, str) else "a callable planner"
    known = OPTIONS.get(planner, ()) if isinstance(planner, str) else ()
    out = dict(options)
    for key, value in options.items():
        if key not in known:
            takes = f"it takes {', '.join(known)}" if known else "it takes none"
            raise ValueError(f"{WHERE}: planner_options key {key!r} is not an option of "
                             f"{name} ({takes})")
        shown = f"planner_options[{key!r}]"
        if key == "bandwidth":
            out[key] = parse_rate(value, WHERE, name=shown)
        elif key == "slots":  # dynprog's memory discretisation; None: exact units
            if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)
                                      or value < 1):
                raise ValueError(f"{WHERE}: {shown} must be a positive int or None, got "
                                 f"{value!r}")
            out[key] = None if value is None else int(value)  # (numpy ints too)
        elif isinstance(value, bool) or not isinstance(value, Integral) or value < 1:  # lms: steps
            raise ValueError(f"{WHERE}: {shown} must be a positive int (steps), got {value!r}")
        else:
            out[key] = int(value)
    return out


@dataclass
class Entry:
    """A cached plan: the sequence it was made for, its schedule, and the runtime's events to
    compare (``expected``, one per pack or unpack) with the step each belongs to (``step_of``:
    a node's unpacks are one step of the sequence)."""

    sequence: VariableSequence
    schedule: SwapSchedule
    expected: List[Tuple[int, str, int]]
    step_of: List[int]
    key: int

    # an iteration kept in place under this plan outgrew it partway, or left tensors alive past
    # its end (``swap_sequence``): those could not move if a later iteration needed the room
    in_place_refused: bool = False
    # iterations in a row that must follow this plan before one is kept in place: doubled
    # each time the pressure callback made one leave (a spike, a cuDNN workspace: the fast
    # path comes back, later each time), halved after twice as many kept in place in a row
    in_place_after: int = IN_PLACE_AFTER

    def may_keep_in_place(self, budget: Optional[int]) -> bool:
        """An iteration following this plan may be kept in place: the schedule swaps nothing out
        or in and releases nothing, and its sequence fits ``budget`` as it is (its replay's peak;
        a planner may move nothing where the budget is too small for that, leaving the runtime
        to evict on demand), and ``in_place_refused`` is not set."""
        return (budget is not None and not self.in_place_refused and self.moves_nothing
                and self.peak <= budget)

    @functools.cached_property
    def packs(self) -> int:
        """The sequence's packs (saved tensors, each time one is saved)."""
        return sum(1 for e in self.expected if e[1] == PACK)

    @functools.cached_property
    def moves_nothing(self) -> bool:
        s = self.schedule
        return not any(any(steps) for steps in (s.swap_out, s.swap_in, s.release))

    @functools.cached_property
    def peak(self) -> float:
        """The replay's peak of saved bytes on the device (infinite if the replay refuses the
        schedule: a callable's)."""
        try:
            return replay(self.sequence, self.schedule).peak
        except InvalidPlanError:
            return float("inf")

    def first_event(self, k: int) -> bool:
        """Event ``k`` starts its step (the schedule's releases and swap-ins go before it)."""
        return k == 0 or (k < len(self.step_of) and self.step_of[k - 1] != self.step_of[k])

    def last_event(self, k: int) -> bool:
        """Event ``k`` ends its step (the schedule's swap-outs go after it)."""
        return k + 1 >= len(self.step_of) or self.step_of[k + 1] != self.step_of[k]


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
        self.options = check_options(planner, options)
        self._offload: Any = None
        self._window_warned = False
        self._budget_warned = False
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
        """The planner's name in stats and messages (``"custom"`` for a callable)."""
        return self.planner if isinstance(self.planner, str) else "custom"

    def entry(self, seq: VariableSequence, key: int, events: Sequence[Tuple[int, str, int]],
              step_of: Sequence[int]) -> Entry:
        """Plan ``seq``, recorded as the runtime's ``events`` (``step_of``: each one's step)."""
        sched = self.plan(seq)
        if len(sched) != len(seq):
            raise ValueError(f"planner {self.planner!r} returned {len(sched)} steps for a "
                             f"sequence of {len(seq)}")
        self._warn_over_budget(seq, sched)
        return Entry(seq, sched, list(events), list(step_of), key)

    def _warn_over_budget(self, seq: VariableSequence, sched: SwapSchedule) -> None:
        """Say once per context that a schedule passes the budget (its prefetches are cut)."""
        if self.budget is None or self._budget_warned:
            return
        try:
            peak = replay(seq, sched).peak
        except InvalidPlanError:  # a callable's schedule the replay rejects: followed as ever
            return
        if peak <= self.budget:
            return
        self._budget_warned = True
        hint = (" (lower planner_options['swapin_ahead'], or use planner='window')"
                if self.planner == "lms" else "")
        user_warning.warn(
            f"{WHERE}: the {self.name!r} planner's schedule keeps {peak} bytes of saved tensors "
            f"on the device at its peak, above budget={self.budget} bytes; the runtime keeps the "
            f"budget anyway: the swap-ins ahead of use that do not fit are skipped and those "
            f"tensors come back on demand, synchronously{hint}", PlanOverBudgetWarning)

    def plan(self, seq: VariableSequence) -> SwapSchedule:
        """The schedule of ``seq`` from the configured planner: a callable, ``window``
        (warning once if the window is smaller than a saved tensor), ``lms``, or an offload
        planner (``greedy``/``dynprog``) on the chain built from the sequence. Raises
        ``InfeasibleError`` first if a step cannot fit the budget on its own."""
        opts = self.options
        if self.budget is not None:  # every planner: a step must fit (lms, a callable too)
            check_budget(seq, self.budget)
        if callable(self.planner):
            return self.planner(seq)
        if self.planner == "window":
            # a window smaller than a saved tensor is fine (no look-ahead past it): say so once
            sched = window_planner.schedule(seq, self.window, self.budget, warn=False)
            note = sched.meta.get("window_note")
            if note is not None and not self._window_warned:
                self._window_warned = True
                user_warning.warn(note, window_planner.WindowWarning)
            return sched
        if self.planner == "lms":
            return lms_planner.schedule(seq, opts.get("swapout_threshold", 1),
                                        opts.get("swapin_ahead", 1))
        chain, stage_vars = chain_from_sequence(seq)
        # one default for every transferring planner: measured on a GPU, 12e9 on the CPU
        bandwidth = opts.get("bandwidth") or default_bandwidth()
        solve = getattr(self._offload, self.planner)
        kwargs = {"slots": opts["slots"]} if "slots" in opts and self.planner == "dynprog" else {}
        plan: Plan = solve(chain, self.budget, bandwidth, **kwargs)
        return schedule_from_plan(seq, plan, stage_vars)


def check_budget(seq: VariableSequence, budget: int) -> None:
    """``window.check_budget`` (a step must fit the budget on its own), naming
    ``torch.compile`` as a likely cause when the step is one node reading several saved
    tensors: a compiled region's backward is one node that reads all of its saved tensors."""
    try:
        window_planner.check_budget(seq, budget)
    except InfeasibleError as exc:
        _, step = seq.min_budget()
        n = len(seq.steps[step])
        if seq.phases[step] != UNPACK or n < 2:
            raise
        raise InfeasibleError(
            f"{exc}. One autograd node reads these {n} saved tensors together; if the model is "
            f"torch.compile'd, that is likely its compiled backward, one node reading every "
            f"tensor the compiled region saved (swapping cannot split it): compile each block "
            f"separately instead of the whole model", min_memory=exc.min_memory) from None
