"""vmalloc's recorded allocation history (``_record_memory_history``) as PyTorch memory
snapshots (``_snapshot()`` format, rendered by ``torch.cuda._memory_viz``)."""
from __future__ import annotations

import threading
import warnings
from collections import deque
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from .registry import REGISTRY, Registry, closed_by_user, core

# The history, its sequence numbers and the user's window change together, from the report, the
# shims and the exit hook, maybe on several threads. Reentrant: start/stop drain under it.
_LOCK = threading.RLock()


def _append_history(reg: Registry, device: int, events: List[Dict[str, Any]]) -> None:
    """Append to a device's bounded history (the newest ``reg.trace_capacity`` events), counting
    what falls out."""
    h = reg.history.get(device)
    if h is None or h.maxlen != reg.trace_capacity:
        h = reg.history[device] = deque(h or (), maxlen=reg.trace_capacity)
    reg.history_dropped[device] = (reg.history_dropped.get(device, 0)
                                   + max(0, len(h) + len(events) - reg.trace_capacity))
    h.extend(events)
    reg.history_seq[device] = reg.history_seq.get(device, 0) + len(events)


def drain_history() -> None:
    """Move events recorded by the native allocators into the (bounded) Python history."""
    if REGISTRY.mode is None or not REGISTRY.recording:
        return
    with _LOCK:
        native = core()
        for d in native._torch_devices():
            a = native._torch_allocator(d)
            if closed_by_user(a):
                continue
            if a.trace_capacity != REGISTRY.trace_capacity:
                a.set_trace_capacity(REGISTRY.trace_capacity)
            _append_history(REGISTRY, d, a.take_trace())


def _devices() -> List[int]:
    return list(core()._torch_devices()) if REGISTRY.mode is not None else []


def _native_dropped(device: int) -> int:
    if device not in _devices():
        return 0
    return int(core()._torch_allocator(device).stats().get("num_trace_dropped", 0))


def _restart_user_view() -> None:
    """The user's snapshots show the history from now on (PyTorch's trace starts empty when
    recording starts, is cleared, or stops)."""
    reg = REGISTRY
    with _LOCK:
        drain_history()
        for d in set(reg.history_seq) | set(_devices()):
            reg.user_since[d] = reg.history_seq.get(d, 0)
            reg.user_native_dropped[d] = _native_dropped(d)


def start_recording(who: str = "report") -> None:
    """Record the allocation history for ``who``: ``"report"`` (the histogram and N_max, as
    VMALLOC_REPORT does) or ``"user"`` (``torch.cuda.memory._record_memory_history``). The
    recording runs while anyone records; each stops only their own (:func:`stop_recording`)."""
    reg = REGISTRY
    with _LOCK:
        if who == "user" and who not in reg.recorders:
            _restart_user_view()
            reg.user_stopped = False
        reg.recorders.add(who)
        reg.recording = True
        if reg.mode is not None:
            core()._torch_set_trace(True)


def clear_user_history() -> None:
    """``_record_memory_history(clear_history=True)``: the user's snapshots start afresh; the
    events themselves go only when the report does not record them too."""
    with _LOCK:
        _restart_user_view()
        if "report" not in REGISTRY.recorders:
            REGISTRY.history.clear()


def stop_recording(who: str = "user") -> None:
    """``who`` stops recording; the history goes when nobody records any more."""
    reg = REGISTRY
    with _LOCK:
        drain_history()
        if who == "user":
            _restart_user_view()
            reg.user_stopped = True   # what the report goes on recording is not the user's
        reg.recorders.discard(who)
        if reg.recorders:
            return
        reg.recording = False
        reg.history.clear()
        if reg.mode is not None:
            core()._torch_set_trace(False)


def history_info(device: int) -> Dict[str, int]:
    """How much of ``device``'s allocation history is kept and how much was dropped (native
    ring + Python history), for the report."""
    reg = REGISTRY
    native = 0
    if reg.mode is not None and device in core()._torch_devices():
        native = int(core()._torch_allocator(device).stats().get("num_trace_dropped", 0))
    return {"capacity": reg.trace_capacity, "events_kept": len(reg.history.get(device, ())),
            "events_dropped": native + reg.history_dropped.get(device, 0)}


def set_trace_capacity(events: int) -> None:
    """Keep at most ``events`` allocation-history events per device (native ring and Python)."""
    if isinstance(events, bool) or not isinstance(events, int) or events < 0:
        raise ValueError(f"events: expected an event count >= 0, got {events!r}")
    REGISTRY.trace_capacity = events
    if REGISTRY.mode is not None:
        native = core()
        for d in native._torch_devices():
            a = native._torch_allocator(d)
            if not closed_by_user(a):
                a.set_trace_capacity(events)


def history_snapshot(device: Optional[int] = None, chunk_size: int = 2 << 20,
                     small_threshold: int = 1 << 20, traces: bool = True) -> Dict[str, Any]:
    """vmalloc's recorded history as a PyTorch memory snapshot (``_snapshot()`` format).

    Each live allocation is one segment with one ``active_allocated`` block (vmalloc maps every
    large allocation on its own range; the segment size is the mapped ``k * chunk_size``): the
    allocator's live set, whenever the history began (a model's weights made before recording
    are in it), not what the bounded history leaves live.
    Trace entries (the user's recording: since ``_record_memory_history`` started or last
    cleared it): ``alloc``, ``free_requested`` + ``free_completed`` (vmalloc frees at once;
    stream-deferred reuse happens below the trace), with ``time_us``. When events of that window
    were dropped (the rings' capacity), the snapshot says so under ``"vmalloc_incomplete"`` (per
    device: ``events_dropped``) and a RuntimeWarning is raised: a replay of its trace misses
    them. ``traces=False``: no trace entries (``memory_snapshot()``).
    """
    reg = REGISTRY
    with _LOCK:
        drain_history()
        devs = sorted(set(reg.history) | set(_devices())) or [0]
        per_device: Dict[int, List[Dict[str, Any]]] = {}
        live: Dict[int, List[Dict[str, Any]]] = {}
        incomplete: List[Dict[str, int]] = []
        for d in range(max(devs) + 1):
            per_device[d], lost = _user_events(d) if traces else ([], 0)
            live[d] = _live_allocations(d)
            if (device is None or d == device) and lost:
                incomplete.append({"device": d, "events_dropped": lost})
    snap = snapshot_from_events(per_device, chunk_size=chunk_size, small_threshold=small_threshold,
                                only_device=device, live=live)
    if incomplete:
        snap["vmalloc_incomplete"] = incomplete
        for i in incomplete:
            warnings.warn(
                f"vmalloc: the memory snapshot of cuda:{i['device']} is incomplete: "
                f"{i['events_dropped']} trace events were dropped (capacity "
                f"{reg.trace_capacity}); a replay of its trace misses them. Raise "
                "vmalloc.torch_allocator.set_trace_capacity()", RuntimeWarning, stacklevel=3)
    return snap


def _user_events(device: int) -> Tuple[List[Dict[str, Any]], int]:
    """The device's history since the user's recording started, and how many events of that
    window were dropped (by the Python history or the native ring)."""
    reg = REGISTRY
    if reg.user_stopped:
        return [], 0
    h = list(reg.history.get(device, ()))
    first = reg.history_seq.get(device, 0) - len(h)     # sequence number of h[0]
    since = reg.user_since.get(device, 0)
    native = max(0, _native_dropped(device) - reg.user_native_dropped.get(device, 0))
    return h[max(0, since - first):], max(0, first - since) + native


def _live_allocations(device: int) -> List[Dict[str, Any]]:
    """The device's live allocations as the allocator lists them, as alloc events (their stream
    and time from the history's alloc event of the same address and size, where it has one)."""
    if device not in _devices() or closed_by_user(core()._torch_allocator(device)):
        return []
    seen = {int(e.get("addr", e["id"])): e for e in REGISTRY.history.get(device, ())
            if e["action"] == "alloc"}
    out = []
    for addr, size in core()._torch_allocator(device).live_allocations():
        e = seen.get(addr)
        if e is None or int(e["size"]) != size:
            e = {"action": "alloc", "id": addr, "addr": addr, "size": size, "stream": 0,
                 "time": 0.0}
        out.append(e)
    return out


def snapshot_from_events(per_device: Mapping[int, List[Mapping[str, Any]]], chunk_size: int,
                         small_threshold: int = 1 << 20, only_device: Optional[int] = None,
                         live: Optional[Mapping[int, Iterable[Mapping[str, Any]]]] = None
                         ) -> Dict[str, Any]:
    """Build ``{"segments", "device_traces"}`` from contract-2 events that carry ``addr``.

    Segments: one per allocation of ``live[device]`` (the allocator's live set) when given,
    else per allocation the events leave live (a complete history)."""
    n = max(max(per_device, default=-1), max(live or {}, default=-1)) + 1
    traces: List[List[Dict[str, Any]]] = [[] for _ in range(n)]
    segments: List[Dict[str, Any]] = []
    for d in range(n):
        if only_device is not None and d != only_device:
            continue
        left: Dict[int, Mapping[str, Any]] = {}
        for e in per_device.get(d, []):
            addr = int(e.get("addr", e["id"]))
            base = {"addr": addr, "size": int(e["size"]), "stream": int(e.get("stream", 0)),
                    "time_us": int(float(e.get("time", 0.0)) * 1e6), "frames": []}
            if e["action"] == "alloc":
                left[addr] = e
                traces[d].append({"action": "alloc", **base})
            else:
                left.pop(addr, None)
                traces[d].append({"action": "free_requested", **base})
                traces[d].append({"action": "free_completed", **base})
        if live is not None:
            left = {int(e.get("addr", e["id"])): e for e in live.get(d, ())}
        for addr, e in left.items():
            size = int(e["size"])
            seg = size if size < small_threshold else -(-size // chunk_size) * chunk_size
            segments.append({
                "device": d, "address": addr, "total_size": seg, "stream": int(e.get("stream", 0)),
                "segment_type": "small" if size < small_threshold else "large",
                "segment_pool_id": (0, 0), "allocated_size": seg, "active_size": seg,
                "requested_size": size, "is_expandable": False, "frames": [],
                "blocks": [{"address": addr, "size": seg, "requested_size": size,
                            "state": "active_allocated", "frames": []}]})
    return {"segments": segments, "device_traces": traces, "allocator_settings": {"backend": "vmalloc"}}
