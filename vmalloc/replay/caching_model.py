"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``).

It reproduces the block bookkeeping of ``DeviceCachingAllocator`` with its default settings
(``PYTORCH_CUDA_ALLOC_CONF`` unset: no ``max_split_size_mb``, no ``expandable_segments``, no
``roundup_power2_divisions``, no garbage collection threshold), so a trace replayed through it
shows the reserved memory that the native allocator would hold. Nothing is allocated: addresses
are numbers. Constants and steps below cite the function of the source they come from
(PyTorch 2.x; the same logic since 1.10, see the file's header comment):

* ``round_size``: every request is rounded up to a multiple of ``kMinBlockSize`` = 512 bytes.
* ``get_pool``: rounded sizes <= ``kSmallSize`` (1 MiB) use the small pool, others the large.
* ``get_allocation_size``: a new segment ("cudaMalloc") is ``kSmallBuffer`` (2 MiB) for the small
  pool, ``kLargeBuffer`` (20 MiB) for sizes below ``kMinLargeAlloc`` (10 MiB), else the size
  rounded up to ``kRoundLarge`` (2 MiB).
* ``get_free_block``: best fit = the smallest cached block of the same stream with size >= the
  request (blocks ordered by (stream, size, address)); with ``max_split_size`` set, an oversize
  block (>= max_split_size) only serves requests >= max_split_size that it exceeds by less than
  ``kLargeBuffer``.
* ``should_split``: the rest of a block is split off when it is >= 512 bytes (small pool) or
  > 1 MiB (large pool, and only for requests below ``max_split_size``).
* ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours *inside its
  own segment* (blocks of different segments never merge).
* ``malloc``: on a miss, allocate a segment; if that fails (device full, or past the
  ``set_per_process_memory_fraction`` limit checked in ``alloc_block``), free oversize cached blocks
  (``release_available_cached_blocks``, only with ``max_split_size``) and retry, then free *all*
  cached unsplit segments (``release_cached_blocks``) and retry once more; then raise OOM.
  Cached segments are otherwise never returned: only this OOM path and ``empty_cache()`` release.

Not modelled: stream-use events (``record_stream``: a trace carries no stream uses, so a freed
block is immediately reusable on its own stream), CUDA-graph private pools, expandable segments.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..errors import OutOfMemoryError

# c10/cuda/CUDACachingAllocator.cpp, namespace Native, top of file
K_MIN_BLOCK_SIZE = 512            # "all sizes are rounded to at least 512 bytes"
K_SMALL_SIZE = 1 << 20            # "largest 'small' allocation is 1 MiB"
K_SMALL_BUFFER = 2 << 20          # "'small' allocations are packed in 2 MiB blocks"
K_LARGE_BUFFER = 20 << 20         # "'large' allocations may be packed in 20 MiB blocks"
K_MIN_LARGE_ALLOC = 10 << 20      # "allocations between 1 and 10 MiB may use kLargeBuffer"
K_ROUND_LARGE = 2 << 20           # "round up large allocations to 2 MiB"
_UNLIMITED = (1 << 64) - 1        # CUDAAllocatorConfig::max_split_size() default: SIZE_MAX
_SEGMENT_ALIGN = 2 << 20          # fake cudaMalloc addresses: 2 MiB aligned, never adjacent


def round_size(size: int) -> int:
    """``round_size``: the block size a request of ``size`` bytes takes (default config)."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: bytes of the segment cudaMalloc'd for a (rounded) request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    stream: int
    small: bool
    segment: int                      # address of the segment's first byte (its cudaMalloc)
    allocated: bool = False
    requested: int = 0
    prev: Optional["_Block"] = None   # neighbours inside the same segment
    next: Optional["_Block"] = None

    @property
    def key(self) -> Tuple[int, int, int]:
        # BlockComparatorSize: (stream, size, address)
        return (self.stream, self.size, self.addr)

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """``BlockPool``: the cached free blocks of one pool, ordered like ``std::set`` by key."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: List[Tuple[int, int, int]] = []
        self.blocks: Dict[Tuple[int, int, int], _Block] = {}

    def insert(self, b: _Block) -> None:
        k = b.key
        bisect.insort(self.keys, k)
        self.blocks[k] = b

    def remove(self, b: _Block) -> None:
        k = b.key
        i = bisect.bisect_left(self.keys, k)
        assert i < len(self.keys) and self.keys[i] == k, "block not in its pool"
        del self.keys[i]
        del self.blocks[k]

    def lower_bound(self, stream: int, size: int) -> Optional[_Block]:
        i = bisect.bisect_left(self.keys, (stream, size, -1))
        if i == len(self.keys) or self.keys[i][0] != stream:
            return None
        return self.blocks[self.keys[i]]


class CachingAllocatorModel:
    """Replays ``malloc``/``free`` the way PyTorch's native caching allocator places them.

    ``budget`` plays ``torch.cuda.set_per_process_memory_fraction`` (a cap on reserved bytes,
    checked in ``alloc_block``) or the device's capacity; ``None`` = unlimited.
    ``max_split_size`` plays ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N`` (bytes; None = off).

    The interface matches :class:`vmalloc.Allocator` (``malloc``, ``free``, ``stats``, ``trim``,
    ``set_budget``) so one replay loop drives both.
    """

    name = "pytorch-caching (model)"

    def __init__(self, budget: Optional[int] = None, max_split_size: Optional[int] = None):
        if budget is not None and budget < 0:
            raise ValueError(f"budget: must be >= 0 bytes, got {budget}")
        if max_split_size is not None and (
                isinstance(max_split_size, bool) or not isinstance(max_split_size, int)
                or max_split_size < K_LARGE_BUFFER):
            # AllocatorConfig::parseMaxSplitSize refuses max_split_size_mb below kLargeBuffer
            # (20 MiB; PyTorch <= 2.8's CUDAAllocatorConfig wanted > 20). Smaller values also
            # break the model: an oversize cached block could then be a split piece of a
            # segment, which _release_block cannot cudaFree on its own.
            raise ValueError(f"max_split_size: must be an int >= 20 MiB ({K_LARGE_BUFFER} "
                             f"bytes) as in PyTorch, got {max_split_size!r}")
        self.budget = budget or None
        self.max_split_size = _UNLIMITED if max_split_size is None else max_split_size
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._live: Dict[int, _Block] = {}
        self._segments: Dict[int, int] = {}      # segment address -> size
        self._next_addr = 1 << 40
        #: smallest ``reserved + segment size`` the budget refused so far (None: never). The
        #: budget only enters through that one comparison, so every budget in
        #: [budget, min_refused) replays identically: min_budget's scan skips to it.
        self.min_refused: Optional[int] = None
        self._s = dict(requested_current=0, requested_peak=0, allocated_current=0,
                       allocated_peak=0, reserved_current=0, reserved_peak=0,
                       num_malloc=0, num_free=0, num_device_alloc=0, num_device_free=0,
                       num_alloc_retries=0, num_ooms=0, num_cache_hits=0)

    # ---- public face -------------------------------------------------------------------

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """``DeviceCachingAllocator::malloc``; returns the block's address."""
        if nbytes <= 0:
            raise ValueError(f"nbytes: must be > 0, got {nbytes}")
        size = round_size(nbytes)
        pool = self._small if size <= K_SMALL_SIZE else self._large
        alloc_size = allocation_size(size)
        block = self._get_free_block(pool, stream, size)
        if block is not None:
            self._s["num_cache_hits"] += 1
        else:
            block = (self._alloc_block(pool, stream, alloc_size)
                     or (self._release_available_cached_blocks(pool, stream, size)
                         and self._alloc_block(pool, stream, alloc_size))
                     or (self._release_cached_blocks()
                         and self._alloc_block(pool, stream, alloc_size, retry=True)))
        if not block:
            self._s["num_ooms"] += 1
            in_use = self._s["reserved_current"]
            raise OutOfMemoryError(
                f"caching-allocator model: out of memory allocating {nbytes} bytes "
                f"(segment of {alloc_size}); reserved {in_use} of budget {self.budget}",
                requested=nbytes, in_use=in_use, budget=self.budget or 0)
        return self._alloc_found_block(block, size, nbytes, pool)

    def free(self, ptr: int) -> None:
        """``DeviceCachingAllocator::free`` -> ``free_block``: merge within the segment, cache."""
        block = self._live.pop(ptr, None)
        if block is None:
            raise ValueError(f"ptr: {ptr:#x} is not a live allocation of this model")
        block.allocated = False
        self._bump("allocated", -block.size)
        self._bump("requested", -block.requested)
        self._s["num_free"] += 1
        pool = self._small if block.small else self._large
        for other in (block.prev, block.next):
            self._try_merge(block, other, pool)
        pool.insert(block)

    def trim(self) -> int:
        """``empty_cache()``: release every cached segment that is not split."""
        before = self._s["reserved_current"]
        self._release_cached_blocks()
        return before - self._s["reserved_current"]

    empty_cache = trim

    def set_budget(self, nbytes: Optional[int]) -> None:
        self.budget = nbytes or None

    def close(self) -> None:
        pass

    def stats(self) -> Dict[str, int]:
        """The vmalloc ``stats()`` keys, with PyTorch's meanings: mapped = physical = reserved."""
        s = self._s
        return {
            "requested_current": s["requested_current"], "requested_peak": s["requested_peak"],
            "mapped_current": s["reserved_current"], "mapped_peak": s["reserved_peak"],
            "physical_current": s["reserved_current"], "physical_peak": s["reserved_peak"],
            "internal_fragmentation": s["allocated_current"] - s["requested_current"],
            "num_malloc": s["num_malloc"], "num_free": s["num_free"],
            "num_map": s["num_device_alloc"], "num_unmap": s["num_device_free"],
            "num_chunks_created": s["num_device_alloc"], "chunk_size": 0,
            # PyTorch's own names, for the side-by-side report
            "allocated_current": s["allocated_current"], "allocated_peak": s["allocated_peak"],
            "num_alloc_retries": s["num_alloc_retries"], "num_oom": s["num_ooms"],
            "num_cache_hits": s["num_cache_hits"], "num_segments": len(self._segments),
            "num_live": len(self._live), "budget": self.budget or 0,
            "cached_bytes": s["reserved_current"] - s["allocated_current"],
        }

    def __enter__(self) -> "CachingAllocatorModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals (names follow the C++) --------------------------------------------

    def _bump(self, what: str, delta: int) -> None:
        cur = self._s[f"{what}_current"] + delta
        self._s[f"{what}_current"] = cur
        if cur > self._s[f"{what}_peak"]:
            self._s[f"{what}_peak"] = cur

    def _get_free_block(self, pool: _Pool, stream: int, size: int) -> Optional[_Block]:
        b = pool.lower_bound(stream, size)
        if b is None:
            return None
        mss = self.max_split_size
        if size < mss and b.size >= mss:          # do not hand an oversize block to a small request
            return None
        if size >= mss and b.size >= size + K_LARGE_BUFFER:   # oversize reuse within 20 MiB only
            return None
        pool.remove(b)
        return b

    def _alloc_block(self, pool: _Pool, stream: int, alloc_size: int,
                     retry: bool = False) -> Optional[_Block]:
        if retry:
            self._s["num_alloc_retries"] += 1
        want = self._s["reserved_current"] + alloc_size
        if self.budget is not None and want > self.budget:
            if self.min_refused is None or want < self.min_refused:
                self.min_refused = want
            return None
        addr = self._next_addr
        # leave a gap so segments are never contiguous (cudaMalloc gives no adjacency guarantee)
        self._next_addr += ((alloc_size + _SEGMENT_ALIGN - 1) // _SEGMENT_ALIGN + 1) * _SEGMENT_ALIGN
        self._segments[addr] = alloc_size
        self._bump("reserved", alloc_size)
        self._s["num_device_alloc"] += 1
        return _Block(addr=addr, size=alloc_size, stream=stream, small=pool.small, segment=addr)

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.max_split_size and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, block: _Block, size: int, requested: int, pool: _Pool) -> int:
        if self._should_split(block, size):
            # the front `size` bytes become the allocation; the rest stays cached
            rest = _Block(addr=block.addr + size, size=block.size - size, stream=block.stream,
                          small=block.small, segment=block.segment, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.insert(rest)
        block.allocated = True
        block.requested = requested
        self._live[block.addr] = block
        self._bump("allocated", block.size)
        self._bump("requested", requested)
        self._s["num_malloc"] += 1
        return block.addr

    def _try_merge(self, dst: _Block, src: Optional[_Block], pool: _Pool) -> None:
        if src is None or src.allocated:
            return
        pool.remove(src)
        if dst.prev is src:          # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:                         # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _release_block(self, block: _Block, pool: _Pool) -> None:
        pool.remove(block)
        del self._segments[block.addr]
        self._bump("reserved", -block.size)
        self._s["num_device_free"] += 1

    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        """Free oversize cached blocks (>= max_split_size) until ``size`` bytes are released."""
        mss = self.max_split_size
        if mss == _UNLIMITED:
            return False
        key_size = max(size, mss)
        b = pool.lower_bound(stream, key_size)
        if b is not None:
            self._release_block(b, pool)
            return True
        # no single block is large enough: release oversize blocks, largest first
        candidates = [pool.blocks[k] for k in pool.keys
                      if k[0] == stream and k[1] >= mss]
        released = 0
        for b in reversed(candidates):
            if released >= key_size:
                break
            released += b.size
            self._release_block(b, pool)
        return released >= key_size

    def _release_cached_blocks(self) -> bool:
        """``release_cached_blocks``: cudaFree every cached block that is a whole segment."""
        for pool in (self._large, self._small):
            for k in list(pool.keys):
                b = pool.blocks[k]
                if not b.is_split():
                    self._release_block(b, pool)
        return True
