"""The chain runner's offload and prefetch of stored activations for pofo plans (seed 001,
section 3).

Everything moves per *storage*: the bytes go to a pinned host buffer (from the swap runtime's
``host_pool.HostPool``: reused by exact size once its last copy is done, what it caches capped)
and the device storage is resized to zero; a prefetch resizes it back and copies the bytes in.
Every tensor object that points at the storage (the value the runner holds, the tensors a
recorded graph saved) stays valid, so what ``F_all`` kept (xbar) and a checkpoint that a graph
saved as its input both really leave the device (the technique FSDP uses to free parameters
it keeps referenced).

On CUDA the device-to-host copies run on one side stream, host-to-device copies on a
second, each with an event: ``record_stream`` on the copy stream keeps the caching allocator
from reusing an offloaded storage while its copy still reads it; the compute stream waits
on a prefetch's event only when the data is used. That wait orders only the stream current
when the data is read (for autograd's backward of a block: when it starts), so a block whose
forward itself runs ops on other CUDA streams would have those ops' backward read prefetched
bytes unordered; the runtime cannot see which streams a block's forward used. On CPU (tests,
CI) the same bookkeeping runs with plain copies.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from .accounting import storage_bytes_view
from .host_pool import HostPool


@dataclass
class HostCopy:
    """One tensor living on the host: its buffer, shape, dtype, device and the copy's event."""
    buf: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    event: Optional[object]

    def view(self) -> torch.Tensor:
        return self.buf.view(self.dtype).view(self.shape)


@dataclass
class StorageCopy:
    """A device storage whose bytes are on the host (its device memory released, unless a
    value that must stay kept it: then ``released`` is False and a prefetch copies nothing)."""
    storage: torch.UntypedStorage
    host: HostCopy
    event: Optional[object] = None      # of the prefetch, once issued
    released: bool = False              # its device memory was freed (``ChainTransfers.release``)
    # queues the host buffer as an orphan if this copy is dropped before its prefetch
    # (``ChainTransfers.offload_storage``); forgotten once the buffer went back
    orphaned: Optional[weakref.ref] = field(default=None, repr=False, compare=False)


class ChainTransfers:
    """The two copy streams and the pinned pool of one device (the swap runtime's counterpart,
    per ``SwapContext``, is ``swap_transfers.SwapTransfers``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.pool = HostPool(pin_memory=self.cuda)
        # copies dropped before their prefetch (a forward that raised, a graph dropped without
        # its backward): their host buffers (``_watched``, by the id of the copy's weak
        # reference) go at the next offload. The reference's callback only queues it (``dead``:
        # it may run in the middle of a pool call), and is a C function, so no Python code runs
        # as a copy dies: a Ctrl-C's KeyboardInterrupt raised there would be lost (CPython only
        # prints it), as the swap runtime's handles avoid too
        self.dead: List[weakref.ref] = []
        self._watched: Dict[int, Tuple[weakref.ref, torch.Tensor]] = {}
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
        self.offloaded_bytes = 0
        self.prefetched_bytes = 0

    def drain_orphans(self) -> None:
        """Let the host buffers of copies dropped before their prefetch go (the runner calls
        this at every step; offloads and prefetches too)."""
        while self.dead:
            _, buf = self._watched.pop(id(self.dead.pop()))
            self.pool.give_away(buf)

    def offload(self, t: torch.Tensor) -> HostCopy:
        """Start copying ``t`` into a pooled (pinned) host buffer: on CUDA on the d2h stream
        after the compute stream's work, with an event, ``t``'s memory kept from reuse until
        the copy read it; on the CPU a plain copy. The buffer comes back to the pool through
        ``_give_back`` (or ``orphans``)."""
        nbytes = t.numel() * t.element_size()
        self.drain_orphans()
        buf = self.pool.acquire(nbytes)
        try:
            host = buf.view(t.dtype).view(t.shape) if nbytes else \
                buf.view(t.dtype).reshape(t.shape)
            event = None
            if self.cuda:
                compute = torch.cuda.current_stream(t.device)
                self.d2h.wait_stream(compute)  # the tensor is complete before we read it
                with torch.cuda.stream(self.d2h):
                    host.copy_(t, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self.d2h)
                t.record_stream(self.d2h)  # no reuse of t's memory until the copy is done
            else:
                host.copy_(t)
        except BaseException:
            # (a Ctrl-C mid-copy): not reused, since a copy may still write it; freed with
            # its last holder (PyTorch's pinned allocator waits for the copy's own event).
            # Given away, not waited for and released as ``SwapTransfers.swap_out`` does: no
            # stream wait while an interrupt unwinds a step; one buffer lost to reuse
            self.pool.give_away(buf)
            raise
        self.offloaded_bytes += nbytes
        return HostCopy(buf, t.shape, t.dtype, t.device, t.requires_grad, event)

    # ---------------------------------------------------------------- whole storages
    def offload_storage(self, storage: torch.UntypedStorage) -> StorageCopy:
        """Copy the bytes of ``storage`` to the host; ``release`` frees the device memory."""
        if not storage.resizable():
            raise RuntimeError("scheduler.wrap: cannot offload a tensor whose storage is not "
                               "resizable (created from external memory)")
        sc = StorageCopy(storage, self.offload(storage_bytes_view(storage)))
        sc.orphaned = weakref.ref(sc, self.dead.append)
        self._watched[id(sc.orphaned)] = (sc.orphaned, sc.host.buf)
        return sc

    def _give_back(self, sc: StorageCopy, event: Optional[object]) -> None:
        """``sc``'s host buffer goes back to the pool, reused once ``event`` is done."""
        if sc.orphaned is not None:  # (the reference dies here: its callback never runs)
            self._watched.pop(id(sc.orphaned), None)
            sc.orphaned = None
        self.pool.release(sc.host.buf, event)

    @staticmethod
    def release(sc: StorageCopy) -> None:
        """Free ``sc``'s device memory (its bytes are on the host; a prefetch brings them
        back)."""
        # offload() recorded the copy stream on this memory: the caching allocator reuses it
        # only once the copy has read it
        sc.storage.resize_(0)
        sc.released = True

    def prefetch_storage(self, sc: StorageCopy) -> None:
        """Give ``storage`` its memory back and copy the bytes in (on the copy stream)."""
        self.drain_orphans()
        h = sc.host
        if not sc.released:
            # it never left (a value later blocks still read): resizing a live CUDA storage
            # would reallocate it on the copy stream under its readers' feet
            self._give_back(sc, h.event)
            return
        n = h.buf.numel()
        if self.cuda:
            with torch.cuda.stream(self.h2d):
                if h.event is not None:
                    self.h2d.wait_event(h.event)
                sc.storage.resize_(n)
                storage_bytes_view(sc.storage).copy_(h.view(), non_blocking=True)
                sc.event = torch.cuda.Event()
                sc.event.record(self.h2d)
        else:
            sc.storage.resize_(n)
            storage_bytes_view(sc.storage).copy_(h.view())
        sc.released = False
        self._give_back(sc, sc.event)
        self.prefetched_bytes += n

    def restore(self, sc: StorageCopy) -> None:
        """Bring a released storage's bytes back now, on the current stream (something
        outside the plan reads it); the host buffer stays with ``sc`` until its prefetch,
        which then copies nothing and hands the buffer back."""
        if not sc.released:
            return
        h = sc.host
        if self.cuda and h.event is not None:
            torch.cuda.current_stream(self.device).wait_event(h.event)
        sc.storage.resize_(h.buf.numel())
        storage_bytes_view(sc.storage).copy_(h.view())
        sc.released = False

    @staticmethod
    def wait(sc: StorageCopy) -> None:
        """The current stream waits for the prefetch of ``sc`` before using its storage."""
        if sc.event is not None:
            view = storage_bytes_view(sc.storage)
            stream = torch.cuda.current_stream(view.device)
            stream.wait_event(sc.event)
            view.record_stream(stream)
            sc.event = None
