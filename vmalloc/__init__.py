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
import importlib.machinery
import os
import sys
import types
from typing import Any, List, Optional

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


# ---------------------------------------------------------------------------------------------
# Where the native module vmalloc._core comes from. `pip install .` puts it in site-packages, but
# `python -c ...` / `python -m vmalloc` started in the checkout import the checkout's sources (the
# current directory comes first on sys.path), where only scripts/dev-build puts a _core. So when
# this package's directory has none for this Python, the _core of an installed vmalloc serves
# (its directory joins __path__, after this one: an in-place build always wins); when there is
# none either, _import_core fails saying which directory was imported, why, and both remedies.
# (Written here, not in a submodule: `import vmalloc` must stay one module.)


def _has_core(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, "_core" + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def _installed_core_dir(here: str) -> Optional[str]:
    """Another ``vmalloc`` directory with a ``_core`` for this Python: on ``sys.path`` (an
    installed package), else among the installed distribution's files (importlib.metadata)."""
    def other(directory: str) -> bool:
        return os.path.realpath(directory) != os.path.realpath(here) and _has_core(directory)
    for entry in sys.path:
        if isinstance(entry, str) and other(os.path.join(entry or os.getcwd(), "vmalloc")):
            return os.path.join(entry or os.getcwd(), "vmalloc")
    try:
        from importlib.metadata import distribution
        for f in distribution("vmalloc").files or ():
            if len(f.parts) >= 2 and f.parts[-2] == "vmalloc" and f.name.startswith("_core."):
                candidate = os.path.dirname(str(f.locate()))
                if other(candidate):
                    return candidate
    except Exception:  # noqa: BLE001 - no distribution, odd metadata: nothing installed to use
        pass
    return None


def _missing_core_message(here: str) -> str:
    """Why vmalloc._core cannot be imported: the directory imported, how it came first, and
    the two remedies."""
    root = os.path.dirname(here)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    source = os.path.isfile(os.path.join(root, "pyproject.toml"))
    what = f"the source tree at {root}" if source else f"the vmalloc package at {here}"
    cwd = os.path.realpath(os.getcwd())
    first = next((os.path.realpath(e or os.getcwd()) for e in sys.path if isinstance(e, str)
                  and os.path.isdir(os.path.join(e or os.getcwd(), "vmalloc"))), None)
    if first == cwd == os.path.realpath(root):
        why = (f"{what} is imported instead of an installed vmalloc because the current "
               "directory comes first on sys.path")
    else:
        why = f"{what} is imported"
    return (f"vmalloc._core is not built: {why}, and it has no vmalloc/_core{suffix} for this "
            f"Python; no installed vmalloc has one either. Build it in place with "
            f"{os.path.join(root, 'scripts', 'dev-build') if source else 'scripts/dev-build'}, "
            f"or install vmalloc with `pip install {root if source else '.'}` (an installed "
            "build is used even from the checkout)")


def _import_core() -> types.ModuleType:
    """``vmalloc._core`` (the allocator and scheduler/_native.py import it through this); when it
    is not built, an ImportError that names the directory imported, why, and both remedies."""
    try:
        return importlib.import_module(f"{__name__}._core")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}._core":
            raise
        raise ImportError(_missing_core_message(__path__[0]),  # noqa: F821
                          name=exc.name) from None


def _locate_core() -> None:
    here = __path__[0]  # noqa: F821 - set by the import system before this file runs
    if _has_core(here):
        return
    found = _installed_core_dir(here)
    if found is not None:
        __path__.append(found)  # noqa: F821


_locate_core()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module, __name__), attr)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        try:
            return importlib.import_module(f".{name}", __name__)
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


class _Package(types.ModuleType):
    """This package's module type. Importing the submodule ``vmalloc.report`` binds it as the
    package's attribute ``report`` (the import system does), which would hide the function
    ``vmalloc.report``; that one binding is dropped, and the function is found on first use."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "report" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
