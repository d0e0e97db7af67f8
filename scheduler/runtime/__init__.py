"""Runtimes that execute plans with torch: the swap runtime and the chain runner.

Nothing is imported here: each submodule loads on first access
(``scheduler.runtime.distributed.shutdown()`` after a plain ``import scheduler``).
"""
from .._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
