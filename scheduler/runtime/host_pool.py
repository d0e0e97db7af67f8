"""Reusable host buffers for swapped-out tensors (the swap runtime) and offloaded activations
(the chain runtime's pofo transfers, ``chain_transfers``).

On a GPU the buffers are pinned (page-locked) so device-to-host and host-to-device copies run
asynchronously on side streams; pinning is slow, so buffers are kept and reused across
iterations (saved-tensor sizes repeat exactly from one iteration to the next, so buffers are
pooled by exact byte size). On the CPU (tests, CI) the pool holds ordinary CPU tensors standing
in for host memory, with the same bookkeeping.

Buffers of ``DIRECT_BELOW`` bytes and more are carved out of large slabs (``Slab``): PyTorch's
pinned-memory cache (CachingHostAllocator) rounds every block up to a power of two, and
activations have sizes like batch x 49 x 2^k x 4 bytes, which a block of their own holds at
~1.86x: ResNet-50 at batch 1440 would pin ~190 GiB for ~100 GiB of activations, beyond a
128 GiB host. A carved buffer costs its size rounded up to ``ALIGN``. It is a view of its slab
(``slab[offset:offset + n]``): pinned like the slab, and PyTorch records a non-blocking copy's
stream on the slab's block, so the slab's memory is not reused by PyTorch while a copy runs.
A slab is let go only once every range carved from it came back and the copies on those ranges
are done. Smaller buffers are allocated directly (their rounding costs little).

A buffer handed back may still be read or written by an asynchronous copy: ``release`` takes the
event of its last copy, and the buffer is handed out again only once that event has completed
(its range goes back to its slab only then, too). The pool knows which buffers are lent out, so
``reclaim`` can take back what an interrupted swap left behind. What it caches is bounded
(``CACHE_FACTOR`` x the most bytes ever lent at once, the oldest released going first): with
dynamic shapes (a new sequence length every step) the sizes of past steps would otherwise pile
up for good, in pinned memory on a GPU.

A buffer given away (``give_away``) stays carved while any tensor other than the pool's own
still uses its slab's storage (the buffer, or views made from it: the storage's use count says
so), and comes back only after a device synchronize (its holder's copies are unknown to the
pool); this is done lazily, when a new slab would be needed, and by ``trim``.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict, defaultdict, deque
from typing import Any, Deque, Dict, Iterable, List, Optional, Set, Tuple

import torch

from ..profile.storage import use_count


CACHE_FACTOR = 2  # cached bytes at most this x the peak lent at once
SLAB_BYTES = 256 << 20  # a power of two: PyTorch's pinned cache holds it without rounding
DIRECT_BELOW = 64 << 10  # smaller buffers get a block of their own (little rounding waste)
ALIGN = 512  # carved offsets: every dtype's view and fast DMA


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _power_of_two_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class Slab:
    """One large host block; buffers are views of ranges of it. ``free`` holds the ranges no
    copy touches any more, sorted and coalesced; ``carved`` the bytes of all others."""

    def __init__(self, nbytes: int, pin_memory: bool):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.storage = self.tensor.untyped_storage()  # (kept: a constant in the use count)
        self.nbytes = nbytes
        self.free: List[Tuple[int, int]] = [(0, nbytes)]  # (offset, length)
        self.carved = 0
        self.given: List[Tuple[int, int]] = []  # ranges given away, not back yet
        self.held = 0  # pool-held buffers (lent or cached) carved from it

    def carve(self, span: int) -> Optional[int]:
        """The offset of a free range of ``span`` bytes (first fit), or None."""
        for i, (off, length) in enumerate(self.free):
            if length >= span:
                if length == span:
                    del self.free[i]
                else:
                    self.free[i] = (off + span, length - span)
                self.carved += span
                return off
        return None

    def give_back(self, off: int, span: int) -> None:
        """The range no copy touches any more is free again (merged with its neighbours)."""
        self.carved -= span
        i = bisect.bisect_left(self.free, (off, 0))
        if i < len(self.free) and self.free[i][0] == off + span:
            span += self.free.pop(i)[1]
        if i > 0 and sum(self.free[i - 1]) == off:
            i -= 1
            prev_off, prev_len = self.free.pop(i)
            off, span = prev_off, prev_len + span
        self.free.insert(i, (off, span))

    def outside_users(self) -> bool:
        """Some tensor that is not the slab or a pool-held buffer uses its storage (a buffer
        given away, or a view made from any buffer)."""
        n = use_count(self.storage)
        return n is None or n > 2 + self.held  # (unknown: assume the worst)


class HostPool:
    """Byte buffers keyed by exact size, reused once their last copy has completed."""

    def __init__(self, pin_memory: bool, slab_bytes: int = SLAB_BYTES,
                 direct_below: int = DIRECT_BELOW):
        self.pin_memory = bool(pin_memory)
        self.slab_bytes = int(slab_bytes)
        self.direct_below = int(direct_below)
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
        self._slabs: List[Slab] = []
        # carved buffers the pool holds (lent or cached): id -> (buffer, slab, offset, span);
        # the buffer is kept so that its id is not reused while the entry exists
        self._where: Dict[int, Tuple[torch.Tensor, Slab, int, int]] = {}
        # ranges neither lent nor cached whose last copy may still run: (slab, off, span, event)
        self._settling: List[Tuple[Slab, int, int, Any]] = []
        self._devices: Set[Any] = set()  # of the copies' events (synchronized for give-aways)

    # --------------------------------------------------------------------------- lending
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
            buf = self._new_buffer(nbytes)
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
        device = getattr(event, "device", None)
        if device is not None:
            self._devices.add(device)
        if self._closed:
            self._let_go(buf, event)
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
        buf, event = free[i]
        del free[i]
        if not free:
            del self._free[n]
        if event is not None:  # (the oldest: its copy is long done)
            event.synchronize()
        self.cached_bytes -= n
        self.num_evicted += 1
        self._let_go(buf, None)

    def resync(self) -> None:
        """``in_use_bytes`` from the buffers lent: a Ctrl-C between a buffer's entry and its
        count (acquire, release) must not leave the figure off for good."""
        self.in_use_bytes = sum(buf.numel() for buf in self._lent.values())
        # a carved buffer neither lent nor cached (release stopped between the two): its range
        # comes back like a given-away one (its last copy's event is lost)
        cached = {id(b) for free in self._free.values() for b, _ in free}
        for key in [k for k in self._where if k not in self._lent and k not in cached]:
            _, slab, off, span = self._where.pop(key)
            slab.held -= 1
            slab.given.append((off, span))

    def give_away(self, buf: torch.Tensor) -> None:
        """``buf`` is no longer the pool's: it is freed with whoever holds it now (a carved
        buffer's range is taken back once nothing but the pool uses its slab, see module)."""
        if self._lent.pop(id(buf), None) is not None:
            self.in_use_bytes -= buf.numel()
            where = self._where.pop(id(buf), None)
            if where is not None:
                _, slab, off, span = where
                slab.held -= 1
                slab.given.append((off, span))

    def reclaim(self, keep: Iterable[torch.Tensor] = ()) -> int:
        """Take back every buffer still lent out but those in ``keep`` (their users are gone,
        as after an interrupted copy); bytes reclaimed."""
        kept = {id(buf) for buf in keep}
        lent = [buf for i, buf in self._lent.items() if i not in kept]
        for buf in lent:
            self.release(buf, None)
        return sum(buf.numel() for buf in lent)

    def trim(self) -> int:
        """Drop every cached buffer (waiting for copies still in flight), and every slab
        nothing is carved from any more; bytes of cached buffers released."""
        released = self._drop_cached()
        for slab, off, span, event in self._settling:
            if event is not None:
                event.synchronize()
            slab.give_back(off, span)
        self._settling.clear()
        self._take_back_given()
        self._slabs = [slab for slab in self._slabs if slab.carved]
        return released

    def _drop_cached(self) -> int:
        """Let every cached buffer go (its copy waited for); bytes. (Its own frame: no local
        may keep a buffer alive, and so its slab in use, once they are gone.)"""
        released = 0
        for free in self._free.values():
            for buf, event in free:
                if event is not None:
                    event.synchronize()
                released += buf.numel()
                self._let_go(buf, None)
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
                "host_buffers_reused": self.num_reused, "host_buffers_evicted": self.num_evicted,
                "host_slab_bytes": self.slab_bytes_held(), "host_slabs": len(self._slabs)}

    def slab_bytes_held(self) -> int:
        return sum(slab.nbytes for slab in self._slabs)

    # --------------------------------------------------------------------------- slabs
    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        if nbytes < self.direct_below:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        self._settle()
        span = _round_up(nbytes, ALIGN)
        found = self._carve(span)
        if found is None and self._take_back_given():
            found = self._carve(span)
        if found is None:  # a huge request gets a slab of its own (its rest carved later)
            slab = Slab(max(self.slab_bytes, _power_of_two_ceil(span)), self.pin_memory)
            self._slabs.append(slab)
            found = slab, slab.carve(span)
        slab, off = found
        buf = slab.tensor[off:off + nbytes]
        self._where[id(buf)] = (buf, slab, off, span)
        slab.held += 1
        return buf

    def _carve(self, span: int) -> Optional[Tuple[Slab, int]]:
        for slab in self._slabs:
            off = slab.carve(span)
            if off is not None:
                return slab, off
        return None

    def _let_go(self, buf: torch.Tensor, event: Optional[Any]) -> None:
        """``buf`` leaves the pool: a direct one dies with its last holder (PyTorch's pinned
        cache waits for its copies), a carved one's range goes back once ``event`` is done."""
        where = self._where.pop(id(buf), None)
        if where is None:
            return
        _, slab, off, span = where
        slab.held -= 1
        if event is None or event.query():
            slab.give_back(off, span)
            if self._closed and not slab.carved:   # (after close: nothing will carve it again)
                self._slabs.remove(slab)
        else:
            self._settling.append((slab, off, span, event))

    def _settle(self) -> None:
        """Ranges whose last copy has completed go back to their slabs."""
        if not self._settling:
            return
        waiting = []
        for slab, off, span, event in self._settling:
            if event.query():
                slab.give_back(off, span)
            else:
                waiting.append((slab, off, span, event))
        self._settling = waiting

    def _take_back_given(self) -> bool:
        """Ranges given away that nothing but the pool uses any more go back to their slabs,
        after a device synchronize (their holders' copies are unknown here); any taken?"""
        ready = [slab for slab in self._slabs if slab.given and not slab.outside_users()]
        if not ready:
            return False
        self._wait_for_all_copies()
        for slab in ready:
            for off, span in slab.given:
                slab.give_back(off, span)
            slab.given.clear()
        return True

    def _wait_for_all_copies(self) -> None:
        if self.pin_memory and torch.cuda.is_initialized():
            # the devices of the copies seen; none seen yet: every device (a pool of another
            # device than the current one would otherwise wait for the wrong one)
            for device in self._devices or range(torch.cuda.device_count()):
                torch.cuda.synchronize(device)
