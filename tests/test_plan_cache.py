import pytest

from scheduler.plan_cache import PlanCache


def test_hits_misses_and_eviction():
    cache: PlanCache[str] = PlanCache(capacity=2)
    calls = []
    for key in ["a", "b", "a", "c", "b"]:
        cache.get_or_plan(key, lambda k=key: calls.append(k) or k.upper())
    assert calls == ["a", "b", "c", "b"]  # b was evicted by c (a was used more recently)
    assert cache.hits == 1 and cache.misses == 4 and len(cache) == 2


def test_capacity_validated():
    with pytest.raises(ValueError, match="capacity"):
        PlanCache(capacity=0)
