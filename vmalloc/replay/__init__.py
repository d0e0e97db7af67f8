"""Trace replay without a GPU: PyTorch snapshots and the project's JSON traces, replayed
through vmalloc's host backend and through a model of PyTorch's caching allocator."""
from .caching_model import CachingAllocatorModel, allocation_size, round_size
from .run import (Contender, ReplayResult, Row, caching_factory, compare, default_contenders,
                  fits, min_budget, replay, vmalloc_factory)
from .trace import Event, Trace, from_json, from_snapshot, load, validate

__all__ = ["CachingAllocatorModel", "Contender", "Event", "ReplayResult", "Row", "Trace",
           "allocation_size", "caching_factory", "compare", "default_contenders", "fits",
           "from_json", "from_snapshot", "load", "min_budget", "replay", "round_size",
           "validate", "vmalloc_factory"]
