"""PyTorch memory snapshots as allocation traces.

Snapshots are the pickles of ``torch.cuda.memory._dump_snapshot()`` (or the dict of
``torch.cuda.memory._snapshot()``) recorded with ``_record_memory_history()``: the per-device
``device_traces`` hold ``alloc`` / ``free_requested`` / ``free_completed`` entries with ``addr``,
``size`` (the caller's requested bytes), ``stream`` and, in recent versions, ``time_us``. Every
entry is checked: a missing or malformed field is an error naming the entry.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .trace import Event, Trace, checked_int, checked_time


def _entry(e: Any, device: int, k: int) -> Tuple[str, int, int, int, Any]:
    """``(action, addr, size, stream, time_us)`` of ``device_traces[device][k]``."""
    where = f"snapshot device_traces[{device}][{k}]"
    if not isinstance(e, Mapping):
        raise ValueError(f"{where}: expected an object, got {e!r:.60}")
    action = e.get("action")
    if action not in ("alloc", "free_requested", "free_completed"):
        return action, 0, 0, 0, None  # segment events and the like: not requests
    for key in ("addr", "size"):
        if key not in e:
            raise ValueError(f"{where} ({action}): missing {key!r}")
    us = e.get("time_us")
    if us is not None:  # a float from here on: a huge int would overflow in t_of's division
        us = checked_time(us, f"{where}.time_us")
    return (action, checked_int(e["addr"], f"{where}.addr"), checked_int(e["size"], f"{where}.size"),
            checked_int(e.get("stream", 0) or 0, f"{where}.stream"), us)


def from_snapshot(snapshot: Mapping[str, Any], device: Optional[int] = None,
                  name: Optional[str] = None) -> Trace:
    """Turn a PyTorch memory snapshot's ``device_traces`` into a :class:`Trace`.

    A block counts as freed at ``free_completed`` (when the native allocator could reuse it),
    or at ``free_requested`` when no completion follows (snapshots made by
    ``torch.cuda.memory._profile_to_snapshot`` or traces cut short). Frees of addresses allocated
    before recording started become allocations at the start of the trace, and so do blocks that
    the snapshot's ``segments`` show live but the trace never allocated.
    """
    traces = snapshot.get("device_traces")
    if "device_traces" not in snapshot:
        raise ValueError("snapshot: no 'device_traces' (record with "
                         "torch.cuda.memory._record_memory_history() before _snapshot())")
    if not isinstance(traces, list):
        raise ValueError(f"snapshot: 'device_traces' has the wrong type: expected a list (one "
                         f"list of entries per device), got {type(traces).__name__}")
    for d, t in enumerate(traces):
        if not isinstance(t, list):
            raise ValueError(f"snapshot: device_traces[{d}] has the wrong type: expected a list "
                             f"of entries, got {type(t).__name__}")
    if device is None:  # the busiest device
        device = max(range(len(traces)), key=lambda d: len(traces[d])) if traces else 0
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < len(traces):
        n = len(traces)
        which = "no device" if n == 0 else "device 0 only" if n == 1 else f"devices 0..{n - 1}"
        raise ValueError(f"device: the snapshot has traces for {which}, got {device!r}")
    entries = traces[device]
    pre: List[Event] = []            # allocations that predate the recording
    events: List[Event] = []
    live: Dict[int, Tuple[int, int]] = {}   # addr -> (id, size)
    stream_of: Dict[int, int] = {}          # addr -> allocation stream
    pending: Dict[int, Tuple[int, int, int, float]] = {}  # addr -> requested free not completed
    next_id = 0
    t0 = None

    def t_of(e: Mapping[str, Any]) -> float:
        nonlocal t0
        us = e.get("time_us")
        if us is None:
            return float(len(events))
        us = float(us)  # _entry checked it is finite as a float: no int overflow below
        if t0 is None:
            t0 = us
        return (us - t0) / 1e6

    def emit_free(addr: int, time: float) -> None:
        ident, size = live.pop(addr)
        pending.pop(addr, None)
        events.append(Event("free", ident, size, stream_of.pop(addr, 0), time))

    for k, e in enumerate(entries):
        action, addr, size, stream, _ = _entry(e, device, k)
        if action == "alloc":
            if addr in live:     # address reused before a completion we never saw
                emit_free(addr, t_of(e))
            live[addr] = (next_id, size)
            stream_of[addr] = stream
            events.append(Event("alloc", next_id, size, stream, t_of(e)))
            next_id += 1
        elif action in ("free_requested", "free_completed"):
            if addr not in live:
                if action == "free_completed" and addr in pending:
                    continue
                # allocated before recording began: make it live from the start
                pre.append(Event("alloc", next_id, size, stream, 0.0))
                live[addr] = (next_id, size)
                stream_of[addr] = stream
                next_id += 1
            if action == "free_requested":
                pending[addr] = live[addr] + (stream, t_of(e))
            else:
                emit_free(addr, t_of(e))
    for addr in list(pending):   # requested but never completed within the trace
        if addr in live:
            emit_free(addr, pending[addr][3])
    # live blocks the trace never allocated (pre-existing, still live at snapshot time)
    segments = snapshot.get("segments", [])
    if not isinstance(segments, list):
        raise ValueError(f"snapshot segments: expected a list, got {type(segments).__name__}")
    for j, seg in enumerate(segments):
        if not isinstance(seg, Mapping) or not isinstance(seg.get("blocks", []), list):
            raise ValueError(f"snapshot segments[{j}]: expected an object with a list of blocks")
        if seg.get("device", device) != device:
            continue
        for b in seg.get("blocks", []):
            if not isinstance(b, Mapping):
                raise ValueError(f"snapshot segments[{j}].blocks: expected objects, got {b!r:.60}")
            if b.get("state") != "active_allocated":
                continue
            addr = checked_int(b.get("address"), f"snapshot segments[{j}] block address")
            if addr not in live:
                size = checked_int(b.get("requested_size") or b.get("size") or 0,
                            f"snapshot segments[{j}] block size")
                if size > 0:
                    pre.append(Event("alloc", next_id, size,
                                     checked_int(seg.get("stream", 0) or 0,
                                          f"snapshot segments[{j}].stream"), 0.0))
                    live[addr] = (next_id, size)
                    next_id += 1
    meta = {"source": "pytorch-snapshot", "device": device, "units": "bytes, seconds",
            "name": name or "snapshot"}
    incomplete = snapshot.get("vmalloc_incomplete")   # vmalloc's own snapshots say so
    if incomplete:
        meta["incomplete"] = incomplete
        warnings.warn(f"{name or 'snapshot'}: incomplete ({incomplete}): allocations live "
                      "before its recording, or whose events were dropped, are not in it, so "
                      "its replay under-counts memory", RuntimeWarning, stacklevel=2)
    return Trace(pre + events, meta)
