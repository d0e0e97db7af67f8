"""vmalloc.Allocator: bad input, out of memory, pressure callback, trace, streams, close, threads,
and the internal-fragmentation bounds of seed 003 (Eq. 1-2) on replayed sequences.

Every test runs on the host backend; the same tests run on "cuda" where a GPU is present.
"""
from __future__ import annotations

import json
import random
import threading

import pytest
from hypothesis import given, settings, strategies as st

from vmalloc import Allocator, OutOfMemoryError, _core
from vmalloc.allocator import granularity
from vmalloc.sizes import parse_chunk_and_budget

from test_alloc_memory import memory_for

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(params=["host", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.driver])])
def backend(request) -> str:
    return request.param


def chunk_for(backend: str) -> int:
    # Small chunks keep host RAM low; GPUs need their 2 MiB granularity.
    return 256 * KiB if backend == "host" else granularity("cuda")


def stream_handles(backend: str, n: int) -> list:
    """n distinct stream handles besides 0, 1 and 2. Host: any ints (its events are trivially
    complete). CUDA: real streams of the primary context, since the driver records events on them
    (0, 1 and 2 are the NULL, legacy and per-thread default streams); never destroyed."""
    if backend == "host":
        return [11 + i for i in range(n)]
    mem = memory_for(backend)
    return [mem.new_stream() for _ in range(n)]


def ceil_chunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_unknown_backend_names_the_value():
    with pytest.raises(ValueError, match=r"backend: unknown backend 'tpu'"):
        Allocator(backend="tpu")


@pytest.mark.parametrize("chunk", [0, 5000, "3KiB", "2MB"])
def test_chunk_size_must_be_a_multiple_of_the_granularity(chunk):
    with pytest.raises(ValueError, match="chunk_size"):
        Allocator(chunk_size=chunk)


def test_chunk_size_garbage_is_a_size_error():
    with pytest.raises(ValueError, match="chunk_size: cannot read 'lots'"):
        Allocator(chunk_size="lots")


def test_budget_smaller_than_one_chunk():
    with pytest.raises(ValueError, match=r"budget: 1 MiB \(1048576 bytes\) is smaller than one chunk"):
        Allocator(chunk_size="2MiB", budget="1MiB")
    with pytest.raises(ValueError, match="budget"):
        Allocator(chunk_size="2MiB", budget=0)
    with pytest.raises(ValueError, match="budget: .*-5"):
        Allocator(budget=-5)



@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4).map(lambda k: k * (2 * MiB)), st.data())
def test_a_budget_below_one_chunk_gets_one_message_wherever_it_is_given(chunk, data):
    """``Allocator(budget=)``, ``Allocator.set_budget`` and the CUDA allocators' check
    (``enable``, ``pool``, ``VMALLOC_BUDGET``: ``sizes.check_budget_holds_a_chunk``) refuse a
    budget below one chunk in the same words (the allocator said it in words of its own)."""
    budget = data.draw(st.integers(1, chunk - 1))
    said = []
    for refuse in (lambda: Allocator(chunk_size=chunk, budget=budget),
                   lambda: Allocator(chunk_size=chunk).set_budget(budget),
                   lambda: parse_chunk_and_budget(chunk, budget)):
        with pytest.raises(ValueError) as exc:
            refuse()
        said.append(str(exc.value))
    assert said[0] == said[1] == said[2] and "smaller than one chunk" in said[0], said


def test_the_python_defaults_are_the_cores():
    """One place sets the allocator's defaults: the core's Config (allocator.hpp). The binding's
    keyword defaults, vmalloc.Allocator's and the registry's history size read it."""
    import inspect

    from vmalloc.pluggable.registry import TRACE_CAPACITY
    defaults = _core.DEFAULT_CONFIG
    params = inspect.signature(Allocator).parameters
    assert {k: params[k].default for k in defaults if k != "budget"} == \
        {k: v for k, v in defaults.items() if k != "budget"}
    assert params["budget"].default is None and defaults["budget"] == 0   # both: no cap
    a = _core.Allocator()
    try:
        assert {k: getattr(a, k) for k in defaults} == defaults
    finally:
        a.close()
    assert TRACE_CAPACITY == defaults["trace_capacity"]

@pytest.mark.parametrize("slack", [-0.5, "lots", float("nan"), True])
def test_bad_cache_slack(slack):
    with pytest.raises(ValueError, match="cache_slack"):
        Allocator(cache_slack=slack)


def test_bad_device():
    with pytest.raises(ValueError, match="device: expected a device index >= 0, got -1"):
        Allocator(device=-1)


def test_size_strings_are_accepted():
    with Allocator(chunk_size="2MiB", budget="40MB") as a:
        assert a.chunk_size == 2 * MiB
        assert a.budget == 40_000_000
        assert a.stats()["chunk_size"] == 2 * MiB


def test_bad_sizes_and_pointers(backend):
    with Allocator(backend, chunk_size=chunk_for(backend)) as a:
        for bad in (0, -1):
            with pytest.raises(ValueError, match=f"nbytes: must be a positive byte count, got {bad}"):
                a.malloc(bad)
        with pytest.raises(ValueError, match=r"ptr: 0x1234 is not a live allocation"):
            a.free(0x1234)
        p = a.malloc(100)
        a.free(p)
        with pytest.raises(ValueError, match=f"ptr: {hex(p)} is not a live allocation .*already freed"):
            a.free(p)
        q = a.malloc(3 * a.chunk_size)
        with pytest.raises(ValueError, match="ptr"):
            a.free(q + 8)  # inside a live range is not an allocation
        a.free(q)
        with pytest.raises(ValueError, match="ptr"):
            a.record_stream(q, 5)
        with pytest.raises(ValueError, match="budget"):
            a.set_budget(a.chunk_size - 1)


def test_cuda_backend_without_a_driver_says_so():
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="backend 'cuda'"):
        Allocator(backend="cuda")


# ---------------------------------------------------------------------------------------------
# Basic behaviour and stats


def test_design_stats_keys_present(backend):
    keys = {"requested_current", "requested_peak", "mapped_current", "mapped_peak", "physical_current",
            "physical_peak", "internal_fragmentation", "num_malloc", "num_free", "num_map", "num_unmap",
            "num_chunks_created", "chunk_size"}
    with Allocator(backend, chunk_size=chunk_for(backend)) as a:
        assert keys <= set(a.stats())
        assert a.total_memory > 0 and a.granularity > 0 and a.chunk_size % a.granularity == 0


def test_large_request_maps_ceil_n_over_chunk_chunks(backend):
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c, small_threshold=0) as a:
        n = 3 * c + 1
        p = a.malloc(n)
        s = a.stats()
        assert p % c == 0 or backend == "host"
        assert s["mapped_current"] == 4 * c
        assert s["requested_current"] == n
        assert s["internal_fragmentation"] == 4 * c - n < c  # Eq. (1)
        assert s["num_map"] == 4 and s["num_chunks_created"] == 4 and s["physical_current"] == 4 * c
        a.free(p)
        # fast path: same chunk count, no driver call
        q = a.malloc(4 * c)
        s2 = a.stats()
        assert q == p
        assert s2["num_map"] == 4 and s2["num_cache_hits"] == 1
        a.free(q)


def test_split_serves_a_smaller_request_from_a_larger_cached_range(backend):
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c, small_threshold=0) as a:
        base = a.malloc(5 * c)
        a.free(base)
        p = a.malloc(2 * c)
        q = a.malloc(3 * c)
        s = a.stats()
        # the split hands out the range's tail; the 3-chunk head left is then an exact hit:
        # still no new mapping
        assert s["num_map"] == 5 and s["num_splits"] == 1 and s["num_cache_hits"] == 2
        assert p == base + 3 * c and q == base
        a.free(p)
        a.free(q)


def test_a_freed_range_joins_its_cached_neighbours(backend):
    """merge_cached: a split hands out a head and caches the tail; the head, freed, joins the
    tail again, so the whole size is an exact hit (no fresh mapping). Three ranges freed next to
    each other in any order make one range."""
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c, small_threshold=0) as a:
        base = a.malloc(5 * c)
        a.free(base)
        p = a.malloc(2 * c)             # split: the tail goes, the 3-chunk head stays cached
        assert p == base + 3 * c
        a.free(p)                       # joins it: one 5-chunk range again
        s = a.stats()
        assert s["num_merges"] == 1 and s["num_map"] == 5
        assert a.malloc(5 * c) == base  # an exact hit: nothing mapped
        assert a.stats()["num_map"] == 5
        a.free(base)
        ps = [a.malloc(c) for _ in range(5)]       # five 1-chunk tails, right to left
        assert ps == [base + (4 - i) * c for i in range(5)]
        for q in (ps[4], ps[0], ps[2], ps[3], ps[1]):   # the last ones join both sides
            a.free(q)
        s = a.stats()
        assert s["num_merges"] == 1 + 4 and s["num_map"] == 5
        assert a.malloc(5 * c) == base and a.stats()["num_map"] == 5


def test_a_range_split_and_joined_again_and_again_stays_one(backend):
    """64 times a chunk split off a cached range and freed: each time it joins the rest again
    (its chunk list once doubled at every join, until joins failed for want of memory)."""
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c, small_threshold=0) as a:
        base = a.malloc(5 * c)
        a.free(base)
        for _ in range(64):
            a.free(a.malloc(c))
        s = a.stats()
        assert s["num_merges"] == 64 and s["num_map"] == 5
        assert a.malloc(5 * c) == base and a.stats()["num_map"] == 5


def test_merging_can_be_turned_off(backend):
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c, small_threshold=0, merge_cached=False) as a:
        assert a.merge_cached is False
        a.free(a.malloc(5 * c))
        a.free(a.malloc(2 * c))
        a.malloc(5 * c)                 # the 2 and 3 cached apart: 5 chunks mapped fresh
        s = a.stats()
        assert s["num_merges"] == 0 and s["num_map"] == 10


def test_ranges_of_other_streams_or_with_record_stream_do_not_join(backend):
    """One event guards a cached range: neighbours owned by another stream, on the per-thread
    handle (another thread's stream each time), or used on a second stream (record_stream) stay
    apart."""
    c = chunk_for(backend)
    s1, s2 = stream_handles(backend, 2)

    def split_then_free(head_stream, tail_stream, record=None):
        with Allocator(backend, chunk_size=c, small_threshold=0) as a:
            a.free(a.malloc(4 * c, stream=head_stream))
            p = a.malloc(2 * c, stream=head_stream)   # split: the head stays cached
            q = a.malloc(2 * c, stream=tail_stream)   # the head (its work complete)
            assert p == q + 2 * c
            a.free(q)
            if record is not None:
                a.record_stream(p, record)
            a.free(p)
            return a.stats()["num_merges"]

    assert split_then_free(s1, s1) == 1      # the control: same stream, joined
    assert split_then_free(s1, s2) == 0
    assert split_then_free(2, 2) == 0        # CU_STREAM_PER_THREAD
    assert split_then_free(s1, s1, record=s2) == 0


def test_once_a_second_stream_allocates_nothing_is_joined(backend):
    """A joined range is ready for another stream only when its newest free's work is done:
    apart, each part is as soon as its own is (a side stream would map fresh chunks or wait)."""
    c = chunk_for(backend)
    (s1,) = stream_handles(backend, 1)
    with Allocator(backend, chunk_size=c, small_threshold=0) as a:
        a.free(a.malloc(c, stream=s1))           # a second stream seen
        base = a.malloc(4 * c)
        a.free(base)
        a.free(a.malloc(2 * c))                  # split, freed next to the head: not joined
        assert a.stats()["num_merges"] == 0


def test_trimming_to_a_budget_takes_only_what_is_over_it(backend):
    """A joined range is larger than what is over a new budget: only that leaves (it was all
    unmapped, and the next mallocs mapped it again)."""
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c, small_threshold=0) as a:
        ps = [a.malloc(c) for _ in range(16)]
        for p in ps:
            a.free(p)
        assert a.stats()["cached_bytes"] == 16 * c
        a.set_budget(15 * c)
        s = a.stats()
        assert s["physical_current"] == 15 * c and s["num_unmap"] == 1


def test_no_split_remaps_under_a_tight_budget(backend):
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c, budget=4 * c, small_threshold=0, split_cached=False) as a:
        a.free(a.malloc(4 * c))
        p = a.malloc(3 * c)  # no 3-chunk range cached, budget full: unmap 3 chunks, map them anew
        s = a.stats()
        assert s["num_unmap"] == 3 and s["num_map"] == 7 and s["num_chunks_created"] == 4
        a.free(p)


def test_small_requests_share_a_slab(backend):
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c, small_threshold=64 * KiB) as a:
        ptrs = [a.malloc(1000) for _ in range(50)]
        s = a.stats()
        assert s["physical_current"] == c  # one slab holds them all
        assert s["num_small_malloc"] == 50
        assert s["mapped_current"] == 50 * 1024  # 512-byte rounding
        assert len(set(ptrs)) == 50 and all(p % 512 == 0 for p in ptrs)
        for p in ptrs:
            a.free(p)
        assert a.stats()["requested_current"] == 0
        assert a.trim() == c
        assert a.stats()["physical_current"] == 0


def test_contents_survive_reuse_and_remap(backend):
    c = chunk_for(backend)
    mem = memory_for(backend)
    with Allocator(backend, chunk_size=c, budget=8 * c, split_cached=False) as a:
        keep = a.malloc(2 * c)
        mem.fill(keep, 2 * c, 0xAB)
        for i in range(20):  # alternate chunk counts so the budget forces remaps
            n = (1 + i % 5) * c
            p = a.malloc(n)
            mem.fill(p, n, i + 1)
            assert mem.intact(p, n, i + 1, 4096)
            a.free(p)
            assert mem.intact(keep, 2 * c, 0xAB, 4096)
        assert a.stats()["num_unmap"] > 0
        a.free(keep)


# ---------------------------------------------------------------------------------------------
# Out of memory, budget, pressure


def test_oom_then_continue(backend):
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c, budget=8 * c) as a:
        held = [a.malloc(3 * c), a.malloc(3 * c)]
        with pytest.raises(OutOfMemoryError) as info:
            a.malloc(3 * c)
        e = info.value
        assert isinstance(e, MemoryError)
        assert e.requested == 3 * c and e.budget == 8 * c
        assert 6 * c <= e.in_use == a.stats()["physical_current"] <= 8 * c
        assert "requested" in str(e) and "in use" in str(e) and "budget" in str(e)
        assert a.stats()["num_oom"] == 1
        a.free(held.pop())
        p = a.malloc(3 * c)  # usable again
        assert a.stats()["physical_current"] <= 8 * c
        with pytest.raises(OutOfMemoryError):
            a.malloc(9 * c)  # larger than the whole budget
        a.free(p)
        a.free(held.pop())


def test_set_budget_releases_cached_chunks(backend):
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c, small_threshold=0) as a:
        a.free(a.malloc(10 * c))
        assert a.stats()["physical_current"] == 10 * c
        a.set_budget(4 * c)
        assert a.stats()["physical_current"] <= 4 * c
        with pytest.raises(OutOfMemoryError):
            a.malloc(5 * c)
        a.set_budget(None)
        a.free(a.malloc(12 * c))
        assert a.stats()["budget"] == 0


def test_pressure_callback_frees_and_malloc_retries(backend):
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c, budget=6 * c) as a:
        held = [a.malloc(2 * c) for _ in range(3)]
        asked = []

        def relieve(missing: int) -> bool:
            asked.append(missing)
            a.free(held.pop())  # re-enters the allocator: must not deadlock
            return True

        a.set_pressure_callback(relieve)
        p = a.malloc(2 * c)
        assert asked == [2 * c]
        assert a.stats()["num_pressure_calls"] == 1

        a.set_pressure_callback(lambda missing: False)
        with pytest.raises(OutOfMemoryError, match="pressure callback freed nothing"):
            a.malloc(4 * c)

        def boom(missing: int) -> bool:
            raise KeyError("from the callback")

        a.set_pressure_callback(boom)
        with pytest.raises(KeyError, match="from the callback"):
            a.malloc(4 * c)
        a.set_pressure_callback(None)
        with pytest.raises(OutOfMemoryError):
            a.malloc(4 * c)
        a.free(p)
        for q in held:
            a.free(q)


def test_pressure_callback_that_frees_too_little_gets_one_retry(backend):
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c, budget=4 * c) as a:
        held = [a.malloc(c) for _ in range(4)]
        calls = []

        def relieve(missing: int) -> bool:
            calls.append(missing)
            a.free(held.pop())
            return True

        a.set_pressure_callback(relieve)
        with pytest.raises(OutOfMemoryError):
            a.malloc(3 * c)  # needs 3 chunks, one freed per call, one retry only
        assert len(calls) == 1
        for q in held:
            a.free(q)


# ---------------------------------------------------------------------------------------------
# Trace (brief contract 2)


def test_trace_events_pair_and_serialize(backend):
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c) as a:
        a.set_trace(True)
        p = a.malloc(100, stream=2)  # 2: CU_STREAM_PER_THREAD, a valid handle on cuda too
        q = a.malloc(3 * c)
        a.free(p)
        a.free(q)
        a.set_trace(False)
        a.free(a.malloc(10))  # not recorded
        events = a.take_trace()
        assert [e["action"] for e in events] == ["alloc", "alloc", "free", "free"]
        assert events[0]["stream"] == 2 and events[0]["size"] == 100 and events[1]["size"] == 3 * c
        by_id = {}
        for e in events:
            by_id.setdefault(e["id"], []).append(e)
        assert all(len(v) == 2 and v[0]["size"] == v[1]["size"] for v in by_id.values())
        times = [e["time"] for e in events]
        assert times == sorted(times)
        doc = {"meta": {"source": "vmalloc.Allocator", "units": "bytes, seconds"},
               "events": [{k: e[k] for k in ("action", "id", "size", "stream", "time")} for e in events]}
        assert json.loads(json.dumps(doc)) == doc
        assert a.take_trace() == []


# ---------------------------------------------------------------------------------------------
# Streams


def test_record_stream_bookkeeping_and_cross_stream_reuse(backend):
    c = chunk_for(backend)
    mem = memory_for(backend)
    s11, s12, s3 = stream_handles(backend, 3)
    # budget: 3 chunks, so stream s3 can only be served with chunks that streams 0, 1, s11, s12 used
    with Allocator(backend, chunk_size=c, budget=3 * c, small_threshold=64 * KiB) as a:
        p = a.malloc(2 * c, stream=0)
        a.record_stream(p, 0)  # the owner stream: nothing to do
        a.record_stream(p, s11)
        a.record_stream(p, s11)
        a.free(p)
        b = a.malloc(1000, stream=1)
        a.record_stream(b, s12)
        a.free(b)  # deferred until stream s12's event completes (immediately on host)
        q = a.malloc(2 * c, stream=s3)  # another stream: allowed once the events completed
        mem.fill(q, 2 * c, 3)
        r = a.malloc(1000, stream=1)
        mem.fill(r, 1000, 4)
        assert mem.intact(q, 2 * c, 3, 4096) and mem.intact(r, 1000, 4, 4096)
        assert a.stats()["physical_peak"] <= 3 * c
        a.free(q)
        a.free(r)
        assert a.stats()["num_live"] == 0


# ---------------------------------------------------------------------------------------------
# close()


def test_close_with_live_allocations_returns_everything(backend):
    c = chunk_for(backend)
    a = Allocator(backend, chunk_size=c)
    ptrs = [a.malloc(n) for n in (10, 5000, 3 * c, c + 1)]
    a.free(ptrs[2])
    a.close()
    s = a.stats()
    assert s["physical_current"] == 0 and s["num_live"] == 0 and s["va_reserved"] == 0
    assert s["num_chunks_released"] == s["num_chunks_created"] > 0
    assert a.closed
    a.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        a.malloc(10)
    with pytest.raises(RuntimeError, match="closed"):
        a.free(ptrs[0])
    if backend == "host":
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                assert not (lo <= ptrs[0] < hi and "vmalloc-chunks" in line)


def test_trim_returns_cached_chunks(backend):
    c = chunk_for(backend)
    with Allocator(backend, chunk_size=c) as a:
        p = a.malloc(4 * c)
        a.free(a.malloc(6 * c))
        released = a.trim()
        s = a.stats()
        assert released == 6 * c
        assert s["physical_current"] == 4 * c and s["num_chunks_released"] == 6
        a.free(p)


# ---------------------------------------------------------------------------------------------
# Threads


def test_cpp_threads_hammer_malloc_free_with_content_checks():
    with Allocator("host", chunk_size=128 * KiB, budget=96 * MiB, small_threshold=64 * KiB) as a:
        r = _core.alloc_stress_threads(a, threads=4, iters=20_000, max_bytes=2 * MiB, seed=1)
        assert r["corruptions"] == 0 and r["overlaps"] == 0
        assert r["operations"] > 20_000
        s = a.stats()
        assert s["num_live"] == 0 and s["requested_current"] == 0 and s["mapped_current"] == 0
        assert s["num_malloc"] == s["num_free"] and s["physical_peak"] <= 96 * MiB


def test_python_threads_hammer_malloc_free(backend):
    c = chunk_for(backend)
    mem = memory_for(backend)
    errors = []
    with Allocator(backend, chunk_size=c, small_threshold=64 * KiB) as a:
        def worker(tid: int) -> None:
            rng = random.Random(tid)
            held = []
            try:
                for i in range(400):
                    if held and (len(held) > 6 or rng.random() < 0.5):
                        p, n, byte = held.pop(rng.randrange(len(held)))
                        if not mem.intact(p, n, byte, 4096):
                            errors.append((tid, i, "corrupt"))
                        a.free(p)
                    else:
                        n = rng.choice([rng.randint(1, 4096), rng.randint(4096, 200 * KiB),
                                        rng.randint(c, 3 * c)])
                        byte = (tid * 50 + i) % 255 + 1
                        p = a.malloc(n, stream=tid % 2)
                        mem.fill(p, n, byte)
                        held.append((p, n, byte))
                for p, n, byte in held:
                    if not mem.intact(p, n, byte, 4096):
                        errors.append((tid, "final", "corrupt"))
                    a.free(p)
            except Exception as exc:  # surfaced below
                errors.append((tid, repr(exc)))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        s = a.stats()
        assert s["num_live"] == 0 and s["num_malloc"] == s["num_free"]


# ---------------------------------------------------------------------------------------------
# Seed 003 Eq. (1)-(2) on a replayed sequence


def training_like_trace(seed: int, steps: int = 3, layers: int = 24):
    """Alloc/free events of a few training steps: activations allocated in the forward and freed
    in reverse in the backward, gradients and temporaries of varied sizes in between."""
    rng = random.Random(seed)
    sizes = [rng.choice([rng.randint(1, 64 * KiB), rng.randint(MiB, 24 * MiB)]) for _ in range(layers)]
    events, nid = [], 0
    for _ in range(steps):
        acts = []
        for n in sizes:
            nid += 1
            events.append(("alloc", nid, n))
            acts.append((nid, n))
            nid += 1  # a temporary
            events.append(("alloc", nid, n // 3 + 1))
            events.append(("free", nid, n // 3 + 1))
        for aid, n in reversed(acts):
            nid += 1
            events.append(("alloc", nid, n + rng.randint(0, 4096)))  # its gradient
            events.append(("free", aid, n))
            events.append(("free", nid, None))
    return events


@pytest.mark.parametrize("chunk", [2 * MiB, 512 * KiB])
@pytest.mark.parametrize("small_threshold", [0, MiB])
def test_internal_fragmentation_bounds_on_a_replayed_trace(chunk, small_threshold):
    with Allocator("host", chunk_size=chunk, small_threshold=small_threshold) as a:
        live, sizes = {}, {}
        if_max, n_max = 0, 0
        for action, eid, n in training_like_trace(seed=3):
            if action == "alloc":
                live[eid] = a.malloc(n)
                sizes[eid] = n
            else:
                a.free(live.pop(eid))
                sizes.pop(eid)
            s = a.stats()
            n_max = max(n_max, len(live))
            frag = s["internal_fragmentation"]
            if_max = max(if_max, frag)
            # Eq. (1) summed over live allocations: each wastes less than one chunk.
            assert frag < max(1, len(live)) * chunk
            if small_threshold == 0:  # the paper's scheme exactly: m_a = ceil(m_r / m_c) * m_c
                assert frag == sum(ceil_chunks(v, chunk) * chunk - v for v in sizes.values())
        assert if_max < n_max * chunk  # Eq. (2)


def test_reset_peak_sets_peaks_to_current(backend):
    chunk = chunk_for(backend)
    with Allocator(backend, chunk_size=chunk) as a:
        big = a.malloc(3 * chunk)
        small = a.malloc(chunk)
        a.free(big)
        before = a.stats()
        assert before["requested_peak"] == 4 * chunk
        a.reset_peak()
        s = a.stats()
        for key in ("requested", "mapped", "physical"):
            assert s[f"{key}_peak"] == s[f"{key}_current"] == before[f"{key}_current"]
        a.free(small)


def test_live_allocations_lists_every_live_allocation_by_address():
    """What a memory snapshot lists, whenever its history began: small blocks and chunked
    ranges, with their requested bytes, freed ones gone."""
    with Allocator("host", chunk_size=2 << 20) as a:
        big, small, gone = a.malloc(5 << 20), a.malloc(100), a.malloc(3000)
        a.free(gone)
        assert a.live_allocations() == sorted([(big, 5 << 20), (small, 100)])
        a.free(big)
        a.free(small)
        assert a.live_allocations() == []
