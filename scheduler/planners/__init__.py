"""The planners. Each is a module: ``scheduler.planners.rotor.solve(chain, memory)`` etc.
``scheduler.planners.best.solve(chain, memory, bandwidth=None)`` is the default choice: the
fastest valid plan of them all under the limit, chosen with the simulator.

Submodules load on first access (every one: ``scheduler.planners.offload_follow`` too), so
``import scheduler`` stays cheap.
"""
from .._lazy import submodule_getattr

_PLANNERS = ("rotor", "periodic", "revolve", "offload", "pofo", "window", "lms", "mimose",
             "best", "improve")
__all__ = list(_PLANNERS)


__getattr__ = submodule_getattr(__name__)
