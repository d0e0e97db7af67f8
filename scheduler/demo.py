"""The planning half of ``vmalloc demo``: no GPU needed.

Plan a bundled chain (a real model's sizes from the meta-device profile) under a memory limit
with every planner, simulate each plan, and keep the fastest plan's allocation trace for the
allocator replay. This is the one module that runs all planners side by side for a person to
read; the benchmarks in ``bench/`` do the same at scale.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from .chain import FIELDS, Chain
from .errors import InfeasibleError
from .plan import Plan
from .simulate import SimResult, simulate

DEFAULT_CHAIN = "resnet101-i1000-b2"   # seed 002's Figure 3 model at 1000x1000 pixels
BANDWIDTH = 12e9                       # bytes/s host<->device, seed 001's setting


def bundle_roots() -> List[Path]:
    """Where the bundled files (``bench/chains``, ``bench/traces``) are looked for, in order:
    the working directory, then the source checkout this package runs from (its parent
    directory). The one search of ``vmalloc demo`` too (here, not in vmalloc: this module stays
    free of the vmalloc package, which imports it)."""
    checkout = Path(__file__).resolve().parent.parent
    return list(dict.fromkeys([Path(os.getcwd()).resolve(), checkout]))   # (once when the same)


def bundled_chains() -> List[str]:
    """Names of the bundled chains: ``bench/chains/*.json`` of the first of
    :func:`bundle_roots` that has any."""
    for root in bundle_roots():
        found = sorted(p.stem for p in (root / "bench" / "chains").glob("*.json"))
        if found:
            return found
    return []


def find_chain(name: str = DEFAULT_CHAIN) -> Chain:
    """A bundled chain (``bench/chains/NAME.json`` of the first of :func:`bundle_roots` that
    has it). Where no chain is bundled at all (an installed package), the default name gives
    a random 40-stage chain in MiB so the demo still runs anywhere; any other name that is not
    bundled is an error listing those that are."""
    for root in bundle_roots():
        path = root / "bench" / "chains" / f"{name}.json"
        if path.is_file():
            return Chain.from_json(str(path))
    available = bundled_chains()
    if available or name != DEFAULT_CHAIN:
        listing = ", ".join(available) if available else "none (no bench/chains directory)"
        raise ValueError(f"chain {name!r}: no such bundled chain; available: {listing}")
    mib = 1 << 20
    c = Chain.random(40, seed=0)
    return c.replace(**{f: [v * mib for v in getattr(c, f)] for f in FIELDS[2:]},  # sizes
                     fw=[v / 1e3 for v in c.fw], bw=[v / 1e3 for v in c.bw],
                     name=f"random-40 (no bench/chains/{name}.json)")


@dataclass
class Planned:
    planner: str
    plan: Optional[Plan]
    result: Optional[SimResult]
    solve_seconds: float
    note: str = ""


def planners(chain: Chain, memory: float, bandwidth: float
             ) -> List[Tuple[str, Callable[[], Plan]]]:
    from .planners import offload, periodic, pofo, revolve, rotor
    return [
        ("store all (plain PyTorch)", lambda: periodic.solve(chain, 1)),
        ("periodic (best segments)", lambda: periodic.best(chain, memory)),
        ("revolve", lambda: revolve.solve(chain, memory)),
        ("rotor", lambda: rotor.solve(chain, memory)),
        ("offload DYNPROG", lambda: offload.dynprog(chain, memory, bandwidth)),
        ("pofo", lambda: pofo.solve(chain, memory, bandwidth)),
    ]


def plan_all(chain: Chain, fraction: float = 0.4, bandwidth: float = BANDWIDTH
             ) -> Tuple[float, List[Planned]]:
    """Every planner at ``fraction`` x the store-all peak; each plan simulated."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction: expected a number in (0, 1], got {fraction!r}")
    from .planners import periodic
    memory = fraction * periodic.solve(chain, 1).predicted_peak
    out: List[Planned] = []
    for name, solve in planners(chain, memory, bandwidth):
        start = time.perf_counter()
        try:
            plan = solve()
        except InfeasibleError as exc:
            out.append(Planned(name, None, None, time.perf_counter() - start,
                               f"infeasible: needs {exc.min_memory / 2**30:.2f} GiB"
                               if exc.min_memory else "infeasible"))
            continue
        elapsed = time.perf_counter() - start
        # under the limit, transfers wait for memory as the offload planners assume (Lemma 1);
        # storing everything cannot fit, so it runs unlimited to show what it would need
        limit = None if plan.predicted_peak > memory else memory
        out.append(Planned(name, plan, simulate(chain, plan, bandwidth=bandwidth, memory=limit),
                           elapsed))
    return memory, out


def table(chain: Chain, memory: float, rows: List[Planned]) -> str:
    base = next((r.result.makespan for r in rows if r.result is not None), None)
    head = (f"{'planner':<26} {'solve':>8} {'sim. time':>10} {'vs plain':>9} {'peak':>10} "
            f"{'fits':>5}  ops")
    lines = [f"chain {chain.name or '?'} ({chain.L} stages + loss), memory limit "
             f"{memory / 2**30:.2f} GiB, transfers at {BANDWIDTH / 1e9:g} GB/s", head,
             "-" * len(head)]
    for r in rows:
        if r.result is None:
            lines.append(f"{r.planner:<26} {r.solve_seconds:>7.2f}s {'-':>10} {'-':>9} "
                         f"{'-':>10} {'no':>5}  {r.note}")
            continue
        res = r.result
        slow = f"{res.makespan / base:.3f}x" if base else "-"
        fits = "yes" if res.peak_memory <= memory else "no"
        kinds = {k: r.plan.count(k) for k in ("F_none", "F_ck", "offload")}
        ops = ", ".join(f"{v} {k}" for k, v in kinds.items() if v) or "-"
        lines.append(f"{r.planner:<26} {r.solve_seconds:>7.2f}s {res.makespan:>9.4f}s "
                     f"{slow:>9} {res.peak_memory / 2**30:>6.2f} GiB {fits:>5}  {ops}")
    return "\n".join(lines)


def fastest_fitting(memory: float, rows: List[Planned]) -> Optional[Planned]:
    ok = [r for r in rows if r.result is not None and r.result.peak_memory <= memory]
    return min(ok, key=lambda r: r.result.makespan) if ok else None
