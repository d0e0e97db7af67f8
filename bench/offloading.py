"""Seed 000 Figure 4 in simulation: makespan / lower bound vs memory for GREEDY, DYNPROG
and VDNN on the model zoo (image size 224, batch 32, bandwidth 12.2 GB/s as measured in
seed 000 section 6.1).

Memory limits run from the least any offloading schedule needs (0%) to M_peak (100%: no
offloading), like seed 000 sections 6.2-6.3. Every makespan is the simulator's, on the plan
the planner returns; the lower bound is Proposition 3. The summary reports DYNPROG's worst
and mean ratio (seed 000: below 1.3 everywhere) and its relaxed optimum (Algorithm 1's own
value, before the whole-activation conversion), and the fluid LP bound of
``offload_fluid.py`` (needs scipy): no plan of any kind is faster, so where it is above 1.3 x
Proposition 3 the goal cannot be met.

``dynprog_streamed`` is DYNPROG with streamed transfers (``transfer_chunk``, our own
extension: an offload frees its activation chunk by chunk as the copy proceeds, a prefetch
reserves it chunk by chunk), in chunks of :data:`STREAM_CHUNK` bytes. That is Algorithm 1's
own relaxation, so its plans come close to ``dynprog_relaxed``; the whole-activation column
``dynprog`` is what the chain runtime can run today.

    python bench/offloading.py [--quick] [--out DIR]

Writes bench/results/offloading.json and offloading.png.
"""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Sequence

from common import (parse_args, print_table, pyplot, run_meta, save_png, say_nothing_written,
                    write_json)
from offload_fluid import fluid_lower_bound

from scheduler import Chain
from scheduler.planners import offload

BANDWIDTH = 12.2e9  # bytes/s, seed 000 section 6.1
STREAM_CHUNK = 8 << 20  # bytes: four of vmalloc's 2 MiB mapping chunks per copy
CHAINS = ["resnet18-i224-b32", "resnet50-i224-b32", "resnet101-i224-b32", "resnet152-i224-b32",
          "densenet121-i224-b32", "densenet201-i224-b32"]
QUICK = ["resnet18-i224-b32", "resnet50-i224-b32"]
CHAIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chains")


def run_chain(chain: Chain, points: int, slots: int, vdnn_max_L: int) -> Dict:
    lo, hi = offload.min_memory(chain), offload.peak_memory(chain)
    rows = []
    for k in range(points):
        frac = k / (points - 1)
        M = lo + frac * (hi - lo)
        lb = offload.lower_bound(chain, M, BANDWIDTH)
        row = {"chain": chain.name, "memory_pct": round(100 * frac), "memory_gib": M / 2 ** 30,
               "lower_bound_s": lb}
        fluid = fluid_lower_bound(chain, M, BANDWIDTH)
        row["fluid_bound"] = None if fluid is None else fluid / lb
        for name in ("greedy", "dynprog", "dynprog_streamed", "vdnn"):
            if name == "vdnn" and chain.L > vdnn_max_L:
                continue
            t0 = time.perf_counter()
            if name == "dynprog":
                p = offload.dynprog(chain, M, BANDWIDTH, slots=slots)
            elif name == "dynprog_streamed":
                p = offload.dynprog(chain, M, BANDWIDTH, slots=slots, transfer_chunk=STREAM_CHUNK)
            else:
                p = getattr(offload, name)(chain, M, BANDWIDTH)
            row[f"{name}_solve_s"] = time.perf_counter() - t0
            row[name] = p.predicted_time / lb
            if name == "dynprog":
                relaxed = p.meta["relaxed_time"]   # None: the greedy fallback (no DP value)
                row["dynprog_relaxed"] = None if relaxed is None else relaxed / lb
                row["dynprog_paper"] = p.meta["paper_time"] / lb    # before our own step
                row["dynprog_variant"] = p.meta["variant"]
        rows.append(row)
    return {"name": chain.name, "L": chain.L, "min_memory": lo, "peak_memory": hi, "rows": rows}


def summary_of(rows: List[Dict]) -> Dict:
    """The all-chains summary of ``run_chain``'s rows (``dynprog_relaxed`` is None where
    DYNPROG fell back to GREEDY: no DP value)."""
    dyn = [r["dynprog"] for r in rows]
    streamed = [r["dynprog_streamed"] for r in rows]
    return {
        "dynprog_max_ratio": max(dyn), "dynprog_mean_ratio": sum(dyn) / len(dyn),
        "dynprog_paper_max_ratio": max(r["dynprog_paper"] for r in rows),
        "dynprog_paper_mean_ratio": sum(r["dynprog_paper"] for r in rows) / len(rows),
        "dynprog_slower_than_greedy": sum(r["dynprog"] > r["greedy"] * (1 + 1e-9) for r in rows),
        "greedy_max_ratio": max(r["greedy"] for r in rows),
        "vdnn_max_ratio": max((r["vdnn"] for r in rows if "vdnn" in r), default=None),
        "dynprog_relaxed_max_ratio": max((r["dynprog_relaxed"] for r in rows
                                          if r["dynprog_relaxed"] is not None), default=None),
        "dynprog_fallbacks": sum(1 for r in rows if r["dynprog_relaxed"] is None),
        "dynprog_le_1_3_everywhere": max(dyn) <= 1.3,
        "dynprog_max_solve_s": max(r["dynprog_solve_s"] for r in rows),
        "fluid_max_ratio": max((r["fluid_bound"] for r in rows if r["fluid_bound"]),
                               default=None),
        "fluid_above_1_3": sum(1 for r in rows if (r["fluid_bound"] or 0) > 1.3),
        "dynprog_max_over_fluid": max((r["dynprog"] / r["fluid_bound"] for r in rows
                                       if r["fluid_bound"]), default=None),
        "stream_chunk": STREAM_CHUNK,
        "dynprog_streamed_max_ratio": max(streamed),
        "dynprog_streamed_mean_ratio": sum(streamed) / len(streamed),
        "dynprog_streamed_le_1_3_everywhere": max(streamed) <= 1.3,
        "dynprog_streamed_max_solve_s": max(r["dynprog_streamed_solve_s"] for r in rows),
        # the fluid LP frees memory as a copy proceeds too: streamed plans stay above it
        "dynprog_streamed_min_over_fluid": min((r["dynprog_streamed"] / r["fluid_bound"]
                                                for r in rows if r["fluid_bound"]),
                                               default=None),
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    names = QUICK if args.quick else CHAINS
    points = 5 if args.quick else 11
    slots = 500
    results = []
    for n in names:
        chain = Chain.from_json(os.path.join(CHAIN_DIR, f"{n}.json"))
        results.append(run_chain(chain, points, slots, vdnn_max_L=60 if args.quick else 120))
    rows = [r for c in results for r in c["rows"]]
    print_table(rows, ["chain", "memory_pct", "lower_bound_s", "greedy", "dynprog",
                       "dynprog_paper", "dynprog_streamed", "dynprog_relaxed", "fluid_bound",
                       "vdnn", "dynprog_solve_s"],
                title="makespan / lower bound (seed 000 Fig. 4), bandwidth 12.2 GB/s")
    summary = summary_of(rows)
    print_table([summary], title="summary")
    if args.out is None:
        say_nothing_written()
        return
    # the tags every results file carries (machine, torch, date; simulated on the CPU)
    meta = run_meta("python bench/offloading.py" + (" --quick" if args.quick else ""), "cpu")
    write_json("offloading", {"meta": meta, "bandwidth": BANDWIDTH, "slots": slots,
                              "chains": results, "summary": summary}, args.out)
    plt = pyplot()
    if plt is not None:
        n = len(results)
        cols = min(3, n)
        fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(4.2 * cols, 3.2 * ((n + cols - 1) // cols)),
                                 squeeze=False)
        for ax, c in zip(axes.flat, results):
            x = [r["memory_pct"] for r in c["rows"]]
            for name, style, label in (("greedy", "o-", "GREEDY"), ("dynprog", "s-", "DYNPROG"),
                                       ("dynprog_streamed", "s--", "DYNPROG streamed"),
                                       ("vdnn", "^-", "VDNN")):
                y = [r.get(name) for r in c["rows"]]
                if any(v is not None for v in y):
                    ax.plot(x, y, style, ms=3, label=label)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_title(f"{c['name']} (L={c['L']})", fontsize=9)
            ax.set_xlabel("memory (0% = least, 100% = M_peak)")
            ax.set_ylabel("makespan / lower bound")
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=8)
        fig.tight_layout()
        save_png(fig, "offloading", args.out)


if __name__ == "__main__":
    main()
