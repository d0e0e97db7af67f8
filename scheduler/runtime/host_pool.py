"""Reusable host buffers for swapped-out tensors (the swap runtime) and offloaded activations
(the chain runtime's pofo transfers, ``chain_transfers``).

On a GPU the buffers are pinned (page-locked) so device-to-host and host-to-device copies run
asynchronously on side streams; pinning is slow, so buffers are kept and reused across
iterations (saved-tensor sizes repeat exactly from one iteration to the next, so buffers are
pooled by exact byte size). On the CPU (tests, CI) the pool holds ordinary CPU tensors standing
in for host memory, with the same bookkeeping.

A buffer handed back may still be read or written by an asynchronous copy: ``release`` takes the
event of its last copy, and the buffer is handed out again only once that event has completed.
The pool knows which buffers are lent out, so ``reclaim`` can take back what an interrupted
swap left behind. What it caches is bounded (``CACHE_FACTOR`` x the most bytes ever lent at
once, the oldest released going first): with dynamic shapes (a new sequence length every
step) the sizes of past steps would otherwise pile up for good, in pinned memory on a GPU.
"""
from __future__ import annotations

from collections import OrderedDict, defaultdict, deque
from typing import Any, Deque, Dict, Iterable, Optional, Tuple

import torch


CACHE_FACTOR = 2  # cached bytes at most this x the peak lent at once


class HostPool:
    """Byte buffers keyed by exact size, reused once their last copy has completed."""

    def __init__(self, pin_memory: bool):
        self.pin_memory = bool(pin_memory)
        self._free: Dict[int, Deque[Tuple[torch.Tensor, Optional[Any]]]] = defaultdict(deque)
        self._age: "OrderedDict[int, int]" = OrderedDict()  # cached: id -> size, oldest first
        self.num_evicted = 0
        self.in_use_bytes = 0
        self.cached_bytes = 0
        self.peak_in_use_bytes = 0
        self.num_allocated = 0
        self.num_reused = 0
        self._closed = False
        self._lent: Dict[int, torch.Tensor] = {}  # id -> buffer handed out, not released

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` buffer of exactly ``nbytes`` bytes, not read or written by any copy."""
        free = self._free.get(nbytes)
        buf = None
        if free:
            for _ in range(len(free)):
                cand, event = free[0]
                if event is None or event.query():
                    free.popleft()
                    buf = cand
                    del self._age[id(buf)]
                    break
                free.rotate(-1)
        if buf is not None:
            self.cached_bytes -= nbytes
            self.num_reused += 1
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
            self.num_allocated += 1
        self._closed = False
        self._lent[id(buf)] = buf
        self.in_use_bytes += nbytes
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf

    def release(self, buf: torch.Tensor, event: Optional[Any] = None) -> None:
        """Hand ``buf`` back; ``event`` (a CUDA event or None) marks its last copy."""
        if self._lent.pop(id(buf), None) is None:
            return  # reclaimed already
        n = buf.numel()
        self.in_use_bytes -= n
        if self._closed:
            return
        self._free[n].append((buf, event))
        self._age[id(buf)] = n
        self.cached_bytes += n
        while self.cached_bytes > CACHE_FACTOR * self.peak_in_use_bytes and self._age:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        key, n = self._age.popitem(last=False)
        free = self._free[n]
        i = next(i for i, (b, _) in enumerate(free) if id(b) == key)
        _, event = free[i]
        del free[i]
        if not free:
            del self._free[n]
        if event is not None:  # (the oldest: its copy is long done)
            event.synchronize()
        self.cached_bytes -= n
        self.num_evicted += 1

    def resync(self) -> None:
        """``in_use_bytes`` from the buffers lent: a Ctrl-C between a buffer's entry and its
        count (acquire, release) must not leave the figure off for good."""
        self.in_use_bytes = sum(buf.numel() for buf in self._lent.values())

    def give_away(self, buf: torch.Tensor) -> None:
        """``buf`` is no longer the pool's: it is freed with whoever holds it now."""
        if self._lent.pop(id(buf), None) is not None:
            self.in_use_bytes -= buf.numel()

    def reclaim(self, keep: Iterable[torch.Tensor] = ()) -> int:
        """Take back every buffer still lent out but those in ``keep`` (their users are gone,
        as after an interrupted copy); bytes reclaimed."""
        kept = {id(buf) for buf in keep}
        lent = [buf for i, buf in self._lent.items() if i not in kept]
        for buf in lent:
            self.release(buf, None)
        return sum(buf.numel() for buf in lent)

    def trim(self) -> int:
        """Drop every cached buffer (waiting for copies still in flight); bytes released."""
        released = 0
        for free in self._free.values():
            for buf, event in free:
                if event is not None:
                    event.synchronize()
                released += buf.numel()
        self._free.clear()
        self._age.clear()
        self.cached_bytes = 0
        return released

    def close(self) -> None:
        """Trim, and drop buffers handed back later instead of caching them."""
        self.trim()
        self._closed = True

    def stats(self) -> Dict[str, int]:
        return {"host_in_use_bytes": self.in_use_bytes, "host_cached_bytes": self.cached_bytes,
                "host_peak_bytes": self.peak_in_use_bytes,
                "host_buffers_allocated": self.num_allocated,
                "host_buffers_reused": self.num_reused, "host_buffers_evicted": self.num_evicted}
