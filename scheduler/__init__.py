"""Planners for activation memory: the chain model, one Plan format, an event simulator,
the optimal dynamic programs of the papers, and the runtimes that execute their plans.

The planners and the simulator never import torch; ``scheduler.swap``,
``scheduler.wrap`` and ``scheduler.checkpoint`` (the runtimes) do, on first use.
"""
from importlib import import_module
from typing import Any

from .chain import Chain
from .errors import InfeasibleError, InvalidPlanError
from .plan import Op, Plan
from .simulate import SimResult, simulate

__all__ = ["Chain", "InfeasibleError", "InvalidPlanError", "Op", "Plan", "SimResult",
           "simulate", "swap", "wrap", "checkpoint", "planners", "profile", "runtime"]

_LAZY = {"swap": ("scheduler.runtime.swap", "swap"),
         "wrap": ("scheduler.runtime.wrap", "wrap"),
         "checkpoint": ("scheduler.runtime.checkpoint", "checkpoint")}


def __getattr__(name: str) -> Any:
    # the runtimes import torch: load them only when asked for
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(import_module(module), attr)
    if name in ("planners", "profile", "runtime"):
        return import_module(f"scheduler.{name}")
    raise AttributeError(f"module 'scheduler' has no attribute {name!r}")
