"""A native module built from older sources (a git pull without a rebuild) is an ImportError
naming the rebuild, which the CLI prints in one line, not an AttributeError deep in the first
call; the registry's history default equals the core's own."""
import types

import pytest

import vmalloc
from vmalloc import cli
from vmalloc.pluggable import registry


def test_a_core_from_older_sources_says_rebuild():
    old = types.ModuleType("vmalloc._core")
    old.__file__ = "/somewhere/_core.so"
    with pytest.raises(ImportError, match="built from older sources.*rebuild") as got:
        vmalloc._current(old)
    assert got.value.name == "vmalloc._core" and cli._core_missing(got.value)


def test_the_current_core_passes():
    core = vmalloc._import_core()
    assert vmalloc._current(core) is core


def test_the_registrys_history_default_is_the_cores():
    assert registry.TRACE_CAPACITY == vmalloc._import_core().DEFAULT_CONFIG["trace_capacity"]
