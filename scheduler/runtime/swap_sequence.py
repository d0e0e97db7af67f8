"""The swap runtime's variable sequence: record it, plan it once per signature, follow it.

Every pack (forward) and unpack (backward) of a saved tensor is one step. The first iteration
records the steps; at its end the planner turns the sequence into a ``SwapSchedule`` (cached
per signature, the Mimose idea); later iterations follow it step by step: before a step, the
schedule's releases and swap-ins; after it, its swap-outs. A live step that differs from the
schedule's (a new input shape) switches to a cached schedule whose sequence starts the same
way, or else stops following and records; that iteration's sequence then gets its own plan.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from ..plan_cache import PlanCache
from ..planners.swap_schedule import HOST, VariableSequence
from .swap_eviction import Eviction
from .swap_planning import Entry, SwapPlanner
from .swap_stats import Residency
from .swap_transfers import Transfers
from .swap_vars import Var


class SwapSequence:
    def __init__(self, planner: SwapPlanner, transfers: Transfers, eviction: Eviction,
                 residency: Residency, counters: Dict[str, float], cache_size: int):
        self.planner = planner
        self.transfers = transfers
        self.eviction = eviction
        self.residency = residency
        self.counters = counters
        self.cache: PlanCache[Entry] = PlanCache(cache_size)
        self.known: "OrderedDict[int, Entry]" = OrderedDict()
        self.last_entry: Optional[Entry] = None   # the plan the last iteration ended with
        self.last_recorded: Optional[VariableSequence] = None
        self.it = 0
        self.active: Optional[Entry] = None
        self.new_iteration()

    def new_iteration(self) -> None:
        self.events: List[Tuple[int, str, int]] = []
        self.times: List[float] = []
        self.t_last = time.perf_counter()
        self.vars: List[Var] = []
        self.free_after: Dict[int, int] = {}
        self.live_in_iter = 0
        self.backward_seen = False
        self.callback_queued = False
        self.residency.new_iteration()
        self.following = self.active is not None

    def freed(self, var: Var) -> None:
        """``var`` was freed after the last recorded step (once: a drain cut short by an
        interrupt may report it again)."""
        if var.it == self.it and var.vid not in self.free_after:
            self.free_after[var.vid] = len(self.events) - 1
            self.live_in_iter -= 1

    # ---------------------------------------------------------------------- the steps
    def step_begin(self, vid: int, phase: str, nbytes: int, var: Optional[Var]) -> None:
        """Record the step; apply the schedule's releases and swap-ins planned before it; keep
        the budget for what this step brings onto the device."""
        t = self.transfers
        t.poll()
        now = time.perf_counter()
        self.times.append(now - self.t_last)
        self.t_last = now
        k = len(self.events)
        event = (vid, phase, nbytes)
        self.events.append(event)
        self.eviction.current = var
        entry = self.active
        if entry is not None and self.following:
            if k >= len(entry.expected) or entry.expected[k] != event:
                entry = self._switch_plan(k)
            if entry is not None:
                sched = entry.schedule
                nvars = len(self.vars)
                for v in sched.release[k]:
                    if v < nvars:
                        t.release(self.vars[v], sched.blocking_release)
                for v in sched.swap_in[k]:
                    if v < nvars:
                        t.swap_in(self.vars[v])
        if self.eviction.budget is not None:
            incoming = nbytes if var is None or var.state == HOST else 0
            self.eviction.make_room(incoming, var)

    def step_end(self) -> None:
        k = len(self.events) - 1
        entry = self.active
        if entry is not None and self.following:
            nvars = len(self.vars)
            for v in entry.schedule.swap_out[k]:
                if v < nvars:
                    self.transfers.swap_out(self.vars[v])
        self.eviction.current = None

    def _switch_plan(self, k: int) -> Optional[Entry]:
        """The live sequence left the schedule at step ``k``: take a cached schedule whose
        sequence starts the same way, or stop following (record) for this iteration."""
        live = self.events
        for key in reversed(self.known):
            entry = self.known[key]
            exp = entry.expected
            if len(exp) > k and exp[k] == live[k] and exp[:k + 1] == live:
                self.active = entry
                self.counters["plan_switches"] += 1
                return entry
        self.following = False
        self.counters["plan_mismatches"] += 1
        return None

    # ------------------------------------------------------------------ iterations
    def end_iteration(self) -> None:
        events = self.events
        if not events:
            return
        n = len(events)
        try:
            active = self.active
            if self.following and active is not None and len(active.expected) == n:
                # every step matched the schedule: the same sequence, no need to rebuild it
                key = active.sequence.signature
                self.cache.get_or_plan(key, lambda: active)
                self.known[key] = active
                self.known.move_to_end(key)
                self.last_entry = active
                return
            seq = VariableSequence(
                steps=tuple((e[0],) for e in events), sizes=tuple(v.nbytes for v in self.vars),
                phases=tuple(e[1] for e in events),
                free_after=tuple(max(self.free_after.get(v, n - 1), 0)
                                 for v in range(len(self.vars))),
                times=tuple(self.times))
            self.last_recorded = seq
            key = seq.signature
            entry = self.cache.get_or_plan(key, lambda: self.planner.entry(seq))
            self.known[key] = entry
            self.known.move_to_end(key)
            for old in [k for k in self.known if k not in self.cache]:
                del self.known[old]
            self.active = entry
            self.last_entry = entry
        finally:
            self.counters["iterations"] += 1
            self.residency.end_iteration()
            self.it += 1
            self.new_iteration()
