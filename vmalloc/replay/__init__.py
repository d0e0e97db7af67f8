"""Trace replay without a GPU: PyTorch snapshots and the project's JSON traces, replayed
through vmalloc's host-lazy backend (no RAM taken) and through a model of PyTorch's caching
allocator."""
from .caching_model import CachingAllocatorModel, allocation_size, round_size
from .run import (Contender, ReplayResult, Row, caching_factory, compare, default_contenders,
                  fits, min_budget, replay, smallest_budget, vmalloc_factory)
from .files import DEFAULT_MAX_BYTES, TraceFileError, load, read_bounded
from .snapshot import from_snapshot
from .trace import Event, Trace, from_json, validate

__all__ = ["CachingAllocatorModel", "Contender", "DEFAULT_MAX_BYTES", "Event", "ReplayResult",
           "Row", "Trace", "TraceFileError", "read_bounded",
           "allocation_size", "caching_factory", "compare", "default_contenders", "fits",
           "from_json", "from_snapshot", "load", "min_budget", "replay", "round_size",
           "smallest_budget",
           "validate", "vmalloc_factory"]
