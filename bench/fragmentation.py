"""Fragmentation of vmalloc (2 MiB and 20 MiB chunks) vs PyTorch's caching allocator on the
bundled allocation traces, replayed without a GPU.

    python bench/fragmentation.py [--quick] [--traces DIR|FILE] [--out FILE.json]

``--traces``: a trace file or a folder of them, in any form ``vmalloc.replay.load`` reads
(``*.json``, ``*.json.gz``, PyTorch snapshots ``*.pickle`` / ``*.pkl``, optionally gzip'ed);
none there is an error (exit 2) before anything is written.

Per trace and allocator: peak requested, peak physical without a budget (the default policy),
fragmentation 1 - requested/physical (GMLake's metric: it reports 15% on average, up to 33%, for
PyTorch on LLM training), and the smallest physical budget at which the whole trace replays
(bisection). Goal: vmalloc needs <= 1.05 x the peak requested bytes on every swap-heavy trace.
vmalloc runs on its host-lazy backend (real memfd page mappings that take no RAM); PyTorch's
allocator is the model in vmalloc/replay/caching_model.py. Writes
bench/results/fragmentation.json and .png (``--quick``: nothing unless ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":  # run as a script (bench/ is first on sys.path)
    import checkout
    checkout.on_path()

from bench.common import output_dir, run_meta, say_nothing_written, trace_files  # noqa: E402
from vmalloc.replay import TraceFileError, compare, default_contenders, load  # noqa: E402
from vmalloc.report_format import draw_replay_timelines, side_by_side  # noqa: E402

GOAL = 1.05
TRACES = os.path.join(HERE, "traces")   # the bundled traces (the default of --traces)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first two traces (CI-sized)")
    ap.add_argument("--traces", default=TRACES, metavar="DIR|FILE",
                    help="a trace file or a folder of them (default bench/traces)")
    ap.add_argument("--out", default=None, metavar="FILE", help="results JSON; the PNG goes "
                    "beside it (default bench/results/fragmentation.json; --quick: none)")
    args = ap.parse_args(argv)
    path = output_dir(args.quick, args.out, os.path.join(HERE, "results", "fragmentation.json"))
    try:
        paths = trace_files(args.traces)
    except ValueError as exc:
        ap.error(f"--traces {args.traces!r}: {exc}")
    if args.quick:
        paths = paths[:2]
    t0 = time.time()   # (loading included, as before)
    traces = []
    for p in paths:   # every trace read before any replay: a bad file ends the run first
        try:
            traces.append(load(p))
        except TraceFileError as exc:
            ap.error(f"--traces {args.traces!r}: {exc}")
    results = []
    for trace in traces:
        t1 = time.time()
        rows = compare(trace, default_contenders((2 << 20, 20 << 20)), bisect=True, timeline=True)
        print(side_by_side(trace.name, rows, trace.meta))
        print(f"({time.time() - t1:.1f} s)\n")
        results.append({"trace": trace.name, "meta": trace.meta, "events": len(trace),
                        "rows": [r.to_json() for r in rows],
                        "timelines": {r.allocator: r.timeline for r in rows}})
    print("goal: vmalloc smallest budget <= %.2f x peak requested on every swap-heavy trace" % GOAL)
    ok_all = True
    for res in results:
        for r in res["rows"]:
            if r["allocator"].startswith("vmalloc"):
                ok = r["budget_ratio"] is not None and r["budget_ratio"] <= GOAL
                ok_all &= ok
                print(f"  {res['trace']:<28}{r['allocator']:<18} budget/req "
                      f"{r['budget_ratio']:.3f}  {'ok' if ok else 'MISSED'}")
    summary = {}
    for name in {r["allocator"] for res in results for r in res["rows"]}:
        rows = [r for res in results for r in res["rows"] if r["allocator"] == name]
        summary[name] = {
            "mean_fragmentation_uncapped": sum(r["fragmentation"] for r in rows) / len(rows),
            "mean_budget_ratio": sum(r["budget_ratio"] or 0 for r in rows) / len(rows),
            "max_budget_ratio": max(r["budget_ratio"] or 0 for r in rows),
        }
    print("summary:", json.dumps(summary, indent=1))
    if path is None:
        say_nothing_written("--out FILE")
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    real = sum(1 for res in results if res["meta"].get("real_gpu_trace"))
    command = ("python bench/fragmentation.py" + (" --quick" if args.quick else "")
               + ("" if args.traces == TRACES else f" --traces {args.traces}"))
    # the tags every results file carries (machine, torch, date; replayed on the CPU)
    out = {"meta": run_meta(command, "cpu"), "benchmark": "fragmentation", "quick": args.quick, "goal_budget_ratio": GOAL,
           "goal_met": ok_all, "seconds": time.time() - t0,
           "machine": platform.platform(), "note": f"traces: {real} recorded on a GPU, "
           f"{len(results) - real} simulated swap schedules; vmalloc on the host-lazy backend "
           "(no RAM taken), PyTorch as vmalloc/replay/caching_model.py",
           "summary": summary,
           "traces": [{k: v for k, v in res.items() if k != "timelines"} for res in results]}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    png = plot(results, os.path.splitext(path)[0] + ".png")
    if png:
        print(f"wrote {png}")


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    n = len(results)
    fig, axes = plt.subplots(n, 2, figsize=(12, 3.2 * n), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1]})
    for (ax_t, ax_b), res in zip(axes, results):
        draw_replay_timelines(ax_t, res["timelines"], unit=1 << 30, unit_name="GiB")
        ax_t.set_title(res["trace"], fontsize=9)
        names = [r["allocator"] for r in res["rows"]]
        ratios = [r["budget_ratio"] or 0 for r in res["rows"]]
        ax_b.bar(range(len(names)), ratios, color=["C0", "C1", "C2"][: len(names)])
        ax_b.axhline(GOAL, color="k", ls="--", lw=1)
        ax_b.set_xticks(range(len(names)))
        ax_b.set_xticklabels([s.replace(" (model)", "") for s in names], fontsize=7)
        ax_b.set_ylabel("smallest budget / peak requested")
        ax_b.set_ylim(0.95, max(ratios + [GOAL]) * 1.05)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
