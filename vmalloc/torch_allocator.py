"""vmalloc as PyTorch's pluggable CUDA allocator: the public names, kept importable from here.

The code lives in :mod:`vmalloc.pluggable`, one module per job (registry, registration, shims,
history, live report); see that package's doc.
"""
from __future__ import annotations

from .pluggable.history import (drain_history, history_info, history_snapshot,
                                set_trace_capacity, snapshot_from_events, start_recording)
from .pluggable.live_report import live_report, register_exit_report
from .pluggable.register import enable, pool
from .pluggable.registry import (ALL_DEVICES, TRACE_CAPACITY, core, device_allocator, devices,
                                 is_enabled, registry, stats)
from .pluggable.shims import install_shims, torch_memory_stats

_core = core   # the native module, as tests/test_torch_registry_budget.py reaches it

__all__ = ["ALL_DEVICES", "TRACE_CAPACITY", "core", "device_allocator", "devices", "drain_history",
           "enable", "history_info", "history_snapshot", "install_shims", "is_enabled",
           "live_report", "pool", "register_exit_report", "registry", "set_trace_capacity",
           "snapshot_from_events", "start_recording", "stats", "torch_memory_stats"]
