"""vmalloc: a chunked virtual-addressing GPU allocator for PyTorch training.

Physical memory comes in fixed-size chunks mapped through the CUDA driver's VMM API into
contiguous virtual ranges (seed 003, section 4). ``VMALLOC=1`` turns it on with no code
change; see the README for every knob.

The public names are loaded on first use (PEP 562): the torch-free planners import
``vmalloc.sizes`` and ``vmalloc._core``, which must not load the allocator, the report or the
PyTorch hooks through this file.
"""
from __future__ import annotations

import importlib
import os
import importlib.machinery
import types
from typing import Any, List

__all__ = ["Allocator", "DriverShutDownError", "OutOfMemoryError", "add_report_section", "enable",
           "format_size", "is_enabled", "parse_size", "pool", "report", "stats"]
__version__ = "0.1.0"

# public name -> (module that defines it, its name there)
_LAZY = {
    "Allocator": (".allocator", "Allocator"),
    "DriverShutDownError": (".errors", "DriverShutDownError"),
    "OutOfMemoryError": (".errors", "OutOfMemoryError"),
    "add_report_section": (".pluggable.live_report", "add_section"),
    "enable": (".torch_allocator", "enable"),
    "format_size": (".sizes", "format_size"),
    "is_enabled": (".torch_allocator", "is_enabled"),
    "parse_size": (".sizes", "parse_size"),
    "pool": (".torch_allocator", "pool"),
    "report": (".pluggable.live_report", "report"),
    "stats": (".torch_allocator", "stats"),
}
# submodules that `import vmalloc` loaded before it was lazy: `vmalloc.torch_allocator.x` after
# a bare `import vmalloc` keeps working
_SUBMODULES = ("_core", "allocator", "errors", "pluggable", "sizes", "torch_allocator")


def _import_core() -> types.ModuleType:
    """``vmalloc._core`` (the allocator, the registry and scheduler/_native.py import it through
    this): this package's build, else that of an installation of the same sources
    (``_core_locator``: ``python -c`` from the checkout after ``pip install .``); neither: an
    ImportError naming the directory imported, why, and both remedies."""
    try:
        return _current(importlib.import_module(f"{__name__}._core"))
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}._core":
            raise
    from . import _core_locator
    return _current(_core_locator.load(__name__, __path__[0]))  # noqa: F821 - the package's own


def _current(core: types.ModuleType) -> types.ModuleType:
    """``core``, unless it was built from older sources than this package's Python (a ``git
    pull`` without a rebuild): then an ImportError saying so (the CLI prints it as one line),
    rather than an AttributeError deep in the first call that needs what it lacks."""
    if not hasattr(core, "DEFAULT_CONFIG"):  # (the newest name the Python side reads)
        raise ImportError(f"{core.__file__} was built from older sources than "
                          f"{os.path.dirname(os.path.abspath(__file__))}: rebuild it "
                          "(scripts/dev-build, or pip install the package)",
                          name=f"{__name__}._core")
    return core


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module, __name__), attr)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        try:
            return _import_core() if name == "_core" else \
                importlib.import_module(f".{name}", __name__)
        except ImportError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            # vmalloc._core not built: an attribute the package lacks (hasattr() says False)
            raise AttributeError(f"module {__name__!r} has no attribute {name!r} ({exc})") from None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    # what dir() showed before this file was lazy: the module's own dunders, the public names
    # and the submodules (those `import vmalloc` loaded then, and any imported since)
    own = {n for n in globals() if n.startswith("__") and n not in ("__getattr__", "__dir__")}
    loaded = {n for n, v in globals().items()
              if isinstance(v, types.ModuleType) and v.__name__ == f"{__name__}.{n}"}
    return sorted(own | set(__all__) | set(_SUBMODULES) | loaded)
