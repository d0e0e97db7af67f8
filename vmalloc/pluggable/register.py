"""Registration with PyTorch: ``enable()`` (vmalloc is PyTorch's CUDA allocator for the process)
and ``pool()`` (a scoped ``torch.cuda.MemPool`` whose segments come from vmalloc).

Both hand PyTorch the C entry points of ``csrc/bind/torch_c_api.cpp`` (exported from
``vmalloc._core``) through ``torch.cuda.memory.CUDAPluggableAllocator`` and wire the extra hooks
PyTorch offers a pluggable allocator (``torch/csrc/cuda/CUDAPluggableAllocator.h``, torch
2.4 - 2.13): ``set_record_stream_fn`` (``Tensor.record_stream``), ``set_reset_fn``
(``torch.cuda.empty_cache()`` -> trim), ``set_memory_fraction_fn``
(``set_per_process_memory_fraction`` -> budget), ``set_init_fn`` (device count),
``set_begin_allocate_to_pool`` (a private pool for CUDA graph capture or ``use_mem_pool``:
refused with a ``RuntimeError``, vmalloc has none); and, with no hook for it, ``cacheInfo``
(cuDNN's autotuner) through ``_torch_install_cache_info`` (csrc/bind/torch_cache_info.cpp).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional

from ..sizes import SizeLike, parse_chunk_and_budget
from .registry import ALLOC_FN, FREE_FN, HOOKS, POOL_ALLOC_FN, REGISTRY, core, entry_point


def enable(chunk_size: Optional[SizeLike] = None, budget: Optional[SizeLike] = None,
           device: Optional[int] = None, backend: str = "cuda") -> None:
    """Make vmalloc PyTorch's CUDA allocator for this process (every device; one allocator per
    device, created on its first allocation).

    ``chunk_size`` (default 2 MiB) and ``budget`` (physical bytes; None = no cap) accept sizes like
    ``"2MiB"``; ``device`` limits the budget to that device (None = every device). ``backend``
    must be ``"cuda"`` (the only memory PyTorch's kernels can use; kept as a keyword so a wrong
    one is refused by name rather than as an unexpected argument). Must run before CUDA is
    initialised - ``VMALLOC=1`` does this for you at ``import torch``. Calling it again with the
    same settings is a no-op.
    """
    if backend != "cuda":  # host memory handed to PyTorch as device memory would fault kernels
        raise ValueError(f"backend: vmalloc.enable() takes only 'cuda', got {backend!r} "
                         "(vmalloc.Allocator(backend='host') is the allocator without a GPU)")
    chunk, cap = parse_chunk_and_budget(chunk_size, budget)
    if device is not None and (isinstance(device, bool) or not isinstance(device, int)
                               or device < 0):
        raise ValueError(f"device: expected a CUDA device index >= 0 or None, got {device!r}")
    cfg = {"chunk_size": chunk, "budget": cap, "device": device, "backend": backend}
    reg = REGISTRY
    with reg.lock:
        if reg.enabled:
            if reg.config == cfg:
                return
            raise RuntimeError(f"vmalloc.enable: already enabled with {reg.config}; PyTorch cannot "
                               f"swap its allocator twice, so {cfg} cannot take effect")
        import torch
        _require_cuda(torch, "vmalloc.enable")
        if torch.cuda.is_initialized():
            used = _native_reserved(torch)
            raise RuntimeError(
                "vmalloc.enable: CUDA is already initialised"
                + (f" and PyTorch's own allocator holds {used} bytes" if used else "")
                + "; PyTorch only accepts a new allocator before that (\"Can't swap an already "
                "initialized allocator\"). Call vmalloc.enable() before any CUDA work, or set "
                "VMALLOC=1 in the environment, or use the scoped form `with vmalloc.pool(): ...`.")
        native = core()
        native._torch_configure(backend, chunk, cap, -1 if device is None else device)
        if reg.recording:
            native._torch_set_trace(True)
        alloc = torch.cuda.memory.CUDAPluggableAllocator(native.__file__, ALLOC_FN, FREE_FN)
        _wire_hooks(native, alloc.allocator())
        torch.cuda.memory.change_current_allocator(alloc)
        reg.torch_allocator = alloc
        reg.cache_info_missing = native._torch_install_cache_info()   # for cudnn.benchmark
        reg.enabled, reg.mode, reg.config = True, "global", cfg
        from .shims import install_shims
        install_shims(torch)


@contextlib.contextmanager
def pool(chunk_size: Optional[SizeLike] = None, budget: Optional[SizeLike] = None,
         device: Optional[int] = None) -> Iterator[Any]:
    """Scoped form (PyTorch with ``torch.cuda.MemPool``): allocations of this thread inside the
    block come from vmalloc, also after CUDA was initialised.

    PyTorch's caching allocator stays in charge of the pool (it asks vmalloc for whole segments
    and caches them until the pool is destroyed), so vmalloc's anti-fragmentation applies to
    segments, not tensors; prefer :func:`enable` when you can set it up before CUDA starts.
    Running out returns null to PyTorch (``vmalloc_torch_malloc_pool``), which frees its cached
    segments, retries, and then raises its own ``torch.OutOfMemoryError``; no pressure callback
    is called in this mode (PyTorch holds its allocator lock there).
    """
    # the arguments first: a bad one is named anywhere
    chunk, cap = parse_chunk_and_budget(chunk_size, budget)
    import torch
    if not hasattr(torch.cuda, "MemPool"):
        raise RuntimeError("vmalloc.pool: this PyTorch has no torch.cuda.MemPool (added in 2.5); "
                           "use vmalloc.enable() before CUDA is initialised instead")
    _require_cuda(torch, "vmalloc.pool")
    if REGISTRY.enabled:
        raise RuntimeError("vmalloc.pool: vmalloc is already PyTorch's allocator (vmalloc.enable)")
    native = core()
    native._torch_configure("cuda", chunk, cap, -1 if device is None else device)
    allocator = _pool_allocator(torch, native).allocator()
    # a MemPool registers its allocator on the device current when it is made (MemPool.cpp):
    # made on another one, `device`'s allocations inside the block would silently get a
    # private pool of PyTorch's own, with no vmalloc and no budget
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        mem_pool = torch.cuda.MemPool(allocator)
    REGISTRY.mode = "pool"
    REGISTRY.config = {"chunk_size": chunk, "budget": cap, "device": device, "backend": "cuda"}
    _trim_on_empty_cache(torch)
    try:
        with torch.cuda.use_mem_pool(mem_pool, device=device):
            yield mem_pool
    finally:
        native._torch_trim()   # what PyTorch gave back meanwhile goes back to the driver


def _trim_on_empty_cache(torch: Any) -> None:
    """In pool mode PyTorch's caching allocator gives the pool's free segments back to vmalloc
    (``torch.cuda.empty_cache()``, ``torch.accelerator.empty_cache()``), which would keep them
    cached: memory neither PyTorch's own allocator nor another process could use. Both then
    also trim vmalloc's cache. (In global mode PyTorch's ``empty_cache`` reaches vmalloc's
    trim through ``set_reset_fn``, and ``shims.install_shims`` answers the accelerator one.)"""
    C = torch._C
    for name in ("_cuda_emptyCache", "_accelerator_emptyCache"):
        original = getattr(C, name, None)
        if original is None or name in REGISTRY.patched:
            continue
        REGISTRY.patched[name] = original
        setattr(C, name, _then_trim(original))


def _then_trim(original: Any) -> Any:
    def empty_cache(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        core()._torch_trim()
        return out
    return empty_cache


def _pool_allocator(torch: Any, native: Any) -> Any:
    """The one ``CUDAPluggableAllocator`` every ``pool()`` gives its ``MemPool``, kept for the
    process. A MemPool holds only a raw pointer to its allocator (torch/csrc/cuda/MemPool.cpp
    binds it without keep_alive) and PyTorch frees the pool's segments through it whenever they
    fall free - after the block too: tensors made inside outlive it, and ``empty_cache()`` or
    the MemPool's destructor release their segments later. An allocator local to ``pool()``
    was freed at the end of the block, and that later free ran on a destroyed object."""
    if REGISTRY.pool_allocator is None:
        alloc = torch.cuda.memory.CUDAPluggableAllocator(native.__file__, POOL_ALLOC_FN, FREE_FN)
        _wire_hooks(native, alloc.allocator())
        REGISTRY.pool_allocator = alloc
    return REGISTRY.pool_allocator


def _require_cuda(torch: Any, who: str) -> None:
    """A clear error where PyTorch has no CUDA (a CPU build) or sees no device."""
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError(f"{who}: this PyTorch ({torch.__version__}) is built without CUDA; "
                           "vmalloc.Allocator(backend='host') works without one")
    if not cuda_present(torch):
        raise RuntimeError(f"{who}: no CUDA device is available (torch.cuda.is_available() is "
                           "False); vmalloc.Allocator(backend='host') works without one")


def cuda_present(torch: Any) -> bool:
    """Whether PyTorch sees a CUDA device, asked without starting the driver where possible.
    ``torch.cuda.is_available()`` runs ``cuInit``, after which a ``fork()``ed child cannot use
    CUDA; registering an allocator needs no driver, so ``VMALLOC=1`` must not take that from a
    program that imports torch and then forks CUDA workers. NVML counts the devices without
    ``cuInit`` (as ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` makes PyTorch do); where NVML cannot
    answer, ``is_available()`` does. A GPU NVML sees but CUDA cannot use (a driver older than
    this PyTorch's CUDA) gets vmalloc registered, and PyTorch's first CUDA call says why it
    fails."""
    cuda = torch.cuda
    if cuda.is_initialized():
        return cuda.device_count() > 0
    compiled = getattr(cuda, "_is_compiled", None)
    if compiled is not None and not compiled():
        return False
    nvml = getattr(cuda, "_device_count_nvml", None)
    if nvml is not None:
        try:
            n = int(nvml())
        except Exception:  # noqa: BLE001 - NVML missing or broken: ask CUDA instead
            n = -1
        if n >= 0:
            return n > 0
    return cuda.is_available()


def _wire_hooks(native: Any, raw: Any) -> None:
    for setter, symbol in HOOKS.items():
        fn = getattr(raw, setter, None)
        if fn is None and setter == "set_record_stream_fn":
            # without it, memory another stream still reads (NCCL's buffers, the swap runtime's
            # and pofo's copies) would be handed out again under that stream: wrong data
            raise RuntimeError(f"vmalloc: this PyTorch ({torch_version()}) has no "
                               "CUDAAllocator.set_record_stream_fn, so Tensor.record_stream "
                               "cannot reach vmalloc; it needs torch >= 2.4")
        if fn is None:  # a torch without this hook: say which feature is missing, keep going
            warnings.warn(f"vmalloc: this PyTorch has no CUDAAllocator.{setter}; "
                          f"{symbol.replace('vmalloc_torch_', '')} will not reach vmalloc",
                          RuntimeWarning, stacklevel=3)
            continue
        fn(entry_point(native, symbol))


def torch_version() -> str:
    import torch
    return str(getattr(torch, "__version__", "?"))


def _native_reserved(torch: Any) -> int:
    try:
        return int(torch.cuda.memory_reserved())
    except Exception:  # noqa: BLE001
        return 0
