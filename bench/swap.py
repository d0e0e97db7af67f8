"""Benchmark the swap runtime (issue 6).

    python bench/swap.py [--quick] [--cpu-only | --gpu-only [--stop-at EPOCH]]
                         [--budget 16GiB] [--window 2GiB] [--worker-timeout 180] [--out DIR]

``--budget`` and ``--window`` apply to the GPU part only, but are checked (byte sizes > 0,
``vmalloc.sizes.parse_size``) on every run: a bad value exits 2 before anything runs.
``--out DIR`` (default ``bench/results``) is where ``swap.json`` / ``swap.png`` are read and
written; ``--quick`` (a smoke run) reads and writes nothing unless ``--out``: the committed file
is a full run.

CPU part (runs anywhere): the cost of the saved-tensor hooks when nothing needs swapping
(goal: <= 5% of the step time), the cost of real swapping on the CPU (copies into the host
pool; informative only), and planning time. Plain steps and steps inside ``scheduler.swap`` are
interleaved in rounds and compared by their medians; one intra-op thread for steadier numbers.

GPU part (only with CUDA; skipped with a message otherwise): ResNet-50 (224x224) and a
GPT-2-style model at growing batch sizes under one fixed device budget, images/s or tokens/s
for: no swapping (until OOM), ``torch.autograd.graph.save_on_cpu(pin_memory=True)``,
torchtune's ``OffloadActivations`` (streams on; if torchtune is installed), LMS, the window
runtime without vmalloc, with vmalloc (its budget and pressure callback), and following
``offload.dynprog`` (if that planner is present). Every configuration runs in its own process
(an OOM or a registered allocator cannot leak into the next). One table, one JSON, one PNG.

Writes ``bench/results/swap.json`` (and ``swap.png`` with the GPU part; ``--out`` elsewhere). ``--gpu-only`` (a
device session: the CPU part is measured on a machine without a GPU and committed) runs the
GPU part alone into the file's ``gpu`` key, keeping the rest, and writes it after every worker:
rows already there for the same budget and window are kept, so a run stopped by ``--stop-at``
(epoch seconds: no worker starts after it) or killed goes on where it stopped
(``gpu.incomplete`` says how many configurations are left). Each worker is killed after
``--worker-timeout`` seconds (default 180, well under a device step): its configuration is a
``timeout`` row, kept like ``ok`` and ``oom`` rows (only ``error`` rows run again), so a hang
costs one step once rather than every session.
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a script (bench/ is first on sys.path)
    import checkout
    checkout.on_path()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import scheduler  # noqa: E402
from scheduler.planners import window as window_planner  # noqa: E402
from scheduler.planners.swap_schedule import SwapSchedule, random_sequence, replay  # noqa: E402
from vmalloc.atomic_file import write_atomic  # noqa: E402
from vmalloc.sizes import format_size, parse_size  # noqa: E402

RESULTS = ROOT / "bench" / "results"


# ----------------------------------------------------------------------------- models
def _zoo(name: str, **kw: Any) -> Tuple[nn.Module, Callable[[int], Tuple[torch.Tensor, torch.Tensor]], str]:
    """A zoo model (issue 4b's bench/models) as one module, a batch maker, and its unit."""
    from bench.models import build

    zm = build(name, **kw)
    model = nn.Sequential(*zm.blocks)
    vocab = zm.vocab

    def batch(seed: int, device: Any = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
        x = zm.sample_input(device=device, seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        if vocab is not None:
            y = torch.randint(0, vocab, x.shape, generator=g)
        else:
            y = torch.randint(0, kw.get("num_classes", 1000), (x.shape[0],), generator=g)
        return x, y.to(device)

    return model, batch, ("tokens" if vocab is not None else "images")


def _mlp(batch_size: int = 128, width: int = 2048) -> Tuple[nn.Module, Callable, str]:
    model = nn.Sequential(nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 100))

    def batch(seed: int, device: Any = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch_size, 1024, generator=g).to(device),
                torch.randint(0, 100, (batch_size,), generator=g).to(device))

    return model, batch, "images"


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = out.float()
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


CPU_MODELS: Dict[str, Callable[[], Tuple[nn.Module, Callable, str]]] = {
    "mlp-2048 b128": lambda: _mlp(),
    "resnet18 64px b8": lambda: _zoo("resnet18", batch=8, image=64, num_classes=100),
    "gpt2 4x256 t128 b4": lambda: _zoo("gpt2", batch=4, seq_len=128, n_layer=4, n_embd=256,
                                       n_head=4, vocab=2000, n_positions=128),
}


# ------------------------------------------------------------------------ CPU part
def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    _loss(model(x), y).backward()
    opt.step()
    return time.perf_counter() - t0


def hook_cost_us(pairs: int = 200) -> float:
    """Microseconds the runtime adds per hook call (a pack, or an unpack; frees included),
    measured on a chain of tiny ops where the hooks dominate: a noise-robust price."""
    x = torch.randn(32, 32, requires_grad=True)

    def f() -> None:
        h = x
        for _ in range(100):
            h = h.relu()  # relu saves its output: one pack and one unpack per op
        h.sum().backward()

    ctx = scheduler.swap(window="2GiB", device="cpu", min_bytes=0)
    with ctx:
        f()
        f()
    plain, hooked = [], []
    for _ in range(pairs):
        t0 = time.perf_counter()
        f()
        plain.append(time.perf_counter() - t0)
        with ctx:
            t0 = time.perf_counter()
            f()
            hooked.append(time.perf_counter() - t0)
    return 1e6 * (min(hooked) - min(plain)) / 200  # 100 packs + 100 unpacks


def cpu_overhead(quick: bool) -> Tuple[List[Dict[str, Any]], float]:
    """Plain and hooked steps alternate (pairs), so load from other processes hits both alike.
    ``overhead_pct`` is the median of the per-pair relative differences (the goal's figure);
    ``overhead_pct_min`` compares the fastest step of each; ``overhead_pct_estimate`` is hooks
    per step times the per-hook price over the plain step (the least noisy of the three)."""
    pairs = 10 if quick else 30
    per_hook = hook_cost_us(100 if quick else 300)
    rows = []
    for name, make in CPU_MODELS.items():
        torch.manual_seed(0)
        model, batch, _ = make()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = batch(0)
        ctx = scheduler.swap(window="2GiB", device="cpu")  # nothing needs swapping
        for _ in range(2):  # warm up both paths (the first hooked step records and plans)
            _step(model, opt, x, y)
            with ctx:
                _step(model, opt, x, y)
        plain: List[float] = []
        hooked: List[float] = []
        for i in range(pairs):
            first_plain = i % 2 == 0
            for which in ((True, False) if first_plain else (False, True)):
                if which:
                    plain.append(_step(model, opt, x, y))
                else:
                    with ctx:
                        hooked.append(_step(model, opt, x, y))
        st = ctx.stats()
        seq = ctx.last_recorded
        p, h = min(plain), min(hooked)
        rows.append({
            "model": name, "plain_step_s": p, "swap_step_s": h,
            "overhead_pct": 100.0 * statistics.median(
                (b - a) / a for a, b in zip(plain, hooked)),
            "overhead_pct_min": 100.0 * (h - p) / p,
            "overhead_pct_estimate": 100.0 * len(seq) * per_hook * 1e-6 / p,
            "hooks_per_step": len(seq), "saved_bytes_per_step": seq.total_bytes(),
            "swapped_out_bytes": st["swapped_out_bytes"], "plans_computed": st["plans_computed"],
            "plain_median_s": statistics.median(plain),
            "swap_median_s": statistics.median(hooked)})
    return rows, per_hook


def cpu_swapping(quick: bool) -> List[Dict[str, Any]]:
    """Real swapping on the CPU (copies into the host pool): what the logic costs when it
    does work. Not a goal: there is no copy engine to overlap with here."""
    steps = 3 if quick else 6
    rows = []
    for name, make in CPU_MODELS.items():
        torch.manual_seed(0)
        model, batch, _ = make()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = batch(0)
        probe = scheduler.swap(window="2GiB", device="cpu")
        with probe:
            _step(model, opt, x, y)
        seq = probe.last_recorded
        plain_peak = replay(seq, SwapSchedule.empty(len(seq))).peak
        plain_t = statistics.median(_step(model, opt, x, y) for _ in range(steps))
        for frac in (0.5, 0.25):
            budget = max(int(plain_peak * frac), seq.min_budget()[0])
            w = max(seq.largest_tensor()[0], budget // 2)
            ctx = scheduler.swap(window=w, budget=budget, device="cpu")
            with ctx:
                _step(model, opt, x, y)  # records and plans
                times = [_step(model, opt, x, y) for _ in range(steps)]
            st = ctx.stats()
            rows.append({"model": name, "budget_fraction": frac, "budget_bytes": budget,
                         "window_bytes": w, "plain_peak_bytes": plain_peak,
                         "peak_resident_bytes": st["last_iteration_peak_resident_bytes"],
                         "swapped_out_bytes_per_step": st["swapped_out_bytes"] // (steps + 1),
                         "plain_step_s": plain_t, "swap_step_s": statistics.median(times),
                         "slowdown_pct": 100.0 * (statistics.median(times) - plain_t) / plain_t,
                         "planning_s": st["planning_seconds"]})
    return rows


def planning_time() -> List[Dict[str, Any]]:
    rows = []
    for n_vars in (1000, 5000):
        seq = random_sequence(n_vars, seed=0, max_size=1 << 20)
        budget = seq.min_budget()[0] * 8
        t0 = time.perf_counter()
        s = window_planner.schedule(seq, 16 << 20, budget)
        rows.append({"steps": len(seq), "variables": n_vars, "seconds": time.perf_counter() - t0,
                     "swap_outs": s.counts()["swap_out"]})
    return rows


# ------------------------------------------------------------------------ GPU part
GPU_METHODS = ["none", "save_on_cpu", "torchtune", "lms", "window", "window+vmalloc",
               "window+dynprog"]


def _gpu_models(quick: bool) -> Dict[str, Tuple[Dict[str, Any], List[int]]]:
    if quick:  # two batches each: 28 worker processes (about 6 min; gpu-check resumes them).
        # GPT-2 at batch 32 fits no method under 16 GiB (its log-softmax backward alone holds
        # 18.4 GiB: bench/e2e.py's op floor), so --quick stops at 16
        return {"resnet50": ({"name": "resnet50", "image": 224}, [64, 256]),
                "gpt2": ({"name": "gpt2", "seq_len": 1024}, [8, 16])}
    return {"resnet50": ({"name": "resnet50", "image": 224},
                         [64, 128, 192, 256, 384, 512, 768, 1024, 1280]),
            "gpt2": ({"name": "gpt2", "seq_len": 1024}, [4, 8, 16, 24, 32, 48, 64, 96])}


# vmalloc's counters a window+vmalloc row keeps (the first GPU run's was 27% slower than the
# window row at ResNet-50 batch 256, with nothing recorded to say why: remaps? stream waits?)
VMALLOC_KEYS = ("requested_peak", "physical_peak", "num_malloc", "num_map", "num_unmap",
                "num_remaps", "num_cache_hits", "num_splits", "num_chunks_created",
                "num_pressure_calls", "num_stream_waits", "driver_seconds")


def gpu_worker(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """One (model, method, batch) configuration, in its own process."""
    method, budget = cfg["method"], cfg["budget"]
    out: Dict[str, Any] = dict(cfg)
    if method == "window+vmalloc":
        import vmalloc
        vmalloc.enable(budget=budget)  # before CUDA allocates anything
    total = torch.cuda.get_device_properties(0).total_memory
    if method != "window+vmalloc":
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    spec = dict(cfg["model"])
    name = spec.pop("name")
    kw = dict(spec, batch=cfg["batch"])
    if name.startswith("resnet"):
        kw["num_classes"] = 1000
    model, batch, unit = _zoo(name, **kw, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x, y = batch(0, device="cuda")
    items = x.numel() if unit == "tokens" else x.shape[0]
    # the saved-tensor budget: the device budget less the static state (params, grads,
    # optimizer) after one plain optimizer step without activations, less 15% for transients
    opt.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    static = torch.cuda.memory_allocated()
    saved_budget = max(int((budget - static) * 0.85), 1 << 20)
    ctx: Any = None
    if method == "save_on_cpu":
        ctx_factory: Callable[[], Any] = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    elif method == "torchtune":
        from torchtune.training import OffloadActivations
        ctx_factory = lambda: OffloadActivations(use_streams=True)
    elif method.startswith("window") or method == "lms":
        planner = {"lms": "lms", "window+dynprog": "dynprog"}.get(method, "window")
        opts = {"swapout_threshold": 8, "swapin_ahead": 4} if planner == "lms" else {}
        ctx = scheduler.swap(window=cfg["window"], budget=saved_budget, planner=planner,
                             planner_options=opts)
        ctx.__enter__()
        ctx_factory = None
    else:
        ctx_factory = None
    try:
        times = []
        for i in range(cfg["warmup"] + cfg["steps"]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if ctx_factory is not None:
                with ctx_factory():
                    loss = _loss(model(x), y)
            else:
                loss = _loss(model(x), y)
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            if i >= cfg["warmup"]:
                times.append(time.perf_counter() - t0)
            del loss
        step = statistics.median(times)
        out.update(status="ok", step_s=step, throughput=items / step, unit=f"{unit}/s",
                   max_allocated=torch.cuda.max_memory_allocated()
                   if method != "window+vmalloc" else None)
        if ctx is not None:
            out["swap"] = ctx.stats()
        if method == "window+vmalloc":  # what the allocator did: why the row runs as it does
            import vmalloc
            vs = vmalloc.stats()
            out["vmalloc"] = {k: vs.get(k) for k in VMALLOC_KEYS}
    except torch.cuda.OutOfMemoryError as exc:
        out.update(status="oom", error=str(exc).splitlines()[0])
    except Exception as exc:  # noqa: BLE001 - one failed configuration must not end the run
        out.update(status="error", error=f"{type(exc).__name__}: {exc}".splitlines()[0])
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return out


def _available(method: str) -> Optional[str]:
    """None if the method can run here, else why not."""
    if method == "torchtune":
        try:
            importlib.import_module("torchtune.training").OffloadActivations  # noqa: B018
        except Exception:  # noqa: BLE001
            return "torchtune not installed"
    if method == "window+vmalloc":
        try:
            import vmalloc
            vmalloc.enable  # noqa: B018
        except Exception:  # noqa: BLE001
            return "vmalloc.enable unavailable"
    if method == "window+dynprog":
        try:
            importlib.import_module("scheduler.planners.offload")
        except ImportError:
            return "scheduler.planners.offload not present"
    return None


WORKER_TIMEOUT = 180.0   # s: well under a device step's time (gpu-check's swap step: 420 s)


def _worker_row(mname: str, cfg: Dict[str, Any], timeout: float = WORKER_TIMEOUT) -> Dict[str, Any]:
    """One configuration's row, from a worker process of its own, killed after ``timeout``
    seconds: a hung worker is a kept ``timeout`` row (resuming does not run it again) rather
    than a step that never ends and repeats every session."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--gpu-worker", json.dumps(cfg)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:   # (run killed the worker)
        row = dict(cfg, status="timeout",
                   error=f"the worker ran past --worker-timeout {timeout:g} s and was killed")
    else:
        try:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            row = dict(cfg, status="error", error=(proc.stderr or "no output")[-300:])
    row["model"] = mname
    row["worker_s"] = round(time.perf_counter() - t0, 1)  # the device time a row costs
    print(f"  {mname:9s} {cfg['method']:15s} batch {cfg['batch']:5d}: {row['status']}"
          + (f" {row['throughput']:.1f} {row['unit']}" if row["status"] == "ok" else ""),
          flush=True)
    return row


def gpu_comparison(quick: bool, budget: int, window: int,
                   earlier: Optional[List[Dict[str, Any]]] = None,
                   save: Optional[Callable[[List[Dict[str, Any]], Optional[int]], None]] = None,
                   stop_at: Optional[float] = None, worker_timeout: float = WORKER_TIMEOUT
                   ) -> Tuple[List[Dict[str, Any]], int]:
    """The rows, and how many configurations were left unrun for ``stop_at``. ``earlier``:
    rows of a run with the same budget and window, kept (those in error run again; a
    ``timeout`` row is kept: a hung configuration would hang again); ``save`` gets the rows
    after every worker (and None: how many are left is not known yet); ``worker_timeout``:
    seconds before a worker is killed."""
    kept = {(r["model"], r["method"], r.get("batch")): r for r in earlier or ()
            if r.get("status") != "error"}
    rows: List[Dict[str, Any]] = []
    left = 0
    for mname, (spec, batches) in _gpu_models(quick).items():
        for method in GPU_METHODS:
            why = _available(method)
            if why is not None:
                rows.append({"model": mname, "method": method, "status": "n/a", "error": why})
                continue
            for b in batches:
                row = kept.get((mname, method, b))
                if row is None and stop_at is not None and time.time() >= stop_at:
                    left += 1   # (a larger batch of a method may be skipped after an OOM)
                    continue
                if row is None:
                    row = _worker_row(mname, {"model": spec, "method": method, "batch": b,
                                              "budget": budget, "window": window, "warmup": 3,
                                              "steps": 3 if quick else 6},
                                      worker_timeout)
                rows.append(row)
                if save is not None:
                    save(rows, None)
                if row["status"] != "ok":
                    break  # larger batches will not fit either
    return rows, left


def gpu_table(rows: List[Dict[str, Any]]) -> str:
    lines = []
    for mname in dict.fromkeys(r["model"] for r in rows):
        mrows = [r for r in rows if r["model"] == mname]
        batches = sorted({r["batch"] for r in mrows if "batch" in r})
        lines.append(f"\n{mname}: throughput under the budget (x = out of memory)")
        lines.append(f"{'method':16s}" + "".join(f"{b:>9d}" for b in batches))
        for method in GPU_METHODS:
            cells = []
            for b in batches:
                r = next((r for r in mrows if r["method"] == method and r.get("batch") == b), None)
                if r is None:
                    na = next((r for r in mrows if r["method"] == method and r["status"] == "n/a"), None)
                    cells.append("n/a" if na else "-")
                elif r["status"] == "ok":
                    cells.append(f"{r['throughput']:.0f}")
                else:
                    cells.append("timeout" if r["status"] == "timeout" else "x")
            lines.append(f"{method:16s}" + "".join(f"{c:>9s}" for c in cells))
    return "\n".join(lines)


def gpu_plot(rows: List[Dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, mname in zip(axes[0], models):
        for method in GPU_METHODS:
            pts = sorted((r["batch"], r["throughput"]) for r in rows
                         if r["model"] == mname and r["method"] == method and r["status"] == "ok")
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set_title(mname)
        ax.set_xlabel("batch size")
        ax.set_ylabel(next((r["unit"] for r in rows if r["model"] == mname and "unit" in r), ""))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def gpu_only(args: argparse.Namespace) -> None:
    """``--gpu-only``: the GPU comparison into the results file's ``gpu`` key, written after
    every worker (write then rename: a kill leaves the last whole file)."""
    if not torch.cuda.is_available():
        raise SystemExit("bench/swap.py --gpu-only: no CUDA device")
    if args.cpu_only:
        raise SystemExit("bench/swap.py: --gpu-only and --cpu-only exclude each other")
    budget, window = parse_size(args.budget, "--budget"), parse_size(args.window, "--window")
    out = _out_dir(args)
    path = None if out is None else out / "swap.json"
    try:
        result = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        result = None
    if result is None:   # no file (or none to read): no CPU part, the README says so
        result = {"meta": {}, "cpu_overhead": []}
    from bench.common import reproduce_command, run_meta, say_nothing_written
    gmeta = run_meta(reproduce_command("bench/swap.py", sys.argv[1:]), "cuda")   # less --stop-at
    # rows kept only from a run of the same grid on the same GPU (one table, one GPU)
    old = result.get("gpu") or {}
    same = ((old.get("budget"), old.get("window"), old.get("quick"),
             (old.get("meta") or {}).get("gpu")) == (budget, window, args.quick, gmeta.get("gpu")))
    earlier = old.get("rows") if same else None
    result.setdefault("meta", {})["cuda"] = torch.cuda.get_device_name(0)

    def save(rows: List[Dict[str, Any]], left: Optional[int]) -> None:
        # left: configurations not run (None: still running, so incomplete if killed now)
        result["gpu"] = {"budget": budget, "window": window, "quick": args.quick, "rows": rows,
                         "meta": gmeta, "incomplete": left != 0, "not_run": left or 0}
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(result, indent=1, default=str))

    print(f"GPU: throughput under a {format_size(budget)} budget, window {format_size(window)}"
          + (f" (resuming: {len(earlier)} rows kept)" if earlier else ""))
    rows, left = gpu_comparison(args.quick, budget, window, earlier, save, args.stop_at,
                                getattr(args, "worker_timeout", WORKER_TIMEOUT))
    save(rows, left)
    print(gpu_table(rows))
    if out is None:
        say_nothing_written()
        return
    gpu_plot(rows, out / "swap.png")
    print(f"\nwrote {path}" + (f"; {left} configurations left for --stop-at (run it again to "
                                "go on)" if left else ""))


def _out_dir(args: argparse.Namespace) -> Optional[Path]:
    """``--out`` (a folder), else ``RESULTS`` (read when called: tests point it elsewhere);
    None for --quick without --out (``bench.common.output_dir``): nothing read or written."""
    from bench.common import output_dir
    out = output_dir(getattr(args, "quick", False), getattr(args, "out", None) or None, RESULTS)
    return None if out is None else Path(out)


# ---------------------------------------------------------------------------- main
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    from bench.common import byte_size, positive_float
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, batches and steps")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--cpu-only", action="store_true", help="skip the GPU comparison")
    only.add_argument("--gpu-only", action="store_true", help="the GPU comparison alone, into "
                      "the existing results file's 'gpu' key, resumed and saved per worker")
    ap.add_argument("--stop-at", type=float, default=None, metavar="EPOCH", help="with "
                    "--gpu-only: start no worker after this time (epoch seconds)")
    ap.add_argument("--budget", type=byte_size, default="16GiB", metavar="SIZE",
                    help="device budget of the GPU part (default 16GiB)")
    ap.add_argument("--window", type=byte_size, default="2GiB", metavar="SIZE",
                    help="swap window of the GPU part (default 2GiB)")
    ap.add_argument("--worker-timeout", type=positive_float, default=WORKER_TIMEOUT,
                    metavar="S", help="GPU part: kill a configuration's worker after S seconds "
                    f"and keep it as a 'timeout' row, not run again on resume (default "
                    f"{WORKER_TIMEOUT:g})")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="folder of swap.json / swap.png (default bench/results; --quick: "
                    "none, nothing read or written)")
    ap.add_argument("--gpu-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stop_at is not None and not args.gpu_only:
        ap.error(f"--stop-at {args.stop_at:g}: only with --gpu-only")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.gpu_worker:
        print(json.dumps(gpu_worker(json.loads(args.gpu_worker)), default=str))
        return

    if args.gpu_only:
        gpu_only(args)
        return
    out = _out_dir(args)
    torch.set_num_threads(1)
    from bench.common import reproduce_command, run_meta   # run_meta: GPU, torch, date
    command = reproduce_command("bench/swap.py", sys.argv[1:] if argv is None else list(argv))
    result: Dict[str, Any] = {
        "meta": {**run_meta(command, "cuda" if torch.cuda.is_available() else "cpu"),
                 "command": command, "torch": torch.__version__, "machine": platform.machine(),
                 "cpu_threads": torch.get_num_threads(),
                 "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}}
    print("CPU: hook overhead when nothing needs swapping (window 2GiB; goal <= 5%)")
    over, per_hook = cpu_overhead(args.quick)
    result["cpu_overhead"] = over
    result["us_per_hook_call"] = per_hook
    print(f"runtime cost per hook call (a pack or an unpack, frees included): {per_hook:.1f} us")
    print(f"{'model':22s}{'plain ms':>10s}{'swap ms':>10s}{'paired':>9s}{'min/min':>9s}"
          f"{'estimate':>10s}{'hooks':>7s}{'saved/step':>12s}")
    for r in over:
        print(f"{r['model']:22s}{1e3 * r['plain_step_s']:10.1f}{1e3 * r['swap_step_s']:10.1f}"
              f"{r['overhead_pct']:8.1f}%{r['overhead_pct_min']:8.1f}%"
              f"{r['overhead_pct_estimate']:9.2f}%{r['hooks_per_step']:7d}"
              f"{format_size(r['saved_bytes_per_step']):>12s}")
    worst = max(r["overhead_pct"] for r in over)
    result["cpu_overhead_goal_met"] = worst <= 5.0
    print(f"worst overhead (median of paired differences) {worst:.1f}% -> goal (<= 5%) "
          f"{'met' if worst <= 5 else 'NOT met'}")

    print("\nCPU: real swapping into the host pool (budget = fraction of the plain peak)")
    sw = cpu_swapping(args.quick)
    result["cpu_swapping"] = sw
    print(f"{'model':22s}{'budget':>8s}{'peak/plain':>12s}{'out/step':>12s}{'slowdown':>10s}"
          f"{'plan s':>8s}")
    for r in sw:
        print(f"{r['model']:22s}{r['budget_fraction']:8.2f}"
              f"{r['peak_resident_bytes'] / r['plain_peak_bytes']:12.2f}"
              f"{format_size(r['swapped_out_bytes_per_step']):>12s}{r['slowdown_pct']:9.1f}%"
              f"{r['planning_s']:8.3f}")
    pt = planning_time()
    result["planning_time"] = pt
    for r in pt:
        print(f"window planner: {r['steps']} steps, {r['variables']} variables: "
              f"{r['seconds']:.3f} s")

    if args.cpu_only or not torch.cuda.is_available():
        why = "--cpu-only" if args.cpu_only else "no CUDA device"
        print(f"\nGPU comparison skipped ({why}); it runs on a machine with CUDA.")
        result["gpu"] = {"skipped": why}
    else:
        budget, window = parse_size(args.budget, "--budget"), parse_size(args.window, "--window")
        print(f"\nGPU: throughput under a {format_size(budget)} budget, window {format_size(window)}")
        rows, _ = gpu_comparison(args.quick, budget, window,
                                 worker_timeout=args.worker_timeout)
        result["gpu"] = {"budget": budget, "window": window, "rows": rows}
        print(gpu_table(rows))
        if out is not None:
            gpu_plot(rows, out / "swap.png")
    if out is None:
        from bench.common import say_nothing_written
        say_nothing_written()
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "swap.json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nwrote {out / 'swap.json'}")


if __name__ == "__main__":
    main()
