"""The native extension the planners' dynamic programs live in (``vmalloc._core``, built
from csrc/ by scripts/dev-build or pip install). One accessor, imported on first use, so the
planners import without it until a DP runs."""
from __future__ import annotations

from types import ModuleType


def core() -> ModuleType:
    """``vmalloc._core``; its ImportError says what is missing when it was not built."""
    import vmalloc
    return vmalloc._import_core()
