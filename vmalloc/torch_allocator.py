"""Registration with PyTorch as its pluggable CUDA allocator, and what PyTorch loses by it.

``enable()`` hands PyTorch the C entry points of ``csrc/bind/torch_c_api.cpp`` (exported from
``vmalloc._core``) through ``torch.cuda.memory.CUDAPluggableAllocator`` and
``change_current_allocator``, and wires the four extra hooks PyTorch offers a pluggable
allocator (``torch/csrc/cuda/CUDAPluggableAllocator.h``, torch 2.4 - 2.13):

* ``set_record_stream_fn(void(void*, cudaStream_t))``: ``Tensor.record_stream`` -> the memory is not
  reused before the work queued on that stream up to the free is done;
* ``set_reset_fn(void())``: ``torch.cuda.empty_cache()`` -> ``trim()`` every device's allocator;
* ``set_memory_fraction_fn(void(double, int))``: ``set_per_process_memory_fraction`` -> budget;
* ``set_init_fn(void(int))``: CUDA lazy init tells the device count.

With a pluggable allocator PyTorch's own ``memory_stats`` & co. raise ("CUDAPluggableAllocator does
not yet support getDeviceStats"). While vmalloc is enabled the ``torch._C`` functions behind them
answer from vmalloc's stats instead (see :func:`torch_memory_stats` for the mapping), and
``_record_memory_history`` / ``_snapshot`` / ``_dump_snapshot`` record vmalloc's own allocation
history in PyTorch's snapshot format, so ``torch.cuda._memory_viz`` renders it.

No torch import at module level: ``import vmalloc`` stays cheap and works without torch.
"""
from __future__ import annotations

import atexit
import importlib
import contextlib
import sys
import threading
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterator, List, Mapping, Optional

from .sizes import SizeLike, parse_optional_size, parse_size

ALL_DEVICES = -1
# Allocation-history events kept per device: the native ring (Allocator trace_capacity) and the
# Python history below both keep the newest this many and count what they drop, so a long
# training run with VMALLOC_REPORT set does not grow. Change with set_trace_capacity().
TRACE_CAPACITY = 100_000

# exported symbol names of csrc/bind/torch_c_api.cpp
_ALLOC_FN = "vmalloc_torch_malloc"
_FREE_FN = "vmalloc_torch_free"
_HOOKS = {"set_record_stream_fn": "vmalloc_torch_record_stream",
          "set_reset_fn": "vmalloc_torch_empty_cache",
          "set_memory_fraction_fn": "vmalloc_torch_memory_fraction",
          "set_init_fn": "vmalloc_torch_init"}


@dataclass
class _Registry:
    """Python side of the per-device registry whose allocators live in ``torch_c_api.cpp``.

    Holds what belongs to a device's registered allocator but is Python: report sections (the
    swap runtime's stats), the recorded allocation history, and the enable() settings. This and
    the C++ table are the one piece of process-wide state vmalloc keeps.
    """

    enabled: bool = False
    mode: Optional[str] = None            # "global" (change_current_allocator) or "pool"
    config: Dict[str, Any] = field(default_factory=dict)
    sections: Dict[int, Dict[str, Callable[[], Mapping[str, Any]]]] = field(default_factory=dict)
    history: Dict[int, Deque[Dict[str, Any]]] = field(default_factory=dict)
    history_dropped: Dict[int, int] = field(default_factory=dict)   # by the Python history
    trace_capacity: int = TRACE_CAPACITY
    recording: bool = False
    torch_allocator: Any = None            # the CUDAPluggableAllocator object (kept alive)
    patched: Dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def section_providers(self, device: Optional[int]) -> Dict[str, Callable[[], Mapping[str, Any]]]:
        return self.sections.setdefault(ALL_DEVICES if device is None else int(device), {})

    def sections_for(self, device: int) -> Dict[str, Mapping[str, Any]]:
        out: Dict[str, Mapping[str, Any]] = {}
        for key in (ALL_DEVICES, device):
            for name, fn in self.sections.get(key, {}).items():
                try:
                    out[name] = dict(fn())
                except Exception as exc:  # noqa: BLE001 - a broken section must not hide the report
                    out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        return out


_REGISTRY = _Registry()


def registry() -> _Registry:
    return _REGISTRY


def _core() -> Any:
    try:
        from . import _core  # type: ignore[attr-defined]
    except ImportError as exc:
        raise RuntimeError("vmalloc's native module vmalloc._core is not built "
                           f"(run scripts/dev-build or pip install the package): {exc}") from None
    return _core


def _entry_point(core: Any, name: str) -> int:
    import ctypes
    lib = ctypes.CDLL(core.__file__)
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


# ---------------------------------------------------------------------------------------------
# enable


def enable(chunk_size: Optional[SizeLike] = None, budget: Optional[SizeLike] = None,
           device: Optional[int] = None, backend: str = "cuda") -> None:
    """Make vmalloc PyTorch's CUDA allocator for this process (every device; one allocator per
    device, created on its first allocation).

    ``chunk_size`` (default 2 MiB) and ``budget`` (physical bytes; None = no cap) accept sizes like
    ``"2MiB"``; ``device`` limits the budget to that device (None = every device). Must run before
    CUDA is initialised - ``VMALLOC=1`` does this for you at ``import torch``. Calling it again
    with the same settings is a no-op.
    """
    chunk = parse_size(chunk_size, "chunk_size") if chunk_size is not None else 2 << 20
    cap = parse_optional_size(budget, "budget") or 0
    if device is not None and (not isinstance(device, int) or device < 0):
        raise ValueError(f"device: expected a CUDA device index >= 0 or None, got {device!r}")
    cfg = {"chunk_size": chunk, "budget": cap, "device": device, "backend": backend}
    reg = _REGISTRY
    with reg.lock:
        if reg.enabled:
            if reg.config == cfg:
                return
            raise RuntimeError(f"vmalloc.enable: already enabled with {reg.config}; PyTorch cannot "
                               f"swap its allocator twice, so {cfg} cannot take effect")
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("vmalloc.enable: no CUDA device is available (torch.cuda.is_available()"
                               " is False); vmalloc.Allocator(backend='host') works without one")
        if torch.cuda.is_initialized():
            used = _native_reserved(torch)
            raise RuntimeError(
                "vmalloc.enable: CUDA is already initialised"
                + (f" and PyTorch's own allocator holds {used} bytes" if used else "")
                + "; PyTorch only accepts a new allocator before that (\"Can't swap an already "
                "initialized allocator\"). Call vmalloc.enable() before any CUDA work, or set "
                "VMALLOC=1 in the environment, or use the scoped form `with vmalloc.pool(): ...`.")
        core = _core()
        core._torch_configure(backend, chunk, cap, -1 if device is None else device)
        if reg.recording:
            core._torch_set_trace(True)
        alloc = torch.cuda.memory.CUDAPluggableAllocator(core.__file__, _ALLOC_FN, _FREE_FN)
        _wire_hooks(core, alloc.allocator())
        torch.cuda.memory.change_current_allocator(alloc)
        reg.torch_allocator = alloc
        reg.enabled, reg.mode, reg.config = True, "global", cfg
        _install_shims(torch)


def _wire_hooks(core: Any, raw: Any) -> None:
    for setter, symbol in _HOOKS.items():
        fn = getattr(raw, setter, None)
        if fn is None:  # a torch without this hook: say which feature is missing, keep going
            warnings.warn(f"vmalloc: this PyTorch has no CUDAAllocator.{setter}; "
                          f"{symbol.replace('vmalloc_torch_', '')} will not reach vmalloc",
                          RuntimeWarning, stacklevel=3)
            continue
        fn(_entry_point(core, symbol))


def _native_reserved(torch: Any) -> int:
    try:
        return int(torch.cuda.memory_reserved())
    except Exception:  # noqa: BLE001
        return 0


@contextlib.contextmanager
def pool(chunk_size: Optional[SizeLike] = None, budget: Optional[SizeLike] = None,
         device: Optional[int] = None) -> Iterator[Any]:
    """Scoped form (PyTorch with ``torch.cuda.MemPool``): allocations of this thread inside the
    block come from vmalloc, also after CUDA was initialised.

    PyTorch's caching allocator stays in charge of the pool (it asks vmalloc for whole segments
    and caches them until the pool is destroyed), so vmalloc's anti-fragmentation applies to
    segments, not tensors; prefer :func:`enable` when you can set it up before CUDA starts.
    """
    import torch
    if not hasattr(torch.cuda, "MemPool"):
        raise RuntimeError("vmalloc.pool: this PyTorch has no torch.cuda.MemPool (added in 2.5); "
                           "use vmalloc.enable() before CUDA is initialised instead")
    if _REGISTRY.enabled:
        raise RuntimeError("vmalloc.pool: vmalloc is already PyTorch's allocator (vmalloc.enable)")
    core = _core()
    chunk = parse_size(chunk_size, "chunk_size") if chunk_size is not None else 2 << 20
    cap = parse_optional_size(budget, "budget") or 0
    core._torch_configure("cuda", chunk, cap, -1 if device is None else device)
    alloc = torch.cuda.memory.CUDAPluggableAllocator(core.__file__, _ALLOC_FN, _FREE_FN)
    _wire_hooks(core, alloc.allocator())
    mem_pool = torch.cuda.MemPool(alloc.allocator())
    _REGISTRY.mode = "pool"
    with torch.cuda.use_mem_pool(mem_pool, device=device):
        yield mem_pool


def is_enabled() -> bool:
    """True once :func:`enable` made vmalloc PyTorch's CUDA allocator."""
    return _REGISTRY.enabled


def stats(device: Optional[int] = None) -> Dict[str, Any]:
    """vmalloc's stats (DESIGN.md keys + extras) for ``device`` (default: the current device).

    Raises RuntimeError when vmalloc is not registered with PyTorch.
    """
    if _REGISTRY.mode is None:
        raise RuntimeError("vmalloc.stats: vmalloc is not enabled (vmalloc.enable() or VMALLOC=1); "
                           "a standalone vmalloc.Allocator has its own .stats()")
    a = device_allocator(device)
    if a is None:   # this device has allocated nothing yet
        cfg = _REGISTRY.config
        return {**_ZERO_STATS, "chunk_size": cfg.get("chunk_size", 2 << 20),
                "budget": cfg.get("budget", 0)}
    return dict(a.stats())


_ZERO_STATS = {k: 0 for k in (
    "requested_current", "requested_peak", "mapped_current", "mapped_peak", "physical_current",
    "physical_peak", "internal_fragmentation", "num_malloc", "num_free", "num_map", "num_unmap",
    "num_chunks_created", "chunk_size", "budget", "num_live", "num_cache_hits", "cached_bytes")}


def device_allocator(device: Optional[int] = None, create: bool = False) -> Any:
    """The registered allocator of ``device`` (a ``vmalloc._core.Allocator`` that lives until
    exit), for the swap runtime's pressure callback and the like; None before its first use
    unless ``create``."""
    if _REGISTRY.mode is None:
        raise RuntimeError("vmalloc is not enabled (vmalloc.enable() or VMALLOC=1)")
    return _core()._torch_allocator(_device_index(device), create)


def _device_index(device: Optional[int]) -> int:
    if device is not None:
        if hasattr(device, "index"):   # torch.device
            device = device.index if device.index is not None else None
        if device is not None:
            return int(device)
    try:
        import torch
        return torch.cuda.current_device()
    except Exception:  # noqa: BLE001
        return 0


def devices() -> List[int]:
    """Devices whose allocator exists (created lazily on first use)."""
    if _REGISTRY.mode is None:
        return []
    return list(_core()._torch_devices())


# ---------------------------------------------------------------------------------------------
# PyTorch's stats API answered by vmalloc


def torch_memory_stats(s: Mapping[str, Any]) -> Dict[str, Any]:
    """vmalloc stats as ``torch._C._cuda_memoryStats`` returns them (nested dict).

    Mapping (documented in the README): ``allocated_bytes`` and ``requested_bytes`` and
    ``active_bytes`` = bytes requested by live tensors (vmalloc hands out exactly what is asked;
    its rounding shows up in mapped bytes); ``reserved_bytes`` = physical bytes held (in use +
    cached chunks); ``allocation`` / ``active`` = live allocations; ``segment`` = chunks held;
    ``num_device_alloc`` / ``num_device_free`` = chunk maps / unmaps; ``num_ooms`` = OOMs raised.
    The ``small_pool`` rows are vmalloc's small-block bins; ``large_pool`` the chunked ranges.
    """
    def stat(cur: int, peak: int, allocated: int = 0, freed: int = 0) -> Dict[str, int]:
        return {"current": int(cur), "peak": int(max(peak, cur)), "allocated": int(allocated),
                "freed": int(freed)}

    req, req_peak = s["requested_current"], s["requested_peak"]
    small_req = s.get("small_requested_current", 0)
    live = s.get("num_live", s["num_malloc"] - s["num_free"])
    phys, phys_peak = s["physical_current"], s["physical_peak"]
    chunk = s.get("chunk_size") or 1
    small_live = s.get("num_small_malloc", 0) - s.get("num_small_free", 0)

    def pools(total: Dict[str, int], small_cur: int) -> Dict[str, Dict[str, int]]:
        return {"all": total, "small_pool": stat(small_cur, small_cur),
                "large_pool": stat(total["current"] - small_cur, total["current"] - small_cur)}

    return {
        "allocated_bytes": pools(stat(req, req_peak), small_req),
        "requested_bytes": pools(stat(req, req_peak), small_req),
        "active_bytes": pools(stat(req, req_peak), small_req),
        "reserved_bytes": pools(stat(phys, phys_peak), s.get("small_pool_bytes", 0)),
        "inactive_split_bytes": pools(stat(0, 0), 0),
        "allocation": pools(stat(live, live, s["num_malloc"], s["num_free"]), small_live),
        "active": pools(stat(live, live, s["num_malloc"], s["num_free"]), small_live),
        "segment": pools(stat(phys // chunk, phys_peak // chunk), 0),
        "inactive_split": pools(stat(0, 0), 0),
        "num_alloc_retries": int(s.get("num_pressure_calls", 0)),
        "num_ooms": int(s.get("num_oom", 0)),
        "num_sync_all_streams": 0,
        "num_device_alloc": int(s.get("num_map", 0)),
        "num_device_free": int(s.get("num_unmap", 0)),
        "max_split_size": -1,
        "oversize_allocations": stat(0, 0),
        "oversize_segments": stat(0, 0),
        "requested_bytes_backend": "vmalloc",
    }


def _append_history(reg: _Registry, device: int, events: List[Dict[str, Any]]) -> None:
    """Append to a device's bounded history (the newest ``reg.trace_capacity`` events), counting
    what falls out."""
    h = reg.history.get(device)
    if h is None or h.maxlen != reg.trace_capacity:
        h = reg.history[device] = deque(h or (), maxlen=reg.trace_capacity)
    reg.history_dropped[device] = (reg.history_dropped.get(device, 0)
                                   + max(0, len(h) + len(events) - reg.trace_capacity))
    h.extend(events)


def history_info(device: int) -> Dict[str, int]:
    """How much of ``device``'s allocation history is kept and how much was dropped (native ring +
    Python history), for the report."""
    reg = _REGISTRY
    native = 0
    if reg.mode is not None and device in _core()._torch_devices():
        native = int(_core()._torch_allocator(device).stats().get("num_trace_dropped", 0))
    return {"capacity": reg.trace_capacity, "events_kept": len(reg.history.get(device, ())),
            "events_dropped": native + reg.history_dropped.get(device, 0)}


def set_trace_capacity(events: int) -> None:
    """Keep at most ``events`` allocation-history events per device (native ring and Python)."""
    if isinstance(events, bool) or not isinstance(events, int) or events < 0:
        raise ValueError(f"events: expected an event count >= 0, got {events!r}")
    _REGISTRY.trace_capacity = events
    if _REGISTRY.mode is not None:
        core = _core()
        for d in core._torch_devices():
            core._torch_allocator(d).set_trace_capacity(events)


def _drain_history() -> None:
    """Move events recorded by the native allocators into the Python history."""
    if _REGISTRY.mode is None or not _REGISTRY.recording:
        return
    core = _core()
    for d in core._torch_devices():
        a = core._torch_allocator(d)
        if a.trace_capacity != _REGISTRY.trace_capacity:
            a.set_trace_capacity(_REGISTRY.trace_capacity)
        _append_history(_REGISTRY, d, a.take_trace())


def history_snapshot(device: Optional[int] = None, chunk_size: int = 2 << 20,
                     small_threshold: int = 1 << 20) -> Dict[str, Any]:
    """vmalloc's recorded history as a PyTorch memory snapshot (``_snapshot()`` format).

    Each live allocation is one segment with one ``active_allocated`` block (vmalloc maps every
    large allocation on its own range; the segment size is the mapped ``k * chunk_size``).
    Trace entries: ``alloc``, ``free_requested`` + ``free_completed`` (vmalloc frees at once;
    stream-deferred reuse happens below the trace), with ``time_us``.
    """
    _drain_history()
    devs = sorted(_REGISTRY.history) or [0]
    n = max(devs) + 1
    return snapshot_from_events({d: _REGISTRY.history.get(d, []) for d in range(n)},
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


def _install_shims(torch: Any) -> None:
    """Answer ``torch._C``'s allocator-stats entry points from vmalloc (see module doc)."""
    C = torch._C
    reg = _REGISTRY

    def memory_stats(device: Any = None) -> Dict[str, Any]:
        s = stats(_device_index(device))
        return torch_memory_stats(s)

    def reset_peak(device: Any = None) -> None:
        a = device_allocator(device)
        if a is not None:
            a.reset_peak()

    def reset_accumulated(device: Any = None) -> None:
        _warn_once("reset_acc", "vmalloc: accumulated counters are not reset")

    def memory_snapshot(arg: Any = None) -> Dict[str, Any]:
        cfg = reg.config
        include_traces = not (isinstance(arg, tuple) and len(arg) >= 3 and not arg[2])
        snap = history_snapshot(chunk_size=cfg.get("chunk_size", 2 << 20))
        if not include_traces:
            snap["device_traces"] = [[] for _ in snap["device_traces"]]
        return snap

    def record_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        on = bool(enabled)
        core = _core()
        with reg.lock:
            if on and kwargs.get("clear_history", len(args) > 3 and args[3]):
                reg.history.clear()
            if not on:
                _drain_history()
                reg.history.clear()
            reg.recording = on
            core._torch_set_trace(on)

    replacements = {
        "_cuda_memoryStats": memory_stats,
        "_cuda_resetPeakMemoryStats": reset_peak,
        "_cuda_resetAccumulatedMemoryStats": reset_accumulated,
        "_cuda_memorySnapshot": memory_snapshot,
        "_cuda_record_memory_history": record_history,
        "_cuda_record_memory_history_legacy": lambda enabled, *a, **k: record_history(
            "all" if enabled else None),
    }
    for name, fn in replacements.items():
        if hasattr(C, name):
            reg.patched[name] = getattr(C, name)
            setattr(C, name, fn)


_WARNED: set = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------
# the live report (vmalloc.report)


def live_report(device: Optional[int] = None) -> Dict[str, Any]:
    """Report dict for ``vmalloc.report()``: vmalloc's figures when enabled, else PyTorch's."""
    rpt = importlib.import_module("vmalloc.report")
    reg = _REGISTRY
    if reg.mode is not None:
        d = _device_index(device)
        s = stats(d)
        _drain_history()
        events = list(reg.history.get(d, ()))
        sizes = [int(e["size"]) for e in events if e["action"] == "alloc"] or None
        info = history_info(d)
        # n_max needs the whole history: not known once events were dropped
        n_max = _max_live(events) if events and not info["events_dropped"] else None
        sections = reg.sections_for(d)
        if reg.recording:
            sections["history"] = info
        return rpt.build(s, source="vmalloc", device=d, sizes=sizes, n_max=n_max,
                         sections=sections,
                         title=f"vmalloc ({reg.mode}) on cuda:{d}")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        d = _device_index(device)
        s = rpt.from_torch_stats(torch.cuda.memory_stats(d))
        return rpt.build(s, source="torch-native", device=d, sections=reg.sections_for(d),
                         title=f"PyTorch native allocator on cuda:{d}")
    d = 0 if device is None else int(device)
    empty = {k: 0 for k in ("requested_current", "requested_peak", "mapped_current", "mapped_peak",
                            "physical_current", "physical_peak", "num_malloc", "num_free")}
    return rpt.build(empty, source="none", device=None, sections=reg.sections_for(d),
                     title="no CUDA allocator in use (vmalloc not enabled, CUDA not initialised)")


def _max_live(events: List[Mapping[str, Any]]) -> int:
    cur = peak = 0
    for e in events:
        cur += 1 if e["action"] == "alloc" else -1
        peak = max(peak, cur)
    return peak


def start_recording() -> None:
    """Record the allocation history (for the histogram and snapshots), as VMALLOC_REPORT does."""
    _REGISTRY.recording = True
    if _REGISTRY.mode is not None:
        _core()._torch_set_trace(True)


def register_exit_report(target: str) -> None:
    rpt = importlib.import_module("vmalloc.report")
    atexit.register(rpt.write_exit_report, target)
