"""Allocation traces: the project's JSON format, checked field by field.

The JSON format (brief contract 2) is ``{"meta": {...}, "events": [...]}`` with events
``{"action": "alloc"|"free", "id": int, "size": int, "stream": int, "time": float}``; ``id``
pairs an alloc with its free and a free carries its alloc's size. ``.json.gz`` is read and
written transparently. Sizes are below 2**64, streams non-negative and below 2**64.

PyTorch snapshots are read by ``snapshot.py``, files (bounded, gzip or not) by ``files.py``.
"""
from __future__ import annotations

import gzip
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Union

from ..atomic_file import write_atomic
from ..sizes import SIZE_LIMIT

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

    def to_json(self) -> Dict[str, Any]:
        return {"meta": dict(self.meta), "events": [e.to_json() for e in self.events]}

    def save(self, path: PathLike) -> None:
        """Write JSON (gzip'ed when the name ends in ``.gz``), compact and deterministic; whole
        or not at all (written beside it, then renamed: a kill mid-write leaves no truncated
        trace for a replay to choke on)."""
        data = json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True).encode()
        if str(path).endswith(".gz"):
            # mtime=0: the same trace gives the same bytes (reproducible bundled files)
            buf = io.BytesIO()
            with gzip.GzipFile(filename="", fileobj=buf, mode="wb", mtime=0) as f:
                f.write(data)
            data = buf.getvalue()
        write_atomic(path, data)


def checked_int(value: Any, where: str, lo: int = 0, hi: int = SIZE_LIMIT) -> int:
    """``value`` as an int in ``[lo, hi)``; a bool, float or string is an error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: expected an int, got {value!r:.60}")
    if not lo <= value < hi:
        raise ValueError(f"{where}: {value} is out of range (expected {lo} <= value < "
                         f"{'2**64' if hi == SIZE_LIMIT else hi})")
    return value


def checked_time(value: Any, where: str) -> float:
    """``value`` as a finite float; a bool, string, NaN, infinity or an int too big for a float
    (JSON ``1e400`` written out as digits) is an error, not an OverflowError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a finite number, got {value!r:.60}")
    try:
        t = float(value)
    except OverflowError:
        t = math.inf
    if not math.isfinite(t):
        raise ValueError(f"{where}: expected a finite number, got {str(value):.60}")
    return t


def validate(events: Iterable[Event]) -> None:
    """Raise ``ValueError`` naming the event index when the sequence is not a valid trace."""
    live: Dict[int, int] = {}
    for i, e in enumerate(events):
        if e.action not in ("alloc", "free"):
            raise ValueError(f"events[{i}].action: expected 'alloc' or 'free', got {e.action!r}")
        if not isinstance(e.size, int) or isinstance(e.size, bool) or e.size <= 0:
            raise ValueError(f"events[{i}].size: expected a positive int of bytes, got {e.size!r}")
        checked_int(e.size, f"events[{i}].size")
        checked_int(e.stream, f"events[{i}].stream")
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
    meta = data.get("meta") or {}
    if not isinstance(meta, Mapping):
        raise ValueError(f"meta: expected an object, got {meta!r:.60}")
    meta = dict(meta)
    if name and "name" not in meta:
        meta["name"] = name
    raw = data["events"]
    if not isinstance(raw, list):
        raise ValueError(f"events: expected a list of events, got {type(raw).__name__}")
    events = []
    for i, ev in enumerate(raw):
        if not isinstance(ev, Mapping):
            raise ValueError(f"events[{i}]: expected an object, got {ev!r:.60}")
        for key in ("action", "id", "size"):
            if key not in ev:
                raise ValueError(f"events[{i}]: missing {key!r} in {ev!r:.80}")
        t = checked_time(ev.get("time", 0.0), f"events[{i}].time")
        events.append(Event(action=ev["action"], id=checked_int(ev["id"], f"events[{i}].id", -2**63,
                                                           2**63),
                            size=checked_int(ev["size"], f"events[{i}].size"),
                            stream=checked_int(ev.get("stream", 0), f"events[{i}].stream"),
                            time=t))
    return Trace(events, meta)

