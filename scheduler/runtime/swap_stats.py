"""What the swap runtime counts: saved bytes resident on the device (the budget's measure, with
the eviction order) and the counters ``SwapContext.stats()`` reports."""
from __future__ import annotations

from typing import Any, Dict

COUNTERS = ("swapped_out_bytes", "swapped_in_bytes", "reattached_bytes", "stall_seconds",
            "iterations", "on_demand_swap_ins", "late_swap_ins", "plan_switches",
            "plan_mismatches", "pressure_calls", "pressure_freed_bytes", "budget_evictions",
            "iterations_in_place", "in_place_evicted_bytes")


_MISSING = object()


def new_counters() -> Dict[str, float]:
    return {name: 0.0 if name == "stall_seconds" else 0 for name in COUNTERS}


class Residency:
    """Saved bytes held on the device, oldest first, with the all-time and per-iteration peaks."""

    def __init__(self) -> None:
        self.bytes = 0
        self.peak = 0
        self.iter_peak = 0
        self.last_iter_peak = 0
        # a plain dict keeps insertion order and pops faster than OrderedDict (hot path)
        self.order: Dict[Any, None] = {}
        self.unmanaged = 0  # (``set_unmanaged``)

    def add(self, var: Any) -> None:
        self.order[var] = None
        self.bytes += var.nbytes
        if self.bytes > self.peak:
            self.peak = self.bytes
        if self.bytes > self.iter_peak:
            self.iter_peak = self.bytes

    def set_unmanaged(self, nbytes: int) -> None:
        """Saved bytes resident without a var (tensors of iterations kept in place that are
        still alive: ``swap_in_place``), in ``bytes`` and the peaks like any other."""
        self.bytes += nbytes - self.unmanaged
        self.unmanaged = nbytes
        self.add_peak(0)

    def add_peak(self, nbytes: int) -> None:
        """The peaks as if ``nbytes`` more were resident now (an iteration kept in place counts
        its saved bytes, not their deaths: all of them, its peak in a training step)."""
        now = self.bytes + nbytes
        if now > self.peak:
            self.peak = now
        if now > self.iter_peak:
            self.iter_peak = now

    def drop(self, var: Any) -> None:
        # idempotent: a drain cut short by an interrupt may drop the same var again
        if self.order.pop(var, _MISSING) is not _MISSING:
            self.bytes -= var.nbytes

    def resync(self) -> None:
        """``bytes`` from ``order``: a Ctrl-C between an entry and its count (add, drop) must
        not leave phantom bytes charged to the budget for good."""
        self.bytes = sum(var.nbytes for var in self.order) + self.unmanaged

    def end_iteration(self) -> None:
        self.last_iter_peak = self.iter_peak
        self.resync()

    def new_iteration(self) -> None:
        self.iter_peak = self.bytes


def stats_dict(counters: Dict[str, float], residency: Residency, cache: Any, live: int,
               settings: Dict[str, Any], pool_stats: Dict[str, int],
               in_place_bytes: int = 0) -> Dict[str, Any]:
    """The public ``stats()`` keys (README, swap runtime section). ``in_place_bytes``: what
    the running iteration, kept in place, saved and may still hold (resident; the caller puts
    its count in the peaks)."""
    c = counters
    out: Dict[str, Any] = {
        "swapped_out_bytes": int(c["swapped_out_bytes"]),
        "swapped_in_bytes": int(c["swapped_in_bytes"]),
        "reattached_bytes": int(c["reattached_bytes"]),
        "peak_resident_bytes": residency.peak,
        "resident_bytes": residency.bytes + in_place_bytes,
        "last_iteration_peak_resident_bytes": residency.last_iter_peak,
        "stall_seconds": float(c["stall_seconds"]),
        "plans_computed": cache.misses,
        "plan_cache_hits": cache.hits,
        "planning_seconds": cache.planning_seconds,
        "iterations": int(c["iterations"]),
        "live_variables": live,
        "on_demand_swap_ins": int(c["on_demand_swap_ins"]),
        "late_swap_ins": int(c["late_swap_ins"]),
        "plan_switches": int(c["plan_switches"]),
        "plan_mismatches": int(c["plan_mismatches"]),
        "budget_evictions": int(c["budget_evictions"]),
        "iterations_in_place": int(c["iterations_in_place"]),
        "in_place_evicted_bytes": int(c["in_place_evicted_bytes"]),
        "pressure_calls": int(c["pressure_calls"]),
        "pressure_freed_bytes": int(c["pressure_freed_bytes"]),
    }
    out.update(settings)
    out.update(pool_stats)
    return out
