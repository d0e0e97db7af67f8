"""The limit an ``InfeasibleError`` names: the least of some candidate limits (bounds, other
planners' minima) at which a solve is checked to find a plan. A bound alone may not work
(sizes rounded to slots, heuristics that miss it), and naming the limit just refused would
send the caller round in a circle."""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

from ..chain import Number


def least_working(limits: Iterable[Optional[Number]], memory: Number,
                  works: Callable[[Number], bool]) -> Optional[Number]:
    """The least of ``limits`` above ``memory`` (finite ones; None entries skipped) at which
    ``works`` (a solve there, True if it finds a plan that fits); None if none does."""
    above = {v for v in limits if v is not None and isinstance(v, (int, float))
             and math.isfinite(v) and v > memory}
    return next((v for v in sorted(above) if works(v)), None)
