"""Record real allocation traces on a GPU: PyTorch's own allocation history for a few training
steps, under plain PyTorch and under the swap runtime (issue 12, step 3).

    python bench/traces/record_gpu.py [--quick] [--out bench/traces] [--steps 3]

For each workload (ResNet-50 at batch 256, GPT-2 at sequence 1024, BERT with variable lengths)
and each method (``native``: plain training; ``window``: ``scheduler.swap``) one child process
builds the model, turns on ``torch.cuda.memory._record_memory_history`` (no stack frames: the
trace stays small), trains ``--steps`` SGD steps on the native caching allocator, and dumps the
snapshot. The parent turns it into the project's trace format (``vmalloc.replay.trace``,
gzip'ed JSON, a few hundred KB) with ``meta.real_gpu_trace = True`` and what PyTorch itself
reported: peak reserved and peak allocated bytes, each step's wall time (``step_seconds``,
synchronized, under recording) and first event (``step_starts``: the child counts PyTorch's
allocations at each step's start; ``bench/cache_slack.py`` cuts the trace there). It then
replays the trace through the model of the caching allocator (``vmalloc.replay.caching_model``)
and reports the model's error: its predicted peak reserved bytes against what PyTorch really
reserved, in percent. Beside PyTorch's counter, the trace's own count of what it reserved
(``trace_reserved_peak``: segments mapped less segments freed) and what would make the
comparison unfair (``model_comparison_unfair``: cached segments released on an allocation
failure, a full history ring, memory reserved before recording, expandable segments) are
recorded; the children run with PyTorch's allocator settings and vmalloc's variables
unset, so the caching allocator follows the default rules the model knows. Each job has
``CHILD_TIMEOUT_S``; ``traces-gpu.json`` is rewritten after every job. A job whose trace file is
already in ``--out`` (an earlier call cut off at its time limit, or committed) is not recorded
again: its row is kept from ``traces-gpu.json``, or rebuilt from the trace's own ``meta``
(``--fresh`` records every job again).

Results: the traces in ``--out`` (``<model>-b<batch>-<method>-gpu.json.gz``) and
``bench/results/traces-gpu.json`` (per trace: events, peaks, model error). Without CUDA it
says so and exits 0 (``scripts/gpu-check`` runs it on every machine).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: bench/checkout.py says where the packages are
    sys.path.insert(0, str(ROOT / "bench"))
    import checkout
    checkout.on_path()


@dataclass(frozen=True)
class Job:
    model: str            # bench/e2e.py's model names
    batch: int
    method: str           # "native" (plain) or "window" (scheduler.swap)
    budget: Optional[str] = None   # the swap runtime's saved-tensor budget

    @property
    def stem(self) -> str:
        return f"{self.model}-b{self.batch}-{self.method}-gpu"


JOBS: Sequence[Job] = (
    Job("resnet50", 256, "native"), Job("resnet50", 256, "window", "8GiB"),
    Job("gpt2-s1024", 8, "native"), Job("gpt2-s1024", 8, "window", "4GiB"),
    Job("bert-dyn", 32, "native"), Job("bert-dyn", 32, "window", "2GiB"),
)
QUICK_JOBS: Sequence[Job] = (Job("resnet50", 64, "native"), Job("resnet50", 64, "window", "2GiB"))
MAX_ENTRIES = 2_000_000   # history ring: far more than a few steps allocate
CHILD_TIMEOUT_S = 240     # one job (gpu-check gives the whole step 420 s)


def record_one(job: Job, steps: int, snapshot_path: str) -> Dict[str, Any]:
    """In a fresh process: train ``steps`` steps of ``job`` while recording, dump the snapshot
    to ``snapshot_path``; return PyTorch's own peak figures."""
    import torch

    from bench.e2e import BY_NAME, build_workload, loss_of, method_context

    device = torch.device("cuda")
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=MAX_ENTRIES)

    def allocs() -> int:   # PyTorch counts each allocation where it records its trace entry
        return int(torch.cuda.memory_stats(device).get("allocation.all.allocated", 0))

    base = allocs()
    step_allocs: List[int] = []      # allocations recorded before each step, then in all
    step_seconds: List[float] = []
    wl = build_workload(job.model, job.batch, device, smoke=False, seed=0)
    params = list({id(p): p for b in wl.blocks for p in b.parameters()}.values())
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    method = BY_NAME[job.method]
    budget = None if job.budget is None else _parse(job.budget)
    torch.manual_seed(0)
    with method_context(method, wl, budget, device, None) as (forward, _stats):
        for step in range(steps):
            torch.cuda.synchronize()
            step_allocs.append(allocs() - base)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = loss_of(forward(wl.input(step)), wl)
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            step_seconds.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    step_allocs.append(allocs() - base)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(snapshot_path, "wb") as f:
        pickle.dump(snap, f)
    return {"reserved_peak": int(torch.cuda.max_memory_reserved()),
            "allocated_peak": int(torch.cuda.max_memory_allocated()),
            "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda, "step_seconds": step_seconds, "step_allocs": step_allocs,
            "allocator_settings": snap.get("allocator_settings", {}),  # (JSON: default=str)
            **segment_figures(snap, device.index or 0, MAX_ENTRIES)}


def segment_figures(snap: Dict[str, Any], device: int, max_entries: int) -> Dict[str, Any]:
    """What the trace itself says PyTorch reserved: the segments it mapped and freed during
    the recording (``segment_alloc``/``segment_map`` minus ``segment_free``/``segment_unmap``,
    on top of what was reserved when recording began), and what makes the comparison with the
    model unfair, counted: releases of cached segments and out-of-memory retries (the model
    never runs out), a full history ring (events lost), expandable segments (other rules)."""
    entries = (snap.get("device_traces") or [[]])[device] if snap.get("device_traces") else []
    net = peak = 0
    counts: Dict[str, int] = {}
    for e in entries:
        action = e.get("action")
        counts[action] = counts.get(action, 0) + 1
        if action in ("segment_alloc", "segment_map"):
            net += int(e.get("size", 0))
            peak = max(peak, net)
        elif action in ("segment_free", "segment_unmap"):
            net -= int(e.get("size", 0))
    at_end = sum(int(s.get("total_size", 0)) for s in snap.get("segments", ())
                 if s.get("device", device) == device)
    start = at_end - net
    settings = snap.get("allocator_settings") or {}
    unfair = [why for why, bad in (
        ("cached segments released (an allocation failed and was retried)",
         counts.get("segment_free", 0) + counts.get("oom", 0) > 0),
        ("the history ring was full: early events lost", len(entries) >= max_entries),
        ("recording began with memory reserved", start != 0),
        ("expandable segments", bool(settings.get("expandable_segments")))) if bad]
    return {"trace_reserved_peak": start + peak, "trace_actions": counts,
            "model_comparison_unfair": unfair}


def _parse(size: str) -> int:
    from vmalloc.sizes import parse_size
    return parse_size(size, "budget")


def model_error(trace: Any, reserved_peak: int) -> Dict[str, Any]:
    """The caching-allocator model's predicted peak reserved bytes for ``trace`` against what
    PyTorch really reserved (``reserved_peak``): error in percent, positive = over-predicts."""
    from vmalloc.replay.caching_model import CachingAllocatorModel
    from vmalloc.replay.run import replay

    res = replay(trace, CachingAllocatorModel())
    predicted = int(res.stats["physical_peak"])
    return {"model_reserved_peak": predicted, "reserved_peak": reserved_peak,
            "model_error_percent": 100.0 * (predicted - reserved_peak) / reserved_peak
            if reserved_peak else None}


def step_starts(trace: Any, step_allocs: Optional[Sequence[int]]) -> Optional[List[int]]:
    """Index of each step's first event in ``trace``, from ``step_allocs`` (allocations recorded
    before each step, then in all). The recorded allocations are the trace's last ones: blocks
    that predate the recording come first (``from_snapshot``). None when the counts do not fit
    the trace (the history ring dropped entries, or no counts)."""
    if not step_allocs or len(step_allocs) < 2:
        return None
    alloc_at = [i for i, e in enumerate(trace.events) if e.action == "alloc"]
    offset = len(alloc_at) - step_allocs[-1]
    if offset < 0 or any(b < a for a, b in zip(step_allocs, step_allocs[1:])) or step_allocs[0] < 0:
        return None
    return [alloc_at[offset + c] if offset + c < len(alloc_at) else len(trace.events)
            for c in step_allocs[:-1]]


def convert(snapshot_path: str, job: Job, figures: Dict[str, Any], steps: int,
            out_dir: Path) -> Dict[str, Any]:
    """Snapshot -> ``out_dir/<stem>.json.gz`` with the recording's facts in ``meta``; the row
    of ``traces-gpu.json``."""
    from vmalloc.replay import load

    trace = load(snapshot_path)
    starts = step_starts(trace, figures.get("step_allocs"))
    trace.meta.update({
        "name": job.stem, "source": "recorded: torch.cuda.memory._record_memory_history "
        "(native caching allocator)", "real_gpu_trace": True,
        "derived_from": f"bench/traces/record_gpu.py: {job.model} batch {job.batch}, "
                        f"{steps} SGD steps, method {job.method}"
                        + (f", saved-tensor budget {job.budget}" if job.budget else ""),
        "model": job.model, "batch": job.batch, "method": job.method, "steps": steps,
        "step_starts": starts, **figures})
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{job.stem}.json.gz"
    trace.save(path)
    return row_of(trace, path, job, figures)


def row_of(trace: Any, path: Path, job: Job, figures: Dict[str, Any]) -> Dict[str, Any]:
    """The row of ``traces-gpu.json`` for ``trace`` saved at ``path``."""
    row = {"trace": path.name, "model": job.model, "batch": job.batch, "method": job.method,
           "events": len(trace), "peak_requested": trace.peak_requested(),
           "bytes_on_disk": path.stat().st_size, **figures}
    row.update(model_error(trace, figures["reserved_peak"]))
    return row


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one small ResNet-50 pair (a minute)")
    p.add_argument("--steps", type=int, default=3, help="training steps recorded per trace")
    p.add_argument("--out", default=str(ROOT / "bench" / "traces"), help="where traces go")
    p.add_argument("--results", default=str(ROOT / "bench" / "results"),
                   help="where traces-gpu.json goes")
    p.add_argument("--fresh", action="store_true", help="record every job again, also those "
                   "whose trace file is already in --out (default: keep them, resume)")
    p.add_argument("--one", help=argparse.SUPPRESS)        # child: JSON job spec
    p.add_argument("--snapshot", help=argparse.SUPPRESS)   # child: where to dump
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")

    if args.one:
        figures = record_one(Job(**json.loads(args.one)), args.steps, args.snapshot)
        print("FIGURES " + json.dumps(figures, default=str), flush=True)
        return 0

    import torch
    if not torch.cuda.is_available():
        print("record_gpu: no CUDA device; nothing recorded (run it on a GPU machine)")
        return 0
    from bench.common import write_json
    from bench.e2e import meta   # machine, GPU, driver, torch, CUDA, date
    command = " ".join(["python", "bench/traces/record_gpu.py", *(argv or sys.argv[1:])])
    head = meta(torch.device("cuda"), command) | {"steps": args.steps}
    rows: List[Dict[str, Any]] = []
    failed = 0
    jobs = QUICK_JOBS if args.quick else JOBS
    earlier = {} if args.fresh else earlier_rows(Path(args.results) / "traces-gpu.json")
    # the native caching allocator with its default rules, which the model follows: none of
    # the settings that change them, and not vmalloc
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VMALLOC") and k not in ("PYTORCH_CUDA_ALLOC_CONF",
                                                       "PYTORCH_ALLOC_CONF")}
    with tempfile.TemporaryDirectory() as tmp:
        for i, job in enumerate(jobs, 1):
            kept = None if args.fresh else kept_row(job, Path(args.out), earlier)
            if kept is not None:   # resumed: a recording costs minutes of device time
                print(f"[{i}/{len(jobs)}] {job.stem}: its trace is already in {args.out}, kept "
                      "(--fresh records it again)", flush=True)
                rows.append(kept)
            else:
                print(f"[{i}/{len(jobs)}] recording {job.stem} ...", flush=True)
                rows.append(_record(job, args, tmp, env))
            failed += rows[-1]["status"] != "ok"
            # written after every job: a step killed for time keeps what it recorded
            path = write_json("traces-gpu", {"meta": head | {"jobs": len(jobs)}, "rows": rows},
                              args.results)
    print(f"wrote {path}")
    return 1 if failed else 0


# a recorded trace's meta beside the recording's figures: the snapshot loader's and convert's
NOT_FIGURES = ("source", "device", "units", "incomplete", "name", "real_gpu_trace",
               "derived_from", "model", "batch", "method", "steps", "step_starts")


def earlier_rows(path: Path) -> Dict[str, Dict[str, Any]]:
    """The ok rows of an earlier ``traces-gpu.json``, by trace file name; none when it is
    missing or does not parse (a write cut short: the rows are rebuilt from the traces)."""
    try:
        doc = json.loads(path.read_text())
        return {r["trace"]: r for r in doc["rows"]
                if isinstance(r, dict) and r.get("status") == "ok" and "trace" in r}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def kept_row(job: Job, out_dir: Path, earlier: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The row of ``job`` when its trace is already in ``out_dir`` (recorded on a GPU: not
    recorded again), from ``earlier`` or rebuilt from the trace's meta; None: record it (no
    trace, or one that does not load)."""
    path = out_dir / f"{job.stem}.json.gz"
    if not path.is_file():
        return None
    if path.name in earlier:
        return dict(earlier[path.name])
    from vmalloc.replay import load
    try:
        trace = load(path)
    except Exception as exc:  # noqa: BLE001 - a trace that does not load is recorded again
        print(f"  {path.name} does not load ({exc!r:.200}): recording it again")
        return None
    if not trace.meta.get("real_gpu_trace") or "reserved_peak" not in trace.meta:
        return None
    row = row_of(trace, path, job, {k: v for k, v in trace.meta.items() if k not in NOT_FIGURES})
    row["status"] = "ok"
    return row


def _record(job: Job, args: argparse.Namespace, tmp: str, env: Dict[str, str]) -> Dict[str, Any]:
    """One job in a child process, converted: its row (``status`` "ok" or "error")."""
    snap = os.path.join(tmp, f"{job.stem}.pickle")
    cmd = [sys.executable, __file__, "--one", json.dumps(job.__dict__), "--snapshot", snap,
           "--steps", str(args.steps)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"  FAILED: no result in {CHILD_TIMEOUT_S} s")
        return {"trace": job.stem, "status": "error", "note": f"timeout {CHILD_TIMEOUT_S} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FIGURES ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        print(f"  FAILED (exit {proc.returncode}):\n    " + "\n    ".join(tail))
        return {"trace": job.stem, "status": "error", "note": tail[-1:]}
    try:
        row = convert(snap, job, json.loads(lines[-1][len("FIGURES "):]), args.steps,
                      Path(args.out))
    except Exception as exc:  # noqa: BLE001 - one bad snapshot must not lose the others
        print(f"  FAILED converting: {exc!r}")
        return {"trace": job.stem, "status": "error", "note": f"convert: {exc!r}"[:300]}
    row["status"] = "ok"
    print(f"  {row['events']} events, {row['bytes_on_disk'] / 1e6:.2f} MB; reserved "
          f"{row['reserved_peak'] / 2**30:.2f} GiB (the trace's own count "
          f"{row['trace_reserved_peak'] / 2**30:.2f}), model "
          f"{row['model_reserved_peak'] / 2**30:.2f} GiB ({row['model_error_percent']:+.1f}%)"
          + (f"; not comparable: {'; '.join(row['model_comparison_unfair'])}"
             if row["model_comparison_unfair"] else ""))
    return row


if __name__ == "__main__":
    sys.exit(main())
