"""The caching-allocator model against hand-worked cases of c10/cuda/CUDACachingAllocator.cpp."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmalloc.errors import OutOfMemoryError
from vmalloc.replay.caching_model import CachingAllocatorModel, allocation_size, round_size

MiB = 1 << 20


@pytest.mark.parametrize("n,rounded", [(1, 512), (512, 512), (513, 1024), (1000, 1024),
                                        (MiB, MiB), (MiB + 1, MiB + 512)])
def test_round_size_to_512(n, rounded):
    assert round_size(n) == rounded


@pytest.mark.parametrize("size,segment", [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB),
                                          (10 * MiB - 512, 20 * MiB), (10 * MiB, 10 * MiB),
                                          (10 * MiB + 512, 12 * MiB), (21 * MiB, 22 * MiB)])
def test_segment_sizes(size, segment):
    assert allocation_size(size) == segment


def test_small_requests_share_a_2mib_segment():
    m = CachingAllocatorModel()
    a = m.malloc(1000)
    b = m.malloc(300)
    s = m.stats()
    assert s["physical_current"] == 2 * MiB and s["num_map"] == 1
    assert b == a + 1024                          # split: the next block starts after 1024 bytes
    assert s["allocated_current"] == 1024 + 512 and s["requested_current"] == 1300


def test_small_and_large_pools_are_separate():
    m = CachingAllocatorModel()
    m.malloc(4096)            # small pool: 2 MiB segment with 2 MiB - 4 KiB cached
    m.malloc(MiB + 1)         # large pool: cannot use the small remainder -> 20 MiB segment
    s = m.stats()
    assert s["num_map"] == 2 and s["physical_current"] == 22 * MiB


def test_large_split_only_when_remainder_exceeds_1mib():
    m = CachingAllocatorModel()
    m.malloc(5 * MiB)                     # 20 MiB segment, 15 MiB remain cached (split)
    m.malloc(5 * MiB)                     # served from the remainder
    assert m.stats()["num_map"] == 1
    m2 = CachingAllocatorModel()
    p = m2.malloc(19 * MiB + MiB // 2)    # 20 MiB segment, 0.5 MiB would remain: no split
    assert m2.stats()["allocated_current"] == 20 * MiB
    m2.free(p)
    m2.malloc(2 * MiB)                    # the whole 20 MiB block is reused, then split
    assert m2.stats()["num_map"] == 1


def test_best_fit_takes_the_smallest_fitting_block():
    m = CachingAllocatorModel()
    big = m.malloc(30 * MiB)
    small = m.malloc(12 * MiB)
    m.free(big)
    m.free(small)
    p = m.malloc(11 * MiB)
    assert p == small                      # the 12 MiB block, not the 30 MiB one


def test_streams_do_not_share_cached_blocks():
    m = CachingAllocatorModel()
    p = m.malloc(12 * MiB, stream=1)
    m.free(p)
    m.malloc(12 * MiB, stream=2)
    assert m.stats()["num_map"] == 2


def test_free_merges_inside_a_segment_but_never_across_segments():
    m = CachingAllocatorModel()
    a = m.malloc(10 * MiB)     # exactly one 10 MiB segment each (>= kMinLargeAlloc)
    b = m.malloc(10 * MiB)
    m.free(a)
    m.free(b)
    m.malloc(16 * MiB)         # two free 10 MiB segments do not merge: a third segment
    assert m.stats()["num_map"] == 3
    m2 = CachingAllocatorModel()
    x = m2.malloc(5 * MiB)
    y = m2.malloc(5 * MiB)     # same 20 MiB segment
    m2.free(x)
    m2.free(y)                 # merges back into one 20 MiB block
    m2.malloc(18 * MiB)
    assert m2.stats()["num_map"] == 1


def test_oom_retry_releases_cached_segments():
    m = CachingAllocatorModel(budget=40 * MiB)
    a = m.malloc(30 * MiB)
    m.free(a)                               # 30 MiB segment cached, unsplit
    m.malloc(34 * MiB)                      # 30 + 34 > 40: release the cache, retry, succeed
    s = m.stats()
    assert s["num_unmap"] == 1 and s["physical_current"] == 34 * MiB
    assert s["num_alloc_retries"] == 1


def test_split_segments_are_not_released_and_oom_is_raised():
    m = CachingAllocatorModel(budget=24 * MiB)
    keep = m.malloc(5 * MiB)                # 20 MiB segment, split, partly in use
    with pytest.raises(OutOfMemoryError) as exc:
        m.malloc(16 * MiB)                  # needs a 16 MiB segment: 36 MiB > 24 MiB
    assert exc.value.requested == 16 * MiB
    assert m.stats()["num_oom"] == 1
    m.free(keep)
    m.malloc(16 * MiB)                      # the merged 20 MiB block serves it now


def test_empty_cache_releases_only_whole_segments():
    m = CachingAllocatorModel()
    keep = m.malloc(5 * MiB)                # split segment stays
    other = m.malloc(40 * MiB)
    m.free(other)
    released = m.trim()
    assert released == 40 * MiB
    assert m.stats()["physical_current"] == 20 * MiB
    m.free(keep)


def test_max_split_size_keeps_oversize_blocks_whole():
    m = CachingAllocatorModel(max_split_size=32 * MiB)
    big = m.malloc(64 * MiB)
    m.free(big)
    m.malloc(8 * MiB)               # an oversize block is not handed to a small request
    assert m.stats()["num_map"] == 2
    m.malloc(50 * MiB)              # oversize reuse within kLargeBuffer: 64 < 50 + 20, reused
    assert m.stats()["num_map"] == 2


def test_bad_arguments():
    m = CachingAllocatorModel()
    with pytest.raises(ValueError, match="nbytes"):
        m.malloc(0)
    with pytest.raises(ValueError, match="ptr"):
        m.free(12345)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 48 * MiB), st.integers(0, 1)), max_size=60))
def test_blocks_never_overlap_and_accounting_adds_up(ops):
    m = CachingAllocatorModel()
    live = {}
    for is_free, size, stream in ops:
        if is_free and live:
            p = next(iter(live))
            m.free(p)
            del live[p]
        else:
            p = m.malloc(size, stream)
            assert p not in live
            live[p] = round_size(size)
        spans = sorted((p, p + m._live[p].size) for p in live)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        s = m.stats()
        assert s["allocated_current"] == sum(m._live[p].size for p in live)
        assert s["allocated_current"] <= s["physical_current"]
        assert s["physical_current"] == sum(m._segments.values())


@pytest.mark.parametrize("bad", [MiB + 1, 4 * MiB, 20 * MiB - 1, 21.5 * MiB, True])
def test_max_split_size_below_20mib_is_refused_as_pytorch_does(bad):
    # AllocatorConfig::parseMaxSplitSize: max_split_size_mb >= kLargeBuffer (20 MiB). Below it
    # the model used to accept the value, then crash in _release_block with a KeyError.
    with pytest.raises(ValueError, match=r"max_split_size: .*20 MiB.*" + str(bad)[:4]):
        CachingAllocatorModel(max_split_size=bad)


def test_max_split_size_of_20mib_replays_the_oom_path_without_crashing():
    m = CachingAllocatorModel(budget=40 * MiB, max_split_size=20 * MiB)
    m.malloc(2 * MiB)
    m.malloc(3 * MiB)
    m.malloc(3 * MiB + 512)
    assert m.stats()["physical_current"] <= 40 * MiB


def test_min_refused_is_the_smallest_reserved_total_the_budget_refused():
    m = CachingAllocatorModel(budget=30 * MiB)
    assert m.min_refused is None
    m.malloc(5 * MiB)                        # a 20 MiB segment: fits
    assert m.min_refused is None
    with pytest.raises(OutOfMemoryError):
        m.malloc(16 * MiB)                   # the first 20 MiB full: 20 + 16 > 30, refused
    assert m.min_refused == 36 * MiB
