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


class _Fold:
    """One device's entries folded into events: the blocks live so far and the events made.

    A block starts live at its ``alloc``, or at the start of the trace (``pre``) when the
    trace frees it without allocating it (allocated before recording began) or the snapshot's
    ``segments`` show it live. It ends at ``free_completed``, or at ``free_requested`` when no
    completion follows."""

    def __init__(self) -> None:
        self.pre: List[Event] = []          # allocations that predate the recording
        self.events: List[Event] = []
        self.live: Dict[int, Tuple[int, int]] = {}   # addr -> (id, size)
        self.stream_of: Dict[int, int] = {}          # addr -> allocation stream
        self.pending: Dict[int, float] = {}          # addr -> time of a free not completed
        self.next_id = 0
        self.t0: Optional[float] = None

    def time_of(self, e: Mapping[str, Any]) -> float:
        """An entry's time in seconds from the first timed entry; without ``time_us``, the
        number of events so far."""
        us = e.get("time_us")
        if us is None:
            return float(len(self.events))
        us = float(us)  # _entry checked it is finite as a float: no int overflow below
        if self.t0 is None:
            self.t0 = us
        return (us - self.t0) / 1e6

    def start(self, addr: int, size: int, stream: int, time: Optional[float] = None) -> None:
        """``addr`` live from ``time``; ``None``: from before the recording (``pre``)."""
        ident = self.next_id
        self.next_id += 1
        self.live[addr] = (ident, size)
        self.stream_of[addr] = stream
        if time is None:
            self.pre.append(Event("alloc", ident, size, stream, 0.0))
        else:
            self.events.append(Event("alloc", ident, size, stream, time))

    def end(self, addr: int, time: float) -> None:
        """``addr`` freed at ``time``."""
        ident, size = self.live.pop(addr)
        self.pending.pop(addr, None)
        self.events.append(Event("free", ident, size, self.stream_of.pop(addr, 0), time))

    def add(self, e: Mapping[str, Any], device: int, k: int) -> None:
        """Entry ``k`` of the device's trace."""
        action, addr, size, stream, _ = _entry(e, device, k)
        if action == "alloc":
            if addr in self.live:     # address reused before a completion we never saw
                self.end(addr, self.time_of(e))
            self.start(addr, size, stream, self.time_of(e))
        elif action in ("free_requested", "free_completed"):
            if addr not in self.live:
                if action == "free_completed" and addr in self.pending:
                    return
                self.start(addr, size, stream)   # allocated before recording began
            if action == "free_requested":
                self.pending[addr] = self.time_of(e)
            else:
                self.end(addr, self.time_of(e))

    def end_pending(self) -> None:
        """Frees requested but never completed within the trace end when requested."""
        for addr, time in list(self.pending.items()):
            if addr in self.live:
                self.end(addr, time)

    def trace(self, meta: Dict[str, Any]) -> Trace:
        return Trace(self.pre + self.events, meta)


def _device_entries(snapshot: Mapping[str, Any], device: Optional[int]
                    ) -> Tuple[int, List[Any]]:
    """The device to read (``None``: the busiest) and its ``device_traces`` entries, with the
    snapshot's shape checked."""
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
    return device, traces[device]


def _start_segment_blocks(snapshot: Mapping[str, Any], device: int, fold: _Fold) -> None:
    """Blocks the snapshot's ``segments`` show live (``active_allocated``) on ``device`` that
    the trace never allocated: live from the start (pre-existing, still live at snapshot time)."""
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
            if addr not in fold.live:
                size = checked_int(b.get("requested_size") or b.get("size") or 0,
                                   f"snapshot segments[{j}] block size")
                if size > 0:
                    fold.start(addr, size, checked_int(seg.get("stream", 0) or 0,
                                                       f"snapshot segments[{j}].stream"))


def from_snapshot(snapshot: Mapping[str, Any], device: Optional[int] = None,
                  name: Optional[str] = None) -> Trace:
    """Turn a PyTorch memory snapshot's ``device_traces`` into a :class:`Trace`.

    A block counts as freed at ``free_completed`` (when the native allocator could reuse it),
    or at ``free_requested`` when no completion follows (snapshots made by
    ``torch.cuda.memory._profile_to_snapshot`` or traces cut short). Frees of addresses allocated
    before recording started become allocations at the start of the trace, and so do blocks that
    the snapshot's ``segments`` show live but the trace never allocated.
    """
    device, entries = _device_entries(snapshot, device)
    fold = _Fold()
    for k, e in enumerate(entries):
        fold.add(e, device, k)
    fold.end_pending()
    _start_segment_blocks(snapshot, device, fold)
    meta = {"source": "pytorch-snapshot", "device": device, "units": "bytes, seconds",
            "name": name or "snapshot"}
    incomplete = snapshot.get("vmalloc_incomplete")   # vmalloc's own snapshots say so
    if incomplete:
        meta["incomplete"] = incomplete
        warnings.warn(f"{name or 'snapshot'}: incomplete ({incomplete}): allocations live "
                      "before its recording, or whose events were dropped, are not in it, so "
                      "its replay under-counts memory", RuntimeWarning, stacklevel=2)
    return fold.trace(meta)
