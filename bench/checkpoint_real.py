"""Checkpointing real models with scheduler.wrap: throughput vs peak memory (seed 002 Figure 3,
on hardware), for rotor, pofo, periodic plans run by the chain runtime, PyTorch's own
``checkpoint_sequential`` (every segment count) and plain PyTorch.

On a GPU (the real benchmark): ResNet-101 at 1000x1000 and a GPT-2-style model; peaks are
``torch.cuda.max_memory_allocated`` during a training step beyond what is allocated before it
(parameters, their gradients, the input), plus the input. Budgets: for every segment count
of ``checkpoint_sequential``, its measured peak, so rotor (and pofo) run at exactly the
memory periodic used and the throughput gain at equal memory is direct (the paper reports
+17.2% on average for rotor over the best periodic).

Without a GPU (``--cpu``, or automatically): a tiny CPU mode (a small ResNet and GPT-2 on
small inputs, peaks from the runner's activation accounting) that keeps the script honest.

    python bench/checkpoint_real.py [--quick] [--cpu] [--models resnet101,gpt2]
        [--steps 5] [--bandwidth 12e9] [--threads 1] [--out DIR]

Writes bench/results/checkpoint_real-<device>.json (+ .png); ``--out DIR`` writes them there
instead; ``--quick`` (a smoke run that leaves the committed results alone) writes nothing unless
``--out``. The file is written after
every model, and one failure loses nothing else: a configuration that raises (out of memory, a
pofo or stream error) is a row of its own (``status`` ``oom`` or ``error``, ``note`` the
message) and the rest goes on; a model that fails before its rows (building it, measuring its
chain) is recorded with its ``error``, the other models still run, and the exit status is 1.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint_sequential

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run from a checkout (as bench/common.py)
    import checkout
    checkout.on_path()

import scheduler  # noqa: E402
from bench.common import (output_dir, positive_float, positive_int,  # noqa: E402
                          say_nothing_written, usage_error)
from bench.models import build  # noqa: E402
from scheduler.plan import checkpoint_plan  # noqa: E402
from scheduler.profile import measure_chain  # noqa: E402
from vmalloc.atomic_file import write_atomic  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

GPU_MODELS = {
    "resnet101": dict(name="resnet101", batch=4, image=1000),
    "gpt2": dict(name="gpt2", batch=4, seq_len=1024),
}
CPU_MODELS = {
    "resnet18": dict(name="resnet18", batch=2, image=64),
    "gpt2": dict(name="gpt2", batch=2, seq_len=64, n_layer=4, n_embd=64, n_head=4, vocab=500),
}


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    logits = out.reshape(-1, out.shape[-1]).float()
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long,
                                               device=out.device))


def pinned_bandwidth(device: str) -> float:
    """Host-to-device bytes/s of a pinned copy (pofo's bandwidth)."""
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * n / (time.perf_counter() - t0)


def error_row(exc: BaseException) -> Dict[str, Any]:
    """A configuration that raised: its row says so, with the message."""
    return {"status": "error", "note": f"{type(exc).__name__}: {exc}"[:300]}


class Runner:
    """Times training steps of one configuration and measures its peak."""

    def __init__(self, device: str, steps: int, warmup: int = 1):
        self.device, self.steps, self.warmup = device, steps, warmup

    def run(self, step: Callable[[], None], params: List[torch.nn.Parameter],
            cpu_peak: Optional[Callable[[], int]] = None, x0_bytes: int = 0) -> Dict[str, Any]:
        cuda = self.device == "cuda"
        try:
            for p in params:  # gradients exist before: the peak is activations only
                p.grad = torch.zeros_like(p)
            for _ in range(self.warmup):
                step()
            times, peaks = [], []
            for _ in range(self.steps):
                if cuda:
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                peaks.append(torch.cuda.max_memory_allocated() - base + x0_bytes if cuda
                             else (cpu_peak() if cpu_peak else 0))
            # each step's time beside the median: how much two steps of one configuration
            # differ says whether a gap between configurations is noise
            return {"status": "ok", "step_s": statistics.median(times), "peak": max(peaks),
                    "step_times": [round(t, 6) for t in times]}
        except torch.cuda.OutOfMemoryError as e:  # type: ignore[attr-defined]
            return {"status": "oom", "note": str(e)[:200]}
        except Exception as e:  # noqa: BLE001 - one failed configuration must not end the run
            return error_row(e)
        finally:
            for p in params:
                p.grad = None
            if cuda:
                torch.cuda.empty_cache()


def bench_model(key: str, spec: Dict[str, Any], device: str, steps: int, bandwidth: float,
                quick: bool) -> Dict[str, Any]:
    spec = dict(spec)
    zoo = build(spec.pop("name"), **spec)
    torch.manual_seed(0)
    blocks = [b.to(device) for b in zoo.blocks]
    x = zoo.sample_input(device=device)
    batch = x.shape[0]
    L = len(blocks)
    params = [p for b in blocks for p in b.parameters()]
    runner = Runner(device, steps)
    x0_bytes = x.numel() * x.element_size()
    chain = measure_chain(blocks, x, loss="cross_entropy", input_grad=False,
                          repeat=2 if quick else 5)
    rows: List[Dict[str, Any]] = []

    def record(method: str, res: Dict[str, Any], **extra: Any) -> Dict[str, Any]:
        row = {"model": key, "method": method, "batch": batch, **extra, **res}
        if res.get("status") == "ok":
            row["throughput"] = batch / res["step_s"]
        rows.append(row)
        tp = f"{row.get('throughput', 0):9.2f}/s" if "throughput" in row else f"{row['status']:>11}"
        pk = f"{row['peak'] / 2**20:10.1f} MiB" if "peak" in row else ""
        print(f"  {key:>10} {method:<28} {tp} {pk}")
        return row

    # plain PyTorch
    def plain_step() -> None:
        v = x
        for b in blocks:
            v = b(v)
        loss_fn(v).backward()
    res = runner.run(plain_step, params, None, x0_bytes)
    if device != "cuda" and res["status"] == "ok":
        # CPU: the peak of plain training is what the runner holds with an all-F_all plan
        try:
            probe = scheduler.wrap(blocks, None, planner="none", track_memory=True, chain=chain)
            res["peak"] = cpu_peak(probe, x, params)
        except Exception as e:  # noqa: BLE001
            res = error_row(e)
    record("plain", res,
           predicted_peak=scheduler.simulate(chain, checkpoint_plan(L, [])).peak_memory)

    # torch's checkpoint_sequential, every segment count (the budgets for the others)
    seq = torch.nn.Sequential(*blocks)

    def same_plan(segs: int) -> None:
        """Our runtime on checkpoint_sequential's own plan (``periodic.solve``), the output
        held as ck_step holds it: its measured peak against torch's says whether a gap to the
        chain model's prediction is the model's (both below it) or the runtime's (ours above
        torch's). Not a budget, nor a periodic row of the summary."""
        try:
            plan = scheduler.planners.periodic.solve(chain, segs)
            model = scheduler.wrap(blocks, None, planner=plan)
        except Exception as e:  # noqa: BLE001 - this row only
            record(f"wrap:checkpoint_sequential({segs})", error_row(e), segments=segs)
            return

        def step() -> None:
            out = model(x)
            loss_fn(out).backward()
        record(f"wrap:checkpoint_sequential({segs})", runner.run(step, params, None, x0_bytes),
               segments=segs, predicted_peak=plan.predicted_peak)
    seg_counts = sorted({s for s in range(2, L + 1)} if not quick else
                        {2, max(2, int(L ** 0.5)), max(2, L // 2)})
    budgets = []
    for segs in seg_counts:
        def ck_step(segs: int = segs) -> None:
            # the output held through the backward, as plain_step holds it and as our runtime
            # (and the chain model: x[L] until B L) does: let go, it frees the logits before the
            # loss's backward (GPT-2 batch 4: 823 MB, 25% of checkpoint_sequential(7)'s peak
            # on an H100), and the budgets taken from these rows were not ones the others could
            # meet whatever their plan
            out = checkpoint_sequential(seq, segs, x, use_reentrant=False)
            loss_fn(out).backward()
        if device == "cuda":
            row = record(f"checkpoint_sequential({segs})", runner.run(ck_step, params, None,
                                                                      x0_bytes), segments=segs)
            if row["status"] == "ok":
                budgets.append(int(row["peak"]))
            same_plan(segs)
        else:  # CPU: run the same periodic plan through the runner to get its held peak
            try:
                plan = scheduler.planners.periodic.solve(chain, segs)
            except Exception as e:  # noqa: BLE001
                record(f"checkpoint_sequential({segs})", error_row(e), segments=segs)
                continue
            budgets.append(int(plan.predicted_peak))
    budgets = sorted(set(budgets), reverse=True)

    # our runtime: periodic / rotor / pofo at each budget
    def wrapped(planner: str, budget: int) -> None:
        """One row of our runtime: ``planner`` at ``budget`` (raises what planning raises)."""
        model = scheduler.wrap(blocks, budget, planner=planner, chain=chain,
                               bandwidth=bandwidth if planner == "pofo" else None,
                               sample_input=x)
        plan = model.last_plan or model.plan_for(x)
        peak = cpu_peak(model, x, params) if device != "cuda" else None
        model.track_memory = False  # time without the accounting
        res = runner.run(lambda: loss_fn(model(x)).backward(), params, None, x0_bytes)
        if peak is not None and res["status"] == "ok":
            res["peak"] = peak
        record(f"wrap:{planner}", res, budget=budget, predicted_peak=plan.predicted_peak,
               predicted_time=plan.predicted_time,
               offloads=plan.count("offload"), recomputes=sum(
                   1 for op in plan if op.kind in ("F_all", "F_ck", "F_none")) - (L + 1))

    for budget in budgets:
        for planner in ("periodic", "rotor", "pofo"):
            try:
                wrapped(planner, budget)
            except scheduler.InfeasibleError as e:
                record(f"wrap:{planner}", {"status": "infeasible", "note": str(e)[:200]},
                       budget=budget)
            except Exception as e:  # noqa: BLE001 - planning or a stream error: this row only
                record(f"wrap:{planner}", error_row(e), budget=budget)
    return {"model": key, "L": L, "batch": batch, "chain": chain.to_dict(), "rows": rows,
            "budgets": budgets}


def cpu_peak(model, x: torch.Tensor, params: List[torch.nn.Parameter]) -> int:
    """One tracked step: the activation bytes the runner held at its peak (CPU accounting)."""
    model.track_memory = True
    loss_fn(model(x)).backward()
    for p in params:
        p.grad = None
    return model.stats()["last_peak_bytes"]


def summarize(result: Dict[str, Any]) -> Dict[str, Any]:
    """At each budget: rotor's throughput over the best periodic that fits, pofo's over rotor."""
    out = {}
    for m in result["models"]:
        by = {}
        for r in m["rows"]:
            if r.get("status") == "ok" and "budget" in r:
                by.setdefault(r["budget"], {})[r["method"]] = r["throughput"]
        # best periodic at a budget: the fastest periodic configuration whose peak fits it
        periodic = [(r["peak"], r["throughput"]) for r in m["rows"] if r.get("status") == "ok"
                    and (r["method"].startswith("checkpoint_sequential") or
                         r["method"] == "wrap:periodic")]
        gains_rotor, gains_pofo = [], []
        for b, tp in sorted(by.items()):
            fit = [t for p, t in periodic if p <= b * 1.0001]
            if "wrap:rotor" in tp and fit:
                gains_rotor.append(tp["wrap:rotor"] / max(fit) - 1)
            if "wrap:rotor" in tp and "wrap:pofo" in tp:
                gains_pofo.append(tp["wrap:pofo"] / tp["wrap:rotor"] - 1)
        out[m["model"]] = {
            "rotor_vs_best_periodic_mean_gain": statistics.mean(gains_rotor) if gains_rotor else None,
            "pofo_vs_rotor_mean_gain": statistics.mean(gains_pofo) if gains_pofo else None,
            "budgets": len(by)}
    return out


def plot(result: Dict[str, Any], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        groups: Dict[str, List[Tuple[float, float]]] = {}
        for r in m["rows"]:
            if r.get("status") != "ok":
                continue
            name = r["method"].split("(")[0]   # checkpoint_sequential(k): one line of all k
            groups.setdefault(name, []).append((r["peak"] / 2**20, r["throughput"]))
        for name, pts in groups.items():
            pts.sort()
            ax.plot([p for p, _ in pts], [t for _, t in pts], "o-" if len(pts) > 1 else "o",
                    label=name, ms=4)
        ax.set(xlabel="peak memory (MiB)", ylabel="samples / s",
               title=f"{m['model']} (batch {m['batch']}, {result['meta']['device']})")
        if ax.get_legend_handles_labels()[0]:   # (a model that failed has no points)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer budgets and steps (a smoke run)")
    ap.add_argument("--cpu", action="store_true", help="the tiny CPU mode (default without CUDA)")
    ap.add_argument("--models", default=None, help="comma-separated subset (GPU: "
                    f"{','.join(GPU_MODELS)}; CPU: {','.join(CPU_MODELS)})")
    ap.add_argument("--steps", type=positive_int, default=None, metavar="N",
                    help="timed steps per configuration (default 5 on a GPU, 3 with --quick; "
                         "2 on the CPU)")
    ap.add_argument("--bandwidth", type=positive_float, default=None, metavar="BYTES_PER_S",
                    help="pofo's host-device bytes/s (default: measured on the GPU; 12e9 on CPU)")
    ap.add_argument("--threads", type=positive_int, default=1, metavar="N",
                    help="torch intra-op threads in the CPU mode (default 1)")
    ap.add_argument("--out", default=None, metavar="DIR", help="folder for "
                    "checkpoint_real-<device>.json/.png (default bench/results; --quick: none)")
    args = ap.parse_args(argv)
    out = output_dir(args.quick, args.out, RESULTS)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    table = GPU_MODELS if device == "cuda" else CPU_MODELS
    keys = args.models.split(",") if args.models else list(table)
    unknown = [k for k in keys if k not in table]
    if unknown:   # before any model runs
        usage_error(f"--models {args.models!r}: unknown on {device} "
                    f"{', '.join(map(repr, unknown))} (known: {', '.join(table)})", parser=ap)
    if device == "cpu":
        torch.set_num_threads(args.threads)
    # on a GPU at least 3, so that the median is one (of 2 it is their mean)
    steps = args.steps or (2 if device == "cpu" else 3 if args.quick else 5)
    bandwidth = args.bandwidth or (pinned_bandwidth(device) if device == "cuda" else 12e9)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device {gpu}, pofo bandwidth {bandwidth / 1e9:.1f} GB/s, {steps} timed steps")
    result: Dict[str, Any] = {
        "meta": {"bench": "checkpoint_real", "device": device, "gpu": gpu,
                 "torch": torch.__version__, "machine": platform.machine(),
                 "date": time.strftime("%Y-%m-%d"), "bandwidth": bandwidth, "steps": steps,
                 "command": "python bench/checkpoint_real.py " + " ".join(
                     sys.argv[1:] if argv is None else argv),
                 "peak": ("torch.cuda.max_memory_allocated beyond params/grads/input, plus input"
                          if device == "cuda" else
                          "activation bytes held by the chain runner (CPU accounting); "
                          "checkpoint_sequential rows: not run on CPU")},
        "models": []}
    tag = "cpu" if device == "cpu" else gpu.replace(" ", "_")
    path = None if out is None else os.path.join(out, f"checkpoint_real-{tag}.json")
    if out is not None:
        os.makedirs(out, exist_ok=True)
    failed = []
    for key in keys:
        print(f"{key}:")
        try:
            result["models"].append(bench_model(key, table[key], device, steps, bandwidth,
                                                args.quick))
        except Exception as e:  # noqa: BLE001 - the other models still run
            failed.append(key)
            print(f"  {key}: failed before its rows: {type(e).__name__}: {e}", file=sys.stderr)
            result["models"].append(failed_model(key, e))
        write_result(result, path)   # after every model: a later failure loses nothing
    for k, v in result["summary"].items():
        rv = v["rotor_vs_best_periodic_mean_gain"]
        pv = v["pofo_vs_rotor_mean_gain"]
        print(f"{k}: rotor vs best periodic at equal memory "
              f"{'n/a' if rv is None else f'{100 * rv:+.1f}%'}; pofo vs rotor "
              f"{'n/a' if pv is None else f'{100 * pv:+.1f}%'} ({v['budgets']} budgets)")
    if path is None:
        say_nothing_written()
    else:
        plot(result, path.replace(".json", ".png"))
        print(f"wrote {path}")
    if failed:
        raise SystemExit(f"checkpoint_real: {', '.join(failed)} failed"
                         + ("" if path is None else f" (recorded in {path})"))


def failed_model(key: str, exc: BaseException) -> Dict[str, Any]:
    """A model that failed before any row (building it, measuring its chain): recorded so."""
    return {"model": key, "L": None, "batch": None, "rows": [], "budgets": [],
            "status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}


def write_result(result: Dict[str, Any], path: Optional[str]) -> None:
    """The summary of the models so far, and the file (written then renamed: a kill leaves
    the last whole file; None: no file, --quick without --out)."""
    result["summary"] = summarize(result)
    if path is not None:
        write_atomic(path, json.dumps(result, indent=1))

if __name__ == "__main__":
    main()
