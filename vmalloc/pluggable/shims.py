"""PyTorch's memory API answered by vmalloc while it is PyTorch's allocator (``enable()``).

A pluggable allocator leaves most of PyTorch's memory API raising ("CUDAPluggableAllocator does
not yet support getDeviceStats", torch/csrc/cuda/CUDAPluggableAllocator.cpp) or answering from
the unused native allocator. Every such function of torch 2.4 - 2.13 reads a ``torch._C`` entry
point at call time, so replacing those entry points here makes the public functions answer from
vmalloc:

* ``torch.cuda``: ``memory_stats`` & co. (``_cuda_memoryStats``), ``reset_peak_memory_stats``,
  ``reset_accumulated_memory_stats`` (warns: not supported), ``memory_snapshot`` / ``_snapshot``
  / ``_record_memory_history`` (vmalloc's own history), ``get_per_process_memory_fraction``
  (``_cuda_getMemoryFraction``: budget / device memory, 1.0 without a budget);
* ``torch.accelerator`` (torch >= 2.8; they go through ``c10::getDeviceAllocator(kCUDA)``, the
  native allocator, whatever the current one is): ``memory_stats`` & co.
  (``_accelerator_getDeviceStats``), ``reset_peak_memory_stats``, ``empty_cache``
  (``_accelerator_emptyCache``: vmalloc's trim), ``_accelerator_isAllocatorInitialized``;
* ``torch.backends.cudnn.benchmark = True``: cuDNN's autotuner asks the allocator for its largest
  free block (``CUDAAllocator::cacheInfo``), which PyTorch's pluggable allocator raises on in
  every convolution. ``enable()`` makes vmalloc's allocator object answer it
  (csrc/bind/torch_cache_info.cpp); where that could not be done (``REGISTRY.cache_info_missing``
  says why), setting it warns and leaves it off.

``get_memory_info`` / ``mem_get_info`` ask the driver (cudaMemGetInfo) and stay right as they are.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Mapping

from .history import clear_user_history, history_snapshot, start_recording, stop_recording
from .registry import REGISTRY, closed_by_user, core, device_allocator, device_index, stats


def torch_memory_stats(s: Mapping[str, Any]) -> Dict[str, Any]:
    """vmalloc stats as ``torch._C._cuda_memoryStats`` returns them (nested dict; per stat
    ``current``, ``peak``, ``allocated`` = cumulative increments, ``freed`` = cumulative
    decrements, for ``all`` / ``small_pool`` / ``large_pool``, as c10's CUDACachingAllocator).

    Mapping (documented in the README): ``allocated_bytes`` and ``requested_bytes`` and
    ``active_bytes`` = bytes requested by live tensors (vmalloc hands out exactly what is asked;
    its rounding shows up in mapped bytes); ``reserved_bytes`` = physical bytes held (in use +
    cached chunks; cumulative: chunks created / released x chunk size); ``allocation`` /
    ``active`` = live allocations (cumulative: mallocs / frees); ``segment`` = chunks held
    (cumulative: chunks created / released); ``num_device_alloc`` / ``num_device_free`` = chunk
    maps / unmaps; ``num_ooms`` = OOMs raised. The ``small_pool`` rows are vmalloc's small-block
    bins (their slabs for reserved bytes and segments); ``large_pool`` the chunked ranges.

    A figure vmalloc's stats do not keep is 0, as PyTorch reports the stats its cudaMallocAsync
    backend does not keep (a copy of ``current`` would pass for a real peak): the cumulative
    ``*_bytes`` ``allocated`` / ``freed`` (but ``reserved_bytes.all``'s), every ``small_pool`` /
    ``large_pool`` peak, the peaks of the ``allocation`` / ``active`` counts, and the pools'
    cumulative ``reserved_bytes`` / ``segment`` figures (chunks move between the two).
    """
    def stat(cur: int, peak: int = 0, allocated: int = 0, freed: int = 0) -> Dict[str, int]:
        return {"current": int(cur), "peak": int(peak), "allocated": int(allocated),
                "freed": int(freed)}

    chunk = int(s.get("chunk_size") or 1)
    req, small_req = int(s["requested_current"]), int(s.get("small_requested_current", 0))
    num_malloc, num_free = int(s["num_malloc"]), int(s["num_free"])
    small_malloc, small_free = int(s.get("num_small_malloc", 0)), int(s.get("num_small_free", 0))
    live = int(s.get("num_live", num_malloc - num_free))
    phys, slabs = int(s["physical_current"]), int(s.get("small_pool_bytes", 0))
    created, released = int(s.get("num_chunks_created", 0)), int(s.get("num_chunks_released", 0))

    def requested() -> Dict[str, Dict[str, int]]:
        return {"all": stat(req, s["requested_peak"]), "small_pool": stat(small_req),
                "large_pool": stat(req - small_req)}

    def allocations() -> Dict[str, Dict[str, int]]:
        small_live = small_malloc - small_free
        return {"all": stat(live, 0, num_malloc, num_free),
                "small_pool": stat(small_live, 0, small_malloc, small_free),
                "large_pool": stat(live - small_live, 0, num_malloc - small_malloc,
                                   num_free - small_free)}

    def zero() -> Dict[str, Dict[str, int]]:
        return {"all": stat(0), "small_pool": stat(0), "large_pool": stat(0)}

    return {
        "allocated_bytes": requested(),
        "requested_bytes": requested(),
        "active_bytes": requested(),
        "reserved_bytes": {"all": stat(phys, s["physical_peak"], created * chunk, released * chunk),
                           "small_pool": stat(slabs), "large_pool": stat(phys - slabs)},
        "inactive_split_bytes": zero(),
        "allocation": allocations(),
        "active": allocations(),
        "segment": {"all": stat(phys // chunk, int(s["physical_peak"]) // chunk, created, released),
                    "small_pool": stat(slabs // chunk),
                    "large_pool": stat((phys - slabs) // chunk)},
        "inactive_split": zero(),
        "num_alloc_retries": int(s.get("num_pressure_calls", 0)),
        "num_ooms": int(s.get("num_oom", 0)),
        "num_sync_all_streams": 0,
        "num_device_alloc": int(s.get("num_map", 0)),
        "num_device_free": int(s.get("num_unmap", 0)),
        "max_split_size": -1,
        "oversize_allocations": stat(0),
        "oversize_segments": stat(0),
    }


def install_shims(torch: Any) -> None:
    """Replace the ``torch._C`` entry points listed in the module doc (originals kept in
    ``registry().patched``)."""
    C = torch._C
    reg = REGISTRY

    def memory_stats(device: Any = None) -> Dict[str, Any]:
        return torch_memory_stats(stats(device_index(device)))

    def reset_peak(device: Any = None) -> None:
        a = device_allocator(device)
        if a is not None and not closed_by_user(a):
            a.reset_peak()

    def reset_accumulated(device: Any = None) -> None:
        _warn_once("reset_acc", "vmalloc: accumulated counters are not reset")

    def memory_snapshot(arg: Any = None) -> Dict[str, Any]:
        cfg = reg.config
        include_traces = not (isinstance(arg, tuple) and len(arg) >= 3 and not arg[2])
        return history_snapshot(chunk_size=cfg.get("chunk_size", 2 << 20), traces=include_traces)

    def record_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        # the user's recording only: a stop leaves the one VMALLOC_REPORT started (its exit
        # report's histogram and N_max) running, as PyTorch's "record, dump, stop" expects
        with reg.lock:
            if not enabled:
                stop_recording("user")
                return
            start_recording("user")
            if kwargs.get("clear_history", len(args) > 3 and args[3]):
                clear_user_history()

    def memory_fraction(device: Any = None) -> float:
        return budget_fraction(stats(device_index(device)), _total_memory(torch, device_index(device)))

    def empty_cache() -> None:
        core()._torch_trim()

    replacements = {
        "_cuda_memoryStats": memory_stats,
        "_cuda_resetPeakMemoryStats": reset_peak,
        "_cuda_resetAccumulatedMemoryStats": reset_accumulated,
        "_cuda_memorySnapshot": memory_snapshot,
        "_cuda_record_memory_history": record_history,
        "_cuda_record_memory_history_legacy": lambda enabled, *a, **k: record_history(
            "all" if enabled else None),
        "_cuda_getMemoryFraction": memory_fraction,
        "_accelerator_getDeviceStats": memory_stats,
        "_accelerator_resetPeakStats": reset_peak,
        "_accelerator_resetAccumulatedStats": reset_accumulated,
        "_accelerator_emptyCache": empty_cache,
        "_accelerator_isAllocatorInitialized": lambda: True,
    }
    for name, fn in replacements.items():
        # set even where this torch lacks the entry point: nothing calls it there, and the
        # CPU tests drive the shims through a CPU build of torch
        reg.patched.setdefault(name, getattr(C, name, None))
        setattr(C, name, fn)
    if reg.cache_info_missing != "":
        guard_cudnn_benchmark(torch, reg.cache_info_missing or "not installed")
    refuse_graph_capture_early(torch)


def budget_fraction(s: Mapping[str, Any], total_memory: int) -> float:
    """``get_per_process_memory_fraction``: the budget as a fraction of the device memory (1.0
    without a budget, as PyTorch answers before any fraction was set)."""
    budget = int(s.get("budget") or 0)
    if budget <= 0 or total_memory <= 0:
        return 1.0
    return min(1.0, budget / total_memory)


def _total_memory(torch: Any, device: int) -> int:
    return int(torch.cuda.get_device_properties(device).total_memory)


CUDNN_BENCHMARK_WARNING = (
    "vmalloc: torch.backends.cudnn.benchmark = True is left off: cuDNN's autotuner asks the "
    "allocator for its largest free block (CUDAAllocator::cacheInfo), which PyTorch's pluggable "
    "allocator does not support (every convolution would raise), and vmalloc could not answer "
    "it here ({why}). Convolutions use cuDNN's heuristics instead; run without vmalloc "
    "(VMALLOC=0) to autotune.")


def guard_cudnn_benchmark(torch: Any, why: str) -> None:
    """Keep ``cudnn.benchmark`` off with a warning saying ``why`` (see the module doc), also when
    it was already on and through ``torch.backends.cudnn.flags(benchmark=True)``."""
    C = torch._C
    original = REGISTRY.patched.get("_set_cudnn_benchmark") or getattr(C, "_set_cudnn_benchmark", None)
    if original is None:
        return
    REGISTRY.patched.setdefault("_set_cudnn_benchmark", original)

    def set_benchmark(value: Any) -> None:
        if value:
            _warn_once("cudnn_benchmark", CUDNN_BENCHMARK_WARNING.format(why=why))
        original(False)

    C._set_cudnn_benchmark = set_benchmark
    cudnn = getattr(getattr(torch, "backends", None), "cudnn", None)
    prop = type(cudnn).__dict__.get("benchmark") if cudnn is not None else None
    if prop is not None and hasattr(prop, "setter"):   # ContextProp bound the original setter
        prop.setter = set_benchmark
    if getattr(C, "_get_cudnn_benchmark", lambda: False)():
        set_benchmark(True)


GRAPH_CAPTURE_REFUSED = (
    "vmalloc: CUDA graph capture (torch.cuda.graph, make_graphed_callables, "
    "torch.compile(mode=\"reduce-overhead\")) needs a private memory pool no other tensor may "
    "reuse, and vmalloc has none: it refuses rather than let a replay write into other tensors. "
    "Use torch.compile's default mode, or run without vmalloc (VMALLOC=0) for graph capture.")


def refuse_graph_capture_early(torch: Any) -> None:
    """Refuse ``torch.cuda.graph`` on entry. vmalloc refuses the capture's private pool
    anyway (``vmalloc_torch_begin_allocate_to_pool``), but that comes after the context
    made its side stream current, and a raising ``__enter__`` gets no ``__exit__``: a caller
    that catches the error and falls back to eager would go on queuing work on that stream,
    unordered with the rest."""
    graph = getattr(getattr(getattr(torch, "cuda", None), "graphs", None), "graph", None)
    original = getattr(graph, "__enter__", None)
    if original is None or getattr(original, "vmalloc_refuses", False):
        return

    def __enter__(self: Any) -> Any:
        if REGISTRY.mode == "global":
            raise RuntimeError(GRAPH_CAPTURE_REFUSED)
        return original(self)

    __enter__.vmalloc_refuses = True  # type: ignore[attr-defined]
    REGISTRY.patched.setdefault("graph.__enter__", original)
    graph.__enter__ = __enter__


_WARNED: set = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
