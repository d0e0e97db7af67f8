"""vmalloc as PyTorch's pluggable CUDA allocator: the public names, kept importable from here.

The code lives in :mod:`vmalloc.pluggable`, one module per job (registry, registration, shims,
history, live report); see that package's doc.
"""
from __future__ import annotations

from .pluggable.history import (drain_history, history_info, history_snapshot,
                                set_trace_capacity, snapshot_from_events, start_recording)
from .pluggable.live_report import live_report, register_exit_report
from .pluggable.register import enable, pool
from .pluggable.registry import (ALL_DEVICES, REGISTRY, TRACE_CAPACITY, core, device_allocator,
                                 device_index, devices, is_enabled, registry, stats)
from .pluggable.shims import install_shims, torch_memory_stats

# the names other modules and tests used before the split
_REGISTRY = REGISTRY
_core = core
_device_index = device_index
_drain_history = drain_history
_install_shims = install_shims

__all__ = ["ALL_DEVICES", "TRACE_CAPACITY", "device_allocator", "devices", "enable",
           "history_info", "history_snapshot", "set_trace_capacity",
           "is_enabled", "live_report", "pool", "register_exit_report", "registry",
           "snapshot_from_events", "start_recording", "stats", "torch_memory_stats"]
