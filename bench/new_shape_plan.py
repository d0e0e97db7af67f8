"""How long a new input shape takes to plan with input-aware rotor (issue 13 item 4).

After the collection phase, ``InputAwareChain`` predicts a new shape's chain from the learnt
``ChainEstimator`` and the runner plans it with rotor. Goal: a new shape plans in < 1 ms for
L <= 48. Measured per stage, on a synthetic chain family whose every field grows
quadratically with the input size (an estimator fitted on 10 sizes, as after collection):

* ``predict``: ``ChainEstimator.predict`` (the chain for a size never measured);
* ``rotor``: ``rotor.solve`` on the prediction, at several slot counts;
* ``runner``: what the runner does for a new shape before running it, end to end
  (``CheckpointedChain.plan_for``: the signature and cache key, the chain source's
  prediction, the chain check, ``make_plan``, the compiled plan, the plan cache).

Wall-clock milliseconds, the median over sizes never planned before, each the best of a few
runs (the machine is shared); budgets at half the store-everything peak. Also the plan
quality at fewer slots (predicted step time against 500 slots), to judge a smaller default.

    python bench/new_shape_plan.py [--quick]

Writes bench/results/new_shape_plan.json.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List

import numpy as np

from common import parse_args, print_table, run_meta, say_nothing_written, write_json

import torch
from torch import nn

import scheduler
from scheduler.planners import mimose as M
from scheduler.planners import rotor as R
from scheduler.runtime.planning import make_plan
from scheduler.runtime.input_aware import InputAwareChain

GOAL_MS = 1.0
SLOTS = (500, 200, 100, 50)
FIT_SIZES = [float(n) for n in np.linspace(100, 1000, 10)]


def synthetic_family(L: int, seed: int = 0) -> Callable[[float], scheduler.Chain]:
    """Chains of L blocks whose fields grow as a n^2 + b n + c in the input size n (integer
    sizes, xbar[s] >= x[s+1]): what the estimator's order-2 fits learn exactly."""
    rng = np.random.default_rng(seed)
    coef = rng.uniform(0.5, 2.0, size=(len(scheduler.chain.FIELDS), L + 1, 3))

    def chain(n: float) -> scheduler.Chain:
        v = coef[..., 0] * n * n + coef[..., 1] * n * 100 + coef[..., 2] * 1e4
        f = {k: v[i].tolist() for i, k in enumerate(scheduler.chain.FIELDS)}
        for k in scheduler.chain.FIELDS[2:]:
            f[k] = [int(x) for x in f[k]]
        f["xbar"] = [f["xbar"][s] + (f["x"][s + 1] if s < L else 0) for s in range(L + 1)]
        return scheduler.Chain(**f)
    return chain


def fitted_estimator(L: int, family: Callable[[float], scheduler.Chain]) -> M.ChainEstimator:
    est = M.ChainEstimator(L, samples=len(FIT_SIZES))
    for n in FIT_SIZES:
        est.observe(n, family(n))
    return est


def best_ms(fn: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def runner_ms(L: int, est: M.ChainEstimator, budget: int, sizes: List[int], repeat: int
              ) -> List[float]:
    """Per new size: the runner's whole planning of a new shape (plan_for on an input of that
    many elements, with the fitted estimator as the chain source), the best of ``repeat``
    fresh runners (a runner plans each shape once, then caches it)."""
    blocks = [nn.Identity() for _ in range(L)]
    runners = [scheduler.wrap(blocks, budget, planner="rotor",
                              chain=InputAwareChain(blocks, estimator=est)) for _ in range(repeat)]
    xs = {n: torch.zeros(n) for n in sizes}
    warm = torch.zeros(int(FIT_SIZES[0]))  # a measured size: planned, not predicted
    for r in runners:
        r.plan_for(warm)  # first-call costs (imports, the extension) are not a new shape's
    out = []
    for n in sizes:
        ts = []
        for r in runners:
            t0 = time.perf_counter()
            r.plan_for(xs[n])
            ts.append(time.perf_counter() - t0)
        out.append(1e3 * min(ts))
    return out


def measure(L: int, quick: bool) -> Dict[str, Any]:
    family = synthetic_family(L)
    est = fitted_estimator(L, family)
    full = scheduler.simulate(family(max(FIT_SIZES)), M.plan_from_checkpoints(L, [])).peak_memory
    budget = int(full * 0.5)
    step = 97 if quick else 23
    sizes = [n for n in range(int(FIT_SIZES[0]) + 7, int(FIT_SIZES[-1]), step)
             if float(n) not in FIT_SIZES]
    repeat = 3
    chains = {n: est.predict(float(n)) for n in sizes}
    row: Dict[str, Any] = {"L": L, "n_sizes": len(sizes), "budget": budget,
                           "predict_ms": statistics.median(
                               best_ms(lambda n=n: est.predict(float(n)), repeat) for n in sizes)}
    ref = {n: R.solve(chains[n], budget, slots=500).predicted_time for n in sizes}
    for slots in SLOTS:
        row[f"rotor_ms_slots{slots}"] = statistics.median(
            best_ms(lambda n=n: R.solve(chains[n], budget, slots=slots), repeat) for n in sizes)
        # plan quality: predicted step time against 500 slots (worst and mean over sizes)
        ratio = [R.solve(chains[n], budget, slots=slots).predicted_time / ref[n] for n in sizes]
        row[f"time_vs_500_max_slots{slots}"] = max(ratio)
        row[f"time_vs_500_mean_slots{slots}"] = statistics.mean(ratio)
    row["make_plan_ms"] = statistics.median(
        best_ms(lambda n=n: make_plan(chains[n], budget, "rotor"), repeat) for n in sizes)
    row["runner_ms"] = statistics.median(runner_ms(L, est, budget, sizes, repeat))
    row["total_ms"] = row["runner_ms"]   # the runner's path includes the prediction
    return row


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(__doc__.split("\n")[0], argv)
    torch.set_num_threads(1)
    rows = [measure(L, args.quick) for L in (12, 24, 48)]
    print_table(rows, ["L", "n_sizes", "predict_ms", "rotor_ms_slots500", "rotor_ms_slots100",
                       "rotor_ms_slots50", "make_plan_ms", "runner_ms",
                       "time_vs_500_max_slots100", "time_vs_500_max_slots50"],
                title="new-shape planning latency (ms, median over new sizes)")
    worst = max(r["total_ms"] for r in rows)
    command = "python bench/new_shape_plan.py" + (" --quick" if args.quick else "")
    # run_meta's tags (machine, torch, date; timed on the CPU), then this bench's own
    data = {"meta": {**run_meta(command, "cpu"), "bench": "new_shape_plan", "quick": args.quick,
                     "budget_fraction": 0.5, "fit_sizes": FIT_SIZES, "slots": 500, "repeat": 3,
                     "command": command},
            "rows": rows, "goal_ms": GOAL_MS, "worst_total_ms": worst}
    print(f"worst L: {worst:.3f} ms per new shape (goal < {GOAL_MS} ms)", end="")
    if args.out is None:
        print()
        say_nothing_written()
    else:
        print(f"; wrote {write_json('new_shape_plan', data, args.out)}")
    return data


if __name__ == "__main__":
    main()
