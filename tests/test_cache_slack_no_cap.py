"""Allocator(cache_slack=...) at the edges: inf (and any slack whose cap passes what the native
side can represent) means no cap, as None does, not slack 0; NaN is refused."""
import math

import pytest

vmalloc = pytest.importorskip("vmalloc.allocator")
KiB = 1 << 10
CHUNK = 64 * KiB


def chunks_created(slack):
    """8 x 1 MiB freed, then a 2 MiB miss: no cap grows, slack 0 remaps the cached chunks.
    (Cached neighbours not joined: joined, the eight make one range the miss is split from.)"""
    with vmalloc.Allocator("host-lazy", chunk_size=CHUNK, cache_slack=slack,
                           small_threshold=0, merge_cached=False) as a:
        for p in [a.malloc(1 << 20) for _ in range(8)]:
            a.free(p)
        a.malloc(2 << 20)
        return a.stats()["num_chunks_created"]


@pytest.mark.parametrize("slack", [math.inf, 1e30, 1e17, 128.0 * CHUNK])
def test_a_huge_or_infinite_slack_is_no_cap(slack):
    assert chunks_created(slack) == chunks_created(None) > chunks_created(0.0)


def test_nan_is_refused_naming_the_knob():
    with pytest.raises(ValueError, match="cache_slack.*nan"):
        vmalloc.Allocator("host-lazy", chunk_size=CHUNK, cache_slack=math.nan)
