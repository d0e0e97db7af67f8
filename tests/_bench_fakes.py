"""Fakes of bench scripts' measurements, for tests that check what a run writes, not what it
measures."""
from typing import Any, Dict

# one row of bench/swap.py's CPU-overhead table
SWAP_CPU_ROW: Dict[str, Any] = {
    "model": "m", "plain_step_s": 1.0, "swap_step_s": 1.0, "overhead_pct": 0.0,
    "overhead_pct_min": 0.0, "overhead_pct_estimate": 0.0, "hooks_per_step": 1,
    "saved_bytes_per_step": 1}


def fake_swap_cpu_part(monkeypatch, swap) -> Dict[str, Any]:
    """bench/swap.py's CPU part measuring nothing: one overhead row (returned), no swapping
    rows, no planning times."""
    monkeypatch.setattr(swap, "cpu_overhead", lambda quick: ([SWAP_CPU_ROW], 1.0))
    monkeypatch.setattr(swap, "cpu_swapping", lambda quick: [])
    monkeypatch.setattr(swap, "planning_time", lambda: [])
    return SWAP_CPU_ROW
