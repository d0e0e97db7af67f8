"""Plans cached by input signature (the Mimose idea, seed 004): a shape seen before costs
no re-planning. Used by the swap runtime (per variable-sequence signature) and the chain
runtime (per input shape and budget). No torch here: keys are any hashable signature.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Generic, Hashable, Optional, TypeVar

T = TypeVar("T")


def capacity_arg(value: Any, where: str, name: str = "cache_size") -> int:
    """A cache's size as an entry point takes it (``cache_size=``), checked there so the
    error names that entry point and its argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
    return value


class PlanCache(Generic[T]):
    """A bounded LRU map from a signature to a plan, counting hits, misses and planning time."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity_arg(capacity, "PlanCache", "capacity")
        self._plans: "OrderedDict[Hashable, T]" = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.planning_seconds = 0.0

    def get_or_plan(self, key: Hashable, plan: Callable[[], T]) -> T:
        """The cached plan for ``key`` (a hit), or ``plan()``'s result, timed and stored (a
        miss)."""
        if key in self._plans:
            return self._hit(key)
        self.misses += 1
        start = time.perf_counter()
        value = plan()
        self.planning_seconds += time.perf_counter() - start
        self._plans[key] = value
        if len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return value

    def get(self, key: Hashable) -> Optional[T]:
        """The cached plan for ``key``, counted as a hit and kept as the most recent, or
        ``None`` (not counted: the caller plans, through ``get_or_plan``, or not at all)."""
        return self._hit(key) if key in self._plans else None

    def peek(self, key: Hashable) -> Optional[T]:
        """The cached plan for ``key`` or ``None``, neither counted nor moved."""
        return self._plans.get(key)

    def _hit(self, key: Hashable) -> T:
        self.hits += 1
        self._plans.move_to_end(key)
        return self._plans[key]

    def drop_if(self, which: Callable[[Hashable], bool]) -> None:
        """Forget the plans whose keys ``which`` picks (their chain changed): the next
        ``get_or_plan`` of each plans anew."""
        for key in [k for k in self._plans if which(k)]:
            del self._plans[key]

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._plans

    def stats(self) -> Dict[str, float]:
        """The cache's figures. ``plans_computed`` and ``plan_cache_hits`` repeat ``misses``
        and ``hits`` under the swap runtime's names (``swap_stats``), so both runtimes'
        ``stats()`` answer to them."""
        return {"plans_cached": len(self._plans), "hits": self.hits, "misses": self.misses,
                "plans_computed": self.misses, "plan_cache_hits": self.hits,
                "planning_seconds": self.planning_seconds}
