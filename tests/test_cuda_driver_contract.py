"""The cuda backend (csrc/driver/cuda_driver.cpp) against the strict fake libcuda (tests/fake_cuda):
what it holds after close, events and contexts, stream-ordered reuse, the driver's out-of-memory
and every driver call failing, forked children, the torch entry points, threads with another
device current.

Marked fake_cuda: these run only in the pytest run that tests/test_fake_cuda.py starts with the
fake on LD_LIBRARY_PATH (elsewhere they skip). Every test there also fails on any contract
violation the fake records (tests/conftest.py).
"""
from __future__ import annotations

import ctypes
import os
import random
import threading
from typing import Dict, List

import pytest

from fake_cuda import (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_UNKNOWN,
                       FakeDriver)
from test_alloc_memory import CudaMemory
from vmalloc import Allocator, OutOfMemoryError, _core
from vmalloc.allocator import granularity

pytestmark = pytest.mark.fake_cuda

KiB, MiB = 1 << 10, 1 << 20
G = 2 * MiB  # the fake's granularity


def held_by_driver(fake: FakeDriver) -> Dict[str, int]:
    return {k: fake.get(k) for k in ("reservations", "handles", "committed_bytes", "mappings",
                                     "events", "streams", "context_refs")}


@pytest.fixture
def mem() -> CudaMemory:
    return CudaMemory()  # retains device 0's primary context and makes it current here


def test_close_gives_everything_back(fake, mem):
    s = mem.new_stream()
    before = held_by_driver(fake)
    a = Allocator("cuda", chunk_size=G, small_threshold=MiB)
    assert fake.get("context_refs") == before["context_refs"] + 1
    live = [a.malloc(n, stream=st) for n, st in ((100, 0), (300 * KiB, s), (5 * MiB, 0), (9 * MiB, s))]
    a.record_stream(live[2], s)
    a.free(live[0])
    a.free(live[3])                      # cached, with an event recorded on s
    mem.fill(live[2], 5 * MiB, 9)
    assert fake.get("committed_bytes") == a.stats()["physical_current"] > 0
    a.close()
    after = held_by_driver(fake)
    assert after == before, "a closed allocator still holds driver objects"
    a.close()
    del a                                # the destructor after close() calls nothing more
    assert held_by_driver(fake) == before


def test_the_fast_path_makes_no_driver_call(fake, mem):
    """A single-stream program reusing a cached range and slab blocks calls nothing in the driver:
    no cuMem*, no event, no context switch (a driver call costs microseconds on a GPU). Once a
    second stream is seen, each free records an event (cross-stream reuse must wait for it)."""
    def step() -> None:
        p, q = a.malloc(3 * G), a.malloc(4 * KiB)
        a.free(q)
        a.free(p)

    with Allocator("cuda", chunk_size=G, small_threshold=MiB) as a:
        for _ in range(5):               # the cache settles
            step()
        calls = fake.calls()
        for _ in range(50):
            step()
        assert fake.calls() == calls
        a.free(a.malloc(3 * G, stream=mem.new_stream()))   # a second stream
        for _ in range(5):
            step()
        calls = fake.calls()
        for _ in range(50):
            step()
        after = fake.calls()
        more = {k: after[k] - calls.get(k, 0) for k in after if after[k] != calls.get(k, 0)}
        assert more == {"cuEventRecord": 50, "cuCtxGetCurrent": 50}  # one event per large free


def test_granularity_and_bad_devices_leave_no_context_retained(fake, mem):
    before = fake.get("context_refs")
    retains = fake.get("calls:cuDevicePrimaryCtxRetain")
    for _ in range(3):
        assert granularity("cuda") == G
    assert fake.get("calls:cuDevicePrimaryCtxRetain") == retains  # no context made to answer
    with pytest.raises(ValueError, match="no CUDA device 7"):
        granularity("cuda", device=7)
    with pytest.raises(ValueError, match="no CUDA device 5 .this machine has 3"):
        Allocator("cuda", chunk_size=G, device=5)
    with pytest.raises(ValueError, match="chunk_size"):
        Allocator("cuda", chunk_size=G + 4096)
    fake.inject("cuDeviceTotalMem", 1, CUDA_ERROR_UNKNOWN)
    with pytest.raises(RuntimeError, match="cuDeviceTotalMem failed: unknown error"):
        Allocator("cuda", chunk_size=G)
    assert fake.get("context_refs") == before


def test_a_device_without_the_vmm_api_is_said_by_name(fake, mem, monkeypatch):
    """Without it every VMM call fails with a bare CUDA_ERROR_NOT_SUPPORTED; asked first, the
    error names the device, the attribute and the way out."""
    before = fake.get("context_refs")
    monkeypatch.setenv("FAKECUDA_NO_VMM", "1")
    for make in (lambda: granularity("cuda", device=1), lambda: Allocator("cuda", chunk_size=G)):
        with pytest.raises(RuntimeError, match=r"CUDA device \d does not support the driver's "
                           r"virtual memory management API .*VMALLOC=0"):
            make()
    monkeypatch.delenv("FAKECUDA_NO_VMM")
    with Allocator("cuda", chunk_size=G) as a:
        a.free(a.malloc(G))
    assert fake.get("context_refs") == before


def test_reuse_across_streams_waits_for_the_freeing_stream(fake, mem):
    s1, s2 = mem.new_stream(), mem.new_stream()
    with Allocator("cuda", chunk_size=G, budget=4 * G, small_threshold=0) as a:
        p = a.malloc(2 * G, stream=s1)
        fake.hold(s1)                    # a kernel on s1 still uses p
        a.free(p)
        assert fake.get("pending_events") == 1
        q = a.malloc(2 * G, stream=s2)   # may not take p's memory yet
        assert not (p <= q < p + 2 * G)
        a.free(q)
        r = a.malloc(2 * G, stream=s1)   # the same stream may (stream order)
        assert r in (p, q)
        a.free(r)
        fake.hold(s1, False)
        syncs = fake.get("ctx_syncs")
        fake.hold(s2)
        t = a.malloc(2 * G, stream=s2)
        a.free(t)                        # pending on s2 at close: close waits for it
        assert fake.get("pending_events") >= 1
    assert fake.get("ctx_syncs") == syncs + 1  # one device-wide synchronize, then the unmaps
    assert fake.get("pending_events") == 0


def test_memory_in_use_on_a_stream_is_not_unmapped_until_it_finishes(fake, mem):
    """A kernel on s still reads p after free(p): a budget-pressed malloc on another stream must
    not unmap p's chunks while it runs (the fake fails any unmap of memory queued work uses);
    trim() and close() wait for s's event first (cuMemUnmap does not wait for the device)."""
    s, other = mem.new_stream(), mem.new_stream()
    with Allocator("cuda", chunk_size=G, budget=4 * G, small_threshold=0) as a:
        p = a.malloc(3 * G, stream=s)
        fake.hold(s)
        fake.use(s, p, 3 * G)            # queued work on s reads and writes p
        a.free(p)
        try:
            q = a.malloc(3 * G, stream=other)   # only p's chunks could serve it
            a.free(q)
        except OutOfMemoryError:
            pass
        syncs = fake.get("event_syncs")
        assert fake.get("pending_uses") == (1 if syncs == 0 else 0)
        t = a.malloc(2 * G, stream=s)
        fake.use(s, t, 2 * G)            # more work on s, still running when t is freed
        a.free(t)
        a.trim()                         # waits for s, then gives the chunks back
        assert fake.get("event_syncs") > syncs and fake.get("pending_uses") == 0
        r = a.malloc(G, stream=s)
        fake.use(s, r, G)
        a.free(r)
    assert fake.get("pending_uses") == 0  # close() waited too


def test_the_per_thread_stream_records_its_event_at_free(fake, mem):
    """Handle 2 names the calling thread's stream: an event recorded later, from another thread,
    would land on that thread's stream, so it is recorded when the memory is freed."""
    for stream, events_at_free in ((2, 1), (0, 0), (1, 0)):   # 0 and legacy: recorded late
        with Allocator("cuda", chunk_size=G, small_threshold=0) as a:
            p = a.malloc(2 * G, stream=stream)
            before = fake.get("calls:cuEventRecord")
            a.free(p)
            assert fake.get("calls:cuEventRecord") == before + events_at_free, stream


def test_record_stream_onto_another_devices_stream(fake, mem):
    other = CudaMemory(device=1)         # device 1's context is now current here
    s_other = other.new_stream()
    mem._current()
    before = fake.get("events")
    with Allocator("cuda", chunk_size=G, small_threshold=0) as a:
        p = a.malloc(3 * G)
        a.record_stream(p, s_other)      # its event is made in device 1's context
        fake.hold(s_other)
        a.free(p)
        q = a.malloc(3 * G, stream=mem.new_stream())
        assert not (p <= q < p + 3 * G)  # device 1's work still holds p
        fake.hold(s_other, False)
        a.free(q)
    assert fake.get("events") == before


def test_a_thread_with_another_context_current_keeps_it(fake, mem):
    other = CudaMemory(device=1)
    out: List[object] = []

    def worker() -> None:
        other._current()                 # this thread works on device 1
        try:
            p = a.malloc(5 * MiB)        # the fake refuses device 0's memory made in device 1's context
            a.free(p)
            cur = ctypes.c_void_p()
            other.cu.cuCtxGetCurrent(ctypes.byref(cur))
            out.append(cur.value == other.ctx.value)  # vmalloc put device 1's context back
        except Exception as exc:  # surfaced below
            out.append(exc)

    with Allocator("cuda", chunk_size=G) as a:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert out == [True]


def test_driver_out_of_memory_reclaims_the_cache_then_raises(fake, mem):
    total = fake.get("total_mem")
    with Allocator("cuda", chunk_size=G, small_threshold=0) as a:
        big = a.malloc(total * 3 // 4)
        a.free(big)                      # cached: most of the device
        other = a.malloc(total // 2 + G, stream=mem.new_stream())  # needs cached chunks back
        assert a.stats()["physical_current"] <= total
        with pytest.raises(OutOfMemoryError):
            a.malloc(total // 2 + G)
        a.free(other)
        fake.inject("cuMemCreate", 1, CUDA_ERROR_OUT_OF_MEMORY, count=0)
        a.trim()
        with pytest.raises(OutOfMemoryError, match="out of memory"):
            a.malloc(3 * G)
        fake.disarm()
        a.free(a.malloc(3 * G))


def test_largest_available_asks_the_device(fake, mem):
    """cacheInfo's answer (cudnn.benchmark): the device's free memory (cuMemGetInfo, less 1/64
    for what others may take meanwhile) in whole chunks plus the cached chunks, capped by the
    budget."""
    total = fake.get("total_mem")

    def room():
        free = total - fake.get("committed_bytes")
        return (free - free // 64) // G * G

    with Allocator("cuda", chunk_size=G, small_threshold=0) as a:
        assert a.largest_available() == room() > 0
        p = a.malloc(2 * G + 1)                       # 3 chunks
        assert a.largest_available() == room()
        a.free(p)                                     # cached: still committed, and available
        assert a.largest_available() == room() + 3 * G
        a.set_budget(8 * G)
        q = a.malloc(G)                               # from the cache
        assert a.largest_available() == 7 * G
        a.free(q)
        fake.inject("cuMemGetInfo", 1, CUDA_ERROR_UNKNOWN)
        with pytest.raises(RuntimeError, match="cuMemGetInfo"):
            a.largest_available()


# Host fault kinds (bench/alloc_probe.py's CALLS) -> the driver functions behind them
CUDA_CALLS = {
    "create": ("cuMemCreate",), "release": ("cuMemRelease",), "map": ("cuMemMap", "cuMemSetAccess"),
    "unmap": ("cuMemUnmap",), "reserve": ("cuMemAddressReserve",), "unreserve": ("cuMemAddressFree",),
    "record": ("cuEventRecord", "cuEventCreate", "cuEventQuery", "cuStreamGetCtx"), "any": ("any",),
}


class OnFakeDriver:
    """A cuda Allocator seen through bench.alloc_probe's eyes: its faults are the fake driver's
    (a host errno becomes out of memory or an unknown error), its committed and mapped bytes are
    what the driver holds, and its stream 7 is a real stream."""

    def __init__(self, a: Allocator, fake: FakeDriver, stream: int, seed: int) -> None:
        self.a, self.fake, self.stream = a, fake, stream
        self.rng = random.Random(seed)
        self.base = fake.get("committed_bytes"), fake.get("mapped_bytes")

    def __getattr__(self, name: str):
        return getattr(self.a, name)

    def _s(self, stream: int) -> int:
        return self.stream if stream == 7 else stream

    def malloc(self, n: int, stream: int = 0) -> int:
        return self.a.malloc(n, self._s(stream))

    def record_stream(self, p: int, stream: int) -> None:
        self.a.record_stream(p, self._s(stream))

    def _inject_fault(self, call: str, nth: int, err: int = 0, count: int = 1) -> None:
        if nth == 0:
            self.fake.disarm()
            return
        import errno
        result = CUDA_ERROR_OUT_OF_MEMORY if err in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG) \
            else self.rng.choice((CUDA_ERROR_UNKNOWN, CUDA_ERROR_INVALID_VALUE))
        self.fake.inject(self.rng.choice(CUDA_CALLS[call]), nth, result, count)

    def _debug_state(self) -> dict:
        d = dict(self.a._debug_state())
        d["committed_bytes"] = self.fake.get("committed_bytes") - self.base[0]
        d["mapped_bytes"] = self.fake.get("mapped_bytes") - self.base[1]
        return d


@pytest.mark.parametrize("seed", range(4))
def test_every_driver_call_failing_leaves_the_allocator_consistent(fake, mem, seed):
    """bench.alloc_probe's random operations with faults, on the cuda backend: after every step the
    stats agree with what the driver holds, contents are intact, nothing overlaps; at the end
    everything is released."""
    from bench.alloc_probe import Probe, check

    before = held_by_driver(fake)
    probe = Probe(G, 12 * G, seed)
    probe.a.close()
    a = Allocator("cuda", chunk_size=G, budget=12 * G, small_threshold=64 * KiB)
    probe.a = OnFakeDriver(a, fake, mem.new_stream(), seed)
    for _ in range(150):
        probe.step()
    fake.disarm()
    check(probe.a, probe.live, 12 * G)
    out = probe.finish()
    assert out["corrupted_bytes"] == 0 and out["leaked_bytes"] == 0, out
    assert out["driver_errors"] + out["oom"] > 0, "no fault fired: the probe tested nothing"
    held = held_by_driver(fake)
    held["streams"] -= 1                 # the probe's stream
    assert held == before


def test_a_forked_child_makes_no_driver_call(fake, mem, tmp_path):
    a = Allocator("cuda", chunk_size=G)
    p = a.malloc(3 * G)
    mem.fill(p, 3 * G, 5)
    calls = fake.get("calls")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            for op in (lambda: a.free(p), lambda: a.malloc(10), lambda: a.trim()):
                try:
                    op()
                    raise AssertionError("a forked child used its parent's allocator")
                except RuntimeError as exc:
                    assert "forked child" in str(exc)
            a.close()
            assert a.closed
            code = 0 if fake.get("calls") == calls else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert mem.intact(p, 3 * G, 5, 4096)
    a.free(p)
    a.close()


def test_torch_entry_points_on_the_cuda_backend(fake, mem):
    """The C functions PyTorch's CUDAPluggableAllocator calls, with the registry's cuda allocator
    (process-wide: it is never destroyed)."""
    ep = _core._torch_entry_points()
    malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        ep["vmalloc_torch_malloc"])
    pool_malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        ep["vmalloc_torch_malloc_pool"])
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        ep["vmalloc_torch_free"])
    record = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(ep["vmalloc_torch_record_stream"])
    empty_cache = ctypes.CFUNCTYPE(None)(ep["vmalloc_torch_empty_cache"])
    fraction = ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int)(ep["vmalloc_torch_memory_fraction"])

    _core._torch_configure("cuda", G, 0, -1)
    s = mem.new_stream()
    assert malloc(0, 0, None) is None
    p = malloc(5 * MiB, 0, s)
    mem.fill(p, 5 * MiB, 3)
    record(p, mem.new_stream())
    free(p, 5 * MiB, 0, s)
    a = _core._torch_allocator(0)
    assert a is not None and a.stats()["num_live"] == 0
    empty_cache()
    assert a.stats()["physical_current"] == 0 == fake.get("committed_bytes")
    fraction(2 * G / fake.get("total_mem"), 0)   # a budget of two chunks
    assert pool_malloc(3 * G, 0, s) is None        # pool mode: null, PyTorch raises its own OOM
    q = pool_malloc(G, 0, s)
    assert q is not None
    free(q, G, 0, s)
    _core._torch_set_budget(0, 0)


def test_add_peer_grants_another_gpu_what_is_mapped_and_what_will_be(fake, mem):
    """Mapped memory is readable only by the devices cuMemSetAccess named: before add_peer(1),
    a kernel of device 1 reading device 0's allocation faults (the fake records it); after it,
    live ranges, slabs, cached ranges and new mappings are all readable from device 1."""
    other = CudaMemory(device=1)
    mem._current()
    with Allocator("cuda", chunk_size=G, small_threshold=MiB) as a:
        big, small, cached = a.malloc(3 * G), a.malloc(4 * KiB), a.malloc(2 * G)
        a.free(cached)
        other._current()
        fake.expected_violations = 1
        with pytest.raises(ValueError):
            fake.use(0, big, 4096)       # device 1 reads device 0's memory: no access yet
        mem._current()
        assert a.add_peer(1) and a.add_peer(0)   # its own device: nothing to do
        again = a.malloc(2 * G)          # the cached range, re-used
        fresh = a.malloc(5 * G)          # new mappings
        other._current()
        for p, n in ((big, 3 * G), (small, 4 * KiB), (again, 2 * G), (fresh, 5 * G)):
            fake.use(0, p, n)            # device 1's kernels may read them all now
        mem._current()
        for p in (big, small, again, fresh):
            a.free(p)
    with Allocator("host", chunk_size=G) as h:
        assert not h.add_peer(1)         # no devices on the host backend


def test_a_second_gpu_in_one_process_connects_the_two(fake, mem):
    """The torch registry: when a process allocates on a second GPU, the two get access to each
    other's vmalloc memory, what was allocated before included (model parallel, device_map)."""
    _core._torch_configure("cuda", G, 0, -1)
    ep = _core._torch_entry_points()
    malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        ep["vmalloc_torch_malloc"])
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        ep["vmalloc_torch_free"])
    p0 = malloc(3 * G, 0, None)
    other = CudaMemory(device=1)
    p1 = malloc(3 * G, 1, None)          # device 1's allocator is made: the two are connected
    other._current()
    fake.use(0, p0, 3 * G)               # device 1 reads device 0's tensor
    mem._current()
    fake.use(0, p1, 3 * G)               # and device 0 reads device 1's
    other._current()
    free(p1, 3 * G, 1, None)
    mem._current()
    free(p0, 3 * G, 0, None)


@pytest.mark.parametrize("mapped", [False, True])
def test_a_peer_whose_grant_fails_is_not_kept(fake, mem, mapped):
    """cuDeviceCanAccessPeer says yes but the grant fails (some PCIe, vGPU or IOMMU setups): the
    peer is not kept, so later mappings, which would carry it and fail, still work. Nothing
    mapped: the probe chunk's grant fails; something mapped: re-granting it fails."""
    with Allocator("cuda", chunk_size=G) as a:
        p = a.malloc(G) if mapped else None
        fake.inject("cuMemSetAccess", 2 if mapped else 1, CUDA_ERROR_UNKNOWN)
        with pytest.raises(RuntimeError, match="cuMemSetAccess"):
            a.add_peer(1)
        q = a.malloc(3 * G)
        fake.use(0, q, 3 * G)
        a.free(q)
        if p is not None:
            a.free(p)


def test_a_peer_is_kept_untried_on_a_full_device_and_a_known_one_stays(fake, mem):
    """No chunk to try the grant on (a full device): the peer is kept, as before the probe.
    A peer added again whose re-grant fails stays a peer: it worked before."""
    with Allocator("cuda", chunk_size=G) as a:
        fake.inject("cuMemCreate", 1, CUDA_ERROR_OUT_OF_MEMORY)
        assert a.add_peer(1)
        p = a.malloc(G)
        fake.inject("cuMemSetAccess", 1, CUDA_ERROR_UNKNOWN)  # re-granting p's range
        with pytest.raises(RuntimeError, match="cuMemSetAccess"):
            a.add_peer(1)  # (known: no probe)
        other = CudaMemory(device=1)
        other._current()
        q = a.malloc(3 * G)              # still mapped for device 1 too
        fake.use(0, q, 3 * G)
        mem._current()
        a.free(q)
        a.free(p)


def test_close_waits_for_another_devices_stream(fake, mem):
    """close() synchronizes its own device; work of another device's stream on the memory
    (record_stream) is waited for through its event, not cut short by the unmap."""
    other = CudaMemory(device=1)
    s_other = other.new_stream()
    mem._current()
    a = Allocator("cuda", chunk_size=G, small_threshold=0)
    a.add_peer(1)
    p = a.malloc(3 * G)
    a.record_stream(p, s_other)
    fake.hold(s_other)
    fake.use(s_other, p, 3 * G)          # device 1's kernel still reads p
    a.free(p)                            # cached; its event recorded on s_other
    syncs = fake.get("event_syncs")
    a.close()
    assert fake.get("event_syncs") > syncs
    fake.hold(s_other, False)
    assert fake.get("pending_uses") == 0


def test_a_gpu_pair_that_cannot_be_connected_is_said_and_the_rest_connect(fake, mem, capfd):
    """Connecting a third GPU: a failing cuMemSetAccess leaves that pair unconnected and says so
    on stderr, naming the error; the other pairs still connect."""
    _core._torch_configure("cuda", G, 0, -1)
    a0, a1 = _core._torch_allocator(0, True), _core._torch_allocator(1, True)
    p0 = a0.malloc(G)                    # something mapped: add_peer re-grants it
    fake.inject("cuMemSetAccess", 1, CUDA_ERROR_UNKNOWN)   # the first pair's grant fails
    a2 = _core._torch_allocator(2, True)
    err = capfd.readouterr().err
    assert "GPUs 0 and 2 were not given access to each other's memory" in err
    assert "cuMemSetAccess (granting the peer) failed" in err
    assert "GPUs 1 and 2" not in err     # the next pair connected
    q = a0.malloc(3 * G)                 # fresh mappings leave the failed peer out (they failed)
    a0.free(q)
    third = CudaMemory(device=2)
    third._current()
    p1 = a1.malloc(G)
    fake.use(0, p1, G)                   # device 2 reads device 1's memory
    mem._current()
    a0.free(p0)
    a1.free(p1)
    assert a2 is not None
