"""HostPool's slabs (CPU: the same carving over plain CPU slabs): buffers of activation sizes
cost their own size, not the next power of two, and random acquire / release / give_away /
trim / reclaim sequences with copies in flight never hand out a buffer that is in use."""
import torch
from hypothesis import given, settings, strategies as st

from scheduler.runtime import host_pool
from scheduler.runtime.host_pool import ALIGN, HostPool


class FakeEvent:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def span(buf):
    start = buf.data_ptr()
    return start, start + buf.numel()


def overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]


def test_activation_sizes_cost_their_own_size():
    n = 1440 * 49 * 64 * 4  # ~18 MiB: a block of its own would be rounded up to 32 MiB
    pool = HostPool(pin_memory=False)
    bufs = [pool.acquire(n) for _ in range(10)]
    assert all(b.numel() == n and b.dtype == torch.uint8 and b.is_contiguous() for b in bufs)
    held = pool.stats()["host_slab_bytes"]
    assert held <= 10 * n + host_pool.SLAB_BYTES  # not 10 x 32 MiB
    assert held < 10 * (1 << (n - 1).bit_length())
    for a in bufs:
        for b in bufs:
            assert a is b or not overlaps(span(a), span(b))
    for b in bufs:
        pool.release(b)
    pool.close()
    assert pool.stats()["host_slab_bytes"] == 0


def test_a_buffer_released_after_close_frees_its_slab():
    """A swap context closed while a graph still held buffers (handed back later): once the
    last one is back, its slab goes (nothing carves it again), not at the pool's death."""
    pool = HostPool(pin_memory=False, slab_bytes=1 << 20, direct_below=1024)
    late = pool.acquire(300_000)
    pool.close()
    assert pool.stats()["host_slabs"] == 1    # still lent
    pool.release(late)
    assert pool.stats()["host_slabs"] == 0 and pool.stats()["host_slab_bytes"] == 0


def test_a_huge_request_gets_its_own_slab_and_views_are_aligned():
    pool = HostPool(pin_memory=False, slab_bytes=1 << 16, direct_below=1024)
    big = pool.acquire(100_000)
    small = pool.acquire(3000)
    assert big.numel() == 100_000 and pool.stats()["host_slabs"] == 1  # 128 KiB: room left
    assert (small.data_ptr() - big.data_ptr()) % ALIGN == 0
    small.view(torch.float64)  # any dtype views a carved buffer
    pool.release(big)
    pool.release(small)
    pool.trim()
    assert pool.stats()["host_slabs"] == 0


def test_a_given_away_range_comes_back_only_once_no_view_of_it_lives():
    pool = HostPool(pin_memory=False, slab_bytes=1 << 16, direct_below=1024)
    buf = pool.acquire(1 << 16)
    view = buf.view(torch.float32)[10:]
    pool.give_away(buf)
    del buf
    pool.trim()
    assert pool.stats()["host_slabs"] == 1  # the view still reads the range
    other = pool.acquire(1 << 16)
    assert not overlaps(span(view), (other.data_ptr(), other.data_ptr() + other.numel()))
    del view
    pool.release(other)
    pool.trim()
    assert pool.stats()["host_slabs"] == 0


OPS = st.lists(st.tuples(
    st.sampled_from(["acquire", "acquire", "acquire", "release", "release", "finish",
                     "give_away", "drop", "trim", "reclaim", "view"]),
    st.integers(0, 30_000), st.integers(0, 1000), st.booleans()), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_random_sequences_keep_buffers_apart_and_stats_true(ops):
    pool = HostPool(pin_memory=False, slab_bytes=1 << 14, direct_below=512)
    lent = {}       # id -> buf
    given = {}      # id -> buf (held by someone else)
    views = []      # views made from given-away buffers, alive
    busy = []       # (span, event) of buffers released with a copy in flight
    dead_given = []  # spans of given-away buffers dropped: a copy may still run on them
    synced = []

    def wait_for_all_copies():
        synced.append(True)
        dead_given.clear()
        for _, event in busy:
            event.done = True

    pool._wait_for_all_copies = wait_for_all_copies
    events = []
    peak_need = 0
    largest = 0
    for op, n, pick, done in ops:
        if op == "acquire":
            buf = pool.acquire(n)
            assert buf.numel() == n
            if n:
                s = span(buf)
                live = list(lent.values()) + list(given.values()) + views
                assert not any(overlaps(s, span(b)) for b in live if b.numel())
                del live
                assert not any(overlaps(s, b) for b, e in busy if not e.done)
                assert not any(overlaps(s, b) for b in dead_given)
            lent[id(buf)] = buf
            largest = max(largest, n)
        elif op in ("release", "give_away", "view") and lent:
            key = list(lent)[pick % len(lent)]
            buf = lent.pop(key)
            if op == "release":
                event = None if done else FakeEvent(False)
                if event is not None:
                    events.append(event)
                    busy.append((span(buf), event))
                pool.release(buf, event)
            else:
                pool.give_away(buf)
                if op == "view" and buf.numel() >= 4:
                    views.append(buf[2:])
                else:
                    given[key] = buf
        elif op == "finish" and events:
            events[pick % len(events)].done = True
        elif op == "drop":
            if given:
                key = list(given)[pick % len(given)]
                buf = given.pop(key)
                dead_given.append(span(buf))
            elif views:
                dead_given.append(span(views.pop(pick % len(views))))
        elif op == "trim":
            pool.trim()
        elif op == "reclaim":
            kept = list(lent.values())[:pick % 3]
            pool.reclaim(kept)
            for buf in list(lent.values()):
                if all(buf is not k for k in kept):
                    del lent[id(buf)]
            del kept
        busy = [(s, e) for s, e in busy if not e.done]
        assert pool.in_use_bytes == sum(b.numel() for b in lent.values())
        assert pool.cached_bytes == sum(b.numel() for f in pool._free.values() for b, _ in f)
        held = sum(b.numel() for b in lent.values()) + pool.cached_bytes + \
            sum(b.numel() for b in given.values()) + sum(v.numel() for v in views)
        peak_need = max(peak_need, held)
        cap = max(pool.slab_bytes, 1 << max(0, largest - 1).bit_length())
        # dropped give-aways, settling ranges and fragments: loose, but no unbounded growth
        assert pool.slab_bytes_held() <= 4 * peak_need + 4 * cap + 2 * len(ops) * ALIGN
    for buf in list(lent.values()):
        pool.release(buf)
    buf = None  # (the loop's last buffer, maybe given away)
    lent.clear()
    given.clear()
    views.clear()
    pool.close()
    assert pool.stats()["host_in_use_bytes"] == 0 and pool.stats()["host_cached_bytes"] == 0
    assert pool.stats()["host_slab_bytes"] == 0  # every range back, every slab let go
