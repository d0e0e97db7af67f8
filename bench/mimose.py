"""Mimose (seed 004) on a BERT-style model with sequence lengths drawn from a realistic
distribution, under several activation budgets: Mimose vs a static plan made for the largest
input (Sublinear-style: one plan for every batch) vs rotor on input-aware chains (issue 13
item 4: ``InputAwareChain`` profiles the first 10 sizes, then predicts each new shape's chain
and rotor plans it) vs no checkpointing.

Reported per budget: training time, block forwards recomputed, the peak of activation bytes
held per step (CPU accounting of what autograd keeps, the chain runner's ``track_memory``)
against the budget, and whether losses stay bit-identical to plain training. Also: Mimose's
planning latency per new input size (Algorithm 1 alone, and with the simulator check that
makes the plan's peak fit the budget), the collection overhead, and the estimator's error
on input sizes it never saw; for input-aware rotor, the time to plan a new shape (chain
prediction + rotor solve) on this model and on a synthetic 48-block chain.

    python bench/mimose.py [--quick] [--device cpu|cuda] [--threads N] [--out FILE.json]

Writes bench/results/mimose.json and bench/results/mimose.png (``--quick``: nothing unless
``--out``).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from typing import Any, Dict, List

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as `python bench/mimose.py` from a checkout (as bench/common.py)
    import checkout
    checkout.on_path()

import scheduler  # noqa: E402
from bench.common import (output_dir, positive_int, run_meta, say_nothing_written,  # noqa: E402
                          torch_device)
from bench.models import bert  # noqa: E402
from scheduler.planners import mimose as M  # noqa: E402
from scheduler.planners import rotor as R  # noqa: E402
from scheduler.runtime.input_aware import InputAwareChain  # noqa: E402

METHODS = ("static", "mimose", "rotor-ia")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def seq_lengths(n: int, seed: int, lo: int = 30, hi: int = 332) -> List[int]:
    """GLUE-QQP-like lengths (seed 004 Figure 3: 30..332 tokens, most batches short, a long
    tail): a log-normal around 70 tokens, clipped to [lo, hi]."""
    rng = np.random.default_rng(seed)
    out = np.clip(np.round(rng.lognormal(mean=np.log(70), sigma=0.55, size=n)), lo, hi)
    return [int(v) for v in out]


def batch_of(model, seq: int, batch: int, seed: int, device: str) -> torch.Tensor:
    return model.sample_input(shape=(batch, seq), seed=seed, device=device)


def step(wrapped, ids: torch.Tensor, seed: int, device: str) -> Dict[str, Any]:
    for p in wrapped.parameters():
        p.grad = None
    torch.manual_seed(seed)
    if device == "cuda":
        torch.cuda.synchronize()
    src = getattr(wrapped, "chain_source", None)
    measured = getattr(src, "measurements", 0)
    t0 = time.perf_counter()
    logits = wrapped(ids)
    loss = torch.nn.functional.cross_entropy(logits, torch.zeros(ids.shape[0], dtype=torch.long,
                                                                  device=ids.device))
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    st = wrapped.stats()
    return {"seq": ids.shape[1], "time": dt, "loss": loss.item(),
            "loss_bits": loss.detach().cpu().view(torch.int32).item() if loss.dtype == torch.float32
            else None,
            "peak": st.get("last_peak_bytes", 0),
            "recomputed": st.get("last_recomputed_forwards", 0),
            "planner": wrapped.last_plan.planner if wrapped.last_plan is not None else "",
            "profiled": getattr(src, "measurements", 0) > measured}


def run_interleaved(methods: Dict[str, Any], lens: List[int], batch: int, device: str, zoo
                    ) -> Dict[str, List[Dict[str, Any]]]:
    """Every method runs step i before any runs step i+1, so the machine's load (shared CPU)
    weighs on all of them alike. ``methods``: name -> wrapped model. Times of Mimose's
    collection steps include the memory accounting (they cannot be repeated: a second run of
    a size already measured is planned, not shuttled)."""
    rows: Dict[str, List[Dict[str, Any]]] = {k: [] for k in methods}
    for i, s in enumerate(lens):
        ids = batch_of(zoo, s, batch, i, device)
        for name, wrapped in methods.items():
            # first run: memory accounting on (peak held, recomputations, loss bits)
            r = step(wrapped, ids, i, device)
            if r["planner"] != "mimose-collect":
                # the same step again, accounting off, for its time (a size seen before: the
                # plan comes from the cache, so the work is exactly the first run's)
                wrapped.track_memory = False
                r["time_tracked"] = r["time"]
                r["time"] = step(wrapped, ids, i, device)["time"]
                wrapped.track_memory = True
            rows[name].append(r)
    return rows


def paired_median(rows: List[Dict[str, Any]], plain_rows: List[Dict[str, Any]],
                  steps: List[int]) -> float:
    """Median over ``steps`` of (this method's step time / plain's on the same step, run right
    before it): robust to the load of a shared machine, unlike sums of times."""
    return statistics.median(rows[k]["time"] / plain_rows[k]["time"] for k in steps)


def planning_latency(m: M.Mimose, sizes: List[float], budget: float, verify: bool) -> Dict[str, float]:
    """Seconds per new input size: estimate + Algorithm 1 + Plan (+ simulator check)."""
    m.verify = verify
    m.cache.clear()
    times = []
    for s in sizes:
        t0 = time.perf_counter()
        try:
            m.plan(s, budget)
        except scheduler.InfeasibleError:
            pass
        times.append(time.perf_counter() - t0)
    m.verify = True
    m.cache.clear()
    return {"mean_ms": 1e3 * statistics.mean(times), "median_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * float(np.percentile(times, 90)), "n": len(times)}


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and budgets (CI smoke)")
    ap.add_argument("--device", type=torch_device("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda (default cuda when there is one)")
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="results JSON; the PNG goes beside it (default bench/results/mimose.json; "
                    "--quick: none)")
    ap.add_argument("--threads", type=positive_int, default=1, metavar="N",
                    help="torch intra-op threads on CPU (default 1: steadier timings)")
    args = ap.parse_args(argv)
    out = output_dir(args.quick, args.out, os.path.join(RESULTS, "mimose.json"))
    device = args.device
    if device == "cpu":
        torch.set_num_threads(args.threads)
    quick = args.quick
    n_layer, hidden, heads, inter = (4, 64, 4, 256) if quick else (6, 128, 4, 512)
    batch = 4
    steps = 24 if quick else 200
    fracs = [0.4, 0.7] if quick else [0.3, 0.4, 0.55, 0.7]
    zoo = bert(batch=batch, seq_len=128, n_layer=n_layer, hidden=hidden, heads=heads,
               intermediate=inter, vocab=2000, dropout=0.1)
    torch.manual_seed(0)
    blocks = [b.to(device) for b in zoo.blocks]
    L = len(blocks)
    lens = seq_lengths(steps, seed=1)
    lo, hi = 30, max(lens)   # the static plan is made for the largest input of the run
    print(f"BERT-style: {n_layer} layers, hidden {hidden}, batch {batch}; {steps} steps, "
          f"seq len {min(lens)}..{max(lens)} (median {int(np.median(lens))}), device {device}")

    # the truth about memory: measure every block at the largest input and a few held-out sizes
    probe = scheduler.wrap(copy.deepcopy(blocks), None, planner="mimose", samples=1000)
    held_out = sorted({37, 61, 95, (lo + hi) // 2, hi})
    for i, s in enumerate(held_out):
        step(probe, batch_of(zoo, s, batch, 1000 + i, device), i, device)
    truth = {s: probe.mimose.estimator.measured(batch * s) for s in held_out}
    chain_max = M.chain_from_estimate(truth[hi])
    full = scheduler.simulate(chain_max, M.plan_from_checkpoints(L, [])).peak_memory
    floor = scheduler.simulate(chain_max, M.plan_from_checkpoints(L, range(L))).peak_memory
    # rotor plans on the profiled chain (transients and gradients counted): its least budget
    # at the largest input can sit above the estimate's every-block-checkpointed floor
    measured_hi = scheduler.profile.measure_chain(
        copy.deepcopy(blocks), batch_of(zoo, hi, batch, 0, device), loss="cross_entropy",
        input_grad=False, repeat=1)
    rotor_floor = R.min_memory(measured_hi, slots=500, memory=full)
    budgets = [max(int(full * f), int(floor), int(rotor_floor * 1.02)) for f in fracs]
    print(f"activation peak at seq {hi}: {full / 2**20:.2f} MiB without checkpointing, "
          f"{floor / 2**20:.2f} MiB with every block checkpointed")

    command = "python bench/mimose.py" + (" --quick" if quick else "")
    results: Dict[str, Any] = {
        # run_meta's tags (GPU name, date, ...), then this bench's own (device as given)
        "meta": {**run_meta(command, torch.device(device).type), "bench": "mimose",
                 "device": device, "torch": torch.__version__,
                 "machine": platform.machine(), "quick": quick, "model": {
                     "name": "bert", "n_layer": n_layer, "hidden": hidden, "heads": heads,
                     "intermediate": inter, "batch": batch},
                 "steps": steps, "seq_lens": lens, "seq_range": [lo, hi],
                 "full_peak_at_max": full, "floor_peak_at_max": floor,
                 "rotor_min_budget_at_max": rotor_floor,
                 "budget_fractions_of_full_peak": fracs, "command": command},
        "runs": [], "planning": {}, "estimator": {}}

    methods: Dict[str, Any] = {"none": scheduler.wrap(copy.deepcopy(blocks), None, planner="none",
                                                      track_memory=True)}
    for budget in budgets:
        # static: the plan Mimose makes for the largest input, used for every batch
        static_planner = M.Mimose(L, samples=3)
        m_hi = truth[hi]
        static_planner.observe(batch * hi, m_hi.input_bytes, m_hi.xbar, m_hi.out, m_hi.fw)
        static_plan = static_planner.plan(batch * hi, budget)
        static_plan.planner = "static"
        methods[f"static@{budget}"] = scheduler.wrap(copy.deepcopy(blocks), budget,
                                                     planner=static_plan, track_memory=True)
        methods[f"mimose@{budget}"] = scheduler.wrap(copy.deepcopy(blocks), budget,
                                                     planner="mimose", track_memory=True)
        ia_blocks = copy.deepcopy(blocks)
        methods[f"rotor-ia@{budget}"] = scheduler.wrap(
            ia_blocks, budget, planner="rotor", track_memory=True,
            chain=InputAwareChain(ia_blocks, samples=M.DEFAULT_SAMPLES, loss="cross_entropy",
                                  measure_options={"repeat": 3}))
    all_rows = run_interleaved(methods, lens, batch, device, zoo)
    plain_rows = all_rows["none"]
    plain_bits = [r["loss_bits"] for r in plain_rows]
    t_plain = sum(r["time"] for r in plain_rows)
    results["runs"].append({"method": "none", "budget": None, "rows": plain_rows,
                            "time": t_plain})
    table = []
    mimose_model = None
    for budget in budgets:
        # the steps after Mimose's collection phase (the same steps for every method)
        responsive = [k for k, r in enumerate(all_rows[f"mimose@{budget}"])
                      if r["planner"] != "mimose-collect"]
        for name in METHODS:
            wrapped, rows = methods[f"{name}@{budget}"], all_rows[f"{name}@{budget}"]
            if name == "mimose":
                mimose_model = wrapped
                st = wrapped.stats()
                coll = [r for r in rows if r["planner"] == "mimose-collect"]
            elif name == "rotor-ia":
                st = wrapped.stats()
                coll = [r for r in rows if r.get("profiled")]
            else:
                st, coll = {}, []
            resp = [rows[k] for k in responsive]
            over = sum(1 for r in rows if r["peak"] > budget)
            identical = [r["loss_bits"] for r in rows] == plain_bits
            t = sum(r["time"] for r in rows)
            t_resp_plain = sum(plain_rows[k]["time"] for k in responsive)
            rec = sum(r["recomputed"] for r in rows)
            results["runs"].append({
                "method": name, "budget": budget, "rows": rows, "time": t,
                "time_vs_none": t / t_plain, "recomputed_forwards": rec,
                "max_peak": max(r["peak"] for r in rows), "steps_over_budget": over,
                "losses_identical_to_plain": identical,
                "responsive_time": sum(r["time"] for r in resp),
                "responsive_time_vs_none": sum(r["time"] for r in resp) / t_resp_plain,
                "responsive_paired_median_vs_none": paired_median(rows, plain_rows, responsive),
                "responsive_recomputed_forwards": sum(r["recomputed"] for r in resp),
                "collection_steps": len(coll), "collection_time": sum(r["time"] for r in coll),
                **({"chain_source": wrapped.chain_source.stats()} if name == "rotor-ia" else {}),
                "plan_cache": {k: st.get(k) for k in ("hits", "misses", "planning_seconds")}})
            table.append((budget, name, t, t / t_plain,
                          paired_median(rows, plain_rows, responsive),
                          sum(r["recomputed"] for r in resp),
                          max(r["peak"] for r in rows), over, identical))
        plain_over = sum(1 for r in plain_rows if r["peak"] > budget)
        table.append((budget, "none", t_plain, 1.0, 1.0, 0, max(r["peak"] for r in plain_rows),
                      plain_over, True))

    # estimator error on sizes it never saw (fitted on the 10 collection sizes)
    est = mimose_model.mimose.estimator
    errs = {}
    for s in held_out:
        if est.has(batch * s):
            continue
        t = truth[s]
        pred = est.predict(batch * s)
        errs[s] = {"total": est.relative_error(batch * s, t.xbar),
                   "max_block": float(max(abs(p - a) / a for p, a in zip(pred, t.xbar) if a))}
    results["estimator"] = {"samples": len(est.sizes), "order": est.order, "held_out": errs,
                            "max_total_error": max(e["total"] for e in errs.values()),
                            "max_block_error": max(e["max_block"] for e in errs.values())}

    # planning latency per new size, on sizes never planned before
    new_sizes = [batch * s + 0.5 for s in range(lo, hi)]
    mid = budgets[len(budgets) // 2]
    results["planning"] = {
        "algorithm1_only": planning_latency(mimose_model.mimose, new_sizes, mid, verify=False),
        "with_simulator_check": planning_latency(mimose_model.mimose, new_sizes, mid, verify=True),
        "estimator_predict_us": 1e6 * min(
            timeit_once(lambda: est.predict(batch * 100.5)) for _ in range(50)),
        "paper_ms": 0.3, "goal_ms": 0.1}
    ia = methods[f"rotor-ia@{mid}"].chain_source
    results["input_aware"] = {
        "this_model": input_aware_latency(ia.estimator, new_sizes[::7], mid),
        "synthetic_L48": synthetic_latency(48, quick),
        "goal_ms": 1.0, "goal_step_vs_mimose": 1.10}
    ia_runs = {r["budget"]: r for r in results["runs"] if r["method"] == "rotor-ia"}
    mi_runs = {r["budget"]: r for r in results["runs"] if r["method"] == "mimose"}
    results["input_aware"]["step_vs_mimose"] = {
        str(b): ia_runs[b]["responsive_paired_median_vs_none"]
        / mi_runs[b]["responsive_paired_median_vs_none"] for b in ia_runs}

    if out is not None:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)

    print(f"\n{'budget MiB':>10} {'method':>8} {'time s':>8} {'vs none':>8} {'step/none':>9} "
          f"{'recomp':>7} {'max peak MiB':>13} {'over':>5} {'identical':>9}")
    for b, name, t, rel, rel_resp, rec, peak, over, ident in table:
        print(f"{b / 2**20:10.2f} {name:>8} {t:8.2f} {rel:8.2f} {rel_resp:9.2f} {rec:7d} "
              f"{peak / 2**20:13.2f} {over:5d} {str(ident):>9}")
    print("(time: all steps, collection included; step/none: median over the steps after "
          "Mimose's collection of the step time over plain training's on the same step; "
          "recomp: block forwards recomputed in those steps; over: steps whose held "
          "activations exceeded the budget)")
    p = results["planning"]
    e = results["estimator"]
    print(f"\nplanning latency per new size: Algorithm 1 {p['algorithm1_only']['median_ms']:.3f} ms "
          f"(median), with simulator check {p['with_simulator_check']['median_ms']:.3f} ms; "
          f"estimator predict {p['estimator_predict_us']:.1f} us (goal 0.1 ms, paper 0.3 ms)")
    print(f"estimator error after {e['samples']} samples: total {100 * e['max_total_error']:.3f}%, "
          f"worst block {100 * e['max_block_error']:.3f}% (goal 0.5%)")
    ia = results["input_aware"]
    for where in ("this_model", "synthetic_L48"):
        r = ia[where]
        print(f"input-aware rotor, new shape (L={r['L']}): predict {r['predict_ms']:.3f} ms + "
              f"rotor {r['rotor_ms_slots500']:.3f} ms (500 slots) / {r['rotor_ms_slots100']:.3f} "
              f"ms (100) / {r['rotor_ms_slots50']:.3f} ms (50); goal 1 ms")
    print("input-aware rotor step time / Mimose's, per budget: " + ", ".join(
        f"{int(b) / 2**20:.1f} MiB: {v:.3f}" for b, v in ia["step_vs_mimose"].items())
        + " (goal <= 1.10)")
    if out is None:
        say_nothing_written("--out FILE")
        return
    plot(results, out.replace(".json", ".png"))
    print(f"wrote {out}")


def input_aware_latency(est: M.ChainEstimator, sizes: List[float], budget: float,
                        slots_list=(500, 100, 50)) -> Dict[str, Any]:
    """Milliseconds to plan a new shape with input-aware rotor: the chain prediction, and the
    rotor solve on it at several slot counts (median over ``sizes``)."""
    pred_t, chains = [], []
    for s in sizes:
        t0 = time.perf_counter()
        chains.append(est.predict(s))
        pred_t.append(time.perf_counter() - t0)
    out: Dict[str, Any] = {"L": est.L, "n": len(sizes),
                           "predict_ms": 1e3 * statistics.median(pred_t)}
    for slots in slots_list:
        ts = []
        for c in chains:
            t0 = time.perf_counter()
            try:
                R.solve(c, budget, slots=slots)
            except scheduler.InfeasibleError:
                pass
            ts.append(time.perf_counter() - t0)
        out[f"rotor_ms_slots{slots}"] = 1e3 * statistics.median(ts)
        out[f"total_ms_slots{slots}"] = out["predict_ms"] + out[f"rotor_ms_slots{slots}"]
    return out


def synthetic_latency(L: int, quick: bool) -> Dict[str, Any]:
    """The same on a 48-block chain whose fields grow quadratically with the input size (the
    goal's L <= 48; bench/new_shape_plan.py's family, which also times the runner's whole
    path): an estimator fitted on 10 sizes, new sizes planned at half the full peak."""
    from new_shape_plan import fitted_estimator, synthetic_family  # bench/ is sys.path[0]
    family = synthetic_family(L)
    est = fitted_estimator(L, family)
    sizes = [float(n) + 0.5 for n in range(120, 980, 40 if quick else 9)]
    full = scheduler.simulate(family(1000.0), M.plan_from_checkpoints(L, [])).peak_memory
    return input_aware_latency(est, sizes, full * 0.5)


def timeit_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def plot(results: Dict[str, Any], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = results["runs"]
    budgets = sorted({r["budget"] for r in runs if r["budget"] is not None})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    b = budgets[0]
    for r in runs:
        if r["budget"] not in (None, b):
            continue
        xs = [row["seq"] for row in r["rows"]]
        ys = [row["peak"] / 2**20 for row in r["rows"]]
        axes[0].scatter(xs, ys, s=12, label=r["method"])
    axes[0].axhline(b / 2**20, color="k", ls="--", lw=1, label="budget")
    axes[0].set(xlabel="sequence length", ylabel="activation bytes held, peak (MiB)",
                title=f"per step, budget {b / 2**20:.2f} MiB (cf. seed 004 Fig. 14)")
    axes[0].legend()
    width = 0.35
    width = 0.8 / len(METHODS)
    for k, name in enumerate(METHODS):
        vals = [next(r["responsive_paired_median_vs_none"] for r in runs
                     if r["method"] == name and r["budget"] == bb) for bb in budgets]
        axes[1].bar(np.arange(len(budgets)) + (k - (len(METHODS) - 1) / 2) * width, vals, width,
                    label=name)
    axes[1].axhline(1.0, color="k", ls="--", lw=1, label="no checkpointing")
    axes[1].set_xticks(range(len(budgets)), [f"{bb / 2**20:.2f}" for bb in budgets])
    axes[1].set(xlabel="budget (MiB)", ylabel="step time / no checkpointing (median)",
                title="after Mimose's collection phase")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
