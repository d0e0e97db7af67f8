"""vmalloc's recorded allocation history (``_record_memory_history``) as PyTorch memory
snapshots (``_snapshot()`` format, rendered by ``torch.cuda._memory_viz``)."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from .registry import REGISTRY, core


def drain_history() -> None:
    """Move events recorded by the native allocators into the Python history."""
    if REGISTRY.mode is None or not REGISTRY.recording:
        return
    native = core()
    for d in native._torch_devices():
        REGISTRY.history.setdefault(d, []).extend(native._torch_allocator(d).take_trace())


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
    return snapshot_from_events({d: REGISTRY.history.get(d, []) for d in range(n)},
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
