"""The per-device registry whose allocators live in ``csrc/bind/torch_c_api.cpp``, and the
queries on it (``stats``, ``device_allocator``, ``devices``)."""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Set

ALL_DEVICES = -1
# Allocation-history events kept per device: the native ring (Allocator trace_capacity) and the
# Python history both keep the newest this many and count what they drop, so a long training
# run with VMALLOC_REPORT set does not grow. Change with history.set_trace_capacity(). The
# native default (allocator.hpp, Config; a test holds them equal): written here, since the
# registry is imported without the native module (reports, the swap runtime on the CPU)
TRACE_CAPACITY = 100_000

# exported symbol names of csrc/bind/torch_c_api.cpp
ALLOC_FN = "vmalloc_torch_malloc"            # throws c10::OutOfMemoryError (global mode)
POOL_ALLOC_FN = "vmalloc_torch_malloc_pool"  # null on OOM, no pressure callback (pool mode)
FREE_FN = "vmalloc_torch_free"
HOOKS = {"set_record_stream_fn": "vmalloc_torch_record_stream",
         "set_reset_fn": "vmalloc_torch_empty_cache",
         "set_memory_fraction_fn": "vmalloc_torch_memory_fraction",
         "set_init_fn": "vmalloc_torch_init",
         # refuses: CUDA graphs / use_mem_pool need private pools (see torch_c_api.cpp)
         "set_begin_allocate_to_pool": "vmalloc_torch_begin_allocate_to_pool"}


@dataclass
class Registry:
    """Python side of the per-device registry.

    Holds what belongs to a device's registered allocator but is Python: report sections (the
    swap runtime's stats), the recorded allocation history, and the enable() settings. This and
    the C++ table are the one piece of process-wide state vmalloc keeps.
    """

    enabled: bool = False
    mode: Optional[str] = None            # "global" (change_current_allocator), "pool" or "cupy"
    config: Dict[str, Any] = field(default_factory=dict)
    sections: Dict[int, Dict[str, Callable[[], Mapping[str, Any]]]] = field(default_factory=dict)
    history: Dict[int, Deque[Dict[str, Any]]] = field(default_factory=dict)
    history_dropped: Dict[int, int] = field(default_factory=dict)   # by the Python history
    trace_capacity: int = TRACE_CAPACITY
    # True while anyone records (the native trace is on): ``recorders`` names who, so that
    # PyTorch's "record, dump, stop" (``_record_memory_history(None)``) ends the user's recording
    # only, not the one VMALLOC_REPORT started for its exit report
    recording: bool = False
    recorders: Set[str] = field(default_factory=set)    # "report", "user"
    history_seq: Dict[int, int] = field(default_factory=dict)     # events ever kept, per device
    # the user's snapshot shows the history from this sequence number on (set when the user
    # starts, clears or stops a recording; 0: everything recorded)
    user_since: Dict[int, int] = field(default_factory=dict)
    user_stopped: bool = False     # the user stopped recording: their snapshots show no trace
    user_native_dropped: Dict[int, int] = field(default_factory=dict)  # native drops at that point
    torch_allocator: Any = None            # the CUDAPluggableAllocator object (kept alive)
    pool_allocator: Any = None             # pool()'s CUDAPluggableAllocator (kept alive)
    # why vmalloc's allocator cannot answer cuDNN's cacheInfo ("": it does; None: not tried)
    cache_info_missing: Optional[str] = None
    # why VMALLOC=1 left PyTorch's allocator in place (no CUDA device), for stats()' error
    env_not_enabled: Optional[str] = None
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
                    why = f"{type(exc).__name__}: {exc}"
                    # said as a section that is not JSON is (report_format.save)
                    print(f"vmalloc: report section {name!r} failed ({why}); written as an error",
                          file=sys.stderr)
                    out[name] = {"error": why}
        return out


REGISTRY = Registry()


def registry() -> Registry:
    return REGISTRY


def core() -> Any:
    """The native module vmalloc._core (RuntimeError naming the fix when it is not built)."""
    try:
        from .. import _import_core
        return _import_core()
    except ImportError as exc:
        raise RuntimeError("vmalloc's native module vmalloc._core is not built "
                           f"(run scripts/dev-build or pip install the package): {exc}") from None


def entry_point(native: Any, name: str) -> int:
    """Address of an exported C entry point of vmalloc._core."""
    import ctypes
    lib = ctypes.CDLL(native.__file__)
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def device_index(device: Any) -> int:
    """``device`` (int, torch.device, "cuda:1" or None = the current CUDA device) as an
    index ("cuda" and a torch.device without one: the current device)."""
    if isinstance(device, str):
        import torch
        device = torch.device(device)
    if device is not None:
        if hasattr(device, "type"):   # torch.device (a str has a method named index)
            device = device.index
        if device is not None:
            return int(device)
    torch = sys.modules.get("torch")
    try:
        # asking before CUDA started would start it (a context on device 0): an exit report
        # of a process that never used CUDA, a DataLoader worker's, must not
        if torch is None or not torch.cuda.is_initialized():
            return 0
        return torch.cuda.current_device()
    except Exception:  # noqa: BLE001
        return 0


ZERO_STATS = {k: 0 for k in (
    "requested_current", "requested_peak", "mapped_current", "mapped_peak", "physical_current",
    "physical_peak", "internal_fragmentation", "num_malloc", "num_free", "num_map", "num_unmap",
    "num_chunks_created", "chunk_size", "budget", "num_live", "num_cache_hits", "num_remaps",
    "cached_bytes")}


def stats(device: Optional[int] = None) -> Dict[str, Any]:
    """vmalloc's stats (DESIGN.md keys + extras) for ``device`` (default: the current device).

    Raises RuntimeError when vmalloc is not registered with PyTorch.
    """
    if REGISTRY.mode is None:
        why = (f" ({REGISTRY.env_not_enabled})" if REGISTRY.env_not_enabled
               else " (vmalloc.enable() or VMALLOC=1)")
        raise RuntimeError(f"vmalloc.stats: vmalloc is not enabled{why}; a standalone "
                           "vmalloc.Allocator has its own .stats()")
    a = device_allocator(device)
    if a is None:   # this device has allocated nothing yet
        cfg = REGISTRY.config
        return {**ZERO_STATS, "chunk_size": cfg.get("chunk_size", 2 << 20),
                "budget": cfg.get("budget", 0)}
    return dict(a.stats())


def device_allocator(device: Optional[int] = None, create: bool = False) -> Any:
    """The registered allocator of ``device`` (a ``vmalloc._core.Allocator`` that lives until
    exit), for the swap runtime's pressure callback and the like; None before its first use
    unless ``create``."""
    if REGISTRY.mode is None:
        raise RuntimeError("vmalloc is not enabled (vmalloc.enable() or VMALLOC=1)")
    return core()._torch_allocator(device_index(device), create)


def closed_by_user(allocator: Any) -> bool:
    """The registry's allocator was closed by the user (``device_allocator(d).close()``): every
    call but ``stats()`` raises then, so the loops over all devices skip it. (In a forked child
    every allocator is dead, not closed: that still raises, naming the fork.)"""
    return bool(allocator.closed) and not allocator.forked


def devices() -> List[int]:
    """Devices whose allocator exists (created lazily on first use)."""
    if REGISTRY.mode is None:
        return []
    return list(core()._torch_devices())


def is_enabled() -> bool:
    """True once :func:`vmalloc.enable` made vmalloc PyTorch's CUDA allocator."""
    return REGISTRY.enabled
