"""Event simulator (issue 4): any Plan on any Chain -> makespan, peak, idle, timeline."""
from typing import Any


class SimResult:  # placeholder until issue 4 lands
    pass


def simulate(chain: Any, plan: Any, bandwidth: Any = None) -> SimResult:
    raise NotImplementedError("scheduler.simulate is not built yet")
