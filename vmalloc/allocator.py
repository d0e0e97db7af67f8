"""Python face of the native allocator (seed 003, section 4; DESIGN.md "The allocator").

``vmalloc.Allocator`` subclasses the C++ class, so ``malloc``/``free`` cost one native call; this
module only validates arguments (naming the bad parameter and value) and adds the context manager.
``malloc``/``free``/``record_stream`` check theirs in the binding (``csrc/bind/alloc_py.cpp``:
``nbytes`` a positive int below 2**64, ``stream`` and ``ptr`` ints in [0, 2**64)), so that a
Python wrapper does not add a second call to the fast path.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

from .sizes import SizeLike, check_budget_holds_a_chunk, parse_optional_size, parse_size

# not built: an ImportError naming the directory imported and the two remedies (vmalloc/__init__.py)
from . import _import_core
_core = _import_core()

BACKENDS = ("host", "host-lazy", "cuda")
# the core's own defaults (csrc/alloc/allocator.hpp, Config): the one place they are set
_DEFAULTS = _core.DEFAULT_CONFIG

# cache_slack at or above _NO_CAP_CHUNKS * chunk_size - 1 is no cap. Below it the native cap,
# (chunks in use) * (1 + slack), stays under 2**64 for up to 2**57 bytes in use (57-bit virtual
# addresses, the widest there are): 2**57 / chunk * 2**7 * chunk = 2**64. Above it the cap is at
# least 128 * chunk_size chunks per chunk in use, more than any cache can hold.
_NO_CAP_CHUNKS = 1 << 7


def granularity(backend: str = "host", device: int = 0) -> int:
    """Allocation granularity in bytes: chunk sizes must be a multiple of it.

    ``host``, ``host-lazy``: the page size (4 KiB here). We do not mirror the GPUs' 2 MiB on the host: the tests
    use small chunks to keep RAM low, and the host mapping really works at page granularity.
    ``cuda``: ``cuMemGetAllocationGranularity`` (minimum) for the device, 2 MiB on current GPUs.
    """
    _check_backend(backend)
    return int(_core.backend_granularity(backend, _check_device(device)))


def _check_backend(backend: object) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r} (expected 'host', 'host-lazy' "
                         "or 'cuda')")
    return backend  # type: ignore[return-value]


def _check_device(device: object) -> int:
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"device: expected a device index >= 0, got {device!r}")
    if device >= 1 << 31:  # the native side holds a device in a C int
        raise ValueError(f"device: {device} is too large for a device index (below 2**31)")
    return device


def _check_flag(value: object, name: str) -> bool:
    """A bool knob: True/False (or 1/0). Anything else is refused: bool("no") is True."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name}: expected True or False, got {value!r}")


def _check_event_count(value: object, name: str) -> int:
    """A trace ring's size: an int in [0, 2**64) (a size_t natively)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise ValueError(f"{name}: expected an event count >= 0, got {value!r} "
                         "(at most 2**64 - 1)")
    return value


class Allocator(_core.Allocator):
    """Chunked virtual-addressing allocator.

    Physical memory comes in ``chunk_size`` chunks; a request of ``n`` bytes at or above
    ``small_threshold`` maps ``ceil(n / chunk_size)`` chunks back to back into one virtual range,
    smaller ones are carved from one-chunk slabs. ``budget`` caps the physical bytes held
    (``None``: no cap); past it ``malloc`` raises :class:`vmalloc.OutOfMemoryError`.

    Parameters
    ----------
    backend: ``"host"`` (memfd chunks mapped with mmap; works everywhere), ``"host-lazy"``
        (the same, but a chunk takes RAM only once written: replays, which never write, make
        the same decisions without the trace's peak in RAM; no limit but the budget) or
        ``"cuda"``.
    chunk_size: bytes per chunk (int or size string such as ``"2MiB"``), a multiple of
        :func:`granularity`. Default 2 MiB.
    budget: cap on physical bytes (int or size string), at least one chunk; ``None`` = no cap.
    device: CUDA device index (ignored by the host backend).
    small_threshold: requests below this many bytes use the small-block bins (default 1 MiB,
        capped at ``chunk_size``); 0 turns them off.
    split_cached: reuse the tail of a larger cached range without remapping (default on).
    merge_cached: a freed range joins the cached ranges right before and after it in virtual
        memory (same stream, one reservation), as PyTorch's caching allocator joins free
        neighbours: a larger request then reuses them without mapping fresh chunks (default on;
        with ``split_cached`` only, since a joined range is reused by splitting pieces off).
    prefer_remap: on a cache miss, remap cached chunks before creating new ones: least physical
        memory, more map/unmap calls (default off). Same as ``cache_slack=0``.
    cache_slack: without a budget, on a cache miss new chunks are created while physical memory
        stays below ``(1 + cache_slack)`` x the peak of chunks in use; past that, cached chunks
        are remapped first (default ``None``: no cap, like a caching allocator, as do
        ``float("inf")`` and any value >= 128 x chunk_size). On a GPU a remap costs tens of
        microseconds per chunk; replayed, the traces recorded on an H100 spent at most 2.7% of a
        step remapping at 0.5, for up to 13% less memory, but a cap can thrash where cached
        ranges are not joined (a second stream: malloc+free cycles of mixed sizes remap every
        time), so there is none by default (bench/results/cache_slack.json). With a budget,
        chunks are created up to the budget first.
    trace_capacity: the allocation trace (``set_trace``) is a ring of at most this many events
        (default 100000, about 48 bytes each); older events are dropped and counted in
        ``stats()["num_trace_dropped"]``.

    Reliability (README "Reliability"): every driver failure leaves the allocator consistent;
    ``close()`` never raises or aborts and releases everything; in a forked child the allocator
    is dead (every call raises, ``close()`` releases nothing of the parent's).
    """

    def __init__(self, backend: str = _DEFAULTS["backend"],
                 chunk_size: SizeLike = _DEFAULTS["chunk_size"],
                 budget: Optional[SizeLike] = None, device: int = _DEFAULTS["device"], *,
                 small_threshold: SizeLike = _DEFAULTS["small_threshold"],
                 split_cached: bool = _DEFAULTS["split_cached"],
                 merge_cached: bool = _DEFAULTS["merge_cached"],
                 prefer_remap: bool = _DEFAULTS["prefer_remap"],
                 cache_slack: Optional[float] = _DEFAULTS["cache_slack"],
                 trace_capacity: int = _DEFAULTS["trace_capacity"]) -> None:
        _check_backend(backend)
        device = _check_device(device)
        chunk = parse_size(chunk_size, "chunk_size")
        if chunk <= 0:
            raise ValueError(f"chunk_size: must be positive, got {chunk_size!r}")
        nbudget = parse_optional_size(budget, "budget")
        check_budget_holds_a_chunk(nbudget, chunk, zero_is_no_cap=False)
        small = parse_size(small_threshold, "small_threshold")
        if cache_slack is None:
            slack = -1.0
        elif isinstance(cache_slack, bool) or not isinstance(cache_slack, (int, float)) \
                or not cache_slack >= 0:  # NaN fails >= 0 too
            raise ValueError(f"cache_slack: expected a number >= 0 or None, got {cache_slack!r}")
        elif cache_slack >= _NO_CAP_CHUNKS * chunk - 1:
            # inf (or any slack this large) means no cap, i.e. None. Passed on, the native cap
            # ceil(chunks * (1 + slack)) could pass the size_t range: an undefined conversion
            # that in practice gives 0, i.e. cache_slack=0, the opposite of what was asked.
            slack = -1.0
        else:
            slack = float(cache_slack)
        trace_capacity = _check_event_count(trace_capacity, "trace_capacity")
        split = _check_flag(split_cached, "split_cached")
        merge = _check_flag(merge_cached, "merge_cached")
        remap = _check_flag(prefer_remap, "prefer_remap")
        # The native constructor checks chunk_size against the device granularity and raises
        # ValueError naming chunk_size; the cuda backend raises RuntimeError without a driver.
        super().__init__(backend=backend, chunk_size=chunk, budget=nbudget or 0, device=device,
                         small_threshold=small, split_cached=split, prefer_remap=remap,
                         cache_slack=slack, trace_capacity=trace_capacity, merge_cached=merge)

    def set_budget(self, budget: Optional[SizeLike]) -> None:
        """Change the cap on physical bytes (``None``: no cap); cached chunks above it are released."""
        nbudget = parse_optional_size(budget, "budget")
        check_budget_holds_a_chunk(nbudget, self.chunk_size, zero_is_no_cap=False)
        super().set_budget(nbudget or 0)

    def set_trace_capacity(self, events: int) -> None:
        """Keep at most ``events`` trace events (a ring: the oldest are dropped and counted in
        ``stats()["num_trace_dropped"]``)."""
        super().set_trace_capacity(_check_event_count(events, "events"))

    def add_peer(self, device: int) -> bool:
        """Give CUDA device ``device`` read-write access to all memory this allocator has mapped
        and will map (one process, several GPUs). False when it has no peer-to-peer path (and on
        the host backend)."""
        return super().add_peer(_check_device(device))

    def set_pressure_callback(self, callback: Optional[Callable[[int], bool]]) -> None:
        """``callback(missing_bytes) -> bool`` is asked before ``malloc`` raises OutOfMemoryError.

        Return True if it freed memory: the allocator then retries once. It runs without the
        allocator's lock held, so it may free (or allocate) through this allocator.

        The callback is kept on this Python object (where the garbage collector sees it); the
        native side holds only a weak reference to the allocator, so a callback that refers to
        its allocator makes an ordinary cycle that ``gc.collect()`` frees.
        """
        if callback is None:
            self._pressure_callback = None
            super().set_pressure_callback(None)
            return
        if not callable(callback):
            raise TypeError(f"callback: expected a callable or None, got {callback!r}")
        before = self.__dict__.get("_pressure_callback")
        self._pressure_callback = callback
        ref = weakref.ref(self)

        def trampoline(missing: int) -> bool:
            me = ref()
            cb = None if me is None else me._pressure_callback
            return False if cb is None else cb(missing)

        try:
            super().set_pressure_callback(trampoline)
        except BaseException:
            # refused (closed: RuntimeError): nothing attached, and nothing kept here either,
            # or the callback -> allocator cycle close() broke would be back
            self.__dict__.pop("_pressure_callback", None)
            if before is not None:
                self._pressure_callback = before
            raise

    def close(self) -> None:
        """Return everything to the driver and drop the pressure callback; idempotent. Never
        raises on a driver failure (each release is tried on its own). In a forked child it
        releases nothing: the memory is the parent's. Afterwards every call raises
        ``RuntimeError`` but ``stats()``, the read-only properties (``closed``, ``chunk_size``,
        ...), ``close()`` and ``set_pressure_callback(None)``."""
        super().close()
        self.__dict__.pop("_pressure_callback", None)

    def __enter__(self) -> "Allocator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        budget = self.budget or None
        return (f"vmalloc.Allocator(backend={self.backend!r}, chunk_size={self.chunk_size}, "
                f"budget={budget}, device={self.device}) [{state}]")
