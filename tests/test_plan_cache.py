import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_get_counts_a_hit_and_keeps_the_plan_longest():
    cache: PlanCache[str] = PlanCache(capacity=2)
    cache.get_or_plan("a", lambda: "A")
    cache.get_or_plan("b", lambda: "B")
    assert cache.get("a") == "A" and cache.hits == 1      # a hit, and "a" is now the newest
    assert cache.get("z") is None and (cache.hits, cache.misses) == (1, 2)  # absent: no count
    cache.get_or_plan("c", lambda: "C")                    # evicts "b", the oldest used
    assert "a" in cache and "b" not in cache
    assert cache.stats()["plan_cache_hits"] == cache.stats()["hits"] == 1
    assert cache.stats()["plans_computed"] == cache.stats()["misses"] == 3


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_get_and_get_or_plan_are_one_lru_cache(capacity, ops):
    # the reference: a plain LRU list, newest last; a get of an absent key changes nothing
    cache: PlanCache[int] = PlanCache(capacity=capacity)
    order, hits, misses = [], 0, 0
    for planning, key in ops:
        if key in order:
            order.remove(key)
            order.append(key)
            hits += 1
            expect = key * 10
        elif planning:
            order.append(key)
            order = order[-capacity:]
            misses += 1
            expect = key * 10
        else:
            expect = None
        got = cache.get_or_plan(key, lambda k=key: k * 10) if planning else cache.get(key)
        assert got == expect
        assert (cache.hits, cache.misses) == (hits, misses)
        assert [k for k in range(6) if k in cache] == sorted(order)


def test_a_wrapped_chain_reports_plan_cache_hits_beside_hits():
    import torch
    from torch import nn

    import scheduler
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)]
    model = scheduler.wrap(blocks, "1MiB", planner="rotor",
                           measure_options={"repeat": 1, "warmup": 0})
    for _ in range(3):
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    st_ = model.stats()
    assert st_["plans_computed"] == st_["misses"] == 1
    assert st_["plan_cache_hits"] == st_["hits"] == 2
