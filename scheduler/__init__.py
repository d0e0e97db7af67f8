"""Planners for activation memory: the chain model, one Plan format, an event simulator,
the optimal dynamic programs of the papers, and the runtimes that execute their plans.

The planners and the simulator never import torch; ``scheduler.swap``,
``scheduler.wrap`` and ``scheduler.checkpoint`` (the runtimes) do, on first use. Every
submodule loads on first access too, so a plain ``import scheduler`` is enough for any dotted
name (``scheduler.runtime.distributed.shutdown()``, ``scheduler.plan_cache.PlanCache``).
"""
from importlib import import_module
from typing import Any, Callable

from ._lazy import submodule_getattr
from .chain import Chain
from .errors import InfeasibleError, InvalidPlanError
from .plan import Op, Plan
from .simulate import SimResult, simulate

__all__ = ["Chain", "InfeasibleError", "InvalidPlanError", "Op", "Plan", "SimResult",
           "simulate", "swap", "wrap", "checkpoint", "planners", "profile", "runtime"]


def _runtime(module: str, attr: str) -> Callable[[], Any]:
    return lambda: getattr(import_module(f"scheduler.runtime.{module}"), attr)


# the runtimes import torch: load them only when asked for; every other submodule too
# (``scheduler.runtime.distributed.shutdown()`` after a plain ``import scheduler``)
__getattr__ = submodule_getattr(__name__, {"swap": _runtime("swap", "swap"),
                                           "wrap": _runtime("wrap", "wrap"),
                                           "checkpoint": _runtime("checkpoint", "checkpoint")})


def __dir__() -> list:
    """With the names loaded on first use (the runtimes' entry points, the submodules): what
    tab completion offers after ``import scheduler``."""
    return sorted(set(globals()) | set(__all__))
