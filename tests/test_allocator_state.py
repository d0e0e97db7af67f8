"""Hypothesis state machine over vmalloc.Allocator: random malloc / free / record_stream / trim /
set_budget sequences of mixed sizes (bytes to a couple of hundred MiB), a distinct byte pattern in
every allocation, and after every step: no overlap, contents intact, stats consistent with a model
(mapped - requested < chunk_size per large allocation, physical <= budget, counts add up), and
out-of-memory only when the budget truly cannot hold the request (no external fragmentation).
"""
from __future__ import annotations

import inspect
import math
from typing import Optional

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vmalloc import Allocator, OutOfMemoryError
from vmalloc.allocator import granularity

from test_alloc_memory import memory_for

KiB, MiB = 1 << 10, 1 << 20
SMALL_ALIGN = 512

# Size tiers, picked by a number so that huge requests stay rare (host chunks are real RAM).
TIERS = [(1, 512)] * 4 + [(513, 64 * KiB)] * 3 + [(64 * KiB, 2 * MiB)] * 3 + \
        [(2 * MiB, 24 * MiB)] * 5 + [(24 * MiB, 200 * MiB)]
streams = st.sampled_from([0, 1, 2])


def size_strategy(cap: int):
    tiers = [(lo, min(hi, cap)) for lo, hi in TIERS if lo <= cap]
    return st.integers(0, len(tiers) - 1).flatmap(lambda t: st.integers(*tiers[t]))


def make_machine(backend: str, chunk: int, budget: Optional[int], small_threshold: int,
                 max_size: int = 200 * MiB, **policy):
    """budget None: no cap; then physical memory must stay within the cache_slack soft cap."""
    sizes = size_strategy(max_size)
    slack = 0.0 if policy.get("prefer_remap") else policy.get(
        "cache_slack", inspect.signature(Allocator).parameters["cache_slack"].default)

    class AllocatorMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.a = Allocator(backend, chunk_size=chunk, budget=budget,
                               small_threshold=small_threshold, **policy)
            self.mem = memory_for(backend)
            self.budget = budget
            self.ceiling = budget  # physical may stay above a budget lowered below live memory
            self.peak_in_use = 0   # chunks backing live ranges and slabs
            self.live: dict[int, tuple[int, int]] = {}  # ptr -> (nbytes, byte)
            self.next_byte = 0
            self.ops = 0

        def is_small(self, n: int) -> bool:
            return n < min(small_threshold, chunk)

        def large_chunks(self) -> int:
            return sum(-(-n // chunk) for n, _ in self.live.values() if not self.is_small(n))

        @rule(n=sizes, stream=streams)
        def malloc(self, n: int, stream: int) -> None:
            need = chunk if self.is_small(n) else -(-n // chunk) * chunk
            try:
                p = self.a.malloc(n, stream=stream)
            except OutOfMemoryError as e:
                s = self.a.stats()
                assert e.requested == n and e.budget == self.budget
                # Only a full budget may refuse: live large ranges + slabs + this request > budget.
                assert self.budget is not None
                assert self.large_chunks() * chunk + s["small_pool_bytes"] + need > self.budget
                return
            self.next_byte = self.next_byte % 255 + 1
            self.mem.fill(p, n, self.next_byte)
            self.live[p] = (n, self.next_byte)
            self.ops += 1

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def free(self, data) -> None:
            p = data.draw(st.sampled_from(sorted(self.live)))
            n, byte = self.live.pop(p)
            # every page on the host; on a GPU every chunk (a device-to-host copy per probe:
            # per page, a 200 MiB free took 51,200 of them)
            assert self.mem.intact(p, n, byte, 4096 if backend == "host" else chunk)
            self.a.free(p)

        @precondition(lambda self: self.live)
        @rule(data=st.data(), stream=streams)
        def record_stream(self, data, stream: int) -> None:
            self.a.record_stream(data.draw(st.sampled_from(sorted(self.live))), stream)

        @rule()
        def trim(self) -> None:
            self.a.trim()
            s = self.a.stats()
            assert s["cached_bytes"] == 0
            assert s["physical_current"] == self.large_chunks() * chunk + s["small_pool_bytes"]

        @precondition(lambda self: self.budget is not None)
        @rule(chunks=st.integers(8, 64))
        def set_budget(self, chunks: int) -> None:
            self.budget = chunks * chunk
            self.a.set_budget(self.budget)
            # Live memory is never taken away: above the new budget only by what is live.
            s = self.a.stats()
            assert s["cached_bytes"] == 0 or s["physical_current"] <= self.budget
            self.ceiling = max(self.budget, s["physical_current"])

        @invariant()
        def consistent(self) -> None:
            spans = sorted((p, p + n) for p, (n, _) in self.live.items())
            for (_, end), (start, _) in zip(spans, spans[1:]):
                assert end <= start, "overlapping live allocations"
            for p, (n, byte) in self.live.items():
                assert self.mem.intact(p, n, byte, chunk), f"contents of {hex(p)} changed"
            s = self.a.stats()
            small = [n for n, _ in self.live.values() if self.is_small(n)]
            large = [n for n, _ in self.live.values() if not self.is_small(n)]
            assert s["num_live"] == len(self.live) == s["num_malloc"] - s["num_free"]
            assert s["requested_current"] == sum(small) + sum(large)
            assert s["small_requested_current"] == sum(small)
            # Large: exactly ceil(n / chunk) chunks each, so mapped - requested < chunk per allocation.
            large_mapped = sum(-(-n // chunk) * chunk for n in large)
            small_mapped = s["mapped_current"] - large_mapped
            rounded = sum(-(-n // SMALL_ALIGN) * SMALL_ALIGN for n in small)
            assert rounded <= small_mapped < rounded + SMALL_ALIGN * max(1, len(small))
            assert s["internal_fragmentation"] == s["mapped_current"] - s["requested_current"]
            assert s["internal_fragmentation"] < chunk * max(1, len(self.live))
            # Physical: whole chunks, within the budget, = live ranges + slabs + cache.
            assert s["physical_current"] == chunk * (s["num_chunks_created"] - s["num_chunks_released"])
            assert s["physical_current"] <= s["physical_peak"]
            in_use = self.large_chunks() + s["small_pool_bytes"] // chunk
            self.peak_in_use = max(self.peak_in_use, in_use)
            if self.budget is not None:
                assert s["physical_current"] <= self.ceiling
            elif slack is not None and slack >= 0:  # the soft cap of the slow path
                assert s["physical_current"] <= math.ceil(self.peak_in_use * (1 + slack)) * chunk
            assert s["physical_current"] == large_mapped + s["small_pool_bytes"] + s["cached_bytes"]
            assert s["mapped_current"] <= s["physical_current"]
            assert s["requested_peak"] >= s["requested_current"]
            assert s["mapped_peak"] >= s["mapped_current"]

        def teardown(self) -> None:
            for p, (n, byte) in list(self.live.items()):
                assert self.mem.intact(p, n, byte, chunk)
            self.a.close()
            s = self.a.stats()
            assert s["physical_current"] == 0 and s["va_reserved"] == 0
            assert s["num_chunks_released"] == s["num_chunks_created"]

    return AllocatorMachine


SETTINGS = settings(max_examples=int(__import__("os").environ.get("VMALLOC_TEST_EXAMPLES", 25)), stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

CONFIGS = {
    # default policy; 1 MiB chunks so hundreds of MiB stay a few hundred chunks
    "default": dict(chunk=MiB, budget=320 * MiB, small_threshold=MiB),
    # least physical memory: remap before growing, no splitting, small bins off (the paper's scheme)
    "lean": dict(chunk=512 * KiB, budget=256 * MiB, small_threshold=0, split_cached=False,
                 prefer_remap=True),
    # small threshold above the chunk size: small bins capped at one chunk
    "tiny-chunks": dict(chunk=64 * KiB, budget=192 * MiB, small_threshold=MiB),
    # no budget: the cache_slack soft cap bounds physical memory (sizes capped to keep RAM low)
    "no-budget": dict(chunk=MiB, budget=None, small_threshold=MiB, max_size=48 * MiB,
                      cache_slack=0.25),
    # no budget, the default slack (no cap: a caching allocator)
    "no-budget-default": dict(chunk=MiB, budget=None, small_threshold=MiB, max_size=48 * MiB),
    # cached ranges never joined (merge_cached off: the policy before it)
    "no-merge": dict(chunk=MiB, budget=320 * MiB, small_threshold=MiB, merge_cached=False),
    "no-budget-lean": dict(chunk=256 * KiB, budget=None, small_threshold=64 * KiB, max_size=32 * MiB,
                           prefer_remap=True),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_state_machine_host(config):
    machine = make_machine("host", **CONFIGS[config])
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()


@pytest.mark.gpu
@pytest.mark.driver
def test_state_machine_cuda():
    g = granularity("cuda")
    machine = make_machine("cuda", chunk=g, budget=256 * g, small_threshold=MiB)
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
