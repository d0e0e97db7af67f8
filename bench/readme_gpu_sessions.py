"""README Results sections about GPU sessions: what `scripts/gpu-check` has run on a lent GPU
(gpu-progress.json) and the outcome of `pytest -m gpu` there (gpu-tests.json).

Each renderer takes the shared `Ctx` and a results file's data and returns the section's
markdown lines; goals go to `ctx.goal`. Assembled by bench/readme_results.py.
"""
from __future__ import annotations

from typing import Any, Dict, List

from bench.readme_format import Ctx, meta_line, num, table


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
