"""The host-lazy backend: the host backend's chunks and mappings without committing RAM, for
replays (which never write): the same decisions as "host", no RAM taken, the machine's RAM no
limit (a trace recorded on an 80 GB GPU replays on a 24 GB machine), and memory that still
works when written."""
import ctypes
import os

from hypothesis import given, settings, strategies as st

from vmalloc import Allocator
from vmalloc.replay import compare, default_contenders, vmalloc_factory
from vmalloc.replay.trace import Event, Trace

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def run(backend, ops, budget):
    """Replay `ops` ((size, None) = malloc, (None, k) = free the k-th live block); every outcome
    and the final stats, for comparing backends."""
    outcomes = []
    with Allocator(backend, chunk_size=64 * KiB, budget=budget, small_threshold=16 * KiB) as a:
        live = []
        for size, k in ops:
            if size is not None:
                try:
                    live.append(a.malloc(size))
                    outcomes.append("ok")
                except MemoryError:
                    outcomes.append("oom")
            elif live:
                a.free(live.pop(k % len(live)))
        stats = {k: v for k, v in a.stats().items() if k != "driver_seconds"}
        state = a._debug_state()
    return outcomes, stats, state


ops = st.lists(st.one_of(st.tuples(st.integers(1, 700 * KiB), st.none()),
                         st.tuples(st.none(), st.integers(0, 50))), max_size=120)


@settings(max_examples=60, deadline=None)
@given(ops=ops, budget=st.sampled_from([None, 1 * MiB, 3 * MiB]))
def test_the_same_decisions_as_the_host_backend(ops, budget):
    host, lazy = run("host", ops, budget), run("host-lazy", ops, budget)
    assert lazy[0] == host[0]                    # every malloc succeeds or fails alike
    assert lazy[1] == host[1]                    # every counter and peak alike
    assert lazy[2]["committed_bytes"] == 0       # and no RAM taken for any of it


def test_more_than_the_machines_ram_maps_without_taking_it():
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    size = (2 * ram // GiB + 1) * GiB            # twice the RAM, in 64 MiB chunks
    with Allocator("host-lazy", chunk_size=64 * MiB) as a:
        assert a.total_memory == 0               # no limit but the budget
        p = a.malloc(size)
        assert a.stats()["physical_current"] == size
        assert a._debug_state()["committed_bytes"] == 0
        ctypes.memset(p + size - 4096, 7, 4096)  # the memory works: written, it is RAM
        assert ctypes.string_at(p + size - 4096, 4) == b"\x07" * 4
        assert 0 < a._debug_state()["committed_bytes"] <= 64 * MiB
        a.free(p)
    with Allocator("host", chunk_size=64 * MiB) as a:   # the committing backend refuses it
        try:
            a.malloc(size)
        except MemoryError as e:
            assert "host backend's memory" in str(e)
        else:
            raise AssertionError("host backend mapped twice the machine's RAM")


def test_replays_use_it_and_report_what_host_would():
    ev = [Event("alloc", i, (i % 5 + 1) * 300 * KiB) for i in range(40)]
    ev += [Event("free", i, (i % 5 + 1) * 300 * KiB) for i in range(0, 40, 2)]
    trace = Trace(ev, {"name": "t"})
    lazy = {r.allocator: r for r in compare(trace, default_contenders((2 * MiB,)), bisect=True)}
    host = {r.allocator: r for r in compare(trace, default_contenders((2 * MiB,), "host"),
                                            bisect=True)}
    for name in lazy:
        a, b = dict(lazy[name].__dict__), dict(host[name].__dict__)
        assert a == b, name
    assert "host-lazy" in repr(vmalloc_factory(2 * MiB)(None))
