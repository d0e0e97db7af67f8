"""Event simulator: any Plan on any Chain -> makespan, peak memory, idle time, timeline, trace.

This is THE memory and time model of the project (DESIGN.md "The chain model"); every
planner's prediction must agree with it, and the exhaustive test oracle scores plans with it.

Items in memory
---------------
``x[s]`` (size ``chain.x[s]``; ``x[L+1]``, the loss value, has size 0), ``xbar[s]``
(``chain.xbar[s]``, which holds the output ``x[s+1]`` too) and ``delta[s]``
(``chain.delta[s]``). At time 0 only ``x[0]`` is stored; it counts in every number below.
"The input of stage s" is ``x[s]`` if stored, else ``xbar[s-1]``.

Compute ops (one compute stream, in plan order)
-----------------------------------------------
Memory *during* an op = everything stored + the op's outputs + its ``*_tmp``; outputs and
tmp are allocated when the op starts, tmp and the consumed items are freed when it ends.

===========  =========================================  ================  =====================
op           needs in memory                            adds              frees at its end
===========  =========================================  ================  =====================
``F_all s``  the input of stage s                       ``xbar[s]``       ``fw_tmp[s]``
``F_ck s``   the input of stage s (kept)                ``x[s+1]``        ``fck_tmp[s]``
``F_none s`` the input of stage s                       ``x[s+1]``        ``fck_tmp[s]``, the input
                                                                          if it is held as ``x[s]``
``B s``      ``xbar[s]``, the input of stage s,         ``delta[s]``      ``bw_tmp[s]``, ``xbar[s]``,
             ``delta[s+1]`` (not for the loss, s = L)                     ``delta[s+1]``, the input
                                                                          if it is held as ``x[s]``
===========  =========================================  ================  =====================

``F_*`` take ``fw[s]`` seconds, ``B s`` takes ``bw[s]``. Producing an item that is already
stored (on the GPU, in flight, or offloaded) is an error: plans never hold two copies.
A complete plan ends with ``delta[0]`` produced (B 0 ran); ``complete=False`` allows prefixes.

Transfers (seed 001 section 3, seed 000 assumptions A-D)
--------------------------------------------------------
``offload s`` / ``prefetch s`` move what is stored as the input of stage s (``x[s]``, else
``xbar[s-1]``) to / from host memory. There is ONE transfer channel: transfers run one at a
time in plan order, each taking ``size / bandwidth`` seconds (bandwidth in bytes/s), and they
overlap compute. A transfer is *issued* when every compute op listed before it has finished
(the compute stream has reached its position in the plan); it starts at the latest of its
issue time and the end of the previous transfer (and, under a memory limit, once a
prefetch's reservation fits).

* offload: the item stays in GPU memory (and counts) while the copy is in flight and is
  freed the instant the copy completes. Compute ops listed after the offload may still
  *read* it as long as the copy has not completed before they start (this is how
  ``offload s; F_ck s`` overlaps the copy of x[s] with the forward that reads it, as in
  seeds 000/001); they may not *consume* it (F_none's or B's frees): prefetch it first.
* prefetch: needs an earlier offload of the item; reserves its full size in GPU memory when
  the copy starts; a compute op that needs the item waits until the copy completes.

Streamed transfers (``plan.transfer_chunk``, our own extension, not seed 000/001): with a
chunk size c, a transfer of an item of size S is ceil(S / c) copies of at most c bytes that
run back to back on the channel (still one op of the plan, in plan order). An offload frees
each chunk the instant its copy completes; a prefetch reserves each chunk when its copy
starts (under a limit, the channel waits until the chunk fits). This is the continuous
release and reservation that seed 000's Algorithm 1 assumes (its fractional relaxation),
down to the chunk size. Compute ops still wait for a prefetch's last chunk, and may read
an item being offloaded only if none of its chunks had completed before they start.

By default the bandwidth is the plan's own, ``plan.bandwidth`` (the one its planner planned
at). ``bandwidth=None`` means there is no transfer channel: a plan with an offload or prefetch
is rejected (so is any transfer with bandwidth 0). ``float('inf')`` makes transfers
instantaneous. Strings such as ``"12GB/s"`` or ``"12GB"`` are read as bytes per second.

A plan is feasible under its memory limit at the bandwidth it was planned at. At another one
its transfers start at other times, so under the limit's no-wait policy (below) the order in
which ops take memory can change: a prefetch listed before a backward, ready sooner on a
faster channel, may then take memory the backward needed, and the plan blocks
(``InvalidPlanError``). ``memory=None`` simulates it anyway and reports its peak.

Memory limit and idle time (seed 001 Lemma 1)
---------------------------------------------
By default the limit is the plan's own, ``plan.memory_limit`` (the limit its planner
planned for; a plan without one is not limited), so a plan's ``predicted_peak`` and
``predicted_time`` are what ``simulate(chain, plan, bandwidth)`` reports. ``memory=M``
overrides it; ``memory=None`` enforces no limit.
With no limit nothing ever waits for memory: ops start as soon as their data and
resource are ready, and the peak is reported. With ``memory=M`` the simulator enforces M
with a no-wait policy (seed 000 Proposition 1): a compute op or a prefetch starts at the
first instant when, on top of what is in memory, its allocations fit under M (offloads
completing make room); ties go to the op listed first. This reproduces Lemma 1's idle time
``eps = max(0, (max_o(M_o - beta*d_o) - m_min) / beta)`` for whole-activation transfers. A
plan that can never fit raises ``InvalidPlanError`` at the blocked op.
``idle_time = makespan - compute_time``: the time the compute stream waits for prefetched
data, for memory, or for trailing transfers.

Events at the same instant: completions (frees) come before starts (allocations), and ties
go by plan order, so memory during an op is exactly the Table-1 sum above.

Allocation trace (the brief's contract 2)
-----------------------------------------
``SimResult.alloc_trace`` = ``{"meta": {...}, "events": [{"action", "id", "size", "stream",
"time"}]}`` in time order; stream 0 = compute, 1 = the transfer channel (prefetch buffers).
Sizes are bytes, rounded up to whole bytes for fractional chains; zero-size items are not
traced; items still stored at the end (``delta[0]``) have no free event
(``meta["live_at_end"]`` lists their ids). ``SimResult.trace_json(path)`` writes it
(gzip when the path ends in ``.gz``).
"""
from __future__ import annotations

import functools
import gc
import gzip
import heapq
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from .chain import Chain
from .errors import InvalidPlanError
from .plan import FORWARD_KINDS, TRANSFER_KINDS, Plan, checkpointed_blocks
from .units import format_bytes, limit_tolerance, parse_memory, parse_rate

Key = Tuple[str, int]          # ("x" | "xbar" | "delta", stage)
COMPUTE_STREAM, TRANSFER_STREAM = 0, 1


def _name(key: Key) -> str:
    return f"{key[0]}[{key[1]}]"


@dataclass
class Step:
    """What happened to one op of the plan."""

    index: int
    kind: str
    stage: int
    start: float = 0.0
    end: float = 0.0
    memory_before: float = 0.0   # in memory when it started, before its own allocations
    memory_after: float = 0.0    # in memory right after it completed
    peak: float = 0.0            # the most memory in use while it ran
    wait: float = 0.0            # compute: idle time of the compute stream just before it;
    #                              transfer: delay between being issued and starting
    item: str = ""               # transfers: which item moved ("x[3]", "xbar[2]")


@dataclass
class SimResult:
    makespan: float
    peak_memory: float
    compute_time: float
    idle_time: float
    transfer_time: float
    final_memory: float
    peak_index: int                         # op running when the peak was first reached (-1: x[0])
    # (time, memory in use from then on), one per instant memory changes; two at one instant
    # where memory peaks and drops at once (a zero-length op): max() over it is peak_memory
    timeline: List[Tuple[float, float]]
    steps: List[Step]
    alloc_trace: Dict[str, Any] = field(repr=False)
    bandwidth: Optional[float] = None
    memory_limit: Optional[float] = None

    def trace_json(self, path: Optional[str] = None) -> str:
        """The allocation trace as JSON text; also written to ``path`` if given
        (gzip-compressed when it ends in ``.gz``)."""
        text = json.dumps(self.alloc_trace)
        if path is not None:
            opener = gzip.open if str(path).endswith(".gz") else open
            with opener(path, "wt") as f:
                f.write(text)
        return text


# ---------------------------------------------------------------------------------- input
def _bytes(v: float) -> str:
    """A byte count in a message: whole numbers in full (1e+10 hides the byte that matters)."""
    return str(int(v)) if float(v).is_integer() and abs(v) < 2 ** 63 else f"{v:.10g}"


def _size(chain: Chain, key: Key) -> float:
    kind, s = key
    if kind == "x":
        return chain.x[s] if s <= chain.L else 0  # x[L+1]: the loss value
    return getattr(chain, kind)[s]


# ------------------------------------------------------------------ pass 1: data flow
@dataclass
class _Compute:
    dur: float
    allocs: List[Tuple[Any, float]]          # (key or ("tmp", i), size), at start
    frees: List[Tuple[Any, float]]           # (key, size), at end
    wait_for: List[int]                      # prefetch ops whose copy must be complete
    reads_offloaded: List[Tuple[Key, int]]   # (item, offload op): copy must not be done before start
    need: float = 0                          # the allocs' sizes summed


@dataclass
class _Transfer:
    key: Key
    size: float
    offload_op: int = -1                     # prefetch: the offload it undoes
    chunks: List[float] = field(default_factory=list)  # sizes of the copies, in order


MAX_CHUNKS = 1 << 16   # copies per transfer: a smaller chunk is refused, not simulated for hours


def _chunks(size: float, chunk: Optional[float], where: str) -> List[float]:
    """A transfer's copies: the whole item, or streamed in pieces of at most ``chunk``
    (the last one the rest; never a zero-length one from float rounding)."""
    if chunk is None or size <= chunk:
        return [size]
    n = math.ceil(size / chunk)
    if n > MAX_CHUNKS:
        raise ValueError(f"{where}: transfer_chunk={format_bytes(chunk)} splits an item of "
                         f"{format_bytes(size)} into {n} copies (at most {MAX_CHUNKS}); use a "
                         "larger chunk")
    out = [chunk] * (n - 1)
    rest = size - chunk * (n - 1)
    if rest > 0:
        out.append(rest)
    else:   # size / chunk rounded up past a whole number of chunks
        out[-1] += rest
    return out


def _plan_data_flow(chain: Chain, plan: Plan, bandwidth: Optional[float],
                    complete: bool) -> List[Union[_Compute, _Transfer]]:
    """Check the plan op by op (what is stored where) and say what each op allocates,
    frees and waits for. Time-dependent checks happen in the event loop."""
    L = chain.L
    # state: key -> ("gpu", -1) | ("pre", prefetch op) | ("off", offload op)
    state: Dict[Key, Tuple[str, int]] = {("x", 0): ("gpu", -1)}
    out: List[Union[_Compute, _Transfer]] = []

    def fail(i: int, msg: str) -> None:
        op = plan.ops[i]
        raise InvalidPlanError(f"op {i} ({op.kind} {op.stage}): {msg}", i)

    def input_of(s: int) -> Optional[Key]:
        if ("x", s) in state:
            return ("x", s)
        if s > 0 and ("xbar", s - 1) in state:
            return ("xbar", s - 1)
        return None

    def use(i: int, key: Key, consume: bool, c: _Compute) -> None:
        where, j = state[key]
        if where == "pre":
            c.wait_for.append(j)
        elif where == "off":
            if consume:
                fail(i, f"{_name(key)} was offloaded by op {j}; prefetch it before this op frees it")
            c.reads_offloaded.append((key, j))

    def produce(i: int, key: Key, c: _Compute) -> None:
        if key in state:
            where, j = state[key]
            what = {"gpu": "is already in memory", "pre": f"is already prefetched (op {j})",
                    "off": f"was offloaded by op {j}: prefetch it instead of recomputing it"}[where]
            fail(i, f"{_name(key)} {what}")
        state[key] = ("gpu", -1)
        c.allocs.append((key, _size(chain, key)))

    for i, op in enumerate(plan.ops):
        kind, s = op.kind, op.stage
        if s > L:
            fail(i, f"stage {s} is out of range (the chain has stages 0..{L})")
        if kind in TRANSFER_KINDS:
            if bandwidth is None:
                fail(i, "transfers need a bandwidth (simulate(..., bandwidth=bytes per second))")
            if bandwidth == 0:
                fail(i, "bandwidth is 0: a transfer would never finish")
            cands = [("x", s)] + ([("xbar", s - 1)] if s > 0 else [])
            if kind == "offload":
                key = next((k for k in cands if k in state and state[k][0] in ("gpu", "pre")), None)
                if key is None:
                    fail(i, f"nothing stored as the input of stage {s} is in GPU memory")
                state[key] = ("off", i)
                size = _size(chain, key)
                out.append(_Transfer(key, size, chunks=_chunks(size, plan.transfer_chunk,
                                                               f"op {i} ({kind} {s})")))
            else:
                key = next((k for k in cands if k in state and state[k][0] == "off"), None)
                if key is None:
                    fail(i, f"nothing stored as the input of stage {s} was offloaded")
                size = _size(chain, key)
                out.append(_Transfer(key, size, offload_op=state[key][1],
                                     chunks=_chunks(size, plan.transfer_chunk,
                                                    f"op {i} ({kind} {s})")))
                state[key] = ("pre", i)
            continue

        c = _Compute(dur=chain.fw[s] if kind in FORWARD_KINDS else chain.bw[s],
                     allocs=[], frees=[], wait_for=[], reads_offloaded=[])
        inp = input_of(s)
        if inp is None:
            fail(i, f"its input is not in memory (needs x[{s}]" + (f" or xbar[{s - 1}])" if s else ")"))
        if kind in FORWARD_KINDS:
            consumed = kind == "F_none" and inp == ("x", s)
            use(i, inp, consumed, c)
            produce(i, ("xbar", s) if kind == "F_all" else ("x", s + 1), c)
            tmp = chain.fw_tmp[s] if kind == "F_all" else chain.fck_tmp[s]
            c.allocs.append((("tmp", i), tmp))
            c.frees.append((("tmp", i), tmp))
            if consumed:
                c.frees.append((inp, _size(chain, inp)))
                del state[inp]
        else:  # B
            if ("xbar", s) not in state:
                fail(i, f"xbar[{s}] is not in memory (B {s} needs F_all {s} first)")
            needs = [("xbar", s), inp] + ([("delta", s + 1)] if s < L else [])
            if s < L and ("delta", s + 1) not in state:
                fail(i, f"delta[{s + 1}] is not in memory (B {s + 1} must run before B {s})")
            for key in needs:
                use(i, key, key != inp or key == ("x", s), c)
            produce(i, ("delta", s), c)
            c.allocs.append((("tmp", i), chain.bw_tmp[s]))
            c.frees.append((("tmp", i), chain.bw_tmp[s]))
            for key in needs:
                if key != inp or key == ("x", s):
                    c.frees.append((key, _size(chain, key)))
                    del state[key]
        c.need = sum(size for _, size in c.allocs)
        out.append(c)

    if complete and ("delta", 0) not in state:
        raise InvalidPlanError(
            f"op {len(plan.ops)} (end of plan): the plan ends before B 0 "
            "(delta[0] was never produced); pass complete=False to simulate a prefix",
            len(plan.ops))
    return out


# ------------------------------------------------------------------ pass 2: event loop
class _PlanLimit:
    """The default of ``simulate(memory=)``: the plan's own ``memory_limit``."""

    def __repr__(self) -> str:
        return "PLAN_LIMIT"


PLAN_LIMIT: Any = _PlanLimit()


class _PlanBandwidth:
    """The default of ``simulate(bandwidth=)``: the plan's own ``bandwidth``."""

    def __repr__(self) -> str:
        return "PLAN_BANDWIDTH"


PLAN_BANDWIDTH: Any = _PlanBandwidth()


def _cyclic_gc_paused(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with the cyclic garbage collector paused (enabled again afterwards if it was
    before: the switch is the process's, so a thread that disables it meanwhile is overruled).
    The event loop makes a few small containers per op and event, all alive until it returns
    and none in a cycle: the collector's passes over them took half the time of a ResNet-50
    simulation, and planners simulate hundreds of plans."""
    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        try:
            gc.disable()  # (inside: a Ctrl-C landing right after it still enables it again)
            return fn(*args, **kwargs)
        finally:
            gc.enable()
    return paused


@_cyclic_gc_paused
def simulate(chain: Chain, plan: Plan,
             bandwidth: Optional[Union[float, str]] = PLAN_BANDWIDTH, *,
             memory: Optional[Union[float, str]] = PLAN_LIMIT,
             complete: bool = True) -> SimResult:
    """Execute ``plan`` on ``chain``; see the module docstring for the exact semantics.

    ``bandwidth``: host<->device bytes per second; by default ``plan.bandwidth`` (the one its
    planner planned at); None: transfers are not allowed.
    ``memory``: a limit to enforce by waiting; by default ``plan.memory_limit`` (the limit
    the plan was made for); ``None``: no limit (never wait, just report the peak).
    ``complete``: require the plan to finish the backward (B 0).
    Raises ``InvalidPlanError`` (with ``.index``) for an op that cannot run.
    """
    if not isinstance(chain, Chain):
        raise ValueError(f"chain: expected a scheduler.Chain, got {type(chain).__name__}")
    if not isinstance(plan, Plan):
        raise ValueError(f"plan: expected a scheduler.Plan, got {type(plan).__name__}")
    bw = parse_rate(plan.bandwidth if bandwidth is PLAN_BANDWIDTH else bandwidth, "simulate",
                    allow_zero=True)  # (the one parser: "12GB/s" too)
    limit = parse_memory(plan.memory_limit if memory is PLAN_LIMIT else memory, "memory",
                         allow_zero=True, allow_none=True)
    flow = _plan_data_flow(chain, plan, bw, complete)
    ops = plan.ops
    n = len(ops)
    # an integer limit is kept to the byte on integer sizes; fractional chains (measured,
    # discretized) and chunks get a relative float tolerance
    tol = 0.0 if limit is None else limit_tolerance(limit, chain.is_integer and (
        plan.transfer_chunk is None or float(plan.transfer_chunk).is_integer()))

    steps = [Step(i, op.kind, op.stage) for i, op in enumerate(ops)]
    comp = [i for i in range(n) if isinstance(flow[i], _Compute)]
    xfer = [i for i in range(n) if isinstance(flow[i], _Transfer)]
    n_comp_before = {}
    seen = 0
    for i in range(n):
        if isinstance(flow[i], _Compute):
            seen += 1
        else:
            n_comp_before[i] = seen

    # memory and trace bookkeeping
    x0 = _size(chain, ("x", 0))
    mem: float = 0  # x[0] is allocated below (ints stay ints on integer chains)
    peak, peak_index = x0, -1
    timeline: List[Tuple[float, float]] = [(0.0, x0)]
    events: List[Dict[str, Any]] = []
    # key -> [(trace id, bytes, stream)]: one entry, or one per chunk of a streamed prefetch
    ids: Dict[Any, List[Tuple[int, int, int]]] = {}
    next_id = [0]
    running: List[int] = []                     # ops running now (peaks follow memory)

    def bytes_of(v: float) -> int:
        return int(v) if float(v).is_integer() else int(math.ceil(v))

    def changed(t: float) -> None:
        nonlocal peak, peak_index
        # several changes at one instant make one point, except a peak that memory drops from
        # at the same instant (a zero-length op's): it is kept, so the timeline's max is the peak
        last = timeline[-1]
        if last[0] == t and (mem >= last[1] or (len(timeline) > 1 and timeline[-2][1] >= last[1])):
            timeline[-1] = (t, mem)
        else:
            timeline.append((t, mem))
        for j in running:
            steps[j].peak = max(steps[j].peak, mem)
        if mem > peak:
            peak = mem
            peak_index = next((j for j in running if isinstance(flow[j], _Compute)),
                              running[0] if running else -1)

    def trace_alloc(t: float, key: Any, b: int, stream: int) -> None:
        ids.setdefault(key, []).append((next_id[0], b, stream))
        events.append({"action": "alloc", "id": next_id[0], "size": b, "stream": stream,
                       "time": t})
        next_id[0] += 1

    def trace_free(t: float, key: Any) -> Tuple[int, int]:
        """Free every trace id of ``key``; returns (bytes freed, stream of the first)."""
        entries = ids.pop(key, [])
        for tid, b, stream in entries:
            events.append({"action": "free", "id": tid, "size": b, "stream": stream, "time": t})
        return sum(e[1] for e in entries), (entries[0][2] if entries else COMPUTE_STREAM)

    def alloc(t: float, key: Any, size: float, stream: int) -> None:
        nonlocal mem
        mem += size
        if size > 0:
            trace_alloc(t, key, bytes_of(size), stream)

    def free(t: float, key: Any, size: float) -> None:
        nonlocal mem
        mem -= size
        if size > 0:
            trace_free(t, key)

    def free_part(t: float, key: Any, size: float, last: bool) -> None:
        """A streamed offload's chunk is copied: in the trace, the item's block is freed
        and what is left of it allocated again (an allocator releases it page by page)."""
        nonlocal mem
        mem -= size
        if size > 0 or last:
            held, stream = trace_free(t, key)
            rest = 0 if last else held - bytes_of(size)
            if rest > 0:
                trace_alloc(t, key, rest, stream)

    alloc(0.0, ("x", 0), x0, COMPUTE_STREAM)

    t: float = 0
    ci = xi = 0
    comp_running: Optional[int] = None
    xfer_running: Optional[int] = None       # the transfer op under way (between its chunks too)
    chunk_in_flight = False
    chunk_next: Dict[int, int] = {}           # transfer op -> index of its next chunk
    first_done_at: Dict[int, float] = {}      # offload op -> when its first chunk was copied
    compute_free_at = 0.0
    channel_free_at = 0.0
    comp_done = 0
    done_at: Dict[int, float] = {}            # transfer op -> completion time
    heap: List[Tuple[float, int]] = []
    compute_time = transfer_time = 0.0
    comp_end: List[float] = []                # end time of the k-th compute op

    def start_compute(i: int) -> None:
        nonlocal comp_running
        c = flow[i]
        st = steps[i]
        st.start, st.wait, st.memory_before = t, t - compute_free_at, mem
        running.append(i)
        st.peak = mem
        for key, size in c.allocs:
            alloc(t, key, size, COMPUTE_STREAM)
        changed(t)
        comp_running = i
        heapq.heappush(heap, (t + c.dur, i))

    def start_transfer(i: int) -> None:
        """Start op i's next chunk (its first: the op starts)."""
        nonlocal xfer_running, chunk_in_flight
        tr = flow[i]
        st = steps[i]
        c = chunk_next.setdefault(i, 0)
        if c == 0:
            k = n_comp_before[i]
            issued = comp_end[k - 1] if k else 0.0
            st.start, st.memory_before, st.item = t, mem, _name(tr.key)
            st.wait = t - issued
            st.peak = mem
            running.append(i)
        size = tr.chunks[c]
        if ops[i].kind == "prefetch":
            alloc(t, tr.key, size, TRANSFER_STREAM)
            changed(t)
        xfer_running, chunk_in_flight = i, True
        dur = 0.0 if size == 0 or math.isinf(bw) else size / bw
        heapq.heappush(heap, (t + dur, i))

    def finish(i: int) -> None:
        nonlocal comp_running, xfer_running, comp_done, compute_free_at, channel_free_at
        nonlocal ci, xi, compute_time, transfer_time, chunk_in_flight
        f = flow[i]
        st = steps[i]
        st.end = t
        if isinstance(f, _Compute):
            for key, size in f.frees:
                free(t, key, size)
            comp_running, compute_free_at = None, t
            comp_done += 1
            comp_end.append(t)
            ci += 1
            compute_time += f.dur
        else:
            c = chunk_next[i]
            size = f.chunks[c]
            last = c + 1 == len(f.chunks)
            chunk_in_flight = False
            channel_free_at = t
            transfer_time += 0.0 if size == 0 or math.isinf(bw) else size / bw
            if ops[i].kind == "offload":
                free_part(t, f.key, size, last)
                first_done_at.setdefault(i, t)
            if not last:                       # the op goes on with its next chunk
                chunk_next[i] = c + 1
                changed(t)
                return
            done_at[i] = t
            xfer_running = None
            xi += 1
        running.remove(i)
        changed(t)
        st.memory_after = mem

    def compute_blocker(i: int) -> Optional[str]:
        c = flow[i]
        for j in c.wait_for:
            if j not in done_at:
                return f"waits for the prefetch at op {j}"
        for key, j in c.reads_offloaded:
            # a copy that completes at the instant this op starts has freed the item already
            # (completions come first); only an instantaneous copy (inf bandwidth) may tie
            done = first_done_at.get(j)   # streamed: the first chunk freed part of it
            if done is not None and (done < t or (done == t and steps[j].start < t)):
                raise InvalidPlanError(
                    f"op {i} ({ops[i].kind} {ops[i].stage}): {_name(key)} was offloaded by op {j} "
                    f"and its copy {'completed' if j in done_at else 'began freeing it'} at "
                    f"t={done:g}, before this op starts at t={t:g}; prefetch it first", i)
        if limit is not None and mem + c.need > limit + tol:
            return (f"needs {_bytes(c.need)} more but {_bytes(mem)} of the limit "
                    f"{_bytes(limit)} is in use")
        return None

    def transfer_blocker(i: int) -> Optional[str]:
        if comp_done < n_comp_before[i]:
            return "not issued yet"
        if ops[i].kind == "prefetch" and limit is not None:
            size = flow[i].chunks[chunk_next.get(i, 0)]
            if mem + size > limit + tol:
                return (f"needs {_bytes(size)} more but {_bytes(mem)} of the limit "
                        f"{_bytes(limit)} is in use")
        return None

    while True:
        while heap and heap[0][0] <= t:
            _, i = heapq.heappop(heap)
            finish(i)
        started = False
        cands = []
        if comp_running is None and ci < len(comp):
            cands.append(comp[ci])
        if xfer_running is None and xi < len(xfer):
            cands.append(xfer[xi])
        elif xfer_running is not None and not chunk_in_flight:
            cands.append(xfer_running)            # a streamed transfer's next chunk
        reasons = {}
        for i in sorted(cands):
            why = compute_blocker(i) if isinstance(flow[i], _Compute) else transfer_blocker(i)
            if why is None:
                (start_compute if isinstance(flow[i], _Compute) else start_transfer)(i)
                started = True
                break  # a zero-length op may complete at t: settle that before the next start
            reasons[i] = why
        if started:
            continue
        if heap:
            t = heap[0][0]
            continue
        if ci >= len(comp) and xi >= len(xfer):
            break
        i = min(reasons)
        c = chunk_next.get(i, 0)
        what = "start" if c == 0 else f"copy its chunk {c + 1} of {len(flow[i].chunks)}"
        raise InvalidPlanError(
            f"op {i} ({ops[i].kind} {ops[i].stage}) can never {what}: {reasons[i]}, and "
            "nothing running can free memory", i)

    makespan = max(compute_free_at, channel_free_at)
    live = sorted(e[0] for v in ids.values() for e in v)
    trace = {"meta": {"source": "scheduler.simulate", "chain": chain.name, "planner": plan.planner,
                      "units": {"size": "bytes", "time": "s"},
                      "streams": {"0": "compute", "1": "transfer (prefetch buffers)"},
                      "bandwidth": bw, "memory_limit": limit, "makespan": makespan,
                      "transfer_chunk": plan.transfer_chunk,
                      "peak_memory": peak, "live_at_end": live},
             "events": events}
    return SimResult(makespan=makespan, peak_memory=peak, compute_time=compute_time,
                     idle_time=makespan - compute_time, transfer_time=transfer_time,
                     final_memory=mem, peak_index=peak_index, timeline=timeline, steps=steps,
                     alloc_trace=trace, bandwidth=bw, memory_limit=limit)


# ------------------------------------------------------- checkpoint plans without events
def simulate_checkpointed(chain: Chain, checkpointed: Iterable[int]) -> Tuple[float, float]:
    """``(makespan, peak_memory)`` of ``simulate(chain, checkpoint_plan(chain.L,
    checkpointed))``, the very floats, in one pass over the plan without its events, steps or
    trace (Mimose checks a plan per new input size with it: 6 us at L=12 where simulate takes
    0.2 ms). The plan runs its ops back to back, so memory is the table above applied in plan
    order, each op's allocations before its frees, in ``simulate``'s order of additions;
    ``tests/test_simulate_checkpointed.py`` holds the two equal (ints on an integer chain).
    A block outside 0..L-1 raises ``ValueError``, as ``checkpoint_plan``."""
    L = chain.L
    ck = checkpointed_blocks(L, checkpointed, "simulate_checkpointed")
    x, xbar, delta = chain.x, chain.xbar, chain.delta
    stored = {0}                        # the stages whose input is held as x[s]
    mem = peak = x[0]
    t: float = 0                        # (an integer chain's times stay ints, as simulate's)

    def run(made: float, tmp: float, dur: float) -> None:
        nonlocal mem, peak, t
        mem += made
        mem += tmp
        if mem > peak:
            peak = mem
        mem -= tmp
        t += dur

    for s in range(L):
        if s in ck:     # F_ck s: x[s+1]
            run(x[s + 1], chain.fck_tmp[s], chain.fw[s])
            stored.add(s + 1)
        else:           # F_all s
            run(xbar[s], chain.fw_tmp[s], chain.fw[s])
    run(xbar[L], chain.fw_tmp[L], chain.fw[L])      # the loss: F_all L, B L
    run(delta[L], chain.bw_tmp[L], chain.bw[L])
    mem -= xbar[L]
    if L in stored:
        mem -= x[L]
    for s in range(L - 1, -1, -1):
        if s in ck:
            run(xbar[s], chain.fw_tmp[s], chain.fw[s])
        run(delta[s], chain.bw_tmp[s], chain.bw[s])
        mem -= xbar[s]
        if s in stored:
            mem -= x[s]
        mem -= delta[s + 1]
    return t, peak
