"""The variable sequence, the per-step swap schedule, and the one memory accounting for both.

Seed 003, section 3: a *variable sequence* is the ordered uses of the tensors autograd saves
(every pack in the forward, every unpack in the backward). A *swap schedule* says, per step,
which device copies to release, which swap-ins to issue before the step and which swap-outs to
issue after it. ``replay`` executes a schedule on a sequence and returns the saved-tensor bytes
resident on the device at every step: the window and LMS planners, the offload-plan follower,
the tests and the runtime's own figures all use this one function (the planners through
``record_replay``, which also records its prediction in the schedule). No torch here.

State of a variable during a replay (one of):

==========  =============================================================================
unborn      not used yet; becomes *device* at its first use (the pack that creates it)
device      on the device, counted
out         a swap-out was issued; the device copy still exists (and is counted) until a
            ``release`` step frees it, or a swap-in cancels the swap-out
host        only the host copy exists; a use in this state is an invalid schedule
in          a swap-in was issued: device memory is reserved (counted) from that step on
freed       autograd dropped it (after its ``free_after`` step); counts nothing
==========  =============================================================================

Once a variable has a host copy it keeps it until it is freed (saved tensors never change), so a
second swap-out of the same variable copies nothing: it only releases the device copy.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import InvalidPlanError

PACK = "F"    # a step of the forward: autograd saved (packed) the variable
UNPACK = "B"  # a step of the backward: autograd read (unpacked) the variable

Steps = Tuple[Tuple[int, ...], ...]


def _step(i: int, s: Any) -> Tuple[int, ...]:
    if isinstance(s, (str, bytes)) or not hasattr(s, "__iter__"):
        raise ValueError(f"VariableSequence.steps[{i}]: expected a sequence of variable ids, "
                         f"got {s!r}")
    return tuple(s)


def _seconds(i: int, t: Any) -> float:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
        raise ValueError(f"VariableSequence.times[{i}]: expected a finite number of seconds "
                         f">= 0, got {t!r}")
    return float(t)


def _int_tuple(name: str, values: Sequence[Any]) -> Tuple[int, ...]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"VariableSequence.{name}[{i}]: expected a non-negative int, got {v!r}")
        out.append(v)
    return tuple(out)


@dataclass(frozen=True)
class VariableSequence:
    """The ordered uses of saved tensors across one forward and backward.

    ``steps[i]`` holds the ids of the variables used at step ``i`` (variables are numbered
    ``0 .. V-1``, usually by first use); ``sizes[v]`` is the bytes of variable ``v``;
    ``phases[i]`` is ``"F"`` (pack) or ``"B"`` (unpack); ``free_after[v]`` is the last step
    during which ``v`` is alive (autograd drops it afterwards; default: its last use);
    ``times[i]`` the seconds between step ``i-1`` and step ``i`` (not part of the signature).
    """

    steps: Steps
    sizes: Tuple[int, ...]
    phases: Tuple[str, ...] = ()
    free_after: Tuple[int, ...] = ()
    times: Tuple[float, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        steps = tuple(_step(i, s) for i, s in enumerate(self.steps))
        sizes = _int_tuple("sizes", self.sizes)
        n, nvars = len(steps), len(sizes)
        last = [-1] * nvars
        for i, s in enumerate(steps):
            if not s:
                raise ValueError(f"VariableSequence.steps[{i}]: a step uses at least one variable")
            if len(set(s)) != len(s):
                raise ValueError(f"VariableSequence.steps[{i}]: variable listed twice in {s!r}")
            for v in s:
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < nvars:
                    raise ValueError(f"VariableSequence.steps[{i}]: variable {v!r} is not in "
                                     f"0..{nvars - 1} (one size per variable)")
                last[v] = i
        unused = [v for v in range(nvars) if last[v] < 0]
        if unused:
            raise ValueError(f"VariableSequence.sizes: variables {unused[:5]} are never used")
        phases = tuple(self.phases) if self.phases else (PACK,) * n
        if len(phases) != n or any(p not in (PACK, UNPACK) for p in phases):
            raise ValueError(f"VariableSequence.phases: expected {n} entries of 'F' or 'B', "
                             f"got {self.phases!r}")
        free_after = _int_tuple("free_after", self.free_after) if self.free_after else tuple(last)
        if len(free_after) != nvars:
            raise ValueError(f"VariableSequence.free_after: length {len(free_after)}, "
                             f"expected one per variable ({nvars})")
        for v, (f, lu) in enumerate(zip(free_after, last)):
            if not lu <= f < n:
                raise ValueError(f"VariableSequence.free_after[{v}] = {f}: must lie between the "
                                 f"variable's last use ({lu}) and the last step ({n - 1})")
        times = tuple(_seconds(i, t) for i, t in enumerate(self.times))
        if times and len(times) != n:
            raise ValueError(f"VariableSequence.times: length {len(times)}, expected {n}")
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "phases", phases)
        object.__setattr__(self, "free_after", free_after)
        object.__setattr__(self, "times", times)

    # --------------------------------------------------------------------------- shape
    def __len__(self) -> int:
        return len(self.steps)

    @property
    def num_vars(self) -> int:
        return len(self.sizes)

    @cached_property
    def signature(self) -> int:
        """A hash of what planning depends on (uses, sizes, phases, frees); not the times."""
        return hash((self.steps, self.sizes, self.phases, self.free_after))

    @cached_property
    def events(self) -> Tuple[Tuple[Tuple[int, ...], str, Tuple[int, ...]], ...]:
        """Per step ``(variables, phase, their sizes)``: what the runtime compares live."""
        return tuple((s, p, tuple(self.sizes[v] for v in s))
                     for s, p in zip(self.steps, self.phases))

    @cached_property
    def use_steps(self) -> Tuple[Tuple[int, ...], ...]:
        """Per variable, the sorted steps that use it."""
        uses: List[List[int]] = [[] for _ in self.sizes]
        for i, s in enumerate(self.steps):
            for v in s:
                uses[v].append(i)
        return tuple(tuple(u) for u in uses)

    def next_use(self, var: int, step: int) -> Optional[int]:
        """The first step after ``step`` that uses ``var`` (None if there is none)."""
        u = self.use_steps[var]
        k = bisect.bisect_right(u, step)
        return u[k] if k < len(u) else None

    def step_bytes(self, step: int) -> int:
        return sum(self.sizes[v] for v in self.steps[step])

    def min_budget(self) -> Tuple[int, int]:
        """``(bytes, step)``: the most any one step needs resident (its own variables).
        No schedule fits a smaller budget; every budget at least this large can be met."""
        best, where = 0, 0
        for i in range(len(self.steps)):
            b = self.step_bytes(i)
            if b > best:
                best, where = b, i
        return best, where

    def largest_tensor(self) -> Tuple[int, int]:
        """``(bytes, variable)`` of the largest variable."""
        if not self.sizes:
            return 0, -1
        v = max(range(len(self.sizes)), key=self.sizes.__getitem__)
        return self.sizes[v], v

    def total_bytes(self) -> int:
        return sum(self.sizes)

    # ------------------------------------------------------------------------ JSON I/O
    def to_dict(self) -> Dict[str, Any]:
        return {"steps": [list(s) for s in self.steps], "sizes": list(self.sizes),
                "phases": "".join(self.phases), "free_after": list(self.free_after),
                "times": list(self.times)}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "VariableSequence":
        if not isinstance(d, dict):
            raise ValueError(f"VariableSequence: expected a JSON object, got {type(d).__name__}")
        missing = [k for k in ("steps", "sizes") if k not in d]
        if missing:
            raise ValueError(f"VariableSequence: missing field(s) {missing} (got fields "
                             f"{sorted(d)})")
        if not isinstance(d["steps"], (list, tuple)):
            raise ValueError(f"VariableSequence.steps: expected a list of steps, got "
                             f"{d['steps']!r:.80}")
        return cls(steps=tuple(d["steps"]), sizes=tuple(d["sizes"]),
                   phases=tuple(d.get("phases", "")), free_after=tuple(d.get("free_after", ())),
                   times=tuple(d.get("times", ())))


def _per_step(name: str, lists: Sequence[Sequence[int]], n: int) -> Tuple[Tuple[int, ...], ...]:
    if len(lists) != n:
        raise ValueError(f"SwapSchedule.{name}: {len(lists)} entries for {n} steps")
    return tuple(tuple(x) for x in lists)


@dataclass(frozen=True)
class SwapSchedule:
    """Per step ``i``: ``release[i]`` (wait for those swap-outs, free the device copies),
    then ``swap_in[i]`` (issue host-to-device copies), both before the step runs; and
    ``swap_out[i]`` (issue device-to-host copies) after it.

    ``blocking_release``: the planner relied on the release points to meet a budget, so the
    runtime waits for a copy still in flight there. Without it a release is "as soon as the
    copy completes, not before the planned step" and the runtime never blocks for it.
    """

    swap_in: Steps
    swap_out: Steps
    release: Steps
    blocking_release: bool = False
    planner: str = ""
    meta: Dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        n = len(self.swap_in)
        for name in ("swap_in", "swap_out", "release"):
            object.__setattr__(self, name, _per_step(name, getattr(self, name), n))

    @classmethod
    def empty(cls, n: int, planner: str = "", **meta: Any) -> "SwapSchedule":
        nothing = ((),) * n
        return cls(nothing, nothing, nothing, planner=planner, meta=dict(meta))

    def __len__(self) -> int:
        return len(self.swap_in)

    def counts(self) -> Dict[str, int]:
        return {k: sum(len(s) for s in getattr(self, k)) for k in ("swap_in", "swap_out", "release")}

    def to_dict(self) -> Dict[str, Any]:
        return {"swap_in": [list(s) for s in self.swap_in],
                "swap_out": [list(s) for s in self.swap_out],
                "release": [list(s) for s in self.release],
                "blocking_release": self.blocking_release, "planner": self.planner,
                "meta": self.meta}


# ------------------------------------------------------------------------------ replay
UNBORN, DEVICE, OUT, HOST, IN, FREED = range(6)
STATE_NAMES = ("unborn", "device", "out", "host", "in", "freed")


@dataclass(frozen=True)
class Replay:
    """What a schedule does to memory. ``resident[i]``: saved-tensor bytes on the device during
    step ``i`` (after its releases, swap-ins and creations); ``host[i]``: bytes held in host
    copies after step ``i``'s swap-outs (before its frees)."""

    resident: Tuple[int, ...]
    host: Tuple[int, ...]
    swapped_out_bytes: int
    swapped_in_bytes: int
    swap_outs: int
    swap_ins: int

    @property
    def peak(self) -> int:
        return max(self.resident, default=0)

    @property
    def host_peak(self) -> int:
        return max(self.host, default=0)


def replay(sequence: VariableSequence, schedule: SwapSchedule) -> Replay:
    """Execute ``schedule`` on ``sequence``; the single memory accounting of the swap planners.

    Raises ``InvalidPlanError`` (with the step as ``index``) for an impossible schedule: a use of
    a variable that is only on the host, a release without a swap-out in flight, a swap-in of a
    variable already on the device, a swap-out of one not on the device or freed right after.
    """
    n = len(sequence)
    if len(schedule) != n:
        raise InvalidPlanError(f"schedule has {len(schedule)} steps, the sequence {n}", None)
    sizes, free_after = sequence.sizes, sequence.free_after
    nvars = len(sizes)
    state = [UNBORN] * nvars
    has_host = [False] * nvars
    frees: List[List[int]] = [[] for _ in range(n)]
    for v, f in enumerate(free_after):
        frees[f].append(v)
    dev = host = out_b = in_b = n_out = n_in = 0
    resident: List[int] = []
    host_after: List[int] = []

    def check(v: int, i: int, what: str) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < nvars:
            raise InvalidPlanError(f"step {i}: {what} of unknown variable {v!r}", i)

    for i in range(n):
        for v in schedule.release[i]:
            check(v, i, "release")
            if state[v] != OUT:
                raise InvalidPlanError(f"step {i}: release of variable {v}, which is "
                                       f"{STATE_NAMES[state[v]]} (no swap-out in flight)", i)
            state[v] = HOST
            dev -= sizes[v]
        for v in schedule.swap_in[i]:
            check(v, i, "swap-in")
            if state[v] == HOST:
                state[v] = IN
                dev += sizes[v]
                in_b += sizes[v]
                n_in += 1
            elif state[v] == OUT:  # the device copy is still there: cancel the swap-out
                state[v] = DEVICE
            else:
                raise InvalidPlanError(f"step {i}: swap-in of variable {v}, which is "
                                       f"{STATE_NAMES[state[v]]}", i)
        for v in sequence.steps[i]:
            s = state[v]
            if s == UNBORN:
                dev += sizes[v]
                state[v] = DEVICE
            elif s == IN:
                state[v] = DEVICE
            elif s == HOST:
                raise InvalidPlanError(f"step {i} uses variable {v} while it is only on the "
                                       f"host (no swap-in scheduled before)", i)
            elif s == FREED:  # pragma: no cover - excluded by VariableSequence validation
                raise InvalidPlanError(f"step {i} uses freed variable {v}", i)
        resident.append(dev)
        for v in schedule.swap_out[i]:
            check(v, i, "swap-out")
            if state[v] not in (DEVICE, IN):
                raise InvalidPlanError(f"step {i}: swap-out of variable {v}, which is "
                                       f"{STATE_NAMES[state[v]]}", i)
            if free_after[v] == i:
                raise InvalidPlanError(f"step {i}: swap-out of variable {v}, which autograd "
                                       f"frees right after this step", i)
            if not has_host[v]:
                has_host[v] = True
                host += sizes[v]
                out_b += sizes[v]
                n_out += 1
            state[v] = OUT
        host_after.append(host)
        for v in frees[i]:
            if state[v] in (DEVICE, OUT, IN):
                dev -= sizes[v]
            if has_host[v]:
                host -= sizes[v]
            state[v] = FREED
    return Replay(tuple(resident), tuple(host_after), out_b, in_b, n_out, n_in)


def record_replay(sequence: VariableSequence, schedule: SwapSchedule) -> SwapSchedule:
    """A planner's last step: :func:`replay` ``schedule`` on ``sequence`` (which validates it)
    and record what it predicts in ``schedule.meta`` (``predicted_peak``,
    ``swapped_out_bytes``, ``swapped_in_bytes``). Returns ``schedule``."""
    predicted = replay(sequence, schedule)
    schedule.meta.update(predicted_peak=predicted.peak,
                         swapped_out_bytes=predicted.swapped_out_bytes,
                         swapped_in_bytes=predicted.swapped_in_bytes)
    return schedule


def random_sequence(num_vars: int, seed: int = 0, max_size: int = 10, reuse: float = 0.3,
                    unread: float = 0.1) -> VariableSequence:
    """A random forward/backward variable sequence with integer sizes (tests, benchmarks).

    The forward creates ``num_vars`` variables in order, sometimes packing an earlier one again
    (skip connections: a tensor saved by several ops); the backward unpacks every pack roughly
    in reverse order. A fraction ``unread`` of variables is never unpacked (a node the backward
    does not run): autograd frees those only at the end.
    """
    import random as _random

    if not isinstance(num_vars, int) or num_vars < 1:
        raise ValueError(f"random_sequence: num_vars must be a positive int, got {num_vars!r}")
    rng = _random.Random(seed)
    sizes = tuple(rng.randint(1, max_size) for _ in range(num_vars))
    forward: List[int] = []
    for v in range(num_vars):
        forward.append(v)
        if v and rng.random() < reuse:
            forward.append(rng.randrange(max(0, v - 4), v))
    skipped = {v for v in range(num_vars) if rng.random() < unread}
    backward = [v for v in reversed(forward) if v not in skipped]
    for k in range(len(backward) - 1):  # the backward of a DAG is only roughly reversed
        if rng.random() < 0.2:
            backward[k], backward[k + 1] = backward[k + 1], backward[k]
    order = forward + backward
    n = len(order)
    last = {v: i for i, v in enumerate(order)}
    free_after = tuple(n - 1 if v in skipped else min(n - 1, last[v] + rng.choice((0, 0, 0, 1)))
                       for v in range(num_vars))
    return VariableSequence(steps=tuple((v,) for v in order), sizes=sizes,
                            phases=(PACK,) * len(forward) + (UNPACK,) * len(backward),
                            free_after=free_after)
