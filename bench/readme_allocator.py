"""README Results sections about the allocator: the fast path (alloc_micro.json), cache_slack's
default (cache_slack.json), fragmentation against PyTorch's caching allocator (fragmentation.json)
and the real GPU traces against the caching model (traces-gpu.json).

Each renderer takes the shared `Ctx` and a results file's data and returns the section's
markdown lines; goals go to `ctx.goal`. Assembled by bench/readme_results.py.
"""
from __future__ import annotations

from typing import Any, Dict, List

from bench.readme_format import Ctx, g, met, meta_line, num, pct, rate, reproduce, size, table


def alloc_micro(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    meta, host, cuda = d.get("meta", {}), d["host"], d.get("cuda") or {}
    goal = 5e6
    gpu = cuda.get("device") if not ("skipped" in cuda or "error" in cuda) else None
    what = ("vmalloc's host backend (memfd page mappings), 2 MiB chunks; malloc+free pairs per "
            "second timed in a C++ loop and from Python.")
    out = [(f"Host rows measured on the CPU: {what} GPU rows (the cuda backend, below) measured "
            f"on {gpu}." if gpu else f"Measured on the CPU: {what}"),
           meta_line(meta, (("machine", "machine"), ("cpus", "CPUs"), ("python", "Python"),
                            ("torch", "torch"), ("date", "date"), ("note", "note"))), ""]
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
    out += [""] + _remap_fresh("", host.get("remap") or [], host.get("fresh") or [])
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
        gran = cuda.get("granularity")
        out.append(f"GPU part, measured on {cuda.get('device', 'the GPU')}"
                   + (f" (granularity {size(gran)})" if isinstance(gran, int) else "") + ":")
        out.append("")
        out += table(["cuda", "pairs/s (C++ or direct)", "Python pairs/s"], rows, right=(1, 2))
        # the remap and fresh costs are lists (one row per k), not table rows
        paths = _remap_fresh("GPU ", cuda.get("vmalloc_remap") or [], cuda.get("vmalloc_fresh") or [])
        if paths:
            out += [""] + paths
        if cuda.get("errors"):
            out += ["", "Failed measurements (the others ran): " + "; ".join(
                f"{k}: {v}" for k, v in sorted(cuda["errors"].items())) + "."]
    out += ["", reproduce(meta.get("command", "python bench/alloc_micro.py"))]
    return out


def _remap_fresh(where: str, remap: List[Dict[str, Any]], fresh: List[Dict[str, Any]]) -> List[str]:
    """The remap and fresh paths' cost per chunk, one line each (none without rows); `where`
    starts the lines ("" for the host's, "GPU " for the cuda backend's)."""
    def head(path: str) -> str:
        return (where + path)[0].upper() + (where + path)[1:]
    out = []
    if remap:
        out.append(head("remap path") + " (every malloc unmaps and maps chunks): "
                   + "; ".join(f"k={r['k']}: {num(r['us_per_chunk_remapped'])} us per chunk "
                               f"remapped ({rate(r['pairs_per_s'])} pairs/s)" for r in remap) + ".")
    if fresh:
        out.append(head("fresh path") + " (create + map + unmap + release a chunk): "
                   + "; ".join(f"k={r['k']}: {num(r['us_per_chunk_create_map_unmap_release'])} "
                               "us per chunk" for r in fresh) + ".")
    return out


def _taken(dec: Dict[str, Any]) -> str:
    """Whether the default the data asked for is the allocator's default now (read from
    ``vmalloc.Allocator``'s signature; nothing said where vmalloc is not importable)."""
    if not dec.get("change_default"):
        return ""
    try:
        import inspect

        from vmalloc import Allocator
        now = inspect.signature(Allocator.__init__).parameters["cache_slack"].default
    except Exception:  # noqa: BLE001 - vmalloc not built here: the verdict as recorded
        return ""
    if now != dec["cache_slack"]:   # (the knobs table says why)
        return (f" Not taken: `cache_slack` stays {'None (no cap)' if now is None else now}; "
                "its row in the allocator's knobs table says why.")
    return f" Taken: `cache_slack` defaults to {dec['label']} since this measurement."


def cache_slack(ctx: Ctx, d: Dict[str, Any]) -> List[str]:
    meta, cost, dec, rule = d.get("meta", {}), d["remap_cost"], d["decision"], d["rule"]
    traces = d["traces"]
    out = [f"Replayed on the host (vmalloc's host-lazy backend, {size(d.get('chunk_size'))} chunks): "
           f"traces {d['traces_used']} ({', '.join(t['trace'] for t in traces)}); remap cost "
           f"{num(cost['us_per_chunk_remapped'])} us per chunk from alloc_micro.json's "
           f"{cost['source']} rows ({cost['measured_on']}).",
           meta_line(meta, (("gpu", "device"), ("torch", "torch"), ("date", "date"))), "",
           f"**Verdict:** {d['verdict']}" + _taken(dec), "",
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
           "without a budget, under the default policy (GMLake's metric).", ""]
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
