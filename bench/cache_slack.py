"""Choose the allocator's ``cache_slack`` default from data (issue 12, step 4).

    python bench/cache_slack.py [--quick] [--traces-dir DIR] [--alloc-micro FILE]
                                [--max-seconds S] [--stop-at EPOCH]

``cache_slack`` (README, the allocator's knobs): without a budget, new chunks are created only
while physical memory stays below ``(1 + cache_slack)`` x the peak of chunks in use; past that,
cached chunks are remapped. Less slack: less memory, more remaps. The decision needs three
measurements, each taken from the best source there is (the JSON says which one was used):

* the traces: real allocation traces recorded on a GPU (``*-gpu.json.gz``, from
  ``bench/traces/record_gpu.py``; ``--traces-dir`` first, then ``bench/traces``) when there are
  any (provisional until there is one of every record_gpu.py job), else the bundled CPU-made
  ones (``bench/traces/make_traces.py``: simulated swap schedules). Each is replayed through
  vmalloc (host backend: real page mappings, 2 MiB chunks as on a GPU,
  ``vmalloc.replay.replay``) once per candidate slack, and cut into training steps: at
  ``meta.step_starts`` (recorded by record_gpu.py), else where no allocation is live (the
  bundled traces free everything at an iteration's end), else the whole trace is one step.
  What a recorded trace allocates before its first step (model, optimizer) is its set-up,
  counted apart (``setup``), so the steps after the first are the steady ones. Per step:
  chunks mapped, unmapped and created; over the trace: physical / requested peak.
  ``prefer_remap=True`` is ``cache_slack=0`` without a budget (``gather`` in
  csrc/alloc/allocator.cpp), and with a budget the slack does not apply: so no second axis.
* the remap cost per chunk (one unmap + one map): ``bench/results/alloc_micro.json``'s cuda rows
  (``vmalloc_remap``, the largest of its k rows) when a GPU measured them, else its host rows,
  and then the decision is provisional. Chunks created in a step are charged the fresh-path cost
  (create + map + unmap + release: an upper bound), shown beside the remaps, not in the rule:
  no slack avoids creating chunks when the peak grows.
* the step time: what record_gpu.py measured (``meta.step_seconds``, the median of the steps
  after the first), else a GPU ``bench/results/e2e*.json`` row of the same model and batch
  (native), else the trace's own timestamps (recorded, or for the bundled traces simulated by
  ``scheduler.simulate`` with the chains' roofline cost model), and then it is provisional.

The rule (issue 12: "a default that keeps physical/requested near 1.05 if remapping costs under
a few percent of a step, else say why not"): a slack keeps memory near 1.05 on a trace when its
physical / requested peak is at most ``max(1.05, floor) + 0.02``, ``floor`` being the trace's
ratio at slack 0 (the leanest any slack can be: chunk rounding, not caching). The candidate is
the largest finite slack that does so on every trace (the most cache, so the fewest remaps,
the memory target allows) whose remaps cost at most 3% of a step on every trace (the worst
step after the first: the first fills the cache). If none does, the verdict says why, and the
alternative is, of the slacks whose remaps stay under 3%, the one with the least ratio on its
worst trace (the loosest of those that tie: as little memory where it counts, fewer remaps).

The replays run on vmalloc's host-lazy backend (real mappings that take no RAM: a replay never
writes), so a trace recorded on an 80 GB GPU replays whole on any machine; ``--max-seconds`` /
``--stop-at`` leave out the traces there is no time for (said in the JSON; scripts/gpu-check
runs this on the device right after recording the traces).

Results: a table on stdout and ``bench/results/cache_slack.json`` (inputs, every replay's per
step counts, the decision, and the verdict paragraph README's Results section shows; ``--quick``:
the table only, unless ``--out``).
"""
from __future__ import annotations

import argparse
import glob
import inspect
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if __name__ == "__main__":  # run as a script (bench/ is first on sys.path)
    import checkout
    checkout.on_path()

from bench.common import (RESULTS, existing_dir, existing_file, output_dir,  # noqa: E402
                          positive_float, reproduce_command, run_meta,
                          say_nothing_written, write_json)

MiB = 1 << 20
CHUNK = 2 * MiB                     # the CUDA granularity of current GPUs, vmalloc's default
CANDIDATES: Tuple[Optional[float], ...] = (0.0, 0.02, 0.05, 0.1, 0.25, 0.5, None)
QUICK_CANDIDATES: Tuple[Optional[float], ...] = (0.0, 0.05, 0.25, None)
RATIO_TARGET = 1.05                 # physical / requested peak, issue 12
RATIO_TOLERANCE = 0.02              # "near 1.05": at most 1.07 (or the slack-0 floor + 0.02)
REMAP_THRESHOLD_PERCENT = 3.0       # "a few percent of a step"


def label(slack: Optional[float]) -> str:
    return "None (no cap)" if slack is None else f"{slack:g}"


# ------------------------------------------------------------------------------ inputs
def find_traces(dirs: Sequence[str]) -> Tuple[List[str], bool]:
    """The trace files to replay and whether they were recorded on a GPU: the real GPU traces
    (``*-gpu.json.gz``) in ``dirs`` when there are any (a name found twice: the first dir's),
    else the bundled CPU-made ones in ``bench/traces``."""
    gpu: Dict[str, str] = {}
    for d in dirs:
        for p in sorted(glob.glob(os.path.join(d, "*-gpu.json.gz"))):
            gpu.setdefault(os.path.basename(p), p)
    if gpu:
        return [gpu[k] for k in sorted(gpu)], True
    bundled = sorted(p for p in glob.glob(os.path.join(HERE, "traces", "*.json.gz"))
                     if not p.endswith("-gpu.json.gz"))
    return bundled, False


def missing_gpu_traces(paths: Sequence[str]) -> List[str]:
    """The recordings of ``bench/traces/record_gpu.py``'s jobs that are not among ``paths``:
    a default decided on some of them would stand as if decided on all."""
    from bench.traces.record_gpu import JOBS
    names = {os.path.basename(p) for p in paths}
    return [j.stem for j in JOBS if f"{j.stem}.json.gz" not in names]


def step_cuts(trace: Any) -> Tuple[List[int], str]:
    """Index of each step's first event, and how they were found."""
    starts = trace.meta.get("step_starts")
    n = len(trace.events)
    if isinstance(starts, list) and starts and all(isinstance(s, int) for s in starts) \
            and starts[0] >= 0 and starts == sorted(starts) and starts[-1] <= n:
        return list(starts), "recorded (meta.step_starts)"
    cuts, live = [0], 0
    for i, e in enumerate(trace.events):
        live += 1 if e.action == "alloc" else -1
        if live == 0 and i + 1 < n:
            cuts.append(i + 1)
    if len(cuts) > 1:
        return cuts, "where no allocation is live (the trace frees everything at a step's end)"
    return [0], "none found: the whole trace is one step (its first-step chunk creations included)"


def steady(values: Sequence[Any]) -> List[Any]:
    """The steps after the first (which fills the cache), or the only one."""
    return list(values[1:]) if len(values) > 1 else list(values)


def e2e_step_seconds(model: str, batch: int, results: str) -> Optional[Tuple[float, str]]:
    """A GPU e2e result's step time for plain training of ``model`` at ``batch``."""
    for path in sorted(glob.glob(os.path.join(results, "e2e*.json"))):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        if d.get("meta", {}).get("gpu", "cpu") == "cpu":
            continue
        for r in d.get("results", []):
            if (r.get("model"), r.get("batch_size"), r.get("method")) != (model, batch, "native") \
                    or not r.get("throughput"):
                continue
            per_step = float(batch)
            if str(r.get("unit", "")).startswith("tokens"):
                seq = re.search(r"-s(\d+)", model)
                if not seq:
                    continue   # variable lengths: tokens per step unknown
                per_step *= int(seq.group(1))
            return per_step / r["throughput"], (f"{os.path.basename(path)}: plain training of "
                                                f"{model} at batch {batch}, {d['meta']['gpu']}")
    return None


def step_seconds(trace: Any, starts: Sequence[int], results: str) -> Tuple[Optional[float], str, bool]:
    """(seconds per step, where it came from, measured on a GPU)."""
    meta = trace.meta
    rec = meta.get("step_seconds")
    if isinstance(rec, list) and rec and all(isinstance(x, (int, float)) and x > 0 for x in rec):
        return (statistics.median(steady(rec)),
                f"recorded by record_gpu.py on {meta.get('gpu', 'the GPU')} (median of the steps "
                "after the first, synchronized, under memory-history recording)", True)
    if meta.get("model") and meta.get("batch"):
        got = e2e_step_seconds(str(meta["model"]), int(meta["batch"]), results)
        if got:
            return got[0], got[1], True
    ev = trace.events
    spans = []
    for a, b in zip(starts, list(starts[1:]) + [len(ev)]):
        if b > a:
            spans.append(ev[b - 1].time - ev[a].time)
    spans = [s for s in steady(spans) if s > 0]
    if not spans:
        return None, "none: the trace has no timestamps and no step time was recorded", False
    real = bool(meta.get("real_gpu_trace"))
    how = ("the trace's recorded timestamps" if real else
           "the trace's simulated timeline (scheduler.simulate on the chain's roofline cost "
           "model, swap stalls included): an assumption, not a measurement")
    return statistics.median(spans), how + " (median of the steps after the first)", real


def remap_cost(alloc_micro: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Cost per chunk remapped and per chunk created (us), from alloc_micro.json: its cuda rows
    when a GPU measured them, else its host rows (``provisional``)."""
    if alloc_micro is None:
        raise SystemExit("cache_slack: no bench/results/alloc_micro.json: run "
                         "python bench/alloc_micro.py first (it measures the remap cost)")
    cuda = alloc_micro.get("cuda") or {}
    if isinstance(cuda.get("vmalloc_remap"), list) and cuda["vmalloc_remap"]:
        remap, fresh = cuda["vmalloc_remap"], cuda.get("vmalloc_fresh") or []
        source, on, gpu = "cuda", cuda.get("device", "GPU"), True
    else:
        host = alloc_micro.get("host") or {}
        remap, fresh = host.get("remap") or [], host.get("fresh") or []
        if not remap:
            raise SystemExit("cache_slack: alloc_micro.json has neither cuda nor host remap rows")
        why = cuda.get("skipped", "no cuda rows")
        source, on, gpu = "host", f"host backend ({why})", False
    us_remap = max(float(r["us_per_chunk_remapped"]) for r in remap)
    us_create = max((float(r["us_per_chunk_create_map_unmap_release"]) for r in fresh), default=None)
    return {"source": source, "measured_on": on, "gpu": gpu,
            "us_per_chunk_remapped": us_remap, "us_per_chunk_created": us_create,
            "rows": {"remap": remap, "fresh": fresh},
            "how": "the largest us_per_chunk_remapped of alloc_micro's remap rows (k = "
                   + ", ".join(str(r.get("k")) for r in remap) + " chunks per call)"}


# ------------------------------------------------------------------------------ replay
class _StepCounter:
    """An allocator for ``vmalloc.replay.replay`` that passes every call through and takes
    ``stats()`` before each step's first event."""

    def __init__(self, allocator: Any, starts: Sequence[int]) -> None:
        self.a = allocator
        self.starts = set(starts)
        self.i = 0
        self.at: Dict[int, Dict[str, Any]] = {}

    def _next(self) -> None:
        if self.i in self.starts:
            self.at[self.i] = dict(self.a.stats())
        self.i += 1

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        self._next()
        return self.a.malloc(nbytes, stream)

    def free(self, ptr: int) -> None:
        self._next()
        self.a.free(ptr)

    def stats(self) -> Dict[str, Any]:
        return self.a.stats()


def replay_steps(trace: Any, starts: Sequence[int], slack: Optional[float]) -> Dict[str, Any]:
    """Replay ``trace`` on a fresh host-lazy allocator with ``cache_slack=slack``; per step
    counts."""
    from vmalloc import Allocator
    from vmalloc.replay import replay

    with Allocator("host-lazy", chunk_size=CHUNK, cache_slack=slack) as a:
        counter = _StepCounter(a, starts)
        res = replay(trace, counter)
        end = dict(a.stats())
    # a step's counts run from its first event to the next step's (or the end); what a
    # recorded trace allocates before its first step (the model, the optimizer, the batch)
    # is the set-up, counted apart: ``steady`` must drop the first *training* step
    zero = dict.fromkeys(("num_map", "num_unmap", "num_chunks_created"), 0)
    marks = [zero] + [counter.at[s] for s in starts if s in counter.at] + [end]
    per_step = []
    for before, after in zip(marks, marks[1:]):
        maps = after["num_map"] - before["num_map"]
        unmaps = after["num_unmap"] - before["num_unmap"]
        created = after["num_chunks_created"] - before["num_chunks_created"]
        per_step.append({"maps": maps, "unmaps": unmaps, "created": created,
                         # each remap of a cached chunk is one unmap and one map
                         "remapped": max(maps - created, unmaps),
                         "physical_peak": after.get("physical_peak"),
                         "requested_peak": after.get("requested_peak")})
    head = per_step.pop(0)  # before the first step: the set-up (nothing when it starts at 0)
    req = end["requested_peak"]
    row: Dict[str, Any] = {
        "cache_slack": slack, "label": label(slack), "complete": res.ok,
        "physical_peak": end["physical_peak"], "requested_peak": req,
        "ratio": end["physical_peak"] / req if req else None,
        "maps": end["num_map"], "unmaps": end["num_unmap"], "created": end["num_chunks_created"],
        "mallocs": end["num_malloc"], "per_step": per_step}
    if starts and starts[0] > 0:
        row["setup"] = head
    if not res.ok:
        row["stopped"] = f"ran out of memory at event {res.failed_at} of {len(trace)}"
    return row


def cost_of(row: Dict[str, Any], cost: Dict[str, Any], step_s: Optional[float]) -> None:
    """Each step's remap time (ms) and its share of a step, and the worst step after the first.
    Chunks created are counted and costed beside it, not in the share: creating is what no
    slack avoids when the peak grows, and what a looser slack does instead of remapping."""
    us_c = cost["us_per_chunk_created"]
    for st in row["per_step"]:
        us = st["remapped"] * cost["us_per_chunk_remapped"]
        st["remap_ms"] = us / 1e3
        st["created_ms"] = st["created"] * us_c / 1e3 if us_c is not None else None
        st["percent_of_step"] = 100 * us / 1e6 / step_s if step_s else None
    rest = steady(row["per_step"]) if row["complete"] else []
    worst = max(rest, key=lambda s: s["remapped"], default=None)
    row["steady_remapped_max"] = worst["remapped"] if worst else None
    row["steady_remap_ms_max"] = worst["remap_ms"] if worst else None
    row["steady_percent_max"] = worst["percent_of_step"] if worst else None
    row["steady_created_max"] = max((s["created"] for s in rest), default=None)
    row["steady_created_ms_max"] = max((s["created_ms"] or 0.0 for s in rest), default=None) \
        if us_c is not None else None


# ------------------------------------------------------------------------------ decision
def current_default() -> Optional[float]:
    from vmalloc import Allocator
    return inspect.signature(Allocator.__init__).parameters["cache_slack"].default


def memory_ok(trace: Dict[str, Any], row: Dict[str, Any]) -> bool:
    return (row["complete"] and row["ratio"] is not None
            and row["ratio"] <= trace["ratio_limit"] + 1e-12)


def decide(traces: List[Dict[str, Any]], cost: Dict[str, Any], candidates: Sequence[Optional[float]],
           real_traces: bool, default: Optional[float] = None,
           left_out: Sequence[str] = (), missing: Sequence[str] = ()) -> Dict[str, Any]:
    """The rule of the module docstring on replayed ``traces`` (each with ``rows`` per candidate,
    ``ratio_limit``, ``step_seconds``); returns the decision and its verdict paragraph.
    ``left_out``: traces not replayed for time; ``missing``: GPU recordings not made yet."""
    def rows_of(s: Optional[float]) -> List[Tuple[Dict[str, Any], Dict[str, Any]]]:
        return [(t, next(r for r in t["rows"] if r["cache_slack"] == s)) for t in traces]

    def worst_ratio(s: Optional[float]) -> Tuple[float, str]:
        return max((r["ratio"] or float("inf"), t["trace"]) for t, r in rows_of(s))

    def worst_cost(s: Optional[float]) -> Tuple[Optional[float], str]:
        got = [(r["steady_percent_max"], t["trace"]) for t, r in rows_of(s)]
        if any(p is None for p, _ in got):
            return None, next(n for p, n in got if p is None)
        return max(got)

    provisional: List[str] = []
    if not cost["gpu"]:
        provisional.append("no GPU measurement of the remap cost (host backend numbers)")
    if not real_traces:
        provisional.append("no real GPU traces (the bundled CPU-made ones, simulated)")
    if not all(t["step_time_measured"] for t in traces):
        provisional.append("step times not measured on a GPU for every trace")
    if left_out:
        provisional.append(f"traces left out for time: {', '.join(left_out)}")
    if missing:
        provisional.append(f"no GPU trace yet of {', '.join(missing)}")
    finite = [s for s in candidates if s is not None]
    fits = [s for s in finite if all(memory_ok(t, r) for t, r in rows_of(s))]
    # the tightest first, no cap last
    cheap = [s for s in candidates if worst_cost(s)[0] is not None
             and worst_cost(s)[0] <= REMAP_THRESHOLD_PERCENT]
    good = [s for s in fits if s in cheap]
    pick = max(good) if good else max(fits) if fits else None
    meets = bool(good)
    parts: List[str] = ["Provisional: " + "; ".join(provisional) + "."] if provisional else []
    tol = (f"physical/requested peak at most {RATIO_TARGET:g} + {RATIO_TOLERANCE:g} (or the "
           f"trace's slack-0 floor + {RATIO_TOLERANCE:g})")

    def detail(s: float) -> str:
        pct, where = worst_cost(s)
        t = next(t for t in traces if t["trace"] == where)
        r = next(r for r in t["rows"] if r["cache_slack"] == s)
        if pct is None:
            return f"an unknown share of a step on {where} (no step time, or the replay stopped)"
        return (f"{pct:.2f}% of a step on {where}: {r['steady_remapped_max']} chunks remapped "
                f"in its worst step x {cost['us_per_chunk_remapped']:.3g} us = "
                f"{r['steady_remap_ms_max']:.3g} ms of a {t['step_seconds']:.3g} s step")

    if pick is None:
        parts.append(f"No finite cache_slack keeps {tol} on every trace ({len(traces)}).")
    else:
        ratio, where_r = worst_ratio(pick)
        parts.append(f"cache_slack = {pick:g} is the largest candidate that keeps {tol} on "
                     f"every trace ({len(traces)}; worst {ratio:.3f}, {where_r})"
                     + (f" with remaps under {REMAP_THRESHOLD_PERCENT:g}% of a step." if meets
                        else "."))
        if meets:
            parts.append(f"Its remaps cost at most {detail(pick)} (threshold "
                         f"{REMAP_THRESHOLD_PERCENT:g}%).")
            looser = [s for s in fits if s > pick]
            if looser:
                parts.append(f"{max(looser):g} keeps the memory target too, but its remaps "
                             f"cost {detail(max(looser))}.")
        else:
            parts.append(f"Why not: its remaps cost {detail(pick)}, above the "
                         f"{REMAP_THRESHOLD_PERCENT:g}% threshold, as are every tighter slack's.")
    if meets:
        chosen, found = pick, True
    else:   # of the slacks whose remaps stay under the threshold everywhere, the one with the
        # least worst ratio (memory is judged on the worst trace, as the target is); of those
        # that tie (to 3 decimals), the loosest: no fewer bytes at the worst, fewer remaps
        found = bool(cheap)
        chosen = None
        if found:
            least = min(round(worst_ratio(s)[0], 3) for s in cheap)
            ties = [s for s in cheap if round(worst_ratio(s)[0], 3) == least]
            chosen = ties[-1]   # (candidates run tightest first, no cap last)
            a_ratio, a_where = worst_ratio(chosen)
            tied = (f" ({', '.join(label(s) for s in ties[:-1])} reach the same there; the "
                    f"loosest remaps least)" if len(ties) > 1 else "")
            parts.append(f"Of the candidates whose remaps stay under "
                         f"{REMAP_THRESHOLD_PERCENT:g}% of a step, {label(chosen)} (worst "
                         f"{worst_cost(chosen)[0]:.2f}%) has the least physical/requested peak "
                         f"on its worst trace, {a_ratio:.3f} ({a_where}){tied}: the default to "
                         f"take instead.")
        else:
            parts.append("No candidate's remaps stay under the threshold on every trace "
                         "(or no step time is known): no default can be chosen from this data.")
    if found:
        where = ("(csrc/alloc/allocator.hpp Config::cache_slack, vmalloc/allocator.py, "
                 "csrc/bind/alloc_py.cpp, README's knobs table)")
        if chosen == default:
            parts.append(f"The current default ({label(default)}) is that value: keep it.")
        elif provisional:  # host remap costs and simulated traces: near the threshold, the
            # choice moves with small changes of the traces; a GPU session decides
            parts.append(f"The current default is {label(default)}; this provisional data "
                         f"says {label(chosen)}: the default changes on a GPU session's "
                         f"measurements (GPU remap costs, recorded traces) {where}.")
        else:
            parts.append(f"The current default is {label(default)}: the data says "
                         f"{label(chosen)} {where}.")
    return {"cache_slack": chosen, "label": label(chosen) if found else None, "found": found,
            "meets_target": meets, "memory_candidate": pick, "provisional": bool(provisional),
            "provisional_why": provisional, "current_default": default,
            "change_default": found and chosen != default and not provisional,
            "verdict": " ".join(parts)}


# ------------------------------------------------------------------------------ main
def run(trace_paths: Sequence[str], cost: Dict[str, Any], candidates: Sequence[Optional[float]],
        results: str, max_seconds: Optional[float] = None,
        stop_at: Optional[float] = None) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Replay each trace under each candidate, smallest file first. A trace is left out
    (returned by name; what was done is still written) once ``max_seconds`` have passed, or
    when its replays would end after ``stop_at`` (epoch seconds: the device call's end),
    predicted from the seconds per event the replays so far took."""
    from vmalloc.replay import load

    out: List[Dict[str, Any]] = []
    left_out: List[str] = []
    t0 = time.monotonic()
    spent = events = 0.0   # replay seconds, events those replays went through
    for path in sorted(trace_paths, key=os.path.getsize):
        if max_seconds is not None and out and time.monotonic() - t0 > max_seconds:
            left_out.append(os.path.basename(path))
            continue
        trace = load(path)
        if stop_at is not None and events:
            guess = spent / events * len(trace) * len(candidates)
            if time.time() + guess > stop_at:
                left_out.append(os.path.basename(path))
                print(f"\nleaving out {os.path.basename(path)}: its replays would take about "
                      f"{guess:.0f} s, past --stop-at")
                continue
        starts, cut = step_cuts(trace)
        secs, secs_how, measured = step_seconds(trace, starts, results)
        t: Dict[str, Any] = {
            "trace": os.path.basename(path).replace(".json.gz", ""), "events": len(trace),
            "real_gpu_trace": bool(trace.meta.get("real_gpu_trace")), "steps": len(starts),
            "step_cut": cut, "step_seconds": secs, "step_time_source": secs_how,
            "step_time_measured": measured, "rows": []}
        for s in candidates:
            t1 = time.monotonic()
            row = replay_steps(trace, starts, s)
            spent += time.monotonic() - t1
            events += len(trace)
            cost_of(row, cost, secs)
            t["rows"].append(row)
        floor = next(r for r in t["rows"] if r["cache_slack"] == 0.0)["ratio"]
        t["floor_ratio"] = floor
        t["ratio_limit"] = max(RATIO_TARGET, floor or RATIO_TARGET) + RATIO_TOLERANCE
        out.append(t)
        print_trace(t)
    if left_out:
        print(f"\nleft out for time: {', '.join(left_out)}")
    return out, left_out


def print_trace(t: Dict[str, Any]) -> None:
    secs = f"{t['step_seconds']:.3g} s" if t["step_seconds"] else "unknown"
    print(f"\n{t['trace']}: {t['events']} events, {t['steps']} steps ({t['step_cut']}); step "
          f"time {secs} ({t['step_time_source']})")
    print(f"  {'cache_slack':<14} {'phys/req':>8} {'maps':>7} {'unmaps':>7} {'created':>7} | "
          f"worst step after the first: {'remapped':>8} {'ms':>7} {'% step':>7} "
          f"{'created':>7} {'ms':>7}")

    def f(x: Optional[float], spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for r in t["rows"]:
        ratio = f(r["ratio"], ".3f") + ("+" if not r["complete"] else "")
        print(f"  {r['label']:<14} {ratio:>8} {r['maps']:>7} {r['unmaps']:>7} {r['created']:>7} | "
              f"{'':>27} {f(r['steady_remapped_max'], 'd'):>8} {f(r['steady_remap_ms_max'], '.3g'):>7} "
              f"{f(r['steady_percent_max'], '.2f'):>7} {f(r['steady_created_max'], 'd'):>7} "
              f"{f(r['steady_created_ms_max'], '.3g'):>7}"
              + (f"  ({r['stopped']})" if r.get("stopped") else ""))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"candidates {', '.join(map(label, QUICK_CANDIDATES))} "
                   "only, on the smallest trace (a smoke run: seconds)")
    p.add_argument("--traces-dir", action="append", default=[], type=existing_dir, metavar="DIR",
                   help="look for real GPU traces (*-gpu.json.gz) here first (repeatable); "
                   "then bench/traces")
    p.add_argument("--cpu-traces", action="store_true", help="the bundled CPU-made traces "
                   "even when GPU traces exist")
    p.add_argument("--alloc-micro", default=None, type=existing_file, metavar="FILE",
                   help="alloc_micro.json with the remap cost (default bench/results/)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for cache_slack.json, and of the e2e results it reads step times "
                   "from (default bench/results; --quick: nothing written)")
    p.add_argument("--max-seconds", type=positive_float, default=None, metavar="S",
                   help="start no new trace after this long (the JSON names those left out)")
    p.add_argument("--stop-at", type=float, default=None, metavar="EPOCH", help="epoch "
                   "seconds: leave out a trace whose replays would end later")
    args = p.parse_args(argv)
    out = output_dir(args.quick, args.out)
    if args.cpu_traces and args.traces_dir:
        p.error("--traces-dir: not with --cpu-traces (which replays the bundled traces only)")

    try:
        with open(args.alloc_micro or os.path.join(RESULTS, "alloc_micro.json")) as f:
            micro = json.load(f)
    except FileNotFoundError:   # only the default can be missing (a given one is checked)
        micro = None
    cost = remap_cost(micro)
    paths, real = find_traces([] if args.cpu_traces else
                              list(args.traces_dir) + [os.path.join(HERE, "traces")])
    if not paths:
        raise SystemExit("cache_slack: no traces found (bench/traces/*.json.gz)")
    candidates = QUICK_CANDIDATES if args.quick else CANDIDATES
    if args.quick:
        paths = sorted(paths, key=os.path.getsize)[:1]
    print(f"traces: {'recorded on a GPU' if real else 'bundled, made on the CPU (simulated)'}: "
          + ", ".join(os.path.basename(x) for x in paths))
    print(f"remap cost: {cost['us_per_chunk_remapped']:.3g} us per chunk ({cost['source']}, "
          f"{cost['measured_on']}); created chunk: {cost['us_per_chunk_created']} us")
    traces, left_out = run(paths, cost, candidates, args.out or RESULTS, args.max_seconds,
                           args.stop_at)
    missing = missing_gpu_traces(paths) if real and not args.quick else []
    decision = decide(traces, cost, candidates, real, current_default(), left_out, missing)
    print("\n" + decision["verdict"])

    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # less --stop-at: the device call's deadline, which a later run would be long past
    command = reproduce_command("bench/cache_slack.py", argv if argv is not None else sys.argv[1:])
    meta = run_meta(command, device)
    meta.update({"remap_cost_from": cost["source"], "remap_cost_measured_on": cost["measured_on"],
                 "alloc_micro_date": (micro.get("meta") or {}).get("date"), "quick": args.quick})
    if left_out:   # scripts/gpu-check then runs it again in a later call
        meta.update({"incomplete": True, "not_run": len(left_out), "left_out": list(left_out)})
    if out is None:
        say_nothing_written()
        return 0
    path = write_json("cache_slack", {
        "meta": meta, "chunk_size": CHUNK, "candidates": [label(s) for s in candidates],
        "traces_used": "recorded on a GPU" if real else "bundled CPU-made (simulated)",
        "rule": {"ratio_target": RATIO_TARGET, "ratio_tolerance": RATIO_TOLERANCE,
                 "remap_threshold_percent": REMAP_THRESHOLD_PERCENT,
                 "text": "the largest finite slack whose physical/requested peak is at most "
                         "max(1.05, slack-0 floor) + 0.02 on every trace, if its remaps cost at "
                         "most 3% of a step (worst step after the first) on every trace; else "
                         "why not, and of the slacks under 3% the one with the least ratio "
                         "on its worst trace (of ties, the loosest)",
                 "prefer_remap": "prefer_remap=True is cache_slack=0 without a budget "
                                 "(csrc/alloc/allocator.cpp gather); not a separate axis"},
        "remap_cost": cost, "traces": traces, "left_out": left_out, "decision": decision,
        "verdict": decision["verdict"]}, out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
