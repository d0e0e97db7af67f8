"""The planners. Each is a module: ``scheduler.planners.rotor.solve(chain, memory)`` etc.
``scheduler.planners.best.solve(chain, memory, bandwidth=None)`` is the default choice: the
fastest valid plan of them all under the limit, chosen with the simulator.

Submodules load on first access, so ``import scheduler`` stays cheap.
"""
from importlib import import_module
from typing import Any

_PLANNERS = ("rotor", "periodic", "revolve", "offload", "pofo", "window", "lms", "mimose",
             "best", "improve")
__all__ = list(_PLANNERS)


def __getattr__(name: str) -> Any:
    if name in _PLANNERS:
        return import_module(f"scheduler.planners.{name}")
    raise AttributeError(f"module 'scheduler.planners' has no attribute {name!r}")
