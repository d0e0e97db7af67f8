"""CuPy on vmalloc: ``vmalloc.cupy.enable()`` makes CuPy allocate from the same per-device
allocators PyTorch uses (``cupy.cuda.set_allocator`` with ``UnownedMemory``), so a CuPy +
PyTorch program shares one pool and one budget.

CuPy frees through the owner object we attach to each allocation: when CuPy drops its last
reference to the memory, the owner returns it to vmalloc on the stream it was allocated on.
Unverified on a GPU in this project (no device was available); see the README.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from .sizes import SizeLike, parse_chunk_and_budget


_failed_frees = 0  # frees an owner could not make (said as the torch deleter says them)


def _say_failed_free(ptr: int, exc: BaseException) -> None:
    """A failed free on stderr: the first three in full, then the count at 10, 100, 1000, ...
    (a sticky CUDA error fails every later free), as ``torch_c_api.cpp``'s deleter does."""
    global _failed_frees
    _failed_frees += 1
    n = _failed_frees
    if n <= 3:
        more = " (further failed frees are counted, said at 10, 100, 1000, ...)" if n == 3 else ""
        sys.stderr.write(f"vmalloc.cupy: free({ptr:#x}) failed: {exc}{more}\n")
    elif str(n).rstrip("0") == "1":
        sys.stderr.write(f"vmalloc.cupy: {n} frees have failed (the last: free({ptr:#x}): "
                         f"{exc})\n")


class _Owner:
    """Keeps an allocation alive while CuPy references it; frees it when collected."""

    __slots__ = ("alloc", "ptr")

    def __init__(self, alloc: Any, ptr: int):
        self.alloc = alloc
        self.ptr = ptr

    def __del__(self) -> None:
        try:
            self.alloc.free(self.ptr)
        except Exception as exc:  # noqa: BLE001 - never raise from a finaliser
            # a closed allocator (its memory went with it) or the interpreter's teardown:
            # nothing to say; anything else (a double free: a bug elsewhere) is said
            if sys.is_finalizing() or getattr(self.alloc, "closed", False):
                return
            try:
                _say_failed_free(self.ptr, exc)
            except Exception:  # noqa: BLE001 - stderr gone (teardown): nothing more to do
                pass


def enable(chunk_size: Optional[SizeLike] = None, budget: Optional[SizeLike] = None) -> None:
    """Route CuPy's device allocations to vmalloc.

    If :func:`vmalloc.enable` already registered vmalloc with PyTorch, CuPy joins those
    allocators (``chunk_size``/``budget`` must then be left out); otherwise this configures the
    per-device registry with them (defaults: 2 MiB chunks, no budget).
    """
    # the arguments first: a bad one is named before CuPy or the native module is loaded
    chunk, cap = parse_chunk_and_budget(chunk_size, budget)
    import cupy

    from .pluggable.registry import core as native_core
    from .pluggable.registry import registry
    core = native_core()
    reg = registry()
    if reg.mode is None:
        core._torch_configure("cuda", chunk, cap, -1)
        reg.mode = "cupy"
        reg.config = {"chunk_size": chunk, "budget": cap, "device": None, "backend": "cuda"}
    elif chunk_size is not None or budget is not None:
        raise ValueError("chunk_size/budget: vmalloc is already configured (by vmalloc.enable); "
                         "call vmalloc.cupy.enable() without them to share its allocators")

    def malloc(nbytes: int) -> "cupy.cuda.MemoryPointer":
        dev = cupy.cuda.Device().id
        if nbytes == 0:
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, dev), 0)
        alloc = core._torch_allocator(dev, True)
        stream = cupy.cuda.get_current_stream().ptr
        try:
            ptr = alloc.malloc(nbytes, stream)
        except MemoryError as exc:
            raise cupy.cuda.memory.OutOfMemoryError(nbytes, getattr(exc, "in_use", 0),
                                                    getattr(exc, "budget", 0)) from exc
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, _Owner(alloc, ptr), dev)
        return cupy.cuda.MemoryPointer(mem, 0)

    cupy.cuda.set_allocator(malloc)


def disable() -> None:
    """Back to CuPy's default memory pool (allocations made through vmalloc stay valid)."""
    import cupy
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
