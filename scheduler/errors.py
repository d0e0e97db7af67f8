"""Exceptions shared by the planners, the simulator and the runtimes."""
from __future__ import annotations

from typing import Optional


class InfeasibleError(ValueError):
    """No schedule fits the memory limit. ``min_memory`` is the smallest limit that works
    (``None`` where the planner cannot tell)."""

    def __init__(self, message: str, min_memory: Optional[float] = None):
        super().__init__(message)
        self.min_memory = min_memory


class InvalidPlanError(ValueError):
    """A plan the simulator cannot execute. ``index`` is the offending op's position."""

    def __init__(self, message: str, index: Optional[int] = None):
        super().__init__(message)
        self.index = index
