"""Write README.md's "Results" block from the benchmark JSON files in bench/results/.

    python bench/readme_results.py            # rewrite the block between the markers
    python bench/readme_results.py --check    # exit 1 (naming the stale parts) if it is out of date

Every number in the block comes from a results file; nothing is typed by hand. One subsection
per benchmark: what was measured where (CPU, GPU, or simulated), a compact table of the numbers
the issues set goals for, the figure beside the JSON when there is one, and the command that
reproduces it. A missing results file gives a one-line note. The output depends only on the
files (fixed float formats, sorted keys), so running it again without new results changes
nothing. Only the standard library: it runs in CI before anything is built.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
SELF = "python bench/readme_results.py"

Goal = Tuple[str, str, str, str]   # (benchmark, goal, measured, met: yes | **no** | n/a)


# ------------------------------------------------------------------------------ formatting
def num(x: Optional[float], digits: int = 3) -> str:
    """A float with `digits` significant digits, no exponent for everyday magnitudes."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x == 0:
        return "0"
    mag = math.floor(math.log10(abs(x)))
    if -4 <= mag < 7:
        return f"{x:.{max(0, digits - 1 - mag)}f}"
    return f"{x:.{digits - 1}e}"


def rate(x: Optional[float]) -> str:
    """Events per second: 46.1 M, 134.8 k."""
    if x is None:
        return "-"
    for div, unit in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.1f}"


def size(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for div, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def pct(x: Optional[float], sign: bool = True) -> str:
    """A percentage already in percent units."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:+.1f}%" if sign else f"{x:.1f}%"


def g(x: float) -> str:
    """A goal threshold as written in the issue: 2, 0.1, 1.05."""
    return f"{x:g}"


def met(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("yes" if ok else "**no**")


def table(head: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> List[str]:
    """A markdown table; columns listed in `right` are right-aligned (numbers)."""
    align = ["---:" if i in right else "---" for i in range(len(head))]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


# ------------------------------------------------------------------------------ context
class Ctx:
    """Where the results are and how a README beside `readme_dir` links to them."""

    def __init__(self, results: str, readme_dir: str) -> None:
        self.results = results
        self.readme_dir = readme_dir
        self.goals: List[Goal] = []

    def path(self, name: str) -> str:
        return os.path.join(self.results, name)

    def load(self, name: str) -> Optional[Dict[str, Any]]:
        p = self.path(name)
        if not os.path.exists(p):
            return None
        with open(p) as f:
            return json.load(f)

    def link(self, name: str) -> Optional[str]:
        """A markdown link to results file `name` if it exists."""
        p = self.path(name)
        if not os.path.exists(p):
            return None
        return f"[{name}]({self.rel(name)})"

    def figures(self, names: Sequence[str]) -> List[str]:
        links = [lk for lk in (self.link(n) for n in names) if lk]
        return [f"Figure: {', '.join(links)}."] if links else []

    def rel(self, name: str = "") -> str:
        """`name` in the results folder, relative to the README (forward slashes)."""
        p = os.path.join(self.results, name) if name else self.results
        return os.path.relpath(p, self.readme_dir).replace(os.sep, "/")

    def source(self, name: str) -> str:
        return f"`{self.rel(name)}`"

    def goal(self, bench: str, what: str, measured: str, ok: Optional[bool]) -> None:
        self.goals.append((bench, what, measured, met(ok)))


def reproduce(command: str) -> str:
    return f"Reproduce: `{command.strip()}`"


def meta_line(meta: Dict[str, Any], keys: Sequence[Tuple[str, str]]) -> str:
    parts = [f"{label} {meta[k]}" for k, label in keys if meta.get(k) not in (None, "")]
    return ("Recorded: " + ", ".join(parts) + ".") if parts else ""


# ------------------------------------------------------------------------------ sections
def alloc_micro(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    meta, host, cuda = d.get("meta", {}), d["host"], d.get("cuda") or {}
    goal = 5e6
    out = ["Measured on the CPU: vmalloc's host backend (memfd page mappings), 2 MiB chunks; "
           "malloc+free pairs per second timed in a C++ loop and from Python.",
           meta_line(meta, (("machine", "machine"), ("cpus", "CPUs"), ("python", "Python"),
                            ("note", "note"))), ""]
    fast = [(k, v) for k, v in sorted(host.items()) if k.startswith("fast")]
    out += table(["fast path (host)", "bytes", "C++ pairs/s", "ns/pair", "Python pairs/s",
                  "goal C++ >= 5 M/s"],
                 [(k, size(v["nbytes"]), rate(v["cpp_pairs_per_s"]), num(v["cpp_ns_per_pair"]),
                   rate(v["python_pairs_per_s"]), met(v["cpp_pairs_per_s"] >= goal)) for k, v in fast],
                 right=(1, 2, 3, 4))
    if fast:
        worst = min(v["cpp_pairs_per_s"] for _, v in fast)
        ctx.goal("alloc_micro", "fast path >= 5 M malloc+free pairs/s (C++, host backend)",
                 f"{rate(worst)} pairs/s (slowest case)", worst >= goal)
    remap = host.get("remap") or []
    if remap:
        out += ["", "Remap path (every malloc unmaps and maps chunks): "
                + "; ".join(f"k={r['k']}: {num(r['us_per_chunk_remapped'])} us per chunk remapped "
                            f"({rate(r['pairs_per_s'])} pairs/s)" for r in remap) + "."]
    fresh = host.get("fresh") or []
    if fresh:
        out += ["Fresh path (create + map + unmap + release a chunk): "
                + "; ".join(f"k={r['k']}: {num(r['us_per_chunk_create_map_unmap_release'])} us per chunk"
                            for r in fresh) + "."]
    out.append("")
    if "skipped" in cuda:
        out.append(f"GPU part skipped: {cuda['skipped']} (no GPU lent).")
    elif "error" in cuda:
        out.append(f"GPU part failed: {cuda['error']}.")
    elif cuda:
        rows = []
        for k, v in sorted(cuda.items()):
            if isinstance(v, dict) and "cpp_pairs_per_s" in v:
                rows.append((k, rate(v["cpp_pairs_per_s"]), rate(v.get("python_pairs_per_s"))))
            elif isinstance(v, dict) and "pairs_per_s" in v:
                rows.append((k, rate(v["pairs_per_s"]), "-"))
            elif isinstance(v, dict) and "error" in v:
                rows.append((k, "error", "-"))
        out.append(f"GPU part, measured on {cuda.get('device', 'the GPU')}:")
        out.append("")
        out += table(["cuda", "pairs/s (C++ or direct)", "Python pairs/s"], rows, right=(1, 2))
        if cuda.get("errors"):
            out += ["", "Failed measurements (the others ran): " + "; ".join(
                f"{k}: {v}" for k, v in sorted(cuda["errors"].items())) + "."]
    out += ["", reproduce(meta.get("command", "python bench/alloc_micro.py"))]
    return out


def cache_slack(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    meta, cost, dec, rule = d.get("meta", {}), d["remap_cost"], d["decision"], d["rule"]
    traces = d["traces"]
    out = [f"Replayed on the host (vmalloc's host-lazy backend, {size(d.get('chunk_size'))} chunks): "
           f"traces {d['traces_used']} ({', '.join(t['trace'] for t in traces)}); remap cost "
           f"{num(cost['us_per_chunk_remapped'])} us per chunk from alloc_micro.json's "
           f"{cost['source']} rows ({cost['measured_on']}).",
           meta_line(meta, (("gpu", "device"), ("torch", "torch"), ("date", "date"))), "",
           f"**Verdict:** {d['verdict']}", "",
           f"Per candidate, the worst over the traces: physical / requested peak (target "
           f"{g(rule['ratio_target'])} + {g(rule['ratio_tolerance'])}, or the trace's slack-0 "
           f"floor + {g(rule['ratio_tolerance'])}) and the remap time of the worst step after "
           f"the first, in percent of a step (threshold {g(rule['remap_threshold_percent'])}%).", ""]
    rows = []
    for lab in d["candidates"]:
        per = [(t, next(r for r in t["rows"] if r["label"] == lab)) for t in traces]
        ratio = max(per, key=lambda tr: tr[1]["ratio"] or 0.0)
        pcts = [(r["steady_percent_max"], t["trace"]) for t, r in per]
        known = [x for x in pcts if x[0] is not None]
        worst = max(known) if known and len(known) == len(pcts) else None
        mem = all(r["complete"] and r["ratio"] is not None and r["ratio"] <= t["ratio_limit"] + 1e-12
                  for t, r in per)
        rows.append((lab, f"{num(ratio[1]['ratio'], 4)} ({ratio[0]['trace']})"
                     + ("" if ratio[1]["complete"] else " (lower bound: stopped)"),
                     f"{pct(worst[0], sign=False)} ({worst[1]})" if worst else "-",
                     met(mem), met(worst[0] <= rule["remap_threshold_percent"]) if worst else "n/a"))
    out += table(["cache_slack", "worst physical / requested peak", "worst remap share of a step",
                  "memory target", "remaps under threshold"], rows)
    out += ["", "Step times: " + "; ".join(
        f"{t['trace']} {num(t['step_seconds'])} s" if t["step_seconds"] else f"{t['trace']} unknown"
        for t in traces) + " (" + "; ".join(sorted({t["step_time_source"] for t in traces})) + ")."]
    if d.get("left_out"):
        out += [f"Left out for time: {', '.join(d['left_out'])}."]
    ctx.goal("cache_slack", "default keeps physical/requested near 1.05 if remaps cost < "
             f"{g(rule['remap_threshold_percent'])}% of a step, else say why not",
             (f"{dec['label']}" if dec.get("found") else "no default from this data")
             + (" (provisional)" if dec["provisional"] else ""),
             None if dec["provisional"] else dec["meets_target"])
    out += ["", reproduce(meta.get("command", "python bench/cache_slack.py"))]
    return out


def fragmentation(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    goal = float(d.get("goal_budget_ratio", 1.05))
    traces = sorted(d["traces"], key=lambda t: t["trace"])
    allocators = sorted({r["allocator"] for t in traces for r in t["rows"]})
    real = sorted(t["trace"] for t in traces if t.get("meta", {}).get("real_gpu_trace"))
    kind = ("derived from simulated swap schedules (scheduler.simulate), not recorded on a GPU"
            if not real else "recorded on a GPU: " + ", ".join(real) + "; the others simulated")
    out = [f"Replayed on the CPU: allocation traces {kind}; vmalloc on its host backend (host-lazy: no RAM taken), "
           "PyTorch as the caching-allocator model (vmalloc/replay/caching_model.py).",
           meta_line(d, (("machine", "machine"),)), "",
           f"Cell: smallest physical budget that replays the trace / peak requested bytes "
           f"(goal for vmalloc <= {g(goal)}), then fragmentation 1 - requested/physical "
           "without a cap (GMLake's metric).", ""]
    rows = []
    for t in traces:
        by = {r["allocator"]: r for r in t["rows"]}
        cells = []
        for a in allocators:
            r = by.get(a)
            if r is None:
                cells.append("-")
            elif r.get("budget_ratio") is None:
                cells.append("did not replay")
            else:
                cells.append(f"{r['budget_ratio']:.3f} / {100 * r['fragmentation']:.0f}%")
        rows.append([t["trace"], str(t.get("events", "-"))] + cells)
    summ = d.get("summary", {})
    if summ:
        rows.append(["**mean**", ""] + [
            f"{summ[a]['mean_budget_ratio']:.3f} / {100 * summ[a]['mean_fragmentation_uncapped']:.0f}%"
            if a in summ else "-" for a in allocators])
    out += table(["trace", "events"] + allocators, rows, right=tuple(range(1, 2 + len(allocators))))
    for a in allocators:
        if not a.startswith("vmalloc"):
            continue
        ratios = [r["budget_ratio"] for t in traces for r in t["rows"] if r["allocator"] == a]
        ok = all(x is not None and x <= goal for x in ratios)
        worst = max((x for x in ratios if x is not None), default=None)
        ctx.goal("fragmentation", f"{a}: smallest budget <= {g(goal)} x peak requested, every trace",
                 f"worst {num(worst, 4)}", ok)
    out += [""] + ctx.figures(["fragmentation.png"])
    out += ["", reproduce("python bench/fragmentation.py" + (" --quick" if d.get("quick") else ""))]
    return out


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


def swap(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    meta = d.get("meta", {})
    out = ["Measured on the CPU: the swap runtime's hook overhead with a window large enough that "
           "nothing is swapped (median of paired step-time differences), then real swapping into "
           "the host pool under budgets.",
           meta_line(meta, (("torch", "torch"), ("cpu_threads", "threads"), ("time", "time"))), ""]
    over = d["cpu_overhead"]
    out += table(["model", "plain ms", "swap ms", "overhead", "hooks/step", "goal <= 5%"],
                 [(r["model"], num(1e3 * r["plain_step_s"]), num(1e3 * r["swap_step_s"]),
                   pct(r["overhead_pct"]), r["hooks_per_step"], met(r["overhead_pct"] <= 5.0))
                  for r in over], right=(1, 2, 3, 4))
    if over:
        worst = max(over, key=lambda r: r["overhead_pct"])
        ctx.goal("swap", "hook overhead <= 5% of step time when nothing swaps (CPU)",
                 f"worst {pct(worst['overhead_pct'])} ({worst['model']})", worst["overhead_pct"] <= 5.0)
    if d.get("us_per_hook_call") is not None:
        out += ["", f"Runtime cost per hook call: {num(d['us_per_hook_call'])} us."]
    sw = d.get("cpu_swapping") or []
    if sw:
        out += ["", "Real swapping on the CPU (budget = fraction of plain training's saved bytes):", ""]
        out += table(["model", "budget", "peak resident / plain", "swapped out / step", "slowdown"],
                     [(r["model"], f"{r['budget_fraction']:.2f}",
                       f"{r['peak_resident_bytes'] / r['plain_peak_bytes']:.2f}",
                       size(r["swapped_out_bytes_per_step"]), pct(r["slowdown_pct"])) for r in sw],
                     right=(1, 2, 3, 4))
    gpu = d.get("gpu") or {}
    out.append("")
    what = "window+vmalloc beats save_on_cpu at every batch that fits and reaches a larger batch"
    if "skipped" in gpu:
        out.append(f"GPU comparison (ResNet-50, GPT-2 vs save_on_cpu, torchtune, LMS) skipped: "
                   f"{gpu['skipped']} (no GPU lent).")
        ctx.goal("swap (GPU)", what, f"not run: {gpu['skipped']}", None)
    elif gpu.get("rows"):
        gmeta = gpu.get("meta") or {}
        left = (f" Incomplete: {gpu.get('not_run') or 'some'} configurations not run yet "
                "(`bench/swap.py --gpu-only` goes on)." if gpu.get("incomplete") else "")
        out.append(f"GPU comparison on {gmeta.get('gpu') or meta.get('cuda') or 'the GPU'}"
                   + (f" (driver {gmeta['driver']}, torch {gmeta.get('torch')}, "
                      f"{gmeta.get('date')})" if gmeta.get("driver") else "")
                   + f", budget {size(gpu.get('budget'))}, window {size(gpu.get('window'))}: "
                   f"throughput (x = out of memory).{left}")
        out += [""] + _grid(gpu["rows"], "batch", lambda r: num(r["throughput"]))
        ctx.goal("swap (GPU)", what, *_swap_gpu_goal(gpu["rows"]))
        out += [""] + ctx.figures(["swap.png"])
    out += ["", reproduce(meta.get("command", "python bench/swap.py"))]
    if gpu.get("meta", {}).get("command"):
        out += ["", reproduce(gpu["meta"]["command"])]
    return out


def _swap_gpu_goal(rows: Sequence[Dict[str, Any]]) -> Tuple[str, bool]:
    """Issue 6's GPU goal per model: window+vmalloc faster than save_on_cpu wherever both ran,
    and its largest batch larger than every other method's."""
    ok, parts = True, []
    for model in sorted({r["model"] for r in rows}):
        done = [r for r in rows if r["model"] == model and r.get("status") == "ok"]
        tp = {(r["method"], r["batch"]): r["throughput"] for r in done}
        both = [b for (m, b) in tp if m == "window+vmalloc" and ("save_on_cpu", b) in tp]
        wins = sum(tp[("window+vmalloc", b)] > tp[("save_on_cpu", b)] for b in both)
        top = {m: max(r["batch"] for r in done if r["method"] == m) for m in {r["method"] for r in done}}
        mine = top.pop("window+vmalloc", None)
        peer = max(top.values(), default=None)
        larger = mine is not None and (peer is None or mine > peer)
        ok &= wins == len(both) and larger
        parts.append(f"{model}: faster at {wins}/{len(both)} batches, largest batch "
                     f"{mine if mine is not None else '-'} vs peers' {peer if peer is not None else '-'}")
    return "; ".join(parts), ok


def _grid(rows: Sequence[Dict[str, Any]], bkey: str, cell: Callable[[Dict[str, Any]], str]) -> List[str]:
    """Per model: methods down, batch sizes across; ok cells via `cell`, others their status."""
    out: List[str] = []
    for model in sorted({r["model"] for r in rows}):
        mrows = [r for r in rows if r["model"] == model]
        batches = sorted({r[bkey] for r in mrows if r.get(bkey) is not None})
        methods = list(dict.fromkeys(r["method"] for r in mrows))
        body = []
        for m in methods:
            cells = []
            for b in batches:
                r = next((r for r in mrows if r["method"] == m and r.get(bkey) == b), None)
                if r is None:
                    na = next((r for r in mrows if r["method"] == m and r.get("status") == "n/a"), None)
                    cells.append("n/a" if na else "")
                elif r.get("status") == "ok":
                    cells.append(cell(r))
                else:
                    cells.append({"oom": "x"}.get(r.get("status"), r.get("status", "?")))
            body.append([m] + cells)
        unit = next((r.get("unit") for r in mrows if r.get("unit")), "")
        out += [f"**{model}**" + (f" ({unit})" if unit else ""), ""]
        out += table(["method"] + [str(b) for b in batches], body, right=tuple(range(1, len(batches) + 1)))
        out.append("")
    return out[:-1]


def mimose(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    meta = d.get("meta", {})
    dev = meta.get("device", "cpu")
    model = meta.get("model", {})
    where = "the CPU" if dev == "cpu" else f"the GPU ({dev})"
    out = [f"Measured on {where}: a BERT-style model ({model.get('n_layer')} layers, hidden "
           f"{model.get('hidden')}, batch {model.get('batch')}) over {meta.get('steps')} steps with "
           f"sequence lengths in {meta.get('seq_range')}; peaks are "
           + ("activation bytes held (CPU accounting)" if dev == "cpu" else "measured on the device")
           + ". Step time relative to no checkpointing: median over the steps after Mimose's "
           "collection phase.",
           meta_line(meta, (("torch", "torch"),)), ""]
    runs = [r for r in d["runs"] if r.get("budget") is not None]
    out += table(["budget", "method", "step time / none", "total time / none", "recomputed forwards",
                  "max peak", "steps over budget", "losses bit-identical"],
                 [(size(r["budget"]), r["method"], num(r["responsive_paired_median_vs_none"]),
                   num(r["time_vs_none"]), r["recomputed_forwards"], size(r["max_peak"]),
                   r["steps_over_budget"], "yes" if r["losses_identical_to_plain"] else "**no**")
                  for r in sorted(runs, key=lambda r: (r["budget"], r["method"]))],
                 right=(0, 2, 3, 4, 5, 6))
    p, e = d.get("planning", {}), d.get("estimator", {})
    goal_ms = p.get("goal_ms", 0.1)
    if p:
        a1, sim = p["algorithm1_only"], p["with_simulator_check"]
        out += ["", f"Planning latency per new input size (median of {a1['n']}): Algorithm 1 "
                f"{num(a1['median_ms'])} ms, with the simulator check that fits the plan's peak "
                f"{num(sim['median_ms'])} ms (goal {g(goal_ms)} ms; paper {g(p.get('paper_ms', 0.3))} ms)."]
        ctx.goal("mimose", f"planning <= {g(goal_ms)} ms per new input size (Algorithm 1)",
                 f"{num(a1['median_ms'])} ms median", a1["median_ms"] <= goal_ms)
        ctx.goal("mimose", f"planning <= {g(goal_ms)} ms per new input size (with simulator check)",
                 f"{num(sim['median_ms'])} ms median", sim["median_ms"] <= goal_ms)
    if e:
        worst = 100 * e["max_total_error"]
        out += [f"Estimator error on {len(e.get('held_out', {}))} unseen sizes after {e['samples']} "
                f"samples: total {num(worst)}%, worst block {num(100 * e['max_block_error'])}% "
                "(goal 0.5%)."]
        ctx.goal("mimose", "estimator error <= 0.5% after 10 samples",
                 f"{num(worst)}% (worst block {num(100 * e['max_block_error'])}%)", worst <= 0.5)
    ia = d.get("input_aware")
    if ia:
        goal_ms = ia.get("goal_ms", 1.0)
        lat = []
        for where in ("this_model", "synthetic_L48"):
            r = ia[where]
            lat.append(f"L={r['L']}: prediction {num(r['predict_ms'])} ms + rotor "
                       f"{num(r['rotor_ms_slots500'])} ms at 500 slots, "
                       f"{num(r['rotor_ms_slots50'])} ms at 50")
        out += ["", "Input-aware rotor (`rotor-ia`, issue 13 item 4): `InputAwareChain` profiles "
                "the first 10 input sizes, then rotor plans each new shape on the chain the "
                "estimator predicts. Planning a new shape: " + "; ".join(lat) + "."]
        if ctx.load("new_shape_plan.json") is not None:  # the runner's whole path, timed there
            out += ["(Timed when this file was made; the current timing of a new shape, through "
                    "the runner, is in \"Input-aware rotor: planning a new shape\" below.)"]
        else:
            l48 = ia["synthetic_L48"]
            best = min(l48[k] for k in l48 if k.startswith("total_ms_"))
            ctx.goal("mimose", f"input-aware rotor plans a new shape in < {g(goal_ms)} ms (L <= 48)",
                     f"{num(best)} ms at L=48 (best slot count)", best < goal_ms)
        ratios = ia.get("step_vs_mimose", {})
        if ratios:
            worst = max(ratios.values())
            ia_runs = [r for r in runs if r["method"] == "rotor-ia"]
            over = sum(r["steps_over_budget"] for r in ia_runs)
            ctx.goal("mimose", "input-aware rotor within 10% of Mimose's step time, no step "
                     "over the budget", f"worst budget {num(worst)}x Mimose's; {over} steps "
                     "over", worst <= ia.get("goal_step_vs_mimose", 1.1) and over == 0)
    out += [""] + ctx.figures(["mimose.png"])
    out += ["", reproduce(meta.get("command", "python bench/mimose.py"))]
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


def checkpoint_real(ctx: Ctx, d: Dict[str, Any], name: str) -> List[str]:
    meta = d.get("meta", {})
    cpu = meta.get("device") == "cpu"
    out = [("Measured on the CPU (tiny CPU mode: small models, 2-core shared machine; the GPU "
            "benchmark of ResNet-101 at 1000x1000 and GPT-2 was not run, no GPU lent). "
            if cpu else f"Measured on {meta.get('gpu')}. ")
           + f"Peaks: {meta.get('peak', '-')}.",
           meta_line(meta, (("gpu", "device"), ("torch", "torch"), ("date", "date"),
                            ("steps", "timed steps"))), ""]
    summ = d.get("summary", {})
    rows = []
    for m in d["models"]:
        plain = next((r for r in m["rows"] if r["method"] == "plain" and r.get("status") == "ok"), None)
        s = summ.get(m["model"], {})
        rv, pv = s.get("rotor_vs_best_periodic_mean_gain"), s.get("pofo_vs_rotor_mean_gain")
        rows.append((m["model"], m.get("L") or "-", m.get("batch") or "-",
                     num(plain["throughput"]) if plain else "-",
                     s.get("budgets", "-"), pct(None if rv is None else 100 * rv),
                     pct(None if pv is None else 100 * pv)))
        if rv is not None:
            ctx.goal(f"checkpoint_real ({'CPU' if cpu else meta.get('gpu')})",
                     f"{m['model']}: rotor beats the best periodic at equal peak (paper +17.2%)",
                     f"{pct(100 * rv)} mean" + (" (tiny CPU mode: not the goal's setting)" if cpu else ""),
                     None if cpu else rv > 0)
    out += table(["model", "L", "batch", "plain samples/s", "budgets", "rotor vs best periodic",
                  "pofo vs rotor"], rows, right=(1, 2, 3, 4, 5, 6))
    out += ["", "Gains are mean throughput ratios at each budget (periodic: the fastest periodic "
            "configuration whose peak fits)."]
    failed = [f"{m['model']}: {m['error']}" for m in d["models"] if m.get("error")] + sorted(
        {f"{m['model']} {r['method']}: {r.get('note', '')}" for m in d["models"]
         for r in m["rows"] if r.get("status") == "error"})
    if failed:
        out += ["", "Errors (recorded, the rest ran): " + "; ".join(failed) + "."]
    out += [""] + ctx.figures([name[:-5] + ".png"])
    out += ["", reproduce(meta.get("command", "python bench/checkpoint_real.py"))]
    return out


def e2e(ctx: Ctx, d: Dict[str, Any], name: str) -> List[str]:
    meta = d.get("meta", {})
    gpu = meta.get("gpu", "cpu")
    rows = d["results"]
    out = [("Measured on the CPU (smoke mode: tiny models, simulated budget, a few steps; not "
            "the GPU experiment; bert-dyn's lengths change every step, so rotor, pofo and "
            "mimose are still collecting and profiling shapes there: their steady state is in "
            "the Mimose section below)" if gpu == "cpu" else f"Measured on {gpu}") + ".",
           meta_line(meta, (("gpu", "device"), ("driver", "driver"), ("cuda", "CUDA"),
                            ("torch", "torch"), ("date", "date"))), "",
           "Throughput per batch size, peak memory in parentheses where recorded "
           "(x = out of memory, error = failed: see below).", ""]

    def cell(r: Dict[str, Any]) -> str:
        s = num(r["throughput"])
        return s + (f" ({size(r['peak_bytes'])})" if r.get("peak_bytes") is not None else "")

    out += _grid(rows, "batch_size", cell) + [""]
    budgets = sorted({(r["model"], r["budget_bytes"]) for r in rows if r.get("budget_bytes")})
    if budgets:
        out += ["- Budget: " + "; ".join(f"{m} {size(b)}" for m, b in budgets) + "."]
    bad = sorted({(r["method"], r.get("note", "")) for r in rows
                  if r.get("status") in ("error", "crashed")})
    if bad:
        out += ["- Errors: " + "; ".join(f"{m}: {n}" for m, n in bad) + "."]
    # kept by --resume, never run again on their own: a missing package, a hung job
    held = sorted({(r["method"], r.get("status"), r.get("note", "")) for r in rows
                   if r.get("status") in ("unavailable", "timeout")})
    if held:
        out += ["- Not run: " + "; ".join(f"{m} ({st}): {n}" for m, st, n in held) + "."]
    ok = [r for r in rows if r.get("status") == "ok"]
    exact = sum(1 for r in ok if str(r.get("note", "")).startswith("loss bitwise equal"))
    out += [f"- Losses bitwise equal to plain training: {exact} of {len(ok)} rows that ran."]
    if meta.get("incomplete"):
        out += [f"- Incomplete: {meta.get('not_run', 'some')} jobs not run yet; a later GPU "
                "session resumes this file (`scripts/gpu-check --next`)."]
    rn = [r for r in rows if r["model"] == "resnet50"]
    quick = "--quick" in str(meta.get("command", ""))   # its batches stop short of the goal's
    if gpu != "cpu" and rn and not quick:
        best = max((r for r in rn if r.get("status") == "ok"), key=lambda r: r["batch_size"], default=None)
        if best is not None:
            floor = next((r["note"] for r in rn if r["batch_size"] == 2048
                          and r.get("status") == "infeasible"), "")
            ctx.goal(f"e2e ({gpu})", "ResNet-50 batch >= 2048 within 16 GiB",
                     f"batch {best['batch_size']} ({best['method']})"
                     + (f"; 2048: {floor}" if floor else ""), best["batch_size"] >= 2048)
        plain = [r["throughput"] for r in rn if r["method"] == "native" and r.get("status") == "ok"]
        at = [r for r in rn if r["batch_size"] == 1440 and r.get("status") == "ok"]
        if plain and at:
            top = max(at, key=lambda r: r["throughput"])
            ratio = top["throughput"] / max(plain)
            out += [f"- ResNet-50 at batch 1440: {top['method']} {num(top['throughput'])} images/s = "
                    f"{pct(100 * ratio, sign=False)} of plain PyTorch's best throughput at any batch "
                    "that fits (paper: 321 images/s, 55%; goal 60%)."]
            ctx.goal(f"e2e ({gpu})", ">= 60% of unconstrained throughput at batch 1440",
                     f"{pct(100 * ratio, sign=False)} ({top['method']})", ratio >= 0.6)
    stem = name[:-5]
    out += [""] + ctx.figures([f"{stem}-throughput.png", f"{stem}-memory.png"])
    out += ["", reproduce(meta.get("command", "python bench/e2e.py"))]
    return out


def hf(ctx: Ctx, d: Dict[str, Any], name: str) -> List[str]:
    meta = d.get("meta", {})
    cpu = meta.get("device", "cpu") == "cpu"
    out = [("Measured on the CPU (small configs, random weights; peaks: bytes the CPU allocator "
            "holds above the step's start, from torch.profiler's allocation events; step time: "
            "the least process CPU time of the timed steps, one thread)" if cpu else f"Measured on {meta.get('gpu')} (peaks: "
            "max_memory_allocated above the step's start)") + f". Goal: {meta.get('goal', '')}. "
           "HF checkpointing runs non-reentrant (transformers 5's default); `every-block` is "
           "scheduler.checkpoint running HF's plan (every block checkpointed), its budget "
           "column that plan's peak on the runner's measured chain (the units budgets are "
           "planned in). 'Faster' in the goals means a plan with fewer forwards than HF's and "
           "rotor's median step below HF checkpointing's least: a win beyond the timing noise "
           "(a few percent here); 'at HF's step time', rotor's least step at most HF's median.",
           meta_line(meta, (("gpu", "device"), ("torch", "torch"),
                            ("transformers", "transformers"), ("date", "date"),
                            ("steps", "timed steps"))), ""]
    rows = []
    measured_any = False
    for m in d["models"]:
        if m.get("error"):   # the model's run failed before it had rows
            rows.append((m["model"], "-", "-", "-", "-", "-", "error"))
        for r in m["rows"]:
            ok = r.get("status") == "ok"
            if r.get("status") == "skipped":
                continue  # said once below
            rows.append((m["model"], r["method"], size(r["budget"]) if r.get("budget") else "-",
                         num(1e3 * r["step_s"]) if ok else "-", size(r["peak"]) if ok else "-",
                         r.get("forwards", "-") if ok else "-",
                         "ok" if ok else r.get("status", "-")))
        goal = m.get("goal", {})
        where = "CPU" if cpu else meta.get("gpu")
        if all(v is None for v in goal.values()):
            continue
        measured_any = True
        for key, what in (("faster_at_hf_peak", "rotor faster at HF checkpointing's peak"),
                          ("less_memory_at_hf_time", "rotor less memory at HF's step time"),
                          ("below_hf_peak", "rotor reaches budgets below HF's peak"),
                          ("faster_at_hf_budget_on_chain", "rotor faster than HF at HF's "
                           "plan's peak on the chain")):
            if key not in goal:
                continue
            ok = goal.get(key)
            ctx.goal(f"hf ({where})", f"{m['model']}: {what}", "yes" if ok else "no", ok)
    failed = [f"{m['model']}: {m['error']}" for m in d["models"] if m.get("error")] + [
        f"{m['model']} {r['method']}: {r.get('note', '')}" for m in d["models"]
        for r in m["rows"] if r.get("status") == "error"]
    if not measured_any:
        ctx.goal(f"hf ({'CPU' if cpu else meta.get('gpu')})", meta.get("goal", "rotor vs HF "
                 "checkpointing"), "not run: every model failed (see its errors)" if failed
                 and all(m.get("error") for m in d["models"]) else "not run: no rotor rows "
                 "(scheduler.checkpoint not in the build that made this file)", None)
    out += table(["model", "method", "budget", "step ms", "peak", "forwards", "status"], rows,
                 right=(2, 3, 4, 5))
    if failed:
        out += ["", "Errors (recorded, the other models' rows kept): " + "; ".join(failed) + "."]
    why, tied = [], []   # tied: models where rotor's plan at HF's peak runs as many forwards
    for m in d["models"]:
        a = m.get("rotor_at_hf_peak")
        if not a:
            continue
        if a.get("rotor_forwards", 0) >= a["every_block_forwards"] and \
                not m.get("goal", {}).get("faster_at_hf_peak"):
            tied.append(m["model"])
        if a.get("rotor") == "infeasible":
            why.append(f"{m['model']}: infeasible at HF's peak {size(a['budget'])} on the chain "
                       f"(rotor needs {size(a['rotor_min_budget'])})")
        else:
            why.append(f"{m['model']}: {a['rotor_forwards']} forwards against HF's "
                       f"{a['every_block_forwards']} (predicted {num(1e3 * a['rotor_predicted_s'])}"
                       f" against {num(1e3 * a['every_block_predicted_s'])} ms)")
    if why:
        out += ["", "Rotor's plan on the runner's measured chain at HF checkpointing's measured "
                "peak: " + "; ".join(why) + "." + (
                    f" For {', '.join(tied)}: with no fewer forwards than HF's plan (rotor's "
                    "plan is optimal on an accurate chain, so no checkpointing plan does "
                    "better), rotor can only be faster at that memory by a cheaper runtime: "
                    "keeping any block's activations for its backward would hold them through "
                    "the model's tail (LM head and loss over the vocabulary) or through the "
                    "last block's backward, where HF's own peak is." if tied else "")]
    if cpu:
        out += ["", "On the CPU, pofo's offloads go to host memory, which is the same memory "
                "here: its rows count the copies (a GPU run is where offloading saves)."]
    if not meta.get("checkpoint_available", True):
        out += ["", "rotor/pofo/mimose rows were skipped: `scheduler.checkpoint` was not in the "
                "build that made this file."]
    out += [""] + ctx.figures([name[:-5] + ".png"])
    out += ["", reproduce(meta.get("command", "python bench/hf.py"))]
    return out


def gpu_progress(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    steps = d["steps"]
    out = ["Issue 12's GPU steps as `scripts/gpu-check` recorded them (a GPU session has 15 "
           "minutes of device time; `scripts/gpu-check --next` runs what is not ok, the tests "
           "again whenever the source changed).", ""]
    out += table(["step", "status", "seconds", "GPU", "driver", "torch", "date", "source"],
                 [[name, r["status"], num(r.get("seconds"), 1), r.get("gpu") or "-",
                   r.get("driver") or "-", r.get("torch") or "-", r.get("date") or "-",
                   f"`{r['source']}`" if r.get("source") else "-"]
                  for name, r in steps.items()], right=[2])
    return out


def gpu_tests(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    meta, summary, tests = d["meta"], d["summary"], d["tests"]
    bad = [t for t in tests if t["outcome"] in ("failed", "error")]
    counts = ", ".join(f"{summary[k]} {k}" for k in ("passed", "failed", "error", "skipped")
                       if summary.get(k))
    out = [f"`pytest -m gpu` on {meta.get('gpu', '?')}: {summary['total']} tests, "
           f"{counts or 'none ran'}, {num(summary['seconds'], 1)} s in tests."
           + (f" {d['note']}." if d.get("note") else ""),
           meta_line(meta, (("gpu", "device"), ("driver", "driver"), ("cuda", "CUDA"),
                            ("torch", "torch"), ("date", "date"), ("source", "source hash")))]
    ran = summary["total"] - summary.get("skipped", 0)
    whole = d.get("complete", True)   # False: pytest was killed before its end
    ctx.goal(f"pytest -m gpu ({meta.get('gpu', '?')})", "every GPU test passes on a GPU",
             f"{summary.get('passed', 0)} of {ran} passed"
             + ("" if whole else " (killed before the end)"), not bad and ran > 0 and whole)
    if bad:
        out += ["", "Failed:", ""]
        out += [f"- `{t['test']}`: {(t.get('message') or '').splitlines()[0][:200] if t.get('message') else ''}"
                for t in bad]
    slow = sorted(tests, key=lambda t: -t["seconds"])[:5]
    if slow:
        out += ["", "Slowest: " + "; ".join(f"`{t['test'].split('::')[-1]}` "
                                            f"{num(t['seconds'], 1)} s" for t in slow) + "."]
    return out


def traces_gpu(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    meta, rows = d["meta"], d["rows"]
    out = [f"Real allocation traces recorded on {meta.get('gpu', '?')} "
           "(`torch.cuda.memory._record_memory_history`, a few training steps each; the traces "
           "are in `bench/traces/*-gpu.json.gz` and CI replays them). PyTorch's reserved peak "
           "on the GPU against what the caching-allocator model predicts for the same trace:",
           meta_line(meta, (("gpu", "device"), ("driver", "driver"), ("torch", "torch"),
                            ("date", "date"))), ""]
    ok = [r for r in rows if r.get("status") == "ok"]
    out += table(["trace", "events", "requested peak", "reserved (GPU)", "reserved (model)",
                  "model error"],
                 [[r["trace"], r["events"], size(r["peak_requested"]), size(r["reserved_peak"]),
                   size(r["model_reserved_peak"]), pct(r["model_error_percent"])] for r in ok],
                 right=[1, 2, 3, 4, 5])
    failed = [r for r in rows if r.get("status") != "ok"]
    if failed:
        out += ["", "- Not recorded: " + "; ".join(f"{r['trace']} ({r.get('note')})"
                                                     for r in failed) + "."]
    if ok:
        worst = max(ok, key=lambda r: abs(r["model_error_percent"]))
        ctx.goal(f"traces ({meta.get('gpu', '?')})", "caching model's reserved peak vs "
                 "PyTorch's on the GPU (the model's error)", f"worst {pct(worst['model_error_percent'])}"
                 f" ({worst['trace']}), {len(ok)} traces", None)
    out += ["", reproduce(meta.get("command", "python bench/traces/record_gpu.py"))]
    return out


# ------------------------------------------------------------------------------ assembly
Section = Tuple[str, str, str, Callable[..., List[str]]]   # (file or glob, title, command, renderer)
SECTIONS: List[Section] = [
    ("gpu-progress.json", "GPU sessions: what has run on a GPU (issue 12)",
     "scripts/gpu-check --next OUT", gpu_progress),
    ("gpu-tests.json", "GPU tests", "scripts/gpu-check --next OUT", gpu_tests),
    ("traces-gpu.json", "Real allocation traces: the caching model vs PyTorch on the GPU",
     "python bench/traces/record_gpu.py", traces_gpu),
    ("e2e-*.json", "End to end: training under a budget", "python bench/e2e.py", e2e),
    ("alloc_micro.json", "Allocator fast path", "python bench/alloc_micro.py", alloc_micro),
    ("cache_slack.json", "cache_slack's default: remap time vs memory (issue 12)",
     "python bench/cache_slack.py", cache_slack),
    ("fragmentation.json", "Fragmentation: vmalloc vs PyTorch's caching allocator",
     "python bench/fragmentation.py", fragmentation),
    ("planners_time.json", "Planner solve time", "python bench/planners_time.py", planners_time),
    ("checkpointing.json", "Checkpointing: rotor vs periodic (seed 002 Figs. 3-5)",
     "python bench/checkpointing.py", checkpointing),
    ("offloading.json", "Offloading: GREEDY, DYNPROG, VDNN vs the lower bound (seed 000 Fig. 4)",
     "python bench/offloading.py", offloading),
    ("pofo.json", "pofo vs rotor, offload-only, GREEDY, autocapper, opportunist (seed 001 Figs. 2-3)",
     "python bench/pofo.py", pofo),
    ("pofo_random.json", "pofo on random chains: simulated time vs its DP value (issue 14)",
     "python bench/pofo.py --random", pofo_random),
    ("swap.json", "Swap runtime overhead", "python bench/swap.py", swap),
    ("mimose.json", "Mimose: dynamic input sizes", "python bench/mimose.py", mimose),
    ("new_shape_plan.json", "Input-aware rotor: planning a new shape",
     "python bench/new_shape_plan.py", new_shape_plan),
    ("checkpoint_real-*.json", "Checkpointing real models", "python bench/checkpoint_real.py",
     checkpoint_real),
    ("hf-*.json", "Hugging Face models: plain, HF checkpointing, rotor/pofo/mimose",
     "python bench/hf.py", hf),
]


def _files(results: str, pattern: str) -> List[str]:
    if "*" not in pattern:
        return [pattern] if os.path.exists(os.path.join(results, pattern)) else []
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(results, pattern)))


def _ran_on_gpu(ctx: Ctx, pattern: str, key: str) -> bool:
    """Whether any results file matching `pattern` records a device other than the CPU."""
    for n in _files(ctx.results, pattern):
        try:
            if (ctx.load(n) or {}).get("meta", {}).get(key, "cpu") != "cpu":
                return True
        except ValueError:
            pass
    return False


def render(results: str = RESULTS, readme_dir: str = ROOT) -> str:
    """The whole generated block (without the markers)."""
    ctx = Ctx(results, readme_dir)
    body: List[str] = []
    for pattern, title, command, fn in SECTIONS:
        names = _files(results, pattern)
        if not names:
            body += [f"### {title}", "",
                     f"No results file (`{ctx.rel(pattern)}`): run `{command}`.", ""]
            continue
        for name in names:
            head = f"### {title}" + (f" ({name})" if "*" in pattern else "")
            try:
                data = ctx.load(name)
                lines = (fn(ctx, data, name) if "*" in pattern else fn(ctx, data))
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                lines = [f"Could not read {ctx.source(name)}: unexpected structure "
                         f"({type(exc).__name__}: {exc}); bench/readme_results.py needs updating."]
            body += [head, "", f"From {ctx.source(name)}."]
            body += [ln for i, ln in enumerate(lines) if ln or (i and lines[i - 1])]  # no empty meta
            body.append("")
    # goals only a lent GPU can answer: say they were not run rather than leave them out
    if not _ran_on_gpu(ctx, "e2e-*.json", "gpu"):
        ctx.goal("e2e (GPU)", "ResNet-50 batch >= 2048 within 16 GiB, >= 60% of unconstrained "
                 "throughput at batch 1440", "not run: no GPU results (no GPU lent); 2048 is "
                 "below the op floor (18.4 GiB for one BatchNorm backward, scheduler.profile."
                 "op_floor), 1440 is not (12.9 GiB)", None)
    if not _ran_on_gpu(ctx, "checkpoint_real-*.json", "device"):
        ctx.goal("checkpoint_real (GPU)", "rotor beats the best periodic at equal peak; pofo beats "
                 "rotor where transfers hide", "not run: no GPU results (no GPU lent)", None)
    glance = ["### Goals at a glance", "",
              "Each issue's goal next to what its benchmark recorded (details below).", ""]
    glance += table(["benchmark", "goal", "measured", "met"], ctx.goals) if ctx.goals else ["(none)"]
    lines = [f"<!-- generated by `{SELF}` from bench/results/*.json: edit the script, "
             "not this block -->", ""] + glance + [""] + body
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def splice(readme_text: str, block: str) -> str:
    """`readme_text` with everything between the markers replaced by `block`."""
    i, j = readme_text.find(BEGIN), readme_text.find(END)
    if i < 0 or j < 0 or j < i:
        raise SystemExit(f"README has no '{BEGIN}' ... '{END}' block")
    return readme_text[:i + len(BEGIN)] + "\n" + block + readme_text[j:]


def _sections(text: str) -> Dict[str, str]:
    """The generated block of `text` split by '### ' headings (for naming what is stale)."""
    i, j = text.find(BEGIN), text.find(END)
    inner = text[i + len(BEGIN):j] if 0 <= i < j else ""
    out: Dict[str, str] = {}
    key = "(preamble)"
    for line in inner.splitlines():
        if line.startswith("### "):
            key = line[4:]
        out[key] = out.get(key, "") + line + "\n"
    return out


def stale(readme_text: str, block: str) -> List[str]:
    """Headings whose generated text differs between the README and `block` (empty: up to date)."""
    want = splice(readme_text, block)
    if want == readme_text:
        return []
    have, new = _sections(readme_text), _sections(want)
    return sorted(k for k in set(have) | set(new) if have.get(k) != new.get(k)) or ["(block)"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="do not write: exit 1 if the README block is out of date")
    ap.add_argument("--results", default=RESULTS, metavar="DIR",
                    help="results folder (default bench/results)")
    ap.add_argument("--readme", default=README, metavar="FILE",
                    help="README to update (default README.md)")
    args = ap.parse_args(argv)
    # a typo in a path must not rewrite README's results with "missing" notes
    if not os.path.isdir(args.results):
        ap.error(f"--results {args.results!r}: no such directory")
    if not any(n.endswith(".json") for n in os.listdir(args.results)):
        ap.error(f"--results {args.results!r}: no results files (*.json) there")
    if not os.path.isfile(args.readme):
        ap.error(f"--readme {args.readme!r}: no such file")
    with open(args.readme) as f:
        text = f.read()
    block = render(args.results, os.path.dirname(os.path.abspath(args.readme)))
    diff = stale(text, block)
    if args.check:
        if diff:
            print(f"{args.readme}: the results block is out of date with {args.results} in: "
                  + "; ".join(diff) + f". Run `{SELF}` and commit README.md.", file=sys.stderr)
            return 1
        print(f"{args.readme}: results block up to date")
        return 0
    if diff:
        with open(args.readme, "w") as f:
            f.write(splice(text, block))
        print(f"updated {args.readme}: " + "; ".join(diff))
    else:
        print(f"{args.readme}: results block already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
