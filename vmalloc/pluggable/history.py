"""vmalloc's recorded allocation history (``_record_memory_history``) as PyTorch memory
snapshots (``_snapshot()`` format, rendered by ``torch.cuda._memory_viz``)."""
from __future__ import annotations

from collections import deque
from typing import Any, Dict, List, Mapping, Optional

from .registry import REGISTRY, Registry, core


def _append_history(reg: Registry, device: int, events: List[Dict[str, Any]]) -> None:
    """Append to a device's bounded history (the newest ``reg.trace_capacity`` events), counting
    what falls out."""
    h = reg.history.get(device)
    if h is None or h.maxlen != reg.trace_capacity:
        h = reg.history[device] = deque(h or (), maxlen=reg.trace_capacity)
    reg.history_dropped[device] = (reg.history_dropped.get(device, 0)
                                   + max(0, len(h) + len(events) - reg.trace_capacity))
    h.extend(events)


def drain_history() -> None:
    """Move events recorded by the native allocators into the (bounded) Python history."""
    if REGISTRY.mode is None or not REGISTRY.recording:
        return
    native = core()
    for d in native._torch_devices():
        a = native._torch_allocator(d)
        if a.trace_capacity != REGISTRY.trace_capacity:
            a.set_trace_capacity(REGISTRY.trace_capacity)
        _append_history(REGISTRY, d, a.take_trace())


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
            native._torch_allocator(d).set_trace_capacity(events)


def history_snapshot(device: Optional[int] = None, chunk_size: int = 2 << 20,
                     small_threshold: int = 1 << 20) -> Dict[str, Any]:
    """vmalloc's recorded history as a PyTorch memory snapshot (``_snapshot()`` format).

    Each live allocation is one segment with one ``active_allocated`` block (vmalloc maps every
    large allocation on its own range; the segment size is the mapped ``k * chunk_size``).
    Trace entries: ``alloc``, ``free_requested`` + ``free_completed`` (vmalloc frees at once;
    stream-deferred reuse happens below the trace), with ``time_us``.
    """
    drain_history()
    devs = sorted(REGISTRY.history) or [0]
    n = max(devs) + 1
    return snapshot_from_events({d: list(REGISTRY.history.get(d, ())) for d in range(n)},
                                chunk_size=chunk_size, small_threshold=small_threshold,
                                only_device=device)


def snapshot_from_events(per_device: Mapping[int, List[Mapping[str, Any]]], chunk_size: int,
                         small_threshold: int = 1 << 20, only_device: Optional[int] = None
                         ) -> Dict[str, Any]:
    """Build ``{"segments", "device_traces"}`` from contract-2 events that carry ``addr``."""
    n = max(per_device, default=-1) + 1
    traces: List[List[Dict[str, Any]]] = [[] for _ in range(n)]
    segments: List[Dict[str, Any]] = []
    for d in range(n):
        if only_device is not None and d != only_device:
            continue
        live: Dict[int, Mapping[str, Any]] = {}
        for e in per_device.get(d, []):
            addr = int(e.get("addr", e["id"]))
            base = {"addr": addr, "size": int(e["size"]), "stream": int(e.get("stream", 0)),
                    "time_us": int(float(e.get("time", 0.0)) * 1e6), "frames": []}
            if e["action"] == "alloc":
                live[addr] = e
                traces[d].append({"action": "alloc", **base})
            else:
                live.pop(addr, None)
                traces[d].append({"action": "free_requested", **base})
                traces[d].append({"action": "free_completed", **base})
        for addr, e in live.items():
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


def start_recording() -> None:
    """Record the allocation history (for the histogram and snapshots), as VMALLOC_REPORT does."""
    REGISTRY.recording = True
    if REGISTRY.mode is not None:
        core()._torch_set_trace(True)
