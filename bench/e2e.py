"""End to end: train past the GPU's memory, side by side with what users use today (issue 8).

Seed 003 Table 1 on our hardware: ResNet-50 (and GPT-2 / BERT-style transformers) under a
physical budget, images/s (tokens/s) and peak physical memory for plain PyTorch (native
allocator, with and without ``expandable_segments``), ``save_on_cpu``, torchtune's
``OffloadActivations``, ``checkpoint_sequential`` (best segment count), the byte-window swap
runtime (native allocator and vmalloc), the DYNPROG offload plan, rotor and pofo.

    python bench/e2e.py --smoke     # CPU, tiny models, simulated budget: CI runs this (< 1 min)
    python bench/e2e.py --quick     # GPU, minutes: every method at each model's smallest batch
    python bench/e2e.py             # GPU, the full grid of the issue
    python bench/e2e.py --coexist 64   # + two processes sharing one GPU, half the budget each
    python bench/e2e.py --coexist-only [--coexist 512]   # that pair alone, no model grid
    python bench/e2e.py --resume R.json --stop-at EPOCH   # a grid spread over several sessions

``--stop-at EPOCH`` (seconds since the epoch): no job (one method at one batch size; plain
training's reference run counts as one) starts once fewer than max(60 s, the longest job so
far in that process, the longest job recorded at its model and batch: each row's ``seconds``)
are left before EPOCH; GPU workers obey it too. Jobs not started are not written: the file's
``meta`` says ``"incomplete": true`` and ``"not_run": N``, the exit status stays 0.
``--resume FILE`` keeps FILE's rows whose status is not ``error`` and runs only the other jobs
(``error`` rows run again; ``crashed``, ``timeout`` and ``unavailable`` rows are kept, as they
would crash, hang or fail to import again); the output defaults to FILE, and ``meta`` gets
``"resumed_from": <rows kept>``. A missing FILE starts from nothing, so every session can pass
the same command until the file is complete. A FILE measured on another GPU, under another
``--budget`` or ``--steps``, or with a method this run does not run (``meta.grid``) is refused,
naming what differs: its rows would be mixed with this run's in one table.

Each job trains ``--steps`` timed steps after its warm-up, or fewer once they have taken 15 s
(``TIMED_SECONDS``; at least 3, a dynamic workload all of them; the row's
``detail.timed_steps`` says how many): the offloading methods at large batches take 5-10 s a
step, and their steady state shows in three. Jobs at a model's smallest batch, whose every
loss is checked against plain training's, run all their steps.

On a GPU the parent watches each worker: one silent for ``--job-timeout`` seconds (default
180; a worker prints a line after every training step) is killed, the job it was in gets a
``timeout`` row, and a new worker goes on with the next job; so does one that dies in a job
(the host's OOM killer, a segfault), that job getting a ``crashed`` row. A method whose optional package
does not import (torchtune) gets ``unavailable`` rows, the import error in ``note`` and
``error``. Workers get the parent's environment less ``VMALLOC*`` and
``PYTORCH_CUDA_ALLOC_CONF`` (the method sets its allocator), and plain training's reference
runs with the process's cap lifted. bert-dyn on a GPU warms up over every sequence length of
the run, then times at least one more full cycle of them (``step_counts``).

Each allocator needs its own process (PyTorch's allocator is chosen before CUDA starts), so
on a GPU the parent runs one worker process per allocator and collects their JSON lines.
Every configuration is checked against plain training: at the smallest batch, its losses over
all steps (same seed) must equal plain training's bit for bit, and plain training must give the
same losses under every allocator; a mismatch marks the row ``error`` and the run exits
non-zero. One method need not be bit-exact (``Method.inexact``): ``save_on_cpu`` on a GPU
brings every saved tensor back contiguous (a transposed view with other strides, so cuBLAS may
take another kernel); its note gives the largest relative difference and why. GPU workers run cuDNN's deterministic
algorithms (``torch.backends.cudnn.deterministic``, every method alike), without which
run-to-run noise would fail those checks.

On a GPU the budget caps the whole process (``vmalloc.enable(budget=)`` or
``set_per_process_memory_fraction``); the swap runtime and the chain runtime get the part of
it left for activations (``activation_budget``: less weights, gradients and momentum, less
15%), as ``bench/swap.py`` does. Each row's peak is training's, from after the method's own
set-up (the chain runtime's measurement of the blocks at ``wrap``).

On a GPU a job whose largest operator cannot fit the budget (``scheduler.profile.op_floor``:
its tensors plus weights, gradients and momentum; e.g. ResNet-50 at batch 2048 needs 18.4 GiB
for the first BatchNorm's backward alone, GPT-2 at 32 x 1024 tokens 18.4 GiB for the loss's
log-softmax backward) is not run: its row says ``infeasible`` and why, for every method. So is
a job of an offloading method (save_on_cpu, torchtune, the swap runtimes, pofo) whose pinned
host memory would pass 0.8 x the host's MemAvailable (``host_floor_note``: the saved
activations it offloads, each rounded up to a power of two as PyTorch's pinned cache does):
it would end its worker (the job a ``crashed`` row, and a new worker started for the rest).
Each row's ``detail`` records what the host held over the job, where Linux tells it:
``host_rss_peak_bytes`` (the worker's peak resident memory, pinned copies included: ``VmHWM``,
reset at the job's start through /proc/self/clear_refs) from ``host_rss_base_bytes`` at its start,
to check that estimate against (on the H200, torchtune's offload at ResNet-50 b512 was killed
for host memory where ``save_on_cpu``, estimated the same, ran).

Multi-GPU DDP under ``torchrun`` is not part of this script yet: the lent machines have one
GPU, where ``--coexist`` shows per-process allocators side by side instead.

Results: ``bench/results/e2e-<gpu>-<date>.json`` (shape in the issue), a table on stdout, and
``e2e-<gpu>-<date>-throughput.png`` / ``-memory.png`` beside it when matplotlib is present.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a script (bench/ is first on sys.path)
    import checkout
    checkout.on_path()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from bench.common import (byte_size, nonnegative_int, positive_int,  # noqa: E402
                          reproduce_command, usage_error)
# the parts (bench/e2e_<job>.py), in the order they build on each other; their public names
# are this module's too (``__all__``), all but ``clock``. A test replacing a name replaces it
# where it is read: main reads these from here; run_grid reads run_job, and Plan clock, in
# bench.e2e_grid; the workers read _start_worker, _set_allocator and run_grid in
# bench.e2e_workers
from bench.e2e_workloads import (DYNAMIC_LENGTHS, DYNAMIC_STEPS, SMOKE_SIZES,  # noqa: E402
                                 Workload, build_workload, known_models, loss_of, model_error,
                                 parse_model, zoo_spec)
from bench.e2e_methods import (ALLOCATORS, BY_NAME, GPU_DEFAULT, METHODS, Method,  # noqa: E402
                               MethodUnavailable, method_context)
from bench.e2e_job import (DETAIL_KEYS, MIN_TIMED, TIMED_SECONDS, JobResult,  # noqa: E402
                           activation_budget, run_job, step_counts)
from bench.e2e_grid import (ALIVE, BEAT, FULL_BATCHES, LEFT, QUICK_BATCHES, REF,  # noqa: E402
                            ROW, SMOKE_BATCHES, START, STOP_MARGIN, Grid, Key, Plan,
                            check_losses, release_memory, row_key, run_grid, stopped_note)
from bench.e2e_floors import (HOST_FRACTION, HOST_NOTE, host_floor_note,  # noqa: E402
                              mem_available, op_floor_note, pinned_need, pinned_size,
                              pool_size, saved_activations)
from bench.e2e_workers import (COEXIST_BATCH, FIRST_STEP_GRACE, JOB_TIMEOUT,  # noqa: E402
                               WORKER_ENV_DROP, Watch, deterministic_kernels, run_coexist,
                               run_workers, uncapped, worker_env, worker_main, worker_output)
from bench.e2e_output import meta, plots, table  # noqa: E402
from bench.e2e_remeasure import carried, earlier_meta  # noqa: E402
from vmalloc.atomic_file import write_atomic  # noqa: E402
from vmalloc.sizes import format_size, parse_size  # noqa: E402

__all__ = [
    # the command line (this module)
    "parse_args", "make_grid", "cpu_budgets", "write_results", "grid_settings",
    "resume_mismatch", "load_resume", "grid_order", "main", "ROOT", "RESULTS",
    # bench.e2e_workloads
    "DYNAMIC_LENGTHS", "DYNAMIC_STEPS", "SMOKE_SIZES", "Workload", "build_workload",
    "known_models", "loss_of", "model_error", "parse_model", "zoo_spec",
    # bench.e2e_methods
    "ALLOCATORS", "BY_NAME", "GPU_DEFAULT", "METHODS", "Method", "MethodUnavailable",
    "method_context",
    # bench.e2e_job
    "DETAIL_KEYS", "JobResult", "activation_budget", "run_job", "step_counts",
    # bench.e2e_grid
    "ALIVE", "BEAT", "FULL_BATCHES", "LEFT", "QUICK_BATCHES", "REF", "ROW", "SMOKE_BATCHES",
    "START", "STOP_MARGIN", "Grid", "Key", "Plan", "check_losses", "release_memory", "row_key",
    "run_grid", "stopped_note",
    # bench.e2e_floors
    "HOST_FRACTION", "HOST_NOTE", "host_floor_note", "mem_available", "op_floor_note",
    "pinned_need", "pinned_size", "pool_size", "saved_activations",
    # bench.e2e_workers
    "COEXIST_BATCH", "FIRST_STEP_GRACE", "JOB_TIMEOUT", "WORKER_ENV_DROP", "Watch",
    "deterministic_kernels", "run_coexist", "run_workers", "uncapped", "worker_env",
    "worker_main", "worker_output",
    # bench.e2e_output
    "meta", "plots", "table",
]

RESULTS = ROOT / "bench" / "results"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="CPU, tiny models (CI)")
    mode.add_argument("--quick", action="store_true", help="GPU, a few batch sizes (minutes)")
    p.add_argument("--budget", type=byte_size, default=None, metavar="SIZE",
                   help="physical budget (default 16GiB on a GPU; on the CPU 3/4 of plain "
                        "training's saved activations)")
    p.add_argument("--methods", default=None, help="comma-separated subset of: "
                   + ", ".join(BY_NAME))
    p.add_argument("--models", default=None, help="comma-separated: resnet<depth>, "
                   "gpt2-s<seq>, bert-s<seq>, bert-dyn (default: the grid's)")
    p.add_argument("--steps", type=positive_int, default=None, metavar="N",
                   help="timed steps per job")
    p.add_argument("--coexist", type=nonnegative_int, default=0, metavar="BATCH",
                   help="GPU: also train ResNet-50 at BATCH in two processes at once, each under "
                        "half the budget with its own vmalloc allocator")
    p.add_argument("--coexist-only", action="store_true",
                   help="GPU: run only the --coexist pair (batch --coexist, default "
                        f"{COEXIST_BATCH}), not the model grid")
    p.add_argument("--job-timeout", type=positive_int, default=JOB_TIMEOUT, metavar="SECONDS",
                   help="GPU: a worker silent this long (no step, no row) is killed; its job "
                        f"gets a 'timeout' row, kept by --resume (default {JOB_TIMEOUT})")
    p.add_argument("--out", default=None, metavar="FILE", help="results file (default: the --resume file, "
                   "else bench/results/e2e-<gpu>-<date>.json)")
    p.add_argument("--stop-at", type=float, default=None, metavar="EPOCH",
                   help="start no job once fewer than max(60 s, the longest job so far) are "
                        "left before EPOCH (seconds since the epoch); the jobs not started are "
                        "left for --resume and the file's meta says incomplete")
    p.add_argument("--resume", default=None, metavar="FILE",
                   help="keep FILE's rows (an earlier results file) except status 'error' and "
                        "run only the other jobs (ok, oom, infeasible, crashed, timeout and "
                        "unavailable rows are kept); the output defaults to FILE; a missing "
                        "FILE starts from nothing; one of another GPU, --budget, --steps or "
                        "--methods is refused")
    p.add_argument("--worker", choices=ALLOCATORS, help=argparse.SUPPRESS)
    p.add_argument("--worker-grid", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # names checked before anything runs or is written (make_grid checks them again)
    if args.methods is not None:
        unknown = [n.strip() for n in args.methods.split(",") if n.strip() not in BY_NAME]
        if unknown:
            usage_error(f"--methods {args.methods!r}: unknown {', '.join(map(repr, unknown))}; "
                        f"choose from {', '.join(BY_NAME)}", parser=p)
    if args.models is not None:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        if not names:
            usage_error(f"--models {args.models!r}: no model named", parser=p,
                        value_error=True)
        for n in names:   # (a ValueError too, as main raised for them before this check)
            error = model_error(n)
            if error:
                usage_error(error, parser=p, value_error=True)
    return args


def make_grid(args: argparse.Namespace, cuda: bool) -> Grid:
    batches = SMOKE_BATCHES if args.smoke or not cuda else (
        QUICK_BATCHES if args.quick else FULL_BATCHES)
    if args.models:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        for n in names:
            parse_model(n)  # a clear error for a name we cannot build
        models = {n: batches.get(n, next(iter(batches.values()))) for n in names}
    else:
        models = dict(batches)
    names = ([n.strip() for n in args.methods.split(",")] if args.methods
             else list(GPU_DEFAULT) if cuda else list(BY_NAME))
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {list(BY_NAME)}")
    methods = [BY_NAME[n] for n in names]
    if not cuda:  # one process, no CUDA allocator to choose: the vmalloc rows need a GPU
        methods = [m for m in methods if m.allocator == "native"]
    budget = parse_size(args.budget, "--budget") if args.budget else (16 << 30 if cuda else None)
    steps = args.steps or (2 if not cuda else 5 if args.quick else 10)
    # GPU: a few warm-up steps (cuDNN algorithm search, allocator growth) before timing
    return Grid(models, methods, budget, steps, 1 if not cuda else 3)


def cpu_budgets(grid: Grid) -> Dict[str, int]:
    """On the CPU the budget is simulated, per model: 3/4 of the activation bytes plain training
    saves at the smallest batch, so every runtime has work in the run whose losses are
    checked, and larger batches press harder. The bytes are what the swap runtime records
    for one step (its variable sequence: every saved storage, parameters excluded)."""
    import scheduler

    out: Dict[str, int] = {}
    for model, batches in grid.models.items():
        wl = build_workload(model, min(batches), torch.device("cpu"), True, grid.seed)
        probe = scheduler.swap(window="1TiB", device="cpu", min_bytes=0)   # records only
        with probe:
            loss_of(nn.Sequential(*wl.blocks)(wl.input(0)), wl).backward()
        out[model] = max(1, 3 * probe.last_recorded.total_bytes() // 4)
    return out


def write_results(out: Path, info: Dict[str, Any], rows: List[Dict[str, Any]]) -> None:
    """The results file, written whole and renamed: a kill mid-write leaves the last one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps({"meta": info, "results": rows}, indent=1) + "\n")


def grid_settings(grid: Grid) -> Dict[str, Any]:
    """What the rows of a run were measured under (the results file's ``meta.grid``): rows of
    another budget, step count or method list must not be kept by a ``--resume`` of this one."""
    return {"budget": grid.budget, "steps": grid.steps, "methods": [m.name for m in grid.methods],
            "timed_seconds": TIMED_SECONDS, "min_timed": MIN_TIMED}


def resume_mismatch(earlier: Any, settings: Dict[str, Any]) -> List[str]:
    """How an earlier results file's ``meta`` differs from this run's ``settings`` (its
    ``gpu`` and ``grid_settings``), as phrases; none when it matches. What the file does not
    record (a file from before ``meta.grid``) is not held against it. Its methods need only be
    among this run's (a method added to the default list is run, not a mismatch)."""
    if not isinstance(earlier, dict):
        return []
    out = []
    if earlier.get("gpu") not in (None, settings["gpu"]):
        out.append(f"on {earlier['gpu']!r} (this run: {settings['gpu']!r})")
    old = earlier.get("grid")
    if not isinstance(old, dict):
        return out

    def size(budget: Any) -> str:
        return format_size(budget) if isinstance(budget, int) else "the default"

    if "budget" in old and old["budget"] != settings["budget"]:
        out.append(f"with --budget {size(old['budget'])} (this run: {size(settings['budget'])})")
    if "steps" in old and old["steps"] != settings["steps"]:
        out.append(f"with --steps {old['steps']} (this run: {settings['steps']})")
    extra = [m for m in old.get("methods") or [] if m not in settings["methods"]]
    if extra:
        out.append(f"with methods {', '.join(extra)}, which this run does not run (its --methods: "
                   f"{','.join(settings['methods'])})")
    return out


def load_resume(path: Path, settings: Optional[Dict[str, Any]] = None) -> List[JobResult]:
    """The rows of an earlier results file to keep: every one whose status is not ``error``
    (those run again): ``ok``, ``oom``, ``infeasible``, and ``crashed``, ``timeout`` and
    ``unavailable``, which would only crash, hang or fail to import again. Except rows
    infeasible for host memory (``HOST_NOTE``): judged again (it takes a second), as they rest
    on an estimate and on the host's free memory at the time, not on the GPU. A missing file
    keeps nothing; a file we cannot read is an error, and so is one measured under other
    ``settings`` (``gpu`` and ``grid_settings``: ``resume_mismatch``), whose rows would be
    mixed with this run's in one table."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        print(f"--resume {path}: no such file yet, starting from nothing", file=sys.stderr)
        return []
    try:
        doc = json.loads(text)
        results = doc["results"]
        if not isinstance(results, list):
            raise TypeError("'results' is not a list")
        rows = []
        for row in results:
            missing = {"model", "method", "batch_size", "status"} - set(row)
            if missing:
                raise KeyError(f"a row lacks {sorted(missing)}")
            rows.append(JobResult.of_row(row))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SystemExit(f"--resume {path}: not a bench/e2e.py results file "
                         f"({type(exc).__name__}: {exc})") from None
    differ = resume_mismatch(doc.get("meta"), settings) if settings is not None else []
    if differ:
        raise SystemExit(f"--resume {path}: its rows were measured {', '.join(differ)}; "
                         "resumed, they would be mixed with this run's rows in one table. Run "
                         "the command that made it (its meta.command), or resume another file")
    return [r for r in rows if r.status != "error"
            and not (r.status == "infeasible" and str(r.note).startswith(HOST_NOTE))]


def grid_order(rows: Sequence[JobResult], grid: Grid) -> List[JobResult]:
    """Rows in the order the grid runs them (model, method, batch); others after, as given."""
    pos = {(model, m.name, b): i for i, (model, m, b) in enumerate(
        (model, m, b) for model, bs in grid.models.items() for m in grid.methods for b in bs)}
    return sorted(rows, key=lambda r: pos.get(row_key(r), len(pos)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: running the CPU smoke mode (--smoke)", file=sys.stderr)
        args.smoke = True
    if args.coexist_only and not args.coexist:
        args.coexist = COEXIST_BATCH
    if args.coexist and not cuda:
        raise SystemExit("--coexist: needs a GPU (two processes sharing one device)")
    # less --stop-at: this call's deadline, which a later run of the command would be past
    command = reproduce_command("bench/e2e.py", argv if argv is not None else sys.argv[1:])
    grid = make_grid(args, cuda)
    device = torch.device("cuda" if cuda else "cpu")
    info = meta(device, command)
    info["grid"] = grid_settings(grid)
    kept = (load_resume(Path(args.resume), {"gpu": info["gpu"], **info["grid"]})
            if args.resume else [])
    grid.stop_at = args.stop_at
    grid.done = sorted({row_key(r) for r in kept})
    grid.durations = [(r.model, r.batch_size, r.seconds) for r in kept if r.seconds is not None]
    plan = Plan.of(grid)
    if not cuda and grid.budget is None:
        grid.budgets = cpu_budgets(grid)
    budgets = ", ".join(f"{m} {format_size(b)}" for m, b in grid.budgets.items()) or (
        format_size(grid.budget) if grid.budget else "none")
    print(f"e2e: {device}, budget {budgets}, "
          f"{len(grid.methods)} methods, models {grid.models}", file=sys.stderr)
    if kept:
        print(f"--resume {args.resume}: {len(kept)} rows kept, {len(grid.done)} jobs not run "
              "again", file=sys.stderr)
    if args.resume:
        info["resumed_from"] = len(kept)
        remeasured = carried(earlier_meta(Path(args.resume)), kept)
        if remeasured:   # (bench/e2e_remeasure.py's notes on the rows kept)
            info["remeasured"] = remeasured
    out = Path(args.out or args.resume or RESULTS / (
        f"e2e-{info['gpu'].replace(' ', '_')}-{info['date']}.json"))
    made: List[Dict[str, Any]] = []

    def checkpoint(kind: str, payload: Any) -> None:
        """The file after each row, marked incomplete: a run killed at a time limit (a job
        longer than --stop-at's margin) keeps what it finished for --resume."""
        if kind == ROW:
            made.append(payload)
            write_results(out, {**info, "incomplete": True},
                          [r.row() for r in kept] + made)

    if args.coexist_only:   # the pair alone: none of the model grid's jobs (gpu-check's own step)
        rows = []
    elif cuda:
        rows = run_workers(grid, plan, checkpoint, job_timeout=args.job_timeout)
    else:
        rows = run_grid(grid, grid.methods, device, checkpoint, plan=plan)[0]
    if args.coexist:
        names = {f"window+vmalloc (process {i} of 2, half budget)" for i in (1, 2)}
        if not names <= {r.method for r in kept if r.batch_size == args.coexist}:
            kept = [r for r in kept if r.method not in names]   # both processes run again
            if plan.may_start():
                with plan.job():
                    rows += run_coexist(grid, args.coexist, job_timeout=args.job_timeout)
            else:
                plan.left.append(("resnet50", "window+vmalloc (coexist)", args.coexist))
    new = rows
    rows = grid_order(kept + rows, grid)
    if plan.left:
        info["incomplete"] = True
        info["not_run"] = len(plan.left)
    write_results(out, info, [r.row() for r in rows])
    print(table(rows))
    if plan.left:
        print(f"\n{stopped_note(len(plan.left))}")
    pngs = plots(rows, out.with_suffix(""), grid)
    print(f"\nwrote {out}" + "".join(f", {p}" for p in pngs))
    bad = [r for r in new if "LOSS MISMATCH" in r.note]
    if bad:
        print(f"FAILED: {len(bad)} configuration(s) do not reproduce plain training's loss",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
