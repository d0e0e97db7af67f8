"""Submodules loaded on first attribute access (PEP 562), for ``scheduler`` and its packages.

``import scheduler`` imports neither torch nor the runtimes, yet every dotted name the README
uses works after it alone: ``scheduler.runtime.distributed.shutdown()`` imports
``scheduler.runtime`` and then ``scheduler.runtime.distributed`` on first access. A name that
is no submodule raises the usual ``AttributeError`` (so ``hasattr`` is False); a submodule that
fails to import raises its own error (``hasattr(scheduler.runtime, "swap")`` without torch
installed: ``ModuleNotFoundError``, torch being a dependency). Torch-free: the planners'
package uses it too.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable, Dict, Optional


def submodule_getattr(package: str, special: Optional[Dict[str, Callable[[], Any]]] = None
                      ) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``special`` maps names to loaders (a function
    defined in a torch-importing submodule, say); any other name that is a submodule of
    ``package`` is imported and returned; the rest raise ``AttributeError``."""
    def __getattr__(name: str) -> Any:
        if special is not None and name in special:
            return special[name]()
        # dunders are Python's own probes (__wrapped__, __file__ ...): never submodules
        if name.isidentifier() and not name.startswith("__") and \
                importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
