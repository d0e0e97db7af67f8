"""``vmalloc.report()``'s figures from the live allocators: vmalloc's when it is registered,
else PyTorch's native allocator's."""
from __future__ import annotations

import atexit
import importlib
import os
import sys
from typing import Any, Dict, List, Mapping, Optional

from .history import drain_history, history_info
from .registry import REGISTRY, device_index, stats


def live_report(device: Optional[int] = None) -> Dict[str, Any]:
    """Report dict for ``vmalloc.report()``: vmalloc's figures when enabled, else PyTorch's."""
    rpt = importlib.import_module("vmalloc.report")
    reg = REGISTRY
    if reg.mode is not None:
        d = device_index(device)
        drain_history()   # first: the stats below then count no allocation the events miss
        s = stats(d)
        events = list(reg.history.get(d, ()))
        sizes = [int(e["size"]) for e in events if e["action"] == "alloc"] or None
        info = history_info(d)
        # n_max needs the whole history: not known once events were dropped
        n_max = (_max_live(events, int(s.get("num_live", 0)))
                 if events and not info["events_dropped"] else None)
        sections = reg.sections_for(d)
        if reg.recording:
            sections["history"] = info
        return rpt.build(s, source="vmalloc", device=d, sizes=sizes, n_max=n_max,
                         sections=sections,
                         title=f"vmalloc ({reg.mode}) on cuda:{d}")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        d = device_index(device)
        s = rpt.from_torch_stats(torch.cuda.memory_stats(d))
        return rpt.build(s, source="torch-native", device=d, sections=reg.sections_for(d),
                         title=f"PyTorch native allocator on cuda:{d}")
    d = 0 if device is None else int(device)
    empty = {k: 0 for k in ("requested_current", "requested_peak", "mapped_current", "mapped_peak",
                            "physical_current", "physical_peak", "num_malloc", "num_free")}
    return rpt.build(empty, source="none", device=None, sections=reg.sections_for(d),
                     title="no CUDA allocator in use (vmalloc not enabled, CUDA not initialised)")


def _max_live(events: List[Mapping[str, Any]], live_now: int) -> Optional[int]:
    """The most allocations live at once over ``events`` (the history up to now). The count
    starts from what was live before the first event (``live_now`` less the events' net change):
    allocations made before recording started are live too, and their frees are in the events.
    None when that start is negative (events and stats disagree)."""
    cur = live_now - sum(1 if e["action"] == "alloc" else -1 for e in events)
    if cur < 0:
        return None
    peak = cur
    for e in events:
        cur += 1 if e["action"] == "alloc" else -1
        peak = max(peak, cur)
    return peak


def register_exit_report(target: str) -> None:
    rpt = importlib.import_module("vmalloc.report")
    atexit.register(rpt.write_exit_report, target, os.getpid())
