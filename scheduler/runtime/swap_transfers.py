"""The swap runtime's copies: device-to-host swap-outs and host-to-device swap-ins on two side
streams per device (synchronous copies on the CPU), their events, the host buffer pool, and
when device memory may be let go.

* Swap-out: the out stream waits for the stream that saved the tensor, copies into a pooled
  (pinned) host buffer, records an event. The device storage is kept (``Var.inflight``) until
  that event completed, not ``record_stream``-ed: the runtime then knows exactly when memory
  comes back. A swap-out called off while its copy runs keeps the storage too (``copying``),
  and a var freed while a copy is in flight has its storage parked until the event.
* Swap-in: the in stream copies into memory allocated while it is current, records an event; at
  each use from a stream that has not read the copy yet (autograd runs a backward node on its
  forward op's stream: one saved tensor may be read from several), that stream waits on the
  event only if it has not completed, and the memory is ``record_stream``-ed on it (autograd
  decides when it is freed). A swap-in whose var is swapped out again before its first use (a
  host copy exists: no copy) is still waited for at that use.
* Interrupts: a host buffer is tied to its var only once its copy was issued; if the copy
  raises (a Ctrl-C), the buffer goes back to the pool. ``HostPool.reclaim`` returns whatever an
  interrupt still left lent out when the context exits.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from ..planners.swap_schedule import DEVICE, FREED, HOST, IN, OUT
from .accounting import storage_bytes_view
from .host_pool import HostPool
from .swap_stats import Residency
from .swap_vars import Var


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """Every swap copy goes through here (one place for tests to inject faults)."""
    dst.copy_(src, non_blocking=non_blocking)


class SwapTransfers:
    """Copies between device and host for the vars of one ``SwapContext`` (the chain
    runtime's counterpart, per device, is ``chain_transfers.ChainTransfers``)."""

    def __init__(self, cuda: bool, counters: Dict[str, float], residency: Residency):
        self.cuda = cuda
        self.counters = counters
        self.residency = residency
        self.pool = HostPool(pin_memory=cuda)
        self._streams: Dict[Any, Tuple[Any, Any]] = {}
        self.pending: Dict[Var, None] = {}    # swap-outs not released yet, oldest first
        self.deferred: Dict[Var, None] = {}   # releases waiting on a copy (non-blocking)
        # swap-outs called off while their copy was in flight: ``inflight`` kept until it ends
        self.copying: Dict[Var, None] = {}
        self.parked: List[Tuple[Any, Any]] = []  # (event, storage) of freed vars, copy in flight
        self.gpu_stalls: List[Tuple[Any, Any]] = []
        # keeps the budget before an on-demand swap-in (set by the eviction policy)
        self.make_room: Optional[Callable[[int, Optional[Var]], None]] = None

    def streams_for(self, device: Any) -> Tuple[Any, Any]:
        """The (out, in) copy streams of ``device``, made at its first swap."""
        s = self._streams.get(device)
        if s is None:  # one stream out (device-to-host), one stream in (host-to-device)
            s = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
            self._streams[device] = s
        return s

    # ------------------------------------------------------------------------ swap-out
    def swap_out(self, var: Var) -> None:
        """Issue the device-to-host copy (none if a host copy exists); the device copy stays
        until ``release``."""
        if var.state not in (DEVICE, IN):
            return
        storage = var.storage
        if storage is None:  # every handle died (not drained yet): nothing to keep
            return
        if var.host is None:
            views = [h.view for h in var.live_handles() if h.view is not None]
            var.copied_version = views[0]._version if views else None
            buf = self.pool.acquire(var.nbytes)
            try:
                src = storage_bytes_view(storage)
                if self.cuda:
                    out_stream, _ = self.streams_for(var.device)
                    # after the op that saved it (its stream, not the current one: a swap-out
                    # asked by vmalloc's pressure callback runs inside a swap-in's allocation)
                    out_stream.wait_stream(var.stream)
                    with torch.cuda.stream(out_stream):
                        copy_bytes(buf, src, True)
                        event = torch.cuda.Event()
                        event.record(out_stream)
                    var.out_event = event
                else:
                    copy_bytes(buf, src, False)
                del src
            except BaseException:
                # an interrupted copy: the buffer holds nothing (the next swap-out copies again);
                # on CUDA it is reused only after whatever was queued on the out stream. Waited
                # for and kept, not given away as ``ChainTransfers.offload`` does: the buffer
                # (pinned: slow to make) stays in the pool the next iteration reuses
                if self.cuda:
                    self.streams_for(var.device)[0].synchronize()
                self.pool.release(buf, None)
                raise
            var.host = buf
            self.counters["swapped_out_bytes"] += var.nbytes
        var.inflight = storage
        var.state = OUT
        self.pending[var] = None
        self.copying.pop(var, None)  # (``release`` waits for the copy now)

    def release(self, var: Var, blocking: bool) -> None:
        """Free the device copy of a swapped-out variable once its copy is complete."""
        if var.state != OUT:
            self.deferred.pop(var, None)
            return
        event = var.out_event
        if event is not None and not event.query():
            if not blocking:
                self.deferred[var] = None
                return
            t0 = time.perf_counter()
            event.synchronize()
            self.counters["stall_seconds"] += time.perf_counter() - t0
        self.deferred.pop(var, None)
        self.pending.pop(var, None)
        self._drop_device(var)
        var.state = HOST

    def _drop_device(self, var: Var) -> None:
        var.set_storage(None)
        var.inflight = None
        var.in_tensor = var.in_readers = None
        for h in var.live_handles():
            if h.view is not None:
                v = h.view
                h.modified = h.modified or v._version != h.version
                h.meta = (v.dtype, v.shape, v.stride(), v.storage_offset())
                h.view = None
        self.residency.drop(var)

    def save_again(self, var: Var, storage: Any, version: int) -> None:
        """The forward saves again a tensor it saved before, which the program kept (so its
        storage is the var's). Wherever the runtime had moved the var's bytes, they are that
        storage's from now on: a swap-out under way is called off, a copy swapped back in is
        dropped (re-attach, no copy). The host copy may predate a change the program made in
        place (``version``: the tensor's version counter now; a later swap-out would reuse the
        copy, and the new save's backward read the old bytes): it goes. If the bytes did change,
        the earlier saves' handles raise at their use, as plain autograd does. A counter that
        moved is checked on the bytes (a tensor sharing the storage through ``.data`` has a
        counter of its own): one copy to the host, on this path only."""
        reading = var.in_event  # a swap-in that may still read the host copy
        if var.state == OUT:
            self._call_off(var)
        elif var.state == HOST:
            self.residency.add(var)
        if var.storage is not storage:  # on the host, or a copy swapped back in
            var.in_tensor = var.in_event = var.in_readers = None
            var.set_storage(storage)
        var.state = DEVICE
        host = var.host
        if host is None or version == var.copied_version:
            return
        if var.out_event is not None:  # (the copy may still be under way)
            var.out_event.synchronize()
        self.copying.pop(var, None)  # (done now)
        var.inflight = None
        dev = storage_bytes_view(storage)
        if not torch.equal(dev.cpu(), host):
            for h in var.live_handles():
                h.modified = True
        self.pool.release(host, reading)
        var.host = var.out_event = None

    # ------------------------------------------------------------------------- swap-in
    def swap_in(self, var: Var) -> None:
        """Issue the host-to-device copy ahead of use (or cancel a swap-out still pending)."""
        if var.state == OUT:  # the device copy is still there: keep it
            self._call_off(var)
            # (if it came from a swap-in still copying, its use must still wait for that)
            var.state = IN if var.in_tensor is not None else DEVICE
            return
        if var.state != HOST:
            return
        held = var.storage_ref()
        if held is not None and held.nbytes() == var.nbytes:
            # the program still holds the storage it saved (the batch its loop holds, a
            # module's buffer): releasing it freed nothing, and a copy back would be a second
            # one. Its bytes are the program's, as plain autograd reads them (a change made in
            # place since is caught at the use by the handles' version checks). The host copy
            # goes: those bytes may have changed through ``.data`` meanwhile (no counter moves)
            var.set_storage(held)
            var.state = DEVICE
            var.in_readers = None
            self._drop_host(var)
            self.counters["reattached_bytes"] += var.nbytes
            self.residency.add(var)
            return
        host = var.host_copy()
        if host is None:  # pragma: no cover - a var on the host always has its copy
            raise RuntimeError(f"swap runtime: saved tensor {var.vid} has no host copy")
        n = var.nbytes
        if self.cuda:
            _, in_stream = self.streams_for(var.device)
            with torch.cuda.stream(in_stream):
                if var.out_event is not None:
                    in_stream.wait_event(var.out_event)
                dst = torch.empty(n, dtype=torch.uint8, device=var.device)
                copy_bytes(dst, host, True)
                event = torch.cuda.Event()
                event.record(in_stream)
            var.in_event = event
            var.in_readers = []
        else:
            dst = torch.empty(n, dtype=torch.uint8, device=var.device)
            copy_bytes(dst, host, False)
        var.in_tensor = dst
        var.set_storage(dst.untyped_storage())
        var.state = IN
        self.counters["swapped_in_bytes"] += n
        self.residency.add(var)

    def ensure_resident(self, var: Var, budget: Optional[int]) -> None:
        """At a use: the variable's bytes on the device, the reading stream ordered after the
        copy (waiting only if the copy is still running)."""
        if var.state == HOST:  # not swapped in ahead: on demand, and wait
            self.counters["on_demand_swap_ins"] += 1
            t0 = time.perf_counter()
            if budget is not None and self.make_room is not None:
                self.make_room(var.nbytes, var)
            self.swap_in(var)
            if self.cuda and var.state == IN:  # (not re-attached)
                var.in_event.synchronize()
            self.counters["stall_seconds"] += time.perf_counter() - t0
        readers = var.in_readers
        if readers is not None:  # the bytes are a swap-in's copy (CUDA)
            compute = torch.cuda.current_stream(var.device)
            # (one comparison on the common path: the stream that read the copy first)
            if not readers or (compute != readers[0] and compute not in readers):
                self._read_after_copy(var, compute)
        # the first use since the swap-in, whatever the state: a swap-out issued since (no
        # copy: the host copy exists) leaves the var OUT, its bytes this copy all the same
        if var.in_tensor is not None:
            var.in_tensor = None
            if var.state == IN:
                var.state = DEVICE

    def _read_after_copy(self, var: Var, stream: Any) -> None:
        """``stream`` reads ``var``'s swapped-in bytes: after the copy (a wait, if it still
        runs), and the caching allocator told (``record_stream``) so that it does not hand
        the memory out again while ``stream`` may still read it."""
        event = var.in_event
        if not event.query():
            self.counters["late_swap_ins"] += 1
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            stream.wait_event(event)
            end.record(stream)
            self.gpu_stalls.append((start, end))
        t = var.in_tensor
        if t is None:  # (read before from another stream: a tensor on the same bytes)
            t = storage_bytes_view(var.storage)
        t.record_stream(stream)
        var.in_readers.append(stream)

    # ------------------------------------------------------------------ completion
    def _call_off(self, var: Var) -> None:
        """Cancel ``var``'s swap-out (it stays on the device). Its copy may still read the
        storage: kept (``inflight``) until ``poll`` sees the copy done, for all the handles
        may die before (their keeper would free the storage under the copy)."""
        self.pending.pop(var, None)
        self.deferred.pop(var, None)
        event = var.out_event
        if var.inflight is not None and event is not None and not event.query():
            self.copying[var] = None
        else:
            var.inflight = None

    def poll(self) -> None:
        """Non-blocking: release deferred swap-outs and parked storages whose copies finished,
        and let go of the storages of called-off swap-outs whose copies finished."""
        if self.deferred:
            for var in list(self.deferred):
                if var.state != OUT or var.out_event is None or var.out_event.query():
                    self.release(var, True)
        if self.copying:
            for var in list(self.copying):
                if var.out_event is None or var.out_event.query():
                    del self.copying[var]
                    var.inflight = None
        if self.parked:
            self.parked = [(e, s) for e, s in self.parked if e is not None and not e.query()]

    def forget(self, var: Var) -> None:
        """``var`` was freed by autograd: drop its device bytes (parked while a copy still reads
        them) and hand its host buffer back."""
        if var.state in (DEVICE, OUT, IN):
            # a copy still reads it (a swap-out pending or called off)
            if var.inflight is not None and var.out_event is not None and \
                    not var.out_event.query():
                self.parked.append((var.out_event, var.inflight))
            var.set_storage(None)
            var.inflight = None
            var.in_tensor = var.in_readers = None
            self.residency.drop(var)
        self.pending.pop(var, None)
        self.deferred.pop(var, None)
        self.copying.pop(var, None)
        self._drop_host(var)
        var.state = FREED

    def _drop_host(self, var: Var) -> None:
        """Hand ``var``'s host copy back to the pool, reused after the last copy that reads or
        writes it."""
        if var.host is not None:
            last = var.in_event if var.in_event is not None else var.out_event
            self.pool.release(var.host, last)
            var.host = var.out_event = None

    def hand_over(self, vars: Iterable[Var]) -> None:
        """The context exits while a graph still holds ``vars``: leave nothing that only a
        later drain would free. Swap-outs in flight complete (their device bytes go); host
        copies of vars whose bytes are on the device anyway go back to the pool; those of vars
        only on the host move into their keepers, to die with the graph's handles."""
        self._copies_done()  # (first: dropping a host copy forgets its copy's event)
        for var in vars:
            if var.state == OUT:
                self.release(var, True)
            host = var.host
            if host is None:
                continue
            if var.state in (DEVICE, IN):
                self._drop_host(var)
            elif var.state == HOST:
                keeper = var.keeper_ref() if var.keeper_ref is not None else None
                if keeper is not None:
                    keeper.host = host
                    self.pool.give_away(host)
                    var.host = None

    def _copies_done(self) -> None:
        """Wait for the copies of parked storages and called-off swap-outs, and let those go."""
        for var in self.copying:
            if var.out_event is not None:
                var.out_event.synchronize()
            var.inflight = None
        self.copying.clear()
        for event, _ in self.parked:
            if event is not None:
                event.synchronize()
        self.parked.clear()

    def resolve_gpu_stalls(self, wait: bool) -> None:
        """Add the compute-stream waits timed with events (``_read_after_copy``) to
        ``stall_seconds``: those finished, or all of them after waiting (``wait``)."""
        keep = []
        for start, end in self.gpu_stalls:
            if wait:
                end.synchronize()
            if end.query():
                self.counters["stall_seconds"] += start.elapsed_time(end) / 1000.0
            else:
                keep.append((start, end))
        self.gpu_stalls = keep

    def shutdown(self) -> None:
        """Nothing is saved any more: wait for copies, drop parked storages, return every host
        buffer (an interrupted swap may have left one lent) and drop the cached ones."""
        self._copies_done()
        self.resolve_gpu_stalls(wait=True)
        self.pool.reclaim()
        self.pool.close()
