"""The swap runtime's variable sequence: record it, plan it once per signature, follow it.

Every pack (forward) of a saved tensor is one step; the unpacks (backward) of one autograd node
are one step: the node holds all of them until it has run, so none of them may leave the device
before its last one is read (a budget that fits only one operand of a product is too small).
The runtime sees one *event* per pack or unpack; the planner sees the steps. The first iteration
records the events; at its end the planner turns the sequence into a ``SwapSchedule`` (cached
per signature, the Mimose idea); later iterations follow it step by step: before a step, the
schedule's releases and swap-ins; after it, its swap-outs. A live step that differs from the
schedule's (a new input shape) switches to a cached schedule whose sequence starts the same
way, or else stops following and records; that iteration's sequence then gets its own plan.
A planned swap-in that does not fit the budget (a schedule whose replay passes it, or saved
tensors of an earlier iteration still on the device) is skipped: its tensor comes back on demand.
A recording with no backward whose saved tensors mostly died already (forward-only graphs that
overlap, as in an evaluation loop that forgot ``no_grad``) is dropped once it is as long as the
longest plan known (at least ``DEAD_RECORDING_EVENTS``), so its bookkeeping stays bounded.

*In place*: a plan that moves nothing (a budget the whole sequence fits in), followed to the
letter by two iterations in a row, needs no per-tensor bookkeeping: the next iterations keep
their saved tensors where they are, as parameters are kept, and only add up the bytes the runtime
would have managed (each storage once, ``swap_in_place``). That count is what keeps the budget:
while the bytes saved since the iteration began fit the room the budget leaves, no schedule
could need to move anything, whatever the sequence. An iteration whose first saved tensor
differs from the plan's (a new input shape) takes the full path from its start, and so finds the
plan known for its shape; the pack that would pass the room, or is one more than the plan has
(a longer sequence with the same start), leaves the iteration to the full path
(``leave_in_place``): the bytes kept so far count as resident until those tensors die
(they cannot be moved: the budget may be passed by them in that iteration, and
``peak_resident_bytes`` says so), it is not planned (its start was not recorded), the next one
records, and that plan is never kept in place again (its sequences outgrow it). An iteration
whose kept tensors all die before a backward ends at the next pack, as a full-path one whose
vars all died (not planned: it was not recorded; the next two are tracked). Under a pressure
callback (vmalloc's allocator, ``allocator=``) an iteration that met pressure does not count
towards the two (its plan did not fit the device as it is), and one kept in place that meets
it evicts kept tensors (``swap_in_place_pressure``) and leaves in place there, as one that
outgrows its plan, but its plan is kept in place again after twice as long a streak as before
(``Entry.in_place_after``: 4, 8, ... at most 64); it comes down again by half after each run of
iterations kept in place twice as long as the wait (``in_place_run``): rare spikes cost less
and less, a steady pressure keeps the fast path rare.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from ..plan_cache import PlanCache
from ..planners.swap_schedule import HOST, PACK, UNPACK, VariableSequence
from .swap_eviction import Eviction
from .swap_in_place import InPlace, InPlaceToken
from .swap_planning import IN_PLACE_AFTER, IN_PLACE_AFTER_MAX, Entry, SwapPlanner
from .swap_stats import Residency
from .swap_transfers import SwapTransfers
from .swap_vars import Var

# the least length (events) at which a recording of mostly dead forward-only graphs is dropped
DEAD_RECORDING_EVENTS = 1024


class SwapSequence:
    def __init__(self, planner: SwapPlanner, transfers: SwapTransfers, eviction: Eviction,
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
        self.longest_plan = 0  # events of the longest plan in ``known``
        # in place: how many iterations in a row followed ``active`` to the letter (two: the
        # next may be kept in place; one is not enough where two kinds of iteration alternate,
        # as the two backwards of a gradient penalty do)
        self.streak = 0
        # iterations kept in place in a row since pressure last made one leave, or since the
        # wait last came down (``_end_in_place``)
        self.in_place_run = 0
        self.in_place_run_of: Any = None   # (the plan's key: a run is one plan's)
        self.in_place = InPlace(residency)
        self.new_iteration()

    def new_iteration(self) -> None:
        """Start recording an iteration: no events, vars or running node yet; it follows the
        active schedule, if there is one, until an event departs from it."""
        self.events: List[Tuple[int, str, int]] = []
        self.step_of: List[int] = []   # per event: its step (its autograd node's unpacks)
        self.times: List[float] = []
        # the running step's autograd node (backward only), as an identity that does not own
        # it: a strong reference would keep a failed backward's graph alive
        self.node: Any = None
        self.t_last = time.perf_counter()
        self.vars: List[Var] = []
        self.free_after: Dict[int, int] = {}
        self.live_in_iter = 0
        self.backward_seen = False
        self.callback_queued = False
        self.residency.new_iteration()
        self.following = self.active is not None
        self.eviction.in_use.clear()  # the running step's vars: autograd holds them
        self.partial = False  # the iteration's start was kept in place, not recorded
        self.pressed = False  # the pressure callback was called during it
        if self.in_place.finish() and self.active is not None:
            # its tensors outlive it (a graph kept): they cannot move if a later iteration
            # needs the room, so this plan is not kept in place again
            self.active.in_place_refused = True
        budget = self.eviction.budget
        active = self.active
        # what the saved tensors of an iteration kept in place may add to those still resident
        room = 0 if budget is None else budget - self.residency.bytes
        if active is not None and self.streak >= active.in_place_after and room > 0 \
                and active.may_keep_in_place(budget):
            self.in_place.begin(room, active.packs)
        else:   # (a run kept in place is one in a row: ``_end_in_place``)
            self.in_place_run = 0

    def end_step(self) -> None:
        """No step runs any more (the context exits): nothing in use, no node held."""
        self.eviction.in_use.clear()
        self.node = None
        if self.in_place.on:  # (the peak so far of an iteration the exit cuts)
            self.residency.add_peak(self.in_place.bytes)

    # -------------------------------------------------------------------- in place
    def keep_in_place(self, ptr: int, nbytes: int) -> Optional[InPlaceToken]:
        """A saved storage (``ptr``, ``nbytes``) in an iteration kept in place: the token its
        pack holds if it stays where it is, None if the pack takes the full path."""
        ip = self.in_place
        if ip.seen:
            if ip.token_ref() is None:
                # every tensor it kept died before a backward (a graph dropped, a forward-only
                # pass): it is over, as on the full path when all its vars died; this pack
                # begins the next, tracked (a forward-only sequence is not the plan's: two
                # iterations follow the plan again before the next is kept in place)
                self._end_in_place(followed=False)
                return None
        elif self.active.expected[0] != (0, PACK, nbytes):
            # the first saved tensor differs from the plan's (a new input shape): the full path
            # from the iteration's start, which switches to the plan known for it or records
            ip.leave()
            return None
        token = ip.keep(ptr, nbytes)
        if token is None:
            self.leave_in_place()
        return token

    def leave_in_place(self, pressed: bool = False) -> None:
        """The rest of this iteration takes the full path. Nothing kept in place yet: the whole
        iteration, following its plan as any other. Else recording, not planned
        (``end_iteration``), with the bytes kept so far counted as resident until those tensors
        die; the plan is not kept in place again (its sequences outgrow it), or, ``pressed``
        (the pressure callback evicts what it kept), only after twice as long a streak."""
        if self.in_place.on and self.in_place.leave():
            self.following = False
            self.partial = True
            active = self.active
            self.in_place_run = 0
            if pressed:
                active.in_place_after = min(2 * active.in_place_after, IN_PLACE_AFTER_MAX)
            else:
                active.in_place_refused = True

    def freed(self, var: Var) -> None:
        """``var`` was freed after the last recorded step (once: a drain cut short by an
        interrupt may report it again)."""
        if var.it == self.it and var.vid not in self.free_after:
            self.free_after[var.vid] = len(self.events) - 1
            self.live_in_iter -= 1

    # ---------------------------------------------------------------------- the steps
    def step_begin(self, vid: int, phase: str, nbytes: int, var: Optional[Var],
                   node: Any = None) -> None:
        """Record the event; at the first event of a step, apply the schedule's releases and
        swap-ins planned before the step; keep the budget for what it brings onto the device.
        ``node``: the identity of the autograd node an unpack reads for (its unpacks are one
        step; ``node_identity``)."""
        t = self.transfers
        t.poll()
        now = time.perf_counter()
        self.times.append(now - self.t_last)
        self.t_last = now
        k = len(self.events)
        event = (vid, phase, nbytes)
        self.events.append(event)
        same_step = phase == UNPACK and node is not None and node == self.node
        in_use = self.eviction.in_use
        if same_step:
            self.step_of.append(self.step_of[-1])
            if var is not None and var not in in_use:
                in_use.append(var)
        else:
            self.step_of.append(self.step_of[-1] + 1 if self.step_of else 0)
            in_use[:] = [var] if var is not None else []
            self.node = node
        entry = self.active
        if entry is not None and self.following:
            if k >= len(entry.expected) or entry.expected[k] != event:
                entry = self._switch_plan(k)
            if entry is not None:
                first = entry.first_event(k)
                if first == same_step:
                    # the same events, grouped otherwise: the schedule's steps are not this
                    # iteration's nodes (acting on them could move a tensor a node holds)
                    self.following = False
                    self.counters["plan_mismatches"] += 1
                elif first:
                    sched = entry.schedule
                    j = entry.step_of[k]
                    nvars = len(self.vars)
                    for v in sched.release[j]:
                        if v < nvars:
                            t.release(self.vars[v], sched.blocking_release)
                    for v in sched.swap_in[j]:
                        if v < nvars:
                            self._prefetch(self.vars[v])
        if self.eviction.budget is not None:
            incoming = nbytes if var is None or var.state == HOST else 0
            self.eviction.make_room(incoming, var)

    def step_end(self, var: Optional[Var] = None) -> None:
        """The event ran (``var``: a pack's var, created during it); at its step's last event,
        issue the swap-outs planned after the step."""
        if var is not None and not self.eviction.in_use:
            self.eviction.in_use.append(var)
        k = len(self.events) - 1
        entry = self.active
        if entry is not None and self.following and entry.last_event(k):
            nvars = len(self.vars)
            for v in entry.schedule.swap_out[entry.step_of[k]]:
                if v < nvars:
                    self.transfers.swap_out(self.vars[v])

    def _prefetch(self, var: Var) -> None:
        """A swap-in the schedule issues ahead of use, if it fits the budget (else the use
        brings the tensor on demand, evicting what it must)."""
        if var.state == HOST and not self.eviction.room_for_prefetch(var.nbytes):
            return
        self.transfers.swap_in(var)

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
    def dead_recording(self) -> bool:
        """The running iteration saw no backward, most of its saved tensors died already and
        it is as long as the longest plan known: forward-only graphs that overlap (each batch's
        graph dies only after the next forward), which never free every var at once, so no
        pack would start a new iteration and the recording would grow for good."""
        if self.backward_seen:
            return False
        live = self.live_in_iter
        return (len(self.vars) - live > live
                and len(self.events) >= max(self.longest_plan, DEAD_RECORDING_EVENTS))

    def drop_iteration(self) -> None:
        """End the running iteration without planning it (``dead_recording``). Its saved
        tensors still alive are an earlier iteration's from now on (used on demand)."""
        self.streak = 0
        self._next_iteration()

    def end_iteration(self) -> None:
        """The iteration is over: plan its recorded sequence (or count a hit when
        every event followed the active schedule, with no sequence rebuilt), make that plan
        the one the next iteration follows, and start recording the next iteration. A step
        an exception cut short is not planned (``plan_mismatches``), nor an iteration that
        began in place and left it (its start was not recorded)."""
        if self.in_place.on:  # the plan that moves nothing held: a hit, as a followed one
            self._end_in_place(followed=True)
            return
        events = self.events
        if not events and not self.partial:  # (partial: it left in place in its backward)
            return
        n = len(events)
        streak, self.streak = self.streak, 0
        try:
            active = self.active
            if self.following and active is not None and len(active.expected) == n:
                # every event matched the schedule: the same sequence, no need to rebuild it
                # (one that met pressure does not count: the plan did not fit the device)
                self.streak = 0 if self.pressed else \
                    streak + 1 if active is self.last_entry else 1
                self._hit(active)
                return
            seq = None if self.partial else self._recorded()
            if seq is None:  # an exception cut a step short, or the start was kept in place
                self.counters["plan_mismatches"] += 1
                return
            self.last_recorded = seq
            key = hash((seq.signature, tuple(events)))
            entry = self.cache.get_or_plan(
                key, lambda: self.planner.entry(seq, key, events, self.step_of))
            self.known[key] = entry
            self.known.move_to_end(key)
            for old in [k for k in self.known if k not in self.cache]:
                del self.known[old]
            self.longest_plan = max(len(e.expected) for e in self.known.values())
            self.active = entry
            self.last_entry = entry
        finally:
            self._next_iteration()

    def _end_in_place(self, followed: bool) -> None:
        """End an iteration kept in place: its count in the peaks (its tensors may all be dead
        now); ``followed``: a backward ended it, a hit of the plan, else every tensor it kept
        died before one (the streak starts again)."""
        self.counters["iterations_in_place"] += 1
        self.residency.add_peak(self.in_place.bytes)
        if followed:
            self._hit(self.active)
            self.streak = 0 if self.pressed else self.streak + 1
            active = self.active
            if self.in_place_run_of != active.key:
                self.in_place_run, self.in_place_run_of = 0, active.key
            self.in_place_run = 0 if self.pressed else self.in_place_run + 1
            if self.in_place_run >= 2 * active.in_place_after > 2 * IN_PLACE_AFTER:
                # (pressure has not come back for twice the wait: the wait comes down)
                active.in_place_after //= 2
                self.in_place_run = 0
        else:
            self.streak = 0
            self.in_place_run = 0
        self._next_iteration()

    def _hit(self, entry: Entry) -> None:
        """The iteration followed ``entry``: counted a cache hit, the most recent plan known."""
        self.cache.get_or_plan(entry.key, lambda: entry)
        self.known[entry.key] = entry
        self.known.move_to_end(entry.key)
        self.last_entry = entry

    def _next_iteration(self) -> None:
        self.counters["iterations"] += 1
        self.residency.end_iteration()
        self.transfers.pool.resync()
        self.it += 1
        self.new_iteration()

    def _recorded(self) -> Optional[VariableSequence]:
        """The iteration's events as the planner's steps (a var read twice by one node: once);
        None when an exception (a failed copy, Ctrl-C) cut a pack short: its event was
        recorded, its var never made."""
        step_of = self.step_of
        nvars = len(self.vars)
        if not len(self.events) == len(step_of) == len(self.times) or \
                any(e[0] >= nvars for e in self.events):
            return None
        nsteps = step_of[-1] + 1
        steps: List[List[int]] = [[] for _ in range(nsteps)]
        phases = [""] * nsteps
        times = [0.0] * nsteps
        last_use = [0] * len(self.vars)
        for (vid, phase, _), j, dt in zip(self.events, step_of, self.times):
            if vid not in steps[j]:
                steps[j].append(vid)
            phases[j] = phases[j] or phase
            times[j] += dt
            last_use[vid] = j
        freed = self.free_after
        free_after = tuple(max(step_of[max(freed[v], 0)] if v in freed else nsteps - 1,
                               last_use[v]) for v in range(len(self.vars)))
        return VariableSequence(
            steps=tuple(tuple(s) for s in steps), sizes=tuple(v.nbytes for v in self.vars),
            phases=tuple(phases), free_after=free_after, times=tuple(times))
