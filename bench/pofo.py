"""Seed 001 Figures 2-3 in simulation: throughput of pofo, rotor, offload-only (DYNPROG),
autocapper and opportunist on the model zoo.

* Figure 2: bandwidth 12 GB/s, memory ratio alpha in [0, 1]: the limit is
  (1 - alpha) M^low + alpha M^high, M^low the least memory rotor can use (recompute everything
  from the input), M^high the store-all peak (seed 001 section 5.2).
* Figure 3: alpha = 0.2, bandwidth from 12 to 36 GB/s (and a slow 4 GB/s link).

Throughput = batch / simulated makespan, relative to the sequential time (sum of all
forward and backward times, infinite memory) as in the paper; a planner that finds no
sequence under the limit shows no point. Also measured: pofo's solve time at slots = 50 on
the longest chain (DenseNet-201, L = 107; seed 001 reports up to 4 minutes; issue 14's goal
<= 10 s), its full DP's share of it (``dp_s``) with the DP's forward and backward state
counts (``dp_states_fwd`` / ``dp_states_bwd``, memo sizes: the same on every machine), and
the solve time at half the automatic ``delta_step``.

``--random``: pofo's simulated time against its DP value on random integer chains (60
seeds, L = 2..8, bandwidth 0.5 and 2, three limits from the least feasible up, exact units):
``dp_value`` is the whole-activation DP's (ours, issue 14; ``dp_model`` says which), and the
paper's continuous-transfer value is reported beside it (``paper_dp_value``), with the
exhaustive class optimum (every persistent sequence x offload subset, simulated;
tests/_oracle.py) where L <= 4: the class optimum / paper DP value is the part of the
paper's gap no whole-activation plan of its class can close. Results in ``pofo_random.json``.

    python bench/pofo.py [--quick] [--random] [--out DIR]

Writes bench/results/pofo.json, pofo_fig2.png and pofo_fig3.png (``--random``: pofo_random.json
only).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Dict, Optional, Sequence

from common import (parse_args, print_table, pyplot, run_meta, save_png, say_nothing_written,
                    write_json)

from scheduler import Chain, InfeasibleError, InvalidPlanError, simulate
from scheduler.planners import offload, pofo, rotor

GB = 1e9
CHAIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chains")
CHAINS = ["resnet50-i500-b16", "resnet101-i500-b16", "densenet121-i500-b16", "gpt2-s1024-b8"]
QUICK = ["resnet50-i500-b16"]
ALPHAS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0]
BANDWIDTHS = [4, 12, 16, 24, 36]
SLOTS = 50
TIMING_CHAIN = "densenet201-i500-b16"


def _chain(name: str) -> Optional[Chain]:
    path = os.path.join(CHAIN_DIR, f"{name}.json")
    return Chain.from_json(path) if os.path.exists(path) else None


def limits(chain: Chain):
    high = pofo.max_memory(chain)
    low = rotor.min_memory(chain, SLOTS, high / 20)
    return low, high


def run_point(chain: Chain, M: float, bw: float) -> Dict[str, Optional[float]]:
    """Relative throughput (sequential time / makespan) of each planner, or None."""
    seq = chain.total_compute()
    out: Dict[str, Optional[float]] = {}
    planners = {
        "pofo": lambda: pofo.solve(chain, M, bw, slots=SLOTS),
        "rotor": lambda: rotor.solve(chain, M, slots=500),
        "offload-only": lambda: offload.dynprog(chain, M, bw, slots=500),
        "greedy": lambda: offload.greedy(chain, M, bw),
        "autocapper": lambda: pofo.autocapper(chain, M, bw, slots=SLOTS),
        "opportunist": lambda: pofo.opportunist(chain, M, bw, slots=SLOTS),
    }
    for name, f in planners.items():
        t0 = time.perf_counter()
        try:
            p = f()
        except (InfeasibleError, InvalidPlanError):
            out[name] = None
            continue
        out[name + "_s"] = time.perf_counter() - t0
        assert p.memory_limit == M, (name, p.memory_limit, M)
        r = simulate(chain, p, bw if p.count("offload") else None)   # the plan's own limit
        assert r.peak_memory <= M * (1 + 1e-9), (name, r.peak_memory, M)
        out[name] = seq / r.makespan
        if name == "pofo":
            out["pofo_sim_over_dp"] = _ratio(r.makespan, p.meta["dp_value"])
            out["pofo_sim_over_paper_dp"] = _ratio(r.makespan, p.meta["paper_dp_value"])
            out["pofo_dp_model"] = p.meta["dp_model"]
            out["pofo_variant"] = p.meta["variant"]
    others = [out[k] for k in planners if k != "pofo" and out.get(k)]
    if out.get("pofo") and others:   # throughputs: >= 1 means pofo is at least as fast
        out["pofo_over_best_other"] = out["pofo"] / max(others)
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, or None where either is unknown (pofo's DP values are None when not finite)."""
    return None if a is None or b is None or b == 0 else a / b


RANDOM_SEEDS = 60
ORACLE_MAX_L = 4


def random_sweep(quick: bool) -> Dict:
    """See the module docstring (``--random``)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(CHAIN_DIR)), "tests"))
    from _oracle import pofo_class_optimum
    rows = []
    t_all = time.perf_counter()
    for seed in range(12 if quick else RANDOM_SEEDS):
        L = 2 + seed % 7
        c = Chain.random(L, seed=seed)
        lo, hi = pofo.min_memory(c), pofo.max_memory(c)
        for bw in (0.5, 2.0):
            for M in sorted({lo, (3 * lo + hi) // 4, (lo + hi) // 2}):
                t0 = time.perf_counter()
                try:
                    p = pofo.solve(c, M, bw, slots=None)
                except InfeasibleError:
                    continue
                solve_s = time.perf_counter() - t0
                r = simulate(c, p, bw)
                assert r.makespan == p.predicted_time and r.peak_memory <= M
                dpv, pdv = p.meta["dp_value"], p.meta["paper_dp_value"]
                row = dict(seed=seed, L=L, bandwidth=bw, memory=M, dp_value=dpv,
                           dp_model=p.meta["dp_model"], paper_dp_value=pdv,
                           pofo=r.makespan, paper=p.meta["paper_time"],
                           variant=p.meta["variant"], solve_s=solve_s,
                           sim_over_dp=_ratio(r.makespan, dpv), dp_over_sim=_ratio(dpv, r.makespan),
                           sim_over_paper_dp=_ratio(r.makespan, pdv),
                           paper_over_dp=_ratio(p.meta["paper_time"], pdv))
                if L <= ORACLE_MAX_L:
                    best = pofo_class_optimum(c, M, bw)
                    row["class_optimum"] = best
                    if best is not None:
                        row["class_over_dp"] = _ratio(best, pdv)   # the paper's DP value
                        row["class_over_whole_dp"] = _ratio(best, dpv)
                        row["pofo_over_class"] = r.makespan / best
                rows.append(row)
    # (a DP value that is not finite, None, has no ratio: such a case is in "cases" only)
    ratios = [x for x in (r["sim_over_dp"] for r in rows) if x is not None]
    orc = [r for r in rows if r.get("class_over_dp")]
    paper_ratios = [x for x in (r["sim_over_paper_dp"] for r in rows) if x is not None]
    tight = [x for x in (r["dp_over_sim"] for r in rows) if x is not None]
    paper_over = [x for x in (r["paper_over_dp"] for r in rows) if x is not None]
    summary = {
        "cases": len(rows), "goal_sim_over_dp": 1.02,
        "sim_over_dp_max": max(ratios), "sim_over_dp_mean": sum(ratios) / len(ratios),
        "over_goal": sum(x > 1.02 + 1e-12 for x in ratios),
        "whole_dp_cases": sum(r["dp_model"] == "whole" for r in rows),
        # how far the (achievable) DP value lies above the plan: 1 = the plan is the DP's
        "dp_over_sim_max": max(tight), "dp_over_sim_mean": sum(tight) / len(tight),
        "sim_equals_dp": sum(abs(x - 1) <= 1e-9 for x in tight),
        "sim_over_paper_dp_max": max(paper_ratios),
        "sim_over_paper_dp_mean": sum(paper_ratios) / len(paper_ratios),
        "sim_over_paper_dp_over_goal": sum(x > 1.02 + 1e-12 for x in paper_ratios),
        "paper_over_dp_max": max(paper_over), "unknown_dp_cases": len(rows) - len(ratios),
        "paper_over_goal": sum(x > 1.02 + 1e-12 for x in paper_over),
        "oracle_cases": len(orc),
        "class_over_dp_max": max((r["class_over_dp"] for r in orc), default=None),
        "class_over_goal": sum(r["class_over_dp"] > 1.02 + 1e-12 for r in orc),
        "pofo_over_class_max": max((r["pofo_over_class"] for r in orc), default=None),
        "pofo_slower_than_class": sum(r["pofo_over_class"] > 1 + 1e-12 for r in orc),
        "solve_s_max": max(r["solve_s"] for r in rows),
        "total_s": time.perf_counter() - t_all}
    worst = sorted(rows, key=lambda r: -(r["sim_over_dp"] or 0))[:8]
    print_table(worst, ["seed", "L", "bandwidth", "memory", "dp_value", "paper_dp_value", "pofo",
                        "paper", "class_optimum", "sim_over_dp", "variant"],
                title="random chains: the worst pofo simulated time / DP value")
    print_table([summary], title="random chains summary")
    return {"seeds": 12 if quick else RANDOM_SEEDS, "oracle_max_L": ORACLE_MAX_L,
            "summary": summary, "rows": rows}


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv, extra=lambda p: p.add_argument(
        "--random", action="store_true",
        help="random integer chains with the exhaustive class optimum (pofo_random.json)"))
    # the tags every results file carries (machine, torch, date; simulated on the CPU)
    meta = run_meta("python bench/pofo.py" + (" --random" if args.random else "")
                    + (" --quick" if args.quick else ""), "cpu")
    if args.random:
        sweep = random_sweep(args.quick)
        if args.out is None:
            say_nothing_written()
        else:
            write_json("pofo_random", {"meta": meta, **sweep}, args.out)
        return
    names = QUICK if args.quick else CHAINS
    alphas = [0.1, 0.2, 0.5, 1.0] if args.quick else ALPHAS
    bws = [12, 36] if args.quick else BANDWIDTHS
    fig2, fig3 = [], []
    for n in names:
        chain = _chain(n)
        if chain is None:
            print(f"(chain {n} not bundled: skipped)")
            continue
        low, high = limits(chain)
        for a in alphas:
            M = (1 - a) * low + a * high
            fig2.append(dict(chain=n, L=chain.L, alpha=a, memory_gib=M / 2 ** 30,
                             **run_point(chain, M, 12 * GB)))
        M = 0.8 * low + 0.2 * high
        for bw in bws:
            fig3.append(dict(chain=n, L=chain.L, bandwidth_gbs=bw, memory_gib=M / 2 ** 30,
                             **run_point(chain, M, bw * GB)))
    cols = ["chain", "pofo", "rotor", "offload-only", "greedy", "autocapper", "opportunist",
            "pofo_s", "pofo_sim_over_dp"]
    print_table(fig2, cols[:1] + ["alpha"] + cols[1:],
                title="Figure 2: throughput / sequential throughput, 12 GB/s")
    print_table(fig3, cols[:1] + ["bandwidth_gbs"] + cols[1:],
                title="Figure 3: throughput / sequential throughput, alpha = 0.2")

    # pofo <= rotor and <= offload-only everywhere (simulated), and its mean gain
    def cmp(rows, other):
        pts = [(r["pofo"], r[other]) for r in rows if r.get("pofo") and r.get(other)]
        return {"points": len(pts), "pofo_ge": sum(p >= o - 1e-9 for p, o in pts),
                "mean_gain_pct": 100 * sum(p / o - 1 for p, o in pts) / max(1, len(pts))}
    summary = {f"vs_{o}": cmp(fig2 + fig3, o) for o in ("rotor", "offload-only", "greedy",
                                                         "autocapper", "opportunist")}
    rows = [r for r in fig2 + fig3 if r.get("pofo_sim_over_dp")]
    goals = {"pofo_sim_over_dp_max": max(r["pofo_sim_over_dp"] for r in rows),
             "goal_sim_over_dp": 1.02,
             "pofo_slower_than_best_other": sum(r.get("pofo_over_best_other", 1) < 1 - 1e-9
                                                for r in rows),
             "pofo_over_best_other_min": min(r.get("pofo_over_best_other", 1) for r in rows),
             "points": len(rows)}
    print_table([goals], title="issue 14 goals (pofo simulated time / its DP value; pofo "
                                "throughput / the best other planner's)")
    timing = None
    big = _chain(TIMING_CHAIN) if not args.quick else None
    if big is not None:
        low, high = limits(big)
        M = 0.8 * low + 0.2 * high
        t0 = time.perf_counter()
        p = pofo.solve(big, M, 12 * GB, slots=SLOTS)
        timing = {"chain": TIMING_CHAIN, "L": big.L, "slots": SLOTS,
                  "delta_step": p.meta["delta_step"], "solve_s": time.perf_counter() - t0}
        # the full DP alone (most of solve_s), with its state counts: noise-free work
        t0 = time.perf_counter()
        got = pofo.dp(big, M, 12 * GB, SLOTS, delta_step=p.meta["delta_step"])
        timing.update(dp_s=time.perf_counter() - t0, dp_states_fwd=got[3]["states_fwd"],
                      dp_states_bwd=got[3]["states_bwd"])
        t0 = time.perf_counter()
        pofo.solve(big, M, 12 * GB, slots=SLOTS, delta_step=max(1, p.meta["delta_step"] // 2))
        timing["solve_s_half_step"] = time.perf_counter() - t0
        print_table([timing], title="pofo solve time")
    print_table([dict(against=k, **v) for k, v in summary.items()], title="pofo vs others")
    if args.out is None:
        say_nothing_written()
        return
    write_json("pofo", {"meta": meta, "slots": SLOTS, "figure2": fig2, "figure3": fig3,
                        "summary": summary, "goals": goals, "timing": timing}, args.out)

    plt = pyplot()
    if plt is None:
        return
    for fig_name, rows, xkey, xlabel in (("pofo_fig2", fig2, "alpha", "memory ratio alpha"),
                                         ("pofo_fig3", fig3, "bandwidth_gbs", "bandwidth (GB/s)")):
        chains = sorted({r["chain"] for r in rows}, key=names.index)
        fig, axes = plt.subplots(1, len(chains), figsize=(4.2 * len(chains), 3.3), squeeze=False)
        for ax, n in zip(axes.flat, chains):
            pts = [r for r in rows if r["chain"] == n]
            for name, style in (("pofo", "o-"), ("rotor", "s--"), ("offload-only", "^-"),
                                ("greedy", "<-."),
                                ("autocapper", "v:"), ("opportunist", "x:")):
                xs = [r[xkey] for r in pts if r.get(name)]
                ys = [r[name] for r in pts if r.get(name)]
                if xs:
                    ax.plot(xs, ys, style, ms=4, label=name)
            ax.set_title(n, fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("throughput / sequential")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        save_png(fig, fig_name, args.out)


if __name__ == "__main__":
    main()
