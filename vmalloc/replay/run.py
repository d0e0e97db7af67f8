"""Replay a trace through an allocator, and find the smallest budget it still fits in.

Any object with ``malloc(nbytes, stream) -> int``, ``free(ptr)``, ``stats() -> mapping`` and
``close()`` can be replayed: :class:`vmalloc.Allocator` (host-lazy backend: real page mappings
that take no RAM, no GPU)
and :class:`CachingAllocatorModel` (PyTorch's native allocator) share this one loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..sizes import format_size_exact
from .caching_model import K_ROUND_LARGE, CachingAllocatorModel
from .trace import Trace

#: budget (bytes, or None for no cap) -> a fresh allocator
Factory = Callable[[Optional[int]], Any]


@dataclass
class ReplayResult:
    allocator: str
    ok: bool                       # the whole trace replayed without running out
    failed_at: Optional[int]       # index of the event that ran out, if any
    stats: Dict[str, Any]          # the allocator's stats() after the last event replayed
    if_peak: int = 0               # max over time of mapped - requested (seed 003 Eq. 1, summed)
    n_max: int = 0                 # max simultaneously live allocations (N_max, Eq. 2)
    timeline: Optional[Dict[str, List[float]]] = None   # event index -> requested/physical


def replay(trace: Trace, allocator: Any, name: str = "", timeline: bool = False,
           max_points: int = 2000) -> ReplayResult:
    """Drive ``allocator`` through ``trace``; stop at the first out-of-memory."""
    ptrs: Dict[int, int] = {}
    if_peak = n_live = n_max = 0
    track = timeline
    every = max(1, len(trace) // max_points) if timeline else 0
    tl: Dict[str, List[float]] = {"event": [], "time": [], "requested": [], "mapped": [],
                                  "physical": []}
    failed_at: Optional[int] = None
    for i, e in enumerate(trace.events):
        if e.action == "alloc":
            try:
                ptrs[e.id] = allocator.malloc(e.size, e.stream)
            except MemoryError:   # vmalloc.OutOfMemoryError and the model's both derive from it
                failed_at = i
                break
            n_live += 1
            n_max = max(n_max, n_live)
            if track:
                s = allocator.stats()
                if_peak = max(if_peak, s["mapped_current"] - s["requested_current"])
        else:
            allocator.free(ptrs.pop(e.id))
            n_live -= 1
        if track and (i % every == 0 or i == len(trace) - 1):
            s = allocator.stats()
            tl["event"].append(i)
            tl["time"].append(e.time)
            tl["requested"].append(s["requested_current"])
            tl["mapped"].append(s["mapped_current"])
            tl["physical"].append(s["physical_current"])
    stats = dict(allocator.stats())
    return ReplayResult(allocator=name or getattr(allocator, "name", type(allocator).__name__),
                        ok=failed_at is None, failed_at=failed_at, stats=stats,
                        if_peak=if_peak, n_max=n_max, timeline=tl if timeline else None)


def fits(trace: Trace, factory: Factory, budget: Optional[int]) -> bool:
    """True when the whole trace replays on a fresh allocator capped at ``budget``."""
    a = factory(budget)
    try:
        return replay(trace, a).ok
    finally:
        a.close()


def _trial(trace: Trace, factory: Factory, budget: int) -> Tuple[bool, Optional[int]]:
    """Replay on a fresh allocator capped at ``budget``: (fits, the next budget that can behave
    differently, when the allocator tells: the caching model's ``min_refused``)."""
    a = factory(budget)
    try:
        ok = replay(trace, a).ok
        return ok, getattr(a, "min_refused", None)
    finally:
        a.close()


#: most replays min_budget's scan (non-monotone allocators) spends before it settles for a
#: bisection of what is left; the bundled traces need at most ~20, a 200k-event trace ~140
MAX_SCAN_TRIALS = 256


def smallest_budget(trace: Trace, factory: Factory, granularity: int,
                    upper: Optional[int] = None, fallback_upper: Optional[int] = None,
                    monotone: Optional[bool] = None,
                    max_trials: int = MAX_SCAN_TRIALS) -> Tuple[Optional[int], bool]:
    """:func:`min_budget`, and whether the answer is proven to be the smallest that fits
    (False only when a non-monotone scan ran out of ``max_trials`` and bisected the rest)."""
    if granularity <= 0:
        raise ValueError(f"granularity: must be > 0, got {granularity}")
    if trace.peak_requested() == 0:
        return 0, True            # nothing allocated: no memory needed (not one granule)
    if monotone is None:
        monotone = getattr(factory, "monotone", True)
    if upper is None:
        a = factory(None)
        try:
            res = replay(trace, a)
        finally:
            a.close()
        upper = res.stats["physical_peak"]
    lo = math.ceil(trace.peak_requested() / granularity)
    hi = max(lo, math.ceil(upper / granularity))
    if not monotone:
        # More budget can hurt here (the caching model: a bigger cap means fewer OOM-retry
        # releases, so segments stay split), so bisection may land above smaller budgets that
        # fit. Scan up from the floor instead: the first budget that fits is the smallest.
        # It stops by the uncapped peak (``fallback_upper`` or ``upper``: the cap never binds).
        top = math.ceil(max(upper, fallback_upper or 0) / granularity)
        k = lo
        for _ in range(max_trials):
            if k > top:
                return None, True
            ok, refused = _trial(trace, factory, k * granularity)
            if ok:
                return k * granularity, True
            # every budget below the smallest one refused replays the same way: skip them
            k = max(k + 1, -(-refused // granularity) if refused else k + 1)
        lo, exact = k, False      # out of trials: the answer is in [k, what bisection finds]
        hi = max(lo, hi)
    else:
        exact = True
    if not fits(trace, factory, hi * granularity):
        if fallback_upper is None or fallback_upper <= hi * granularity:
            return None, exact
        lo, hi = hi + 1, math.ceil(fallback_upper / granularity)
        if not fits(trace, factory, hi * granularity):
            return None, exact
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(trace, factory, mid * granularity):
            hi = mid
        else:
            lo = mid + 1
    return lo * granularity, exact


def min_budget(trace: Trace, factory: Factory, granularity: int,
               upper: Optional[int] = None, fallback_upper: Optional[int] = None,
               monotone: Optional[bool] = None,
               max_trials: int = MAX_SCAN_TRIALS) -> Optional[int]:
    """Smallest multiple of ``granularity`` at which ``trace`` replays without running out
    (0 for a trace that allocates nothing; None if no bound tried fits).

    ``monotone`` (default: the factory's ``monotone`` attribute, else True) says more budget
    never hurts, as for vmalloc (a cap only adds failures and remaps): then bisection, as RAPIDS
    RMM's replay benchmark does on its simulated memory size. The search starts at the trace's
    peak requested bytes (no allocator needs less) and ends at ``upper`` (default: the peak
    physical bytes of an uncapped run, which fits by construction); if ``upper`` (a guess, e.g.
    a leaner run's peak) does not fit, ``fallback_upper`` is tried.

    Not monotone (the caching model, ``caching_factory``: a cap can fit where a bigger one
    fails): budgets are tried upward from the peak requested bytes, skipping those the
    allocator reports would replay identically, so the answer is the smallest budget that fits
    anywhere, not just a crossing a bisection happens to find. After ``max_trials`` replays the
    rest is bisected (see :func:`smallest_budget`, which says whether that happened).
    """
    return smallest_budget(trace, factory, granularity, upper, fallback_upper, monotone,
                           max_trials)[0]


def vmalloc_factory(chunk_size: int, backend: str = "host-lazy",
                    prefer_remap: bool = False) -> Factory:
    """Fresh :class:`vmalloc.Allocator` on ``backend`` with ``chunk_size`` and a given budget.

    ``host-lazy`` (the default): real mappings of memfd chunks that take no RAM, since a replay
    never writes, so a trace recorded on an 80 GB GPU replays on any machine, decision for
    decision as on ``host``.

    ``prefer_remap`` is issue 2's lean policy (remap cached chunks before creating new ones); the
    default policy grows the cache up to the budget first, as PyTorch's allocator does.
    """
    from ..allocator import Allocator

    def make(budget: Optional[int]) -> Any:
        return Allocator(backend=backend, chunk_size=chunk_size, budget=budget,
                         prefer_remap=prefer_remap)
    return make


def caching_factory(max_split_size: Optional[int] = None) -> Factory:
    """Fresh :class:`CachingAllocatorModel` with a given budget; marked not monotone (a bigger
    cap can fail where a smaller one fits), so :func:`min_budget` scans instead of bisecting."""
    def make(budget: Optional[int]) -> CachingAllocatorModel:
        return CachingAllocatorModel(budget=budget, max_split_size=max_split_size)
    make.monotone = False  # type: ignore[attr-defined]
    return make


@dataclass
class Contender:
    """One allocator in a side-by-side replay."""

    name: str
    factory: Factory
    granularity: int       # physical memory comes in multiples of this (bisection step)
    chunk_size: int = 0    # vmalloc's m_c (0 for the caching model)
    # a leaner configuration whose uncapped peak is a good first upper bound for the bisection
    # (saves replays; the bisection still checks it and falls back to the uncapped peak)
    lean_factory: Optional[Factory] = None


def default_contenders(chunk_sizes: Sequence[int] = (2 << 20, 20 << 20),
                       backend: str = "host-lazy") -> List[Contender]:
    out = [Contender(f"vmalloc {format_size_exact(c)}", vmalloc_factory(c, backend), c, c,
                     lean_factory=vmalloc_factory(c, backend, prefer_remap=True))
           for c in chunk_sizes]
    # every segment of the native allocator is a multiple of 2 MiB (kSmallBuffer, kRoundLarge)
    out.append(Contender("pytorch caching (model)", caching_factory(), K_ROUND_LARGE))
    return out


@dataclass
class Row:
    """One allocator's figures on one trace (a row of the side-by-side report)."""

    allocator: str
    ok: bool
    requested_peak: int
    physical_peak: int
    mapped_peak: int
    ratio: Optional[float]           # physical_peak / requested_peak (None: nothing requested)
    fragmentation: float             # 1 - requested_peak / physical_peak (GMLake's metric)
    min_budget: Optional[int]
    budget_ratio: Optional[float]    # min_budget / requested_peak: what the workload really needs
    if_peak: int
    if_bound: int                    # N_max * m_c (seed 003 Eq. 2), 0 when not chunked
    n_max: int
    num_map: int
    num_unmap: int
    cache_hits: int
    chunk_size: int = 0
    # False when min_budget is only an upper bound: a non-monotone allocator's scan ran out of
    # trials (MAX_SCAN_TRIALS) and bisected the rest
    min_budget_exact: bool = True
    timeline: Optional[Dict[str, List[float]]] = field(default=None, repr=False)

    def to_json(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("timeline")
        return d


def compare(trace: Trace, contenders: Optional[Sequence[Contender]] = None,
            bisect: bool = True, timeline: bool = False) -> List[Row]:
    """Replay ``trace`` through every contender: peaks, ratio, fragmentation, smallest budget."""
    rows = []
    for c in contenders if contenders is not None else default_contenders():
        a = c.factory(None)
        try:
            res = replay(trace, a, name=c.name, timeline=True)
        finally:
            a.close()
        s = res.stats
        req, phys = s["requested_peak"], s["physical_peak"]
        budget, exact = None, True
        if bisect and res.ok:
            upper = phys
            if c.lean_factory is not None:
                lean = c.lean_factory(None)
                try:
                    upper = min(phys, replay(trace, lean).stats["physical_peak"])
                finally:
                    lean.close()
            budget, exact = smallest_budget(trace, c.factory, c.granularity, upper=upper,
                                            fallback_upper=phys)
        rows.append(Row(
            allocator=c.name, ok=res.ok, requested_peak=req, physical_peak=phys,
            # None, not NaN, for an empty trace: --json must write standard JSON (null)
            mapped_peak=s["mapped_peak"], ratio=phys / req if req else None,
            fragmentation=1 - req / phys if phys else 0.0, min_budget=budget,
            budget_ratio=budget / req if budget and req else None,
            if_peak=res.if_peak, if_bound=res.n_max * c.chunk_size, n_max=res.n_max,
            num_map=s.get("num_map", 0), num_unmap=s.get("num_unmap", 0),
            cache_hits=s.get("num_cache_hits", 0), chunk_size=c.chunk_size,
            min_budget_exact=exact,
            timeline=res.timeline if timeline else None))
    return rows
