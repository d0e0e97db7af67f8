"""The live report of the running process: ``vmalloc.report()``, its added sections (e.g. the
swap runtime's ``"swap"``, kept on the per-device registry) and the ``VMALLOC_REPORT`` exit
report. The figures are vmalloc's when it is registered, else PyTorch's native allocator's;
:mod:`vmalloc.report_format` builds and renders them, :mod:`vmalloc.report_process` says which
process writes which file."""
from __future__ import annotations

import atexit
import os
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..env import is_report_stream, report_target
from ..report_format import (RESERVED_SECTION_NAMES, build, from_torch_stats, json_ready, save,
                             to_text)
from ..report_process import process_identity, report_path
from .history import drain_history, history_info
from .registry import REGISTRY, device_index, devices, stats


def live_report(device: Optional[int] = None, timeline: bool = False) -> Dict[str, Any]:
    """Report dict for ``vmalloc.report()``: vmalloc's figures when enabled, else PyTorch's.
    ``timeline``: with the requested bytes over the recorded history (for the exit report's
    PNG), when vmalloc recorded one."""
    reg = REGISTRY
    if reg.mode is not None:
        d, others = _report_device(device)
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
        also = (f" (also used: {', '.join(f'cuda:{o}' for o in others)}; "
                f"vmalloc.report(device=...) for each)") if others else ""
        tl = None
        if timeline and events:
            try:
                tl = _requested_timeline(events, int(s.get("requested_current", 0)))
            except Exception as exc:  # noqa: BLE001 - the figure is extra: keep the report
                print(f"vmalloc: the report has no timeline: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
        return build(s, source="vmalloc", device=d, sizes=sizes, n_max=n_max,
                     sections=sections, timeline=tl,
                     title=f"vmalloc ({reg.mode}) on cuda:{d}{also}")
    torch = sys.modules.get("torch")
    # (initialised implies available; is_available() first would run cuInit at every exit)
    if torch is not None and torch.cuda.is_initialized():
        d = device_index(device)
        s = from_torch_stats(torch.cuda.memory_stats(d))
        return build(s, source="torch-native", device=d, sections=reg.sections_for(d),
                     title=f"PyTorch native allocator on cuda:{d}")
    d = 0 if device is None else int(device)
    empty = {k: 0 for k in ("requested_current", "requested_peak", "mapped_current", "mapped_peak",
                            "physical_current", "physical_peak", "num_malloc", "num_free")}
    return build(empty, source="none", device=None, sections=reg.sections_for(d),
                 title="no CUDA allocator in use (vmalloc not enabled, CUDA not initialised)")


def _report_device(device: Optional[int]) -> Tuple[int, List[int]]:
    """The device a report is about, and the other devices vmalloc allocated on. ``None``: the
    current device, unless vmalloc never allocated there and did elsewhere (a process that
    used only ``cuda:1``, without ``set_device``): then the first device it did allocate on;
    a report of the zeros of an unused device would say nothing, without a word."""
    if device is not None:
        return device_index(device), []
    used = devices()
    d = device_index(None)
    if used and d not in used:
        d = used[0]
    return d, [u for u in used if u != d]


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


def _requested_timeline(events: List[Mapping[str, Any]], requested_now: int,
                        max_points: int = 2000) -> Dict[str, List[int]]:
    """Requested bytes after each event of the history, at most ``max_points`` of them (the
    highest of each stretch, so no peak is lost). The start is what was requested before the
    first event kept (``requested_now`` less the events' net change): a history whose oldest
    events were dropped starts where they left it."""
    level = max(0, requested_now - sum(int(e["size"]) if e["action"] == "alloc"
                                       else -int(e["size"]) for e in events))
    every = max(1, -(-len(events) // max_points))
    out: Dict[str, List[int]] = {"event": [], "requested": []}
    for i, e in enumerate(events):
        level += int(e["size"]) if e["action"] == "alloc" else -int(e["size"])
        if i % every == 0:
            out["event"].append(i)
            out["requested"].append(level)
        else:
            out["requested"][-1] = max(out["requested"][-1], level)
    return out


# ---------------------------------------------------------------------------------------------
# sections


def add_section(name: str, provider: Callable[[], Mapping[str, Any]], device: Optional[int] = None
                ) -> None:
    """Show ``provider()`` under ``name`` in this device's report (e.g. the swap runtime's
    ``stats()`` under ``"swap"``). Stored on the per-device registry; ``device=None`` = every
    device's report. Adding a name again replaces it."""
    if not isinstance(name, str):  # a section is a key of the JSON report: a str
        raise TypeError(f"name: expected a non-empty str, got {name!r}")
    if not name.strip():           # an empty heading in the text report
        raise ValueError(f"name: expected a non-empty str, got {name!r}")
    if not callable(provider):
        raise TypeError(f"provider: expected a callable returning a mapping, got {provider!r}")
    if name in RESERVED_SECTION_NAMES:
        # the section would replace vmalloc's own figures of that name (to_text then fails)
        raise ValueError(f"name: {name!r} is one of the report's own keys "
                         f"({', '.join(sorted(RESERVED_SECTION_NAMES))}); choose another name")
    REGISTRY.section_providers(device)[name] = provider


def remove_section(name: str, device: Optional[int] = None) -> None:
    """Take the section ``name`` out of the report (of ``device``; None: every device's)."""
    REGISTRY.section_providers(device).pop(name, None)


# ---------------------------------------------------------------------------------------------
# the report of this process, now and at exit


def collect(device: Optional[int] = None, timeline: bool = False) -> Dict[str, Any]:
    """The live report of ``device`` as a dict (see :func:`report`), naming the process that
    made it (rank, pid, host, device: several ranks' reports stay apart); ``timeline``: see
    :func:`live_report`."""
    rep = live_report(device, timeline)
    rep["process"] = process_identity(rep.get("device"))
    return rep


def report(format: str = "text", device: Optional[int] = None) -> Any:
    """The fragmentation report of the running process.

    With vmalloc enabled: its stats, Eq. 1/2, cache hits, map/unmap counts and driver time, the
    allocation-size histogram (when the history is recorded, e.g. ``VMALLOC_REPORT`` set), and
    added sections such as ``"swap"``. Otherwise, when PyTorch's native allocator holds CUDA
    memory: the same rows from ``torch.cuda.memory_stats()``. ``format`` is ``"text"`` (a str)
    or ``"json"`` (a dict that ``json.dumps`` takes: a section that is not JSON comes as
    ``{"error": ...}``, named in one line on stderr, as in a saved report).
    """
    if format not in ("text", "json"):
        raise ValueError(f"format: expected 'text' or 'json', got {format!r}")
    rep = collect(device)
    return json_ready(rep) if format == "json" else to_text(rep)


# ``vmalloc.report`` is this function (DESIGN.md); the README documents
# ``vmalloc.report.add_section(...)`` (also ``vmalloc.add_report_section``)
report.add_section = add_section  # type: ignore[attr-defined]


def write_exit_report(target: str, owner_pid: Optional[int] = None) -> None:
    """The ``VMALLOC_REPORT`` exit hook: ``-`` = stdout, ``stderr`` = stderr, else a path made
    per process by :func:`report_path` (nothing from torchrun's launcher). ``owner_pid``: the
    process that registered the hook; a child forked from it (which inherits the hook and
    exits through it) writes nothing: the allocators are its parent's, and so is the file."""
    if owner_pid is not None and os.getpid() != owner_pid:
        return
    try:
        path = report_path(target)
        if path is None:
            return
        # a file gets a PNG beside it, of the requested bytes over the recorded history
        rep = collect(None, timeline=not is_report_stream(path))
    except Exception as exc:  # noqa: BLE001 - never turn a clean exit into a traceback
        print(f"vmalloc: could not build the exit report: {exc}", file=sys.stderr)
        return
    try:
        if is_report_stream(path):   # "-" or "stdout" (report_target: "-"), or "stderr"
            stream = sys.stdout if report_target(path) == "-" else sys.stderr
            print(to_text(rep), file=stream, flush=True)
        else:
            save(rep, path)
    except Exception as exc:  # noqa: BLE001 - never turn a clean exit into a traceback
        print(f"vmalloc: could not write the exit report to {path!r}: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)


def register_exit_report(target: str) -> None:
    """Write this process's report to ``target`` at exit (:func:`write_exit_report`)."""
    atexit.register(write_exit_report, target, os.getpid())
