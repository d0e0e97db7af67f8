"""bench/e2e.py's GPU workers: one process per CUDA allocator, each re-running bench/e2e.py
with worker arguments (``worker_main``: its allocator, its budget, its part of the grid),
watched by the parent (``Watch``: one silent too long is killed), their printed rows collected
and checked across allocators (``run_workers``), and the coexist pair (``run_coexist``)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from bench.e2e_floors import host_floor_note, op_floor_note
from bench.e2e_grid import (ALIVE, BEAT, LEFT, REF, ROW, START, Grid, Key, Plan, row_key,
                            run_grid)
from bench.e2e_job import JobResult
from bench.e2e_methods import ALLOCATORS, BY_NAME, Method
from vmalloc.sizes import format_size

# what a worker runs: the entry point, with worker arguments (``main`` hands them to
# ``worker_main``)
ENTRY = Path(__file__).with_name("e2e.py")


def _set_allocator(allocator: str, budget: Optional[int]) -> None:
    """Pick this process's CUDA allocator and apply the budget (before any CUDA memory)."""
    if allocator == "vmalloc":
        import vmalloc
        vmalloc.enable(budget=budget)
    elif budget is not None:
        if allocator == "expandable":
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        _set_cap(allocator, budget)


def _set_cap(allocator: str, budget: Optional[int]) -> None:
    """The process's cap on device memory, once its allocator is chosen (None: none)."""
    if allocator == "vmalloc":
        from vmalloc import _core
        _core._torch_set_budget(0, budget or 0)   # 0: no cap
    else:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if budget is None
                                                   else min(1.0, budget / total))


@contextlib.contextmanager
def uncapped(allocator: str, budget: Optional[int]) -> Iterator[None]:
    """No cap inside (plain training's reference trains without a budget: under the grid's
    cap, gpt2-s2048 at batch 2 could run out and leave that model with no loss check); the
    cap ``budget`` again after."""
    if budget is None:
        yield
        return
    _set_cap(allocator, None)
    try:
        yield
    finally:
        _set_cap(allocator, budget)


def deterministic_kernels() -> None:
    """Kernels that give the same bits on every run, which the loss checks need: cuDNN's
    heuristics otherwise may pick convolution backward algorithms that accumulate with atomics
    (ResNet-50's losses would then differ from plain training's, and plain training's from one
    allocator's process to the next, by run-to-run noise). The same setting for every method,
    so the comparison stays fair; cuBLAS and the models' other kernels are deterministic."""
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def worker_main(args: argparse.Namespace) -> int:
    grid = Grid(**json.loads(args.worker_grid))
    grid.methods = [BY_NAME[n] for n in grid.methods]  # type: ignore[index]
    deterministic_kernels()
    _set_allocator(args.worker, grid.budget)

    def tell(kind: str, payload: Any) -> None:
        print(f"{kind} {json.dumps(payload)}", flush=True)

    run_grid(grid, grid.methods, torch.device("cuda"), tell, floor=op_floor_note,
             host_floor=host_floor_note,
             uncapped=lambda: uncapped(args.worker, grid.budget),
             beat=lambda: tell(BEAT, None), alive=lambda: tell(ALIVE, None))
    return 0



JOB_TIMEOUT = 180                 # seconds a worker may stay silent before it is killed
FIRST_STEP_GRACE = 3              # ... times this until a job's first step is done
COEXIST_BATCH = 512               # --coexist-only's batch when --coexist names none
# a worker's environment: the parent's, less what would pick or configure an allocator behind
# the method's back (a VMALLOC=1 left in the shell would put vmalloc under "native")
# (PYTORCH_ALLOC_CONF: torch >= 2.9's name, which outranks PYTORCH_CUDA_ALLOC_CONF)
WORKER_ENV_DROP = ("VMALLOC", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def worker_env(allocator: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(WORKER_ENV_DROP)}
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


class Watch:
    """A worker's stdout lines as they come, with a watchdog: once none came for ``timeout``
    seconds (a hung kernel, a deadlock: every step prints a ``BEAT``) the worker is killed,
    the lines stop and ``timed_out`` is set. A reader thread feeds a queue, so the wait for a
    line can time out."""

    def __init__(self, proc: Any, timeout: float):
        self.proc, self.timeout, self.timed_out = proc, timeout, False
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for line in self.proc.stdout:
                self._lines.put(line)
        except (OSError, ValueError):   # the pipe closed under it (the worker was killed)
            pass
        finally:
            self._lines.put(None)

    def __iter__(self) -> Iterator[str]:
        first = False   # a job started and has not finished its first step yet
        while True:
            try:
                # the first step of a job builds the model, plans (a chain measured at full
                # batch, rotor's or pofo's solve) and pins its host buffers: healthy, and
                # silent for longer than a step, so it gets FIRST_STEP_GRACE x the timeout
                line = self._lines.get(timeout=self.timeout * (FIRST_STEP_GRACE if first
                                                               else 1))
            except queue.Empty:
                self.timed_out = True
                self.proc.kill()
                return
            if line is None:
                return
            kind = line.split(" ", 1)[0]
            if kind == START:
                first = True
            elif kind == BEAT:
                first = False
            yield line


def _start_worker(allocator: str, spec: Dict[str, Any],
                  env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ENTRY), "--worker", allocator,
                             "--worker-grid", json.dumps(spec)],
                            env=env, stdout=subprocess.PIPE, text=True)


def worker_output(stdout: str, left: Optional[List[Key]] = None,
                  started: Optional[List[Key]] = None
                  ) -> Tuple[List[JobResult], Dict[str, List[float]]]:
    """A worker's rows and its plain-training reference losses (per model); the jobs it did
    not start (``--stop-at``) are added to ``left``, those it started to ``started``."""
    rows: List[JobResult] = []
    references: Dict[str, List[float]] = {}
    for line in stdout.splitlines():
        kind, _, payload = line.partition(" ")
        if kind == ROW:
            rows.append(JobResult(**json.loads(payload)))
        elif kind == REF:
            references.update(json.loads(payload))   # one line per model
        elif kind == LEFT and left is not None:
            left.extend((str(m), str(n), int(b)) for m, n, b in json.loads(payload))
        elif kind == START and started is not None:
            m, n, b = json.loads(payload)
            started.append((str(m), str(n), int(b)))
    return rows, references


def run_workers(grid: Grid, plan: Optional[Plan] = None,
                report: Optional[Callable[[str, Any], None]] = None,
                job_timeout: float = JOB_TIMEOUT) -> List[JobResult]:
    """One process per allocator. Plain training must give the same losses under each: a
    worker's rows of a model whose reference differs from the native worker's are errors.
    ``plan`` (default: from ``grid``): the jobs done before are not run, and no worker starts
    at ``--stop-at`` (each worker obeys it too); the jobs not started go to ``plan.left``.
    ``report(ROW, row)`` hears each row, checked, as its worker prints it. A worker silent for
    ``job_timeout`` seconds is killed (``Watch``): the job it was in gets a ``timeout`` row
    (kept by --resume); one that dies in a job (the host's OOM killer, a segfault) gives it a
    ``crashed`` row (kept too). Either way a new worker for the same allocator goes on with
    the jobs after it and the references it still owed, with its predecessors' longest job
    as its ``--stop-at`` margin: one job killing its worker costs that job's row, not the
    session's."""
    plan = plan or Plan.of(grid)
    tell = report or (lambda kind, payload: None)
    rows: List[JobResult] = []
    references: Dict[str, Dict[str, List[float]]] = {}
    pending = [(model, m, b) for model, bs in grid.models.items() for m in grid.methods
               for b in bs if plan.pending(model, m.name, b)]
    # the native worker runs the reference of every model with a job left anywhere: the
    # other allocators' plain training is compared with it
    need_ref = list(dict.fromkeys(model for model, _, _ in pending))
    for allocator in ALLOCATORS:
        methods = [m for m in grid.methods if m.allocator == allocator]
        if not methods:
            continue
        todo = [(model, m.name, b) for model, m, b in pending if m.allocator == allocator]
        refs = need_ref if allocator == "native" else []
        ref = references.setdefault(allocator, {})
        done = set(plan.done)
        longest = 0.0   # the longest job this allocator's workers ran: a replacement's margin
        while todo or refs:
            if not plan.may_start():
                plan.left += todo
                break
            got, unfinished, again = _one_worker(grid, plan, allocator, methods, todo, refs,
                                                 done, ref, references.get("native", {}),
                                                 tell, job_timeout, longest)
            longest = max([longest] + [r.seconds for r in got if r.seconds is not None])
            rows += got
            if not again:
                break
            # a job hung or crashed its worker: the next worker goes on with the jobs after it
            # (the references it already gave are not run again, unless its own jobs need them)
            done |= {row_key(r) for r in got}
            todo, refs = unfinished, [m for m in refs if m not in ref]
    return rows


def _one_worker(grid: Grid, plan: Plan, allocator: str, methods: Sequence[Method],
                todo: List[Key], refs: List[str], done: set, ref: Dict[str, List[float]],
                base: Dict[str, List[float]], tell: Callable[[str, Any], None],
                job_timeout: float, longest: float = 0.0
                ) -> Tuple[List[JobResult], List[Key], bool]:
    """Run one worker process over ``todo``: (its rows, the jobs it left unfinished, whether
    a new worker should go on with those: it hung or died in a job, now a ``timeout`` or
    ``crashed`` row)."""
    spec = dict(grid.__dict__, methods=[m.name for m in methods], references=refs,
                done=sorted(done), durations=plan.duration_list(), longest=longest)
    print(f"-- worker: {allocator} allocator, {len(todo)} jobs", file=sys.stderr)
    left: List[Key] = []
    started: List[Key] = []
    got: List[JobResult] = []
    proc = _start_worker(allocator, spec, worker_env(allocator))
    watch = Watch(proc, job_timeout)
    for line in watch:   # as the worker prints it (each model's reference first)
        new, new_ref = worker_output(line, left, started)
        ref.update(new_ref)
        for r in new:
            if r.model in ref and r.model in base and ref[r.model] != base[r.model]:
                r.status = "error"
                r.note = (f"LOSS MISMATCH: plain training under the {allocator} "
                          f"allocator gives {ref[r.model]}, native {base[r.model]}")
            elif allocator != "native" and r.model not in base and r.note:
                r.note += ("; not compared across allocators: plain training under the "
                           "native one did not run in this call")
            plan.note(r.model, r.batch_size, r.seconds)
            got.append(r)
            tell(ROW, r.row())
    proc.wait()
    plan.left += left
    if left:   # the worker stopped at --stop-at: no later worker starts either
        plan.stopped = True
    finished = {row_key(r) for r in got} | set(left)
    unfinished = [k for k in todo if k not in finished]
    running = started[-1] if started else None
    how = (f"worker for the {allocator} allocator killed after {job_timeout:g} s without "
           "output" if watch.timed_out else
           f"worker for the {allocator} allocator exited {proc.returncode}")
    if running in unfinished and (watch.timed_out or proc.returncode != 0):
        # the job it was running hung it, or crashed it (or the host's OOM killer took it):
        # marked so, and kept by --resume (run again, it would do the same every session); a
        # worker that died or hung before any job, at its start or in a reference run,
        # blames none
        unfinished.remove(running)
        model, name, b = running
        status = "timeout" if watch.timed_out else "crashed"
        row = JobResult(model, name, b, None, "", None, grid.budget_for(model), status,
                        f"{how} during this job")
        plan.note(model, b, job_timeout if watch.timed_out else None)
        got.append(row)
        tell(ROW, row.row())
        if unfinished or any(m not in ref for m in refs):
            # the jobs after it, and the references it still owed, are not to blame: a new
            # worker goes on with them (one that dies before starting a job does not get
            # here: no loop)
            return got, unfinished, True
    # the jobs it did not finish, in its order
    got += [JobResult(model, name, b, None, "", None, grid.budget_for(model), "error",
                      f"{how} before this job started")
            for model, name, b in unfinished]
    return got, unfinished, False


def run_coexist(grid: Grid, batch: int, job_timeout: float = JOB_TIMEOUT) -> List[JobResult]:
    """Two processes on one GPU at once, each with half the budget and its own vmalloc
    allocator (one per process and device): per-process allocators coexist. Each is watched
    as the grid's workers are: one silent for ``job_timeout`` seconds gets a ``timeout`` row."""
    if grid.budget is None:
        raise SystemExit("--coexist needs a budget")
    # its own one-job grid: none of the main grid's resume list, references or deadline
    spec = dict(grid.__dict__, methods=["window+vmalloc"], models={"resnet50": [batch]},
                budget=grid.budget // 2, budgets={}, done=[], references=[], stop_at=None,
                durations=[], reference=False)
    print(f"-- coexist: 2 processes, {format_size(grid.budget // 2)} each", file=sys.stderr)
    procs = [_start_worker("vmalloc", spec, worker_env("vmalloc")) for _ in range(2)]
    watches = [Watch(proc, job_timeout) for proc in procs]   # both read from now on
    rows: List[JobResult] = []
    for i, (proc, watch) in enumerate(zip(procs, watches)):
        got, _ = worker_output("".join(watch))
        proc.wait()
        if watch.timed_out:
            got = [JobResult("resnet50", "window+vmalloc", batch, None, "", None,
                             grid.budget // 2, "timeout",
                             f"killed after {job_timeout:g} s without output")]
        elif proc.returncode != 0 or not got:
            got = [JobResult("resnet50", "window+vmalloc", batch, None, "", None,
                             grid.budget // 2, "error", f"process exited {proc.returncode}")]
        for r in got:
            r.method = f"window+vmalloc (process {i + 1} of 2, half budget)"
        rows += got
    return rows
