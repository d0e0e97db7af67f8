"""README Results sections about the planners, all simulated or timed on the CPU: solve time
(planners_time.json), checkpointing (checkpointing.json), offloading (offloading.json), pofo
(pofo.json, pofo_random.json) and input-aware rotor planning a new shape (new_shape_plan.json).

Each renderer takes the shared `Ctx` and a results file's data and returns the section's
markdown lines; goals go to `ctx.goal`. Assembled by bench/readme_results.py.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

from bench.readme_format import Ctx, g, num, pct, reproduce, table


def planners_time(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    gl = d.get("goals", {})
    out = ["Measured on the CPU: rotor's (and revolve's) solve time, "
           + (d.get("note") or "CPU seconds") + "; the worst of "
           + f"{len(d.get('fractions', []))} memory limits per chain.", ""]
    rows = [r for r in d["rows"] if r["slots"] == 500]
    out += table(["chain", "L", "planner", "slots", "max s", "mean s"],
                 [(r["chain"], r["L"], r["planner"], r["slots"], num(r["max_s"]), num(r["mean_s"]))
                  for r in sorted(rows, key=lambda r: (r["planner"] != "rotor", r["L"], r["chain"]))],
                 right=(1, 3, 4, 5))
    other = sorted({r["slots"] for r in d["rows"]} - {500})
    if other:
        out += ["", "Other slot counts (random chains, max s): " + "; ".join(
            f"L={r['L']} slots={r['slots']}: {num(r['max_s'])}"
            for r in sorted(d["rows"], key=lambda r: (r["L"], r["slots"]))
            if r["slots"] != 500 and r["L"] in (100, 339)) + "."]
    if gl.get("L339_slots500_max_s") is not None:
        ctx.goal("planners_time", f"rotor, L ~ 339 at slots=500 in <= {g(gl['goal_L339_s'])} s",
                 f"{num(gl['L339_slots500_max_s'])} s", gl["L339_slots500_max_s"] <= gl["goal_L339_s"])
    if gl.get("L100_slots500_max_s") is not None:
        ctx.goal("planners_time", f"rotor, L <= 100 at slots=500 in <= {g(gl['goal_L100_s'])} s",
                 f"{num(gl['L100_slots500_max_s'])} s", gl["L100_slots500_max_s"] <= gl["goal_L100_s"])
    out += ["", reproduce("python bench/planners_time.py" + (" --quick" if d.get("quick") else ""))]
    return out


def checkpointing(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    refine = "refined" if d.get("refine") is True else f"refine {d.get('refine')}"
    out = [f"Simulated (scheduler.simulate, not measured): {d.get('source', 'bench/chains')}; "
           f"slots {d.get('slots')}, {refine}. Rotor's throughput at the peak "
           "memory of the fastest periodic (checkpoint_sequential-style) point.", ""]
    out += table(["chain", "L", "PyTorch GiB", "best periodic", "at GiB", "periodic img/s",
                  "rotor img/s", "rotor gain"],
                 [(r["chain"], r["L"], num(r["pytorch_GiB"]), f"{r['best_periodic_k']} segments",
                   num(r["at_GiB"]), num(r["periodic_img_s"]), num(r["rotor_img_s"]), pct(r["gain_%"]))
                  for r in d["summary"]], right=(1, 2, 4, 5, 6, 7))
    mean = d["mean_gain_over_best_periodic_pct"]
    out += ["", f"Mean gain of rotor over the best periodic at equal memory: {pct(mean)} "
            f"(over every periodic point: {pct(d.get('mean_gain_all_periodic_pct'))}); "
            "seed 002 reports +17.2% measured on a V100."]
    ctx.goal("checkpointing", "rotor beats the best periodic at equal memory (paper: +17.2% mean)",
             f"{pct(mean)} mean, simulated", mean > 0)
    out += [""] + ctx.figures([f"checkpointing_{f}.png" for f in sorted(d.get("figures", {}))])
    cmd = "python bench/checkpointing.py" + (" --quick" if d.get("quick") else "")
    if d.get("slots", 500) != 500:
        cmd += f" --slots {d['slots']}"
    if d.get("refine") is False:
        cmd += " --no-refine"
    out += ["", reproduce(cmd)]
    return out


def _finite(xs: Sequence[Optional[float]]) -> List[float]:
    return [x for x in xs if x is not None and not math.isnan(x)]


def offloading(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    bw = d.get("bandwidth")
    points = max((len(c["rows"]) for c in d["chains"]), default=0)
    out = ["Simulated (scheduler.simulate on each planner's plan, not measured): makespan / "
           f"lower bound (Proposition 3) at {points} memory limits from the least to the store-all "
           f"peak, bandwidth {num(bw / 1e9) if bw else '-'} GB/s, slots {d.get('slots')}.", ""]
    rows = []
    for c in d["chains"]:
        rs = c["rows"]
        dyn = _finite([r.get("dynprog") for r in rs])
        streamed = _finite([r.get("dynprog_streamed") for r in rs])
        rel = [r.get("dynprog_relaxed") for r in rs]
        paper = _finite([r.get("dynprog_paper") for r in rs])
        rows.append((c["name"], c["L"], num(max(dyn)), num(sum(dyn) / len(dyn)),
                     num(max(paper)) if paper else "-",
                     num(max(streamed)) if streamed else "-",
                     num(max(_finite([r.get("greedy") for r in rs]), default=None)),
                     num(max(_finite([r.get("vdnn") for r in rs]), default=None)),
                     num(max(_finite(rel), default=None)),
                     sum(1 for x in rel if x is None or math.isnan(x)),
                     num(max(_finite([r.get("fluid_bound") for r in rs]), default=None))))
    out += table(["chain", "L", "DYNPROG worst", "DYNPROG mean", "paper's DYNPROG worst",
                  "DYNPROG streamed worst", "GREEDY worst", "VDNN worst",
                  "DYNPROG relaxed worst", "relaxed fallbacks", "fluid bound worst"],
                 rows, right=tuple(range(1, 11)))
    s = d.get("summary", {})
    if s:
        out += ["", f"All chains: DYNPROG worst {num(s['dynprog_max_ratio'])}, mean "
                f"{num(s['dynprog_mean_ratio'])} (seed 000: below 1.3 everywhere; aim 1.1); "
                f"longest DYNPROG solve {num(s.get('dynprog_max_solve_s'))} s. 'Relaxed' is "
                "Algorithm 1's own value before the whole-activation conversion."]
        if "dynprog_paper_max_ratio" in s:
            out += ["", "DYNPROG includes our own step on top of seed 000 (GREEDY's decisions "
                    "as a candidate, on short chains a simulator-scored climb over the offload "
                    "decisions and prefetch order, then a search over transfer placement); "
                    f"the paper's plan alone: worst {num(s['dynprog_paper_max_ratio'])}, mean "
                    f"{num(s['dynprog_paper_mean_ratio'])}. DYNPROG slower than GREEDY at "
                    f"{s.get('dynprog_slower_than_greedy')} of {sum(len(c['rows']) for c in d['chains'])} points."]
        if s.get("fluid_max_ratio") is not None:
            out += ["", "'Fluid bound' (bench/offload_fluid.py): a lower bound on every "
                    "offload-only plan, tighter than Proposition 3 (transfers as a fluid, "
                    "the simulator's memory constraints at every op); makespan >= fluid x "
                    f"Proposition 3. Points where it is above 1.3 (no plan can meet the 1.3 "
                    f"goal there): {s.get('fluid_above_1_3')}; worst "
                    f"{s['fluid_max_ratio']:.3f}. "
                    f"DYNPROG / fluid bound: worst {num(s.get('dynprog_max_over_fluid'))}."]
        if "dynprog_streamed_max_ratio" in s:
            out += ["", "'DYNPROG streamed': the same planner with streamed transfers "
                    f"(`transfer_chunk={s['stream_chunk'] >> 20} MiB`, our own extension): an "
                    "offload frees its activation chunk by chunk as the copy proceeds and a "
                    "prefetch reserves it chunk by chunk, which is Algorithm 1's own "
                    "relaxation. Worst "
                    f"{num(s['dynprog_streamed_max_ratio'])}, mean "
                    f"{num(s['dynprog_streamed_mean_ratio'])}, longest solve "
                    f"{num(s['dynprog_streamed_max_solve_s'])} s; at least "
                    f"{num(s.get('dynprog_streamed_min_over_fluid'))} x the fluid bound. The "
                    "chain runtime moves whole tensors and refuses such plans: running them "
                    "needs page-level release of an activation (vmalloc's mappings), not built "
                    "yet. The whole-activation column is what runs today."]
            ctx.goal("offloading", "DYNPROG with streamed transfers <= 1.3 x lower bound "
                     "everywhere, mean <= 1.1",
                     f"worst {num(s['dynprog_streamed_max_ratio'])}, mean "
                     f"{num(s['dynprog_streamed_mean_ratio'])}",
                     s["dynprog_streamed_max_ratio"] <= 1.3
                     and s["dynprog_streamed_mean_ratio"] <= 1.1)
        ctx.goal("offloading", "DYNPROG (whole-activation transfers) <= 1.3 x lower bound "
                 "everywhere, mean <= 1.1",
                 f"worst {num(s['dynprog_max_ratio'])}, mean {num(s['dynprog_mean_ratio'])}",
                 s["dynprog_max_ratio"] <= 1.3 and s["dynprog_mean_ratio"] <= 1.1)
    out += [""] + ctx.figures(["offloading.png"])
    out += ["", reproduce("python bench/offloading.py" + (" --quick" if points and points < 11 else ""))]
    return out


def pofo(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    out = ["Simulated (scheduler.simulate, not measured): throughput relative to the sequential "
           "time, Figure 2 (12 GB/s, memory ratio alpha 0..1) and Figure 3 (alpha 0.2, 4..36 GB/s) "
           f"together; pofo at slots {d.get('slots')}.", ""]
    summ = d["summary"]
    out += table(["pofo against", "points", "pofo >= other", "mean pofo gain"],
                 [(k[3:], v["points"], v["pofo_ge"], pct(v["mean_gain_pct"]))
                  for k, v in sorted(summ.items())], right=(1, 2, 3))
    if "vs_rotor" in summ:
        v = summ["vs_rotor"]
        ctx.goal("pofo", "pofo >= rotor at every point (offloading can only help)",
                 f"{v['pofo_ge']}/{v['points']} points, mean {pct(v['mean_gain_pct'])}",
                 v["pofo_ge"] == v["points"])
    rows = d.get("figure2", []) + d.get("figure3", [])
    losses = {}
    for r in rows:
        for other in ("autocapper", "opportunist", "rotor", "offload-only", "greedy"):
            if r.get("pofo") and r.get(other) and r["pofo"] < r[other] - 1e-9:
                losses.setdefault(other, []).append(r["chain"])
    if losses:
        out += ["", "Points where another planner beats pofo: " + "; ".join(
            f"{o}: {len(c)} ({', '.join(f'{n} x{c.count(n)}' for n in sorted(set(c)))})"
            for o, c in sorted(losses.items())) + "."]
    goals = d.get("goals")
    if goals:
        out += ["", f"pofo's simulated time / its DP value: worst "
                f"{num(goals['pofo_sim_over_dp_max'])} over {goals['points']} points (goal <= "
                f"{goals['goal_sim_over_dp']}); pofo slower than the best of the other planners "
                f"at {goals['pofo_slower_than_best_other']} points (worst throughput ratio "
                f"{num(goals['pofo_over_best_other_min'])})."]
        ctx.goal("pofo", "simulated time <= 1.02 x DP value; never slower than the best other",
                 f"worst {num(goals['pofo_sim_over_dp_max'])}; slower at "
                 f"{goals['pofo_slower_than_best_other']}/{goals['points']}",
                 goals["pofo_sim_over_dp_max"] <= goals["goal_sim_over_dp"]
                 and goals["pofo_slower_than_best_other"] == 0)
    t = d.get("timing")
    if t:
        dp = (f" (the dynamic program {num(t['dp_s'])} s, {t['dp_states_fwd']:,} forward and "
              f"{t['dp_states_bwd']:,} backward states)") if "dp_s" in t else ""
        out += ["", f"pofo solve time on {t['chain']} (L={t['L']}, slots {t['slots']}): "
                f"{num(t['solve_s'])} s{dp}, {num(t.get('solve_s_half_step'))} s at half the "
                "Delta step (seed 001 reports up to 4 minutes); measured on the CPU."]
        ctx.goal("pofo", f"solve time, L={t['L']} at {t['slots']} slots <= 10 s (CPU)",
                 f"{num(t['solve_s'])} s", t["solve_s"] <= 10)
    out += [""] + ctx.figures(["pofo_fig2.png", "pofo_fig3.png"])
    out += ["", reproduce("python bench/pofo.py" + (" --quick" if not t else ""))]
    return out


def pofo_random(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    s = d["summary"]
    out = ["Simulated: pofo (slots=None, exact units) on random integer chains "
           f"({d['seeds']} seeds, L = 2..8, bandwidth 0.5 and 2, three limits), against its "
           "DP value: the whole-activation DP's (ours, the simulator's transfer model; "
           f"{s.get('whole_dp_cases', 0)} of {s['cases']} cases) and seed 001's continuous-"
           f"transfer DP's; for L <= {d['oracle_max_L']} also the exhaustive class optimum (the "
           "fastest simulated plan over every persistent sequence x offload subset, "
           "tests/_oracle.py).", ""]
    rows = [("pofo / its DP value (default)", s["cases"], num(s["sim_over_dp_max"]),
             num(s["sim_over_dp_mean"]), s["over_goal"])]
    if "sim_over_paper_dp_max" in s:
        rows.append(("pofo / the paper's DP value", s["cases"], num(s["sim_over_paper_dp_max"]),
                     num(s["sim_over_paper_dp_mean"]), s["sim_over_paper_dp_over_goal"]))
    rows += [("paper's plan / the paper's DP value", s["cases"], num(s["paper_over_dp_max"]),
              "", s["paper_over_goal"]),
             ("class optimum / the paper's DP value", s["oracle_cases"],
              num(s["class_over_dp_max"]), "", s["class_over_goal"])]
    out += table(["", "cases", "worst", "mean", "cases > 1.02"], rows, right=(1, 2, 3, 4))
    if "dp_over_sim_mean" in s:
        out += ["", f"The whole-activation DP's value is one a plan reaches: pofo's plan equals "
                f"it in {s['sim_equals_dp']} of {s['cases']} cases and is faster in the others "
                f"(DP value / pofo: mean {num(s['dp_over_sim_mean'])}, worst "
                f"{num(s['dp_over_sim_max'])}; the heuristics and the placement search find "
                "plans outside the DP's class)."]
    out += ["", f"Where the oracle runs, pofo is slower than the class optimum in "
            f"{s['pofo_slower_than_class']} of {s['oracle_cases']} cases (worst "
            f"{num(s['pofo_over_class_max'])}x); the class optimum itself exceeds 1.02x the "
            f"paper's DP value in {s['class_over_goal']}: that value promises a time no "
            "whole-activation plan of the class reaches."]
    ctx.goal("pofo (random chains)", "simulated time <= 1.02 x DP value",
             f"worst {num(s['sim_over_dp_max'])}, {s['over_goal']}/{s['cases']} above "
             f"(against the paper's DP value: worst "
             f"{num(s.get('sim_over_paper_dp_max', s['class_over_dp_max']))})",
             s["sim_over_dp_max"] <= s["goal_sim_over_dp"])
    out += ["", reproduce("python bench/pofo.py --random" + (" --quick" if d["seeds"] < 60 else ""))]
    return out


def new_shape_plan(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    meta = d.get("meta", {})
    goal_ms = d.get("goal_ms", 1.0)
    out = ["Measured on the CPU (2-core shared machine; wall-clock ms, the median over new "
           "input sizes of the best of a few runs): a new shape planned by input-aware rotor "
           "after the collection phase, on synthetic chains whose fields grow quadratically with "
           "the input size (the estimator fitted on 10 sizes), budget at half the "
           "store-everything peak. `runner`: the chain runner's whole path for a new shape "
           "(`plan_for`: cache key, the predicted chain, rotor at 500 slots, the compiled plan), "
           "what a training step waits for before it runs.", ""]
    rows = d["rows"]
    out += table(["L", "sizes", "predict", "rotor 500 slots", "rotor 100", "rotor 50",
                  "runner (all)", "step time at 100 / 500 slots", "at 50 / 500"],
                 [(r["L"], r["n_sizes"], num(r["predict_ms"]), num(r["rotor_ms_slots500"]),
                   num(r["rotor_ms_slots100"]), num(r["rotor_ms_slots50"]), num(r["runner_ms"]),
                   f"{num(r['time_vs_500_max_slots100'])} worst", f"{num(r['time_vs_500_max_slots50'])} worst")
                  for r in rows], right=(0, 1, 2, 3, 4, 5, 6))
    out += ["", "Fewer slots would plan faster but lose step time (the predicted time of the "
            "plan against 500 slots, worst over the sizes), so 500 stays the default."]
    worst = max(r["runner_ms"] for r in rows if r["L"] <= 48)
    ctx.goal("new_shape_plan", f"input-aware rotor plans a new shape in < {g(goal_ms)} ms "
             "(L <= 48, the runner's whole path, 500 slots)", f"{num(worst)} ms", worst < goal_ms)
    out += ["", reproduce(meta.get("command", "python bench/new_shape_plan.py"))]
    return out
