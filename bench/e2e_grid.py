"""bench/e2e.py's grid: every method at every batch size of every model in one process
(``run_grid``), each run's losses checked against plain training's, and the ``Plan`` of which
jobs are left and whether the next may start (``--resume``, ``--stop-at``). Also the lines a
GPU worker prints for its parent (``ROW``, ``REF``, ...), which are ``run_grid``'s reports."""
from __future__ import annotations

import contextlib
import gc
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from bench.e2e_job import TIMED_SECONDS, JobResult, run_job
from bench.e2e_methods import BY_NAME, Method
from bench.e2e_workloads import Workload, build_workload

Key = Tuple[str, str, int]    # (model, method, batch size): one job, one row

# the kinds run_grid reports (``report(kind, payload)``), which a GPU worker prints
ROW, REF = "E2E-ROW", "E2E-REF"   # the lines a worker prints for the parent
LEFT = "E2E-LEFT"                 # the jobs it did not start (--stop-at)
START = "E2E-START"               # the job it starts now (a worker dying in it: crashed)
BEAT = "E2E-BEAT"                 # a training step done (the parent's watchdog hears it)
ALIVE = "E2E-ALIVE"               # a job's model built, its method set up (heard too)


def row_key(r: JobResult) -> Key:
    return (r.model, r.method, r.batch_size)


def clock() -> float:
    """The wall clock ``--stop-at`` is compared with (seconds since the epoch; tests replace it)."""
    return time.time()


STOP_MARGIN = 60.0   # seconds: no job starts with less than this (or the longest job) left


class Plan:
    """Which jobs are left, and whether the next may start: one rule for the CPU path, the GPU
    parent and its workers. ``done``: jobs whose rows an earlier run wrote (``--resume``);
    ``stop_at``: ``--stop-at``; ``durations``: (model, batch, seconds) of jobs run before (the
    rows' ``seconds``, this session's and earlier ones'). A job starts only with more than
    max(60 s, the longest job this process ran, the longest job recorded at its model and
    batch) left: an offloading job at a large batch takes minutes, whichever job ran before
    it in this process. Once it refuses a job it refuses every later one."""

    def __init__(self, stop_at: Optional[float] = None, done: Sequence[Sequence[Any]] = (),
                 durations: Sequence[Sequence[Any]] = (), longest: float = 0.0):
        self.stop_at = stop_at
        self.done = {(str(m), str(n), int(b)) for m, n, b in done}
        # seconds, the longest job this process has run (a worker that replaces a dead one:
        # the longest its predecessors ran)
        self.longest = float(longest)
        self.last = 0.0             # seconds, the last job's
        self.durations: Dict[Tuple[str, int], float] = {}
        for m, b, sec in durations:
            self.note(str(m), int(b), float(sec))
        self.stopped = False
        self.left: List[Key] = []   # jobs not started because of stop_at

    @classmethod
    def of(cls, grid: "Grid") -> "Plan":
        return cls(grid.stop_at, grid.done, grid.durations, grid.longest)

    def pending(self, model: str, method: str, batch: int) -> bool:
        return (model, method, batch) not in self.done

    def note(self, model: str, batch: int, seconds: Optional[float]) -> None:
        """A job at (model, batch) took ``seconds``: the margin of the next at that batch."""
        if seconds is not None:
            key = (model, int(batch))
            self.durations[key] = max(self.durations.get(key, 0.0), float(seconds))

    def duration_list(self) -> List[Tuple[str, int, float]]:
        return [(m, b, sec) for (m, b), sec in sorted(self.durations.items())]

    def margin(self, model: Optional[str] = None, batch: Optional[int] = None) -> float:
        same = self.durations.get((model, batch), 0.0) if model is not None else 0.0
        return max(STOP_MARGIN, self.longest, same)

    def may_start(self, model: Optional[str] = None, batch: Optional[int] = None) -> bool:
        if self.stop_at is not None and not self.stopped:
            self.stopped = clock() > self.stop_at - self.margin(model, batch)
        return not self.stopped

    @contextlib.contextmanager
    def job(self, model: Optional[str] = None, batch: Optional[int] = None) -> Iterator[None]:
        """Time one job (its length raises the margin for the next, and for its batch's)."""
        t0 = clock()
        try:
            yield
        finally:
            self.last = clock() - t0
            self.longest = max(self.longest, self.last)
            if model is not None and batch is not None:
                self.note(model, batch, self.last)


FULL_BATCHES = {"resnet50": [64, 128, 256, 512, 928, 1120, 1248, 1440, 2048],
                "gpt2-s1024": [4, 8, 16, 32, 64], "gpt2-s2048": [2, 4, 8, 16, 32],
                "bert-dyn": [16, 32, 64, 128]}
# --quick checks that every method trains (bit-equal losses) on the GPU before the full grid:
# each model's smallest full-grid batch only (one job per method; the full grid's larger
# batches are its own steps, not repeated here). ResNet-50 saves 85 MiB per 224px image
# (meta_chain: batch 1440 is 119 GiB, past the 128 GiB hosts once pinned and rounded up to
# powers of two: host_floor_note), GPT-2 at 1024 tokens 2.25 GiB per sequence.
QUICK_BATCHES = {"resnet50": [64], "gpt2-s1024": [8]}
SMOKE_BATCHES = {"resnet18": [4, 8], "gpt2-s32": [2], "bert-dyn": [2]}


@dataclass
class Grid:
    models: Dict[str, List[int]]
    methods: List[Method]
    budget: Optional[int]          # the physical budget (a GPU's, for every model)
    steps: int
    warmup: int
    seed: int = 0
    budgets: Dict[str, int] = field(default_factory=dict)   # per-model override (CPU)
    stop_at: Optional[float] = None          # --stop-at (epoch seconds)
    done: List[Key] = field(default_factory=list)           # jobs an earlier run did (--resume)
    durations: List[Tuple[str, int, float]] = field(default_factory=list)  # (model, batch, s)
    references: List[str] = field(default_factory=list)     # models whose plain-training
    # reference this process runs even with no job of theirs left (the native worker's, which
    # the other allocators' references are compared with)
    # whether this process runs the reference at all (not the coexist pair: two uncapped
    # references at once would not fit the GPU, and no loss is checked there)
    reference: bool = True
    longest: float = 0.0   # seconds: the longest job the worker this process replaces ran

    def budget_for(self, model: str) -> Optional[int]:
        return self.budgets.get(model, self.budget)


def _progress(i: int, n: int, text: str) -> None:
    width = 24
    done = int(width * i / max(n, 1))
    print(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {text[:70]:<70}", end="",
          file=sys.stderr, flush=True)
    if i == n:
        print(file=sys.stderr)


def run_grid(grid: Grid, methods: Sequence[Method], device: torch.device,
             report: Optional[Callable[[str, Any], None]] = None,
             floor: Optional[Callable[[str, int, Optional[int]], str]] = None,
             plan: Optional[Plan] = None,
             host_floor: Optional[Callable[[str, Method, int, Optional[int]], str]] = None,
             uncapped: Optional[Callable[[], ContextManager[Any]]] = None,
             beat: Optional[Callable[[], None]] = None,
             alive: Optional[Callable[[], None]] = None
             ) -> Tuple[List[JobResult], Dict[str, List[float]]]:
    """Every method at every batch size under the budget, in this process. At the smallest
    batch each run's losses are compared with plain training's (same seed, no budget), which
    is also returned so runs under other allocators can be compared with it. ``report(kind,
    payload)`` hears each result as it is made (a GPU worker prints it at once: a worker that
    dies later, killed for host memory say, keeps what it finished). ``floor(model, batch,
    budget)``: why no method can fit (``op_floor_note``), or ""; ``host_floor(model, method,
    batch, budget)``: why the method's pinned host memory cannot fit (``host_floor_note``), or
    ""; such jobs become ``infeasible`` rows without running. ``uncapped()``: a context lifting
    the process's budget, for plain training's reference (no budget: its losses are the
    check's, whatever the cap). ``beat()``: called after every training step (a GPU worker's
    heartbeat, which the parent's watchdog hears). ``plan`` (default: from ``grid.stop_at``
    and ``grid.done``) skips the jobs done before and stops starting jobs at ``--stop-at``;
    those it did not start are in ``plan.left`` and told as one ``LEFT`` list."""
    tell = report or (lambda kind, payload: None)
    plan = plan or Plan.of(grid)
    rows: List[JobResult] = []
    references: Dict[str, List[float]] = {}
    todo = {model: [(m, b) for m in methods for b in batches if plan.pending(model, m.name, b)]
            for model, batches in grid.models.items()}
    # a model's reference runs where its jobs (or another process's loss check) need it
    with_ref = [model for model in grid.models if todo[model] or model in grid.references]
    total = sum(len(t) for t in todo.values()) + (len(with_ref) if grid.reference else 0)
    done = 0

    def skip(model: str, jobs: Sequence[Tuple[Method, int]]) -> None:
        plan.left.extend((model, m.name, b) for m, b in jobs)

    for model, batches in grid.models.items():
        if model not in with_ref:
            continue
        smallest = min(batches)
        if not plan.may_start():
            skip(model, todo[model])
            continue
        ref: Optional[JobResult] = None
        if grid.reference:
            _progress(done, total, f"{model}: plain training, the reference")
            with plan.job(), (uncapped or contextlib.nullcontext)():
                ref = run_job(BY_NAME["native"], _factory(model, smallest, device, grid), None,
                              device, grid.steps, grid.warmup, grid.seed, beat=beat)
                release_memory(device)   # (uncapped: what it cached goes before the cap is back)
            done += 1
            references[model] = ref.losses
            tell(REF, {model: ref.losses})
        # the op floor bounds a physical budget (a GPU's); the CPU smoke's simulated budgets
        # leave the weights out, so none is checked there
        below_floor: Dict[int, str] = {}
        for i, (m, b) in enumerate(todo[model]):
            if not plan.may_start(model, b):
                skip(model, todo[model][i:])
                break
            _progress(done, total, f"{model} {m.name} b={b}")
            tell(START, [model, m.name, b])
            with plan.job(model, b):
                budget = grid.budget_for(model)
                try:
                    if b not in below_floor:
                        below_floor[b] = (floor or (lambda *a: ""))(model, b, budget)
                    why = below_floor[b] or (host_floor or (lambda *a: ""))(model, m, b, budget)
                except Exception as exc:  # noqa: BLE001 - an estimate must not end the worker
                    print(f"e2e: {model} b={b} {m.name}: the floor estimate failed ({exc!r}); "
                          "the job runs", file=sys.stderr, flush=True)
                    below_floor.setdefault(b, "")
                    why = ""
                if why:
                    r = JobResult(model, m.name, b, None, "", None, budget, "infeasible", why)
                else:
                    # (at the smallest batch every step's loss is checked against plain
                    # training's: those jobs run all their steps)
                    r = run_job(m, _factory(model, b, device, grid), budget, device,
                                grid.steps, grid.warmup, grid.seed, beat=beat, alive=alive,
                                timed_seconds=None if b == smallest else TIMED_SECONDS)
                    # after run_job returned: nothing of the job (its wrapped model, pinned
                    # pool) is referenced any more, so the caches can give it all back
                    release_memory(device)
            r.seconds = round(plan.last, 3)
            r.model, r.batch_size = model, b   # also when the workload failed to build
            done += 1
            if b == smallest and r.status == "ok" and ref is not None:
                r.note = check_losses(m, r.losses, ref)
                if r.note.startswith("LOSS MISMATCH"):
                    r.status = "error"
            rows.append(r)
            tell(ROW, r.row())
    if plan.left:
        tell(LEFT, plan.left)
        print(f"\n{stopped_note(len(plan.left))}", file=sys.stderr)
    else:
        _progress(total, total, "done")
    return rows, references


def release_memory(device: torch.device) -> None:
    """Give back what a finished job left cached: cycles first (a wrapped model and its pinned
    host pool may sit in one), then the device cache and PyTorch's pinned host cache, which
    keeps every block (rounded up to a power of two) for the process's life: a grid's jobs
    would otherwise add up past the host's RAM, and the next job's peak would count them."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        # (the private name; torch 2.13 has only torch.accelerator's; without either the
        # pinned cache stays, and the next job counts it)
        host_empty = getattr(torch._C, "_host_emptyCache", None) or \
            getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if host_empty is not None:
            host_empty()


def stopped_note(n: int) -> str:
    return f"stopped at --stop-at: {n} jobs left for a later run (--resume)"


def check_losses(method: Method, losses: List[float], ref: JobResult) -> str:
    """The row's note on its losses against plain training's (same seed): bitwise equal, or
    a ``LOSS MISMATCH`` (the row fails), or for a method that need not be bit-exact
    (``Method.inexact``) how far they are and why."""
    if ref.status != "ok":
        return f"loss not checked: plain training failed ({ref.note})"
    if losses == ref.losses:
        return f"loss bitwise equal to plain training ({len(losses)} steps)"
    if not method.inexact or len(losses) != len(ref.losses):
        return f"LOSS MISMATCH vs plain training: {losses} != {ref.losses}"
    worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref.losses))
    return (f"loss not bitwise equal to plain training, relative difference up to {worst:.1e} "
            f"({len(losses)} steps): {method.inexact}")


def _factory(model: str, batch: int, device: torch.device, grid: Grid) -> Callable[[], Workload]:
    return lambda: build_workload(model, batch, device, device.type == "cpu", grid.seed)
