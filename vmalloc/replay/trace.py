"""Allocation traces: the project's JSON format and PyTorch memory snapshots.

The JSON format (brief contract 2) is ``{"meta": {...}, "events": [...]}`` with events
``{"action": "alloc"|"free", "id": int, "size": int, "stream": int, "time": float}``; ``id``
pairs an alloc with its free and a free carries its alloc's size. ``.json.gz`` is read and
written transparently.

PyTorch snapshots are the pickles of ``torch.cuda.memory._dump_snapshot()`` (or the dict of
``torch.cuda.memory._snapshot()``) recorded with ``_record_memory_history()``: the per-device
``device_traces`` hold ``alloc`` / ``free_requested`` / ``free_completed`` entries with ``addr``,
``size`` (the caller's requested bytes), ``stream`` and, in recent versions, ``time_us``.
"""
from __future__ import annotations

import gzip
import json
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class Event:
    action: str      # "alloc" or "free"
    id: int
    size: int
    stream: int = 0
    time: float = 0.0

    def to_json(self) -> Dict[str, Any]:
        return {"action": self.action, "id": self.id, "size": self.size,
                "stream": self.stream, "time": self.time}


@dataclass
class Trace:
    """A validated sequence of alloc/free events (every free matches a live alloc)."""

    events: List[Event]
    meta: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    @property
    def name(self) -> str:
        return str(self.meta.get("name", "trace"))

    def peak_requested(self) -> int:
        """Largest sum of live requested bytes over the trace."""
        cur = peak = 0
        for e in self.events:
            cur += e.size if e.action == "alloc" else -e.size
            peak = max(peak, cur)
        return peak

    def max_live(self) -> int:
        """Largest number of simultaneously live allocations (N_max of seed 003 Eq. 2)."""
        cur = peak = 0
        for e in self.events:
            cur += 1 if e.action == "alloc" else -1
            peak = max(peak, cur)
        return peak

    def num_allocs(self) -> int:
        return sum(1 for e in self.events if e.action == "alloc")

    def to_json(self) -> Dict[str, Any]:
        return {"meta": dict(self.meta), "events": [e.to_json() for e in self.events]}

    def save(self, path: PathLike) -> None:
        """Write JSON (gzip'ed when the name ends in ``.gz``), compact and deterministic."""
        data = json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True).encode()
        if str(path).endswith(".gz"):
            # mtime=0: the same trace gives the same bytes (reproducible bundled files)
            with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
                f.write(data)
        else:
            with open(path, "wb") as f:
                f.write(data)


def validate(events: Iterable[Event]) -> None:
    """Raise ``ValueError`` naming the event index when the sequence is not a valid trace."""
    live: Dict[int, int] = {}
    for i, e in enumerate(events):
        if e.action not in ("alloc", "free"):
            raise ValueError(f"events[{i}].action: expected 'alloc' or 'free', got {e.action!r}")
        if not isinstance(e.size, int) or isinstance(e.size, bool) or e.size <= 0:
            raise ValueError(f"events[{i}].size: expected a positive int of bytes, got {e.size!r}")
        if e.action == "alloc":
            if e.id in live:
                raise ValueError(f"events[{i}]: id {e.id} allocated again while still live")
            live[e.id] = e.size
        else:
            if e.id not in live:
                raise ValueError(f"events[{i}]: free of id {e.id}, which is not live")
            if live[e.id] != e.size:
                raise ValueError(f"events[{i}]: free of id {e.id} carries size {e.size}, "
                                 f"its alloc had {live[e.id]}")
            del live[e.id]


def from_json(data: Mapping[str, Any], name: Optional[str] = None) -> Trace:
    """Build a :class:`Trace` from the contract-2 dict; errors name the bad field."""
    if not isinstance(data, Mapping) or "events" not in data:
        raise ValueError("trace: expected an object with 'meta' and 'events'")
    meta = dict(data.get("meta") or {})
    if name and "name" not in meta:
        meta["name"] = name
    events = []
    for i, ev in enumerate(data["events"]):
        try:
            events.append(Event(action=ev["action"], id=int(ev["id"]), size=ev["size"],
                                stream=int(ev.get("stream", 0)), time=float(ev.get("time", 0.0))))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"events[{i}]: malformed event {ev!r} ({exc})") from None
    return Trace(events, meta)


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
    if not isinstance(traces, list):
        raise ValueError("snapshot: no 'device_traces' (record with "
                         "torch.cuda.memory._record_memory_history() before _snapshot())")
    if device is None:  # the busiest device
        device = max(range(len(traces)), key=lambda d: len(traces[d])) if traces else 0
    if not 0 <= device < len(traces):
        raise ValueError(f"device: snapshot has traces for {len(traces)} devices, got {device}")
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
        if t0 is None:
            t0 = us
        return (us - t0) / 1e6

    def emit_free(addr: int, time: float) -> None:
        ident, size = live.pop(addr)
        pending.pop(addr, None)
        events.append(Event("free", ident, size, stream_of.pop(addr, 0), time))

    for e in entries:
        action = e.get("action")
        addr = e.get("addr")
        if action == "alloc":
            if addr in live:     # address reused before a completion we never saw
                emit_free(addr, t_of(e))
            live[addr] = (next_id, int(e["size"]))
            stream_of[addr] = int(e.get("stream", 0) or 0)
            events.append(Event("alloc", next_id, int(e["size"]), stream_of[addr], t_of(e)))
            next_id += 1
        elif action in ("free_requested", "free_completed"):
            if addr not in live:
                if action == "free_completed" and addr in pending:
                    continue
                # allocated before recording began: make it live from the start
                size = int(e["size"])
                pre.append(Event("alloc", next_id, size, int(e.get("stream", 0) or 0), 0.0))
                live[addr] = (next_id, size)
                stream_of[addr] = int(e.get("stream", 0) or 0)
                next_id += 1
            if action == "free_requested":
                pending[addr] = live[addr] + (int(e.get("stream", 0) or 0), t_of(e))
            else:
                emit_free(addr, t_of(e))
    for addr in list(pending):   # requested but never completed within the trace
        if addr in live:
            emit_free(addr, pending[addr][3])
    # live blocks the trace never allocated (pre-existing, still live at snapshot time)
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        for b in seg.get("blocks", []):
            addr = b.get("address")
            if b.get("state") == "active_allocated" and addr not in live:
                size = int(b.get("requested_size") or b.get("size") or 0)
                if size > 0:
                    pre.append(Event("alloc", next_id, size, int(seg.get("stream", 0) or 0), 0.0))
                    live[addr] = (next_id, size)
                    next_id += 1
    meta = {"source": "pytorch-snapshot", "device": device, "units": "bytes, seconds",
            "name": name or "snapshot"}
    return Trace(pre + events, meta)


def _open(path: PathLike):
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def load(path: PathLike, device: Optional[int] = None) -> Trace:
    """Read a trace file: contract-2 JSON (optionally gzip'ed) or a PyTorch snapshot pickle."""
    name = os.path.basename(str(path))
    for suffix in (".gz", ".json", ".pickle", ".pkl"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    with _open(path) as f:
        raw = f.read()
    if raw[:1] in (b"{", b"[", b" ", b"\n"):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if isinstance(data, Mapping) and "device_traces" in data:
            return from_snapshot(data, device, name)
        return from_json(data, name)
    try:
        # a snapshot is plain dicts/lists: refuse anything else (no arbitrary objects)
        data = _SafeUnpickler.loads(raw)
    except Exception as exc:  # noqa: BLE001 - report any unpickling problem the same way
        raise ValueError(f"{path}: neither a JSON trace nor a PyTorch snapshot pickle ({exc})") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: the pickle holds {type(data).__name__}, not a snapshot dict")
    return from_snapshot(data, device, name)


class _SafeUnpickler(pickle.Unpickler):
    """Unpickle only builtin containers and scalars (a snapshot is nothing else)."""

    def find_class(self, module: str, name: str):  # noqa: D401
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a snapshot")

    @classmethod
    def loads(cls, data: bytes) -> Any:
        import io
        return cls(io.BytesIO(data)).load()
