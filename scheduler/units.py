"""Transfer rates as every entry point takes them: ``scheduler.wrap``/``checkpoint``'s
``bandwidth``, the swap runtime's ``planner_options["bandwidth"]``, and the offload, pofo and
best planners. One parser, so they all accept and reject the same things. Torch-free: the
planners import it (sizes are ``vmalloc.sizes``', also torch-free)."""
from __future__ import annotations

import numbers
from typing import Any, Optional


def parse_rate(bandwidth: Any, where: str, *, name: str = "bandwidth",
               allow_zero: bool = False) -> Optional[float]:
    """``None`` (the caller's default) passes; else bytes per second as a float: a number
    (``inf``: an instant channel) or a size per second, ``"12GB/s"`` (``"12GB"`` too).
    ``allow_zero``: 0 means no transfer channel (the planners); the runtimes need a rate."""
    if bandwidth is None:
        return None
    rate: Any = bandwidth
    why = ""
    if isinstance(bandwidth, str):
        from vmalloc.sizes import parse_size  # torch-free; lazily, as the planners do
        try:
            rate = parse_size(bandwidth.strip().removesuffix("/s"), name)
        except ValueError as exc:  # the message below names the entry point and the forms
            rate, why = None, f" ({exc})"
    ok = isinstance(rate, numbers.Real) and not isinstance(rate, bool) and \
        (rate > 0 or (allow_zero and rate == 0))  # (NaN fails both)
    if not ok:
        raise ValueError(f"{where}: {name} must be {'non-negative' if allow_zero else 'positive'}"
                         f" bytes/s (e.g. 12e9 or '12GB/s'), got {bandwidth!r}{why}")
    return float(rate)
