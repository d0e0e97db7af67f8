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
the same command until the file is complete.

On a GPU the parent watches each worker: one silent for ``--job-timeout`` seconds (default
180; a worker prints a line after every training step) is killed, the job it was in gets a
``timeout`` row, and a new worker goes on with the next job. A method whose optional package
does not import (torchtune) gets ``unavailable`` rows, the import error in ``note`` and
``error``. Workers get the parent's environment less ``VMALLOC*`` and
``PYTORCH_CUDA_ALLOC_CONF`` (the method sets its allocator), and plain training's reference
runs with the process's cap lifted. bert-dyn on a GPU warms up over every sequence length of
the run, then times at least one more full cycle of them (``step_counts``).

Each allocator needs its own process (PyTorch's allocator is chosen before CUDA starts), so
on a GPU the parent runs one worker process per allocator and collects their JSON lines.
Every configuration is checked against plain training: at the smallest batch, its losses over
all steps (same seed) must equal plain training's bit for bit for the exact methods (all of
them here), and plain training must give the same losses under every allocator; a mismatch
marks the row ``error`` and the run exits non-zero. GPU workers run cuDNN's deterministic
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
it would end its worker, and with it the rest of that worker's jobs.

Multi-GPU DDP under ``torchrun`` is not part of this script yet: the lent machines have one
GPU, where ``--coexist`` shows per-process allocators side by side instead.

Results: ``bench/results/e2e-<gpu>-<date>.json`` (shape in the issue), a table on stdout, and
``e2e-<gpu>-<date>-throughput.png`` / ``-memory.png`` beside it when matplotlib is present.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import (Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence,
                    Tuple)

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a script (bench/ is first on sys.path)
    import checkout
    checkout.on_path()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import (byte_size, driver_version, nonnegative_int, positive_int,  # noqa: E402
                          usage_error)
from vmalloc.atomic_file import write_atomic  # noqa: E402
from vmalloc.sizes import format_size, parse_size  # noqa: E402

RESULTS = ROOT / "bench" / "results"

# ------------------------------------------------------------------------------- methods
# name -> (allocator it needs, what it does). The allocator is a process-wide choice.
ALLOCATORS = ("native", "expandable", "vmalloc")


@dataclass(frozen=True)
class Method:
    name: str
    allocator: str
    kind: str                 # plain | save_on_cpu | torchtune | ckpt_seq | swap | wrap
    planner: Optional[str] = None
    exact: bool = True        # the loss must equal plain training's bit for bit


METHODS: Tuple[Method, ...] = (
    Method("native", "native", "plain"),
    Method("native+expandable", "expandable", "plain"),
    Method("save_on_cpu", "native", "save_on_cpu"),
    Method("torchtune-offload", "native", "torchtune"),
    Method("checkpoint_sequential", "native", "ckpt_seq"),
    Method("window", "native", "swap", "window"),
    Method("lms", "native", "swap", "lms"),
    Method("window+vmalloc", "vmalloc", "swap", "window"),
    Method("dynprog", "native", "swap", "dynprog"),
    Method("dynprog+vmalloc", "vmalloc", "swap", "dynprog"),
    Method("rotor", "native", "wrap", "rotor"),
    Method("rotor+vmalloc", "vmalloc", "wrap", "rotor"),
    Method("pofo", "native", "wrap", "pofo"),
    Method("mimose", "native", "wrap", "mimose"),
    Method("pofo+vmalloc", "vmalloc", "wrap", "pofo"),
)
BY_NAME = {m.name: m for m in METHODS}
# the columns; the CPU smoke runs every method that needs no CUDA allocator instead
GPU_DEFAULT = ("native", "native+expandable", "save_on_cpu", "torchtune-offload",
               "checkpoint_sequential", "window", "lms", "window+vmalloc", "dynprog+vmalloc",
               "rotor", "pofo+vmalloc", "mimose")


# -------------------------------------------------------------------------------- models
@dataclass
class Workload:
    """A model at one batch size: blocks, the inputs of successive steps (one, or several of
    different sequence lengths), targets, and how to count throughput."""
    model: str
    batch: int
    blocks: List[nn.Module]
    inputs: List[torch.Tensor]
    unit: str                  # images/s or tokens/s
    seed: int
    targets: Optional[torch.Tensor] = None

    def input(self, step: int) -> torch.Tensor:
        return self.inputs[step % len(self.inputs)]

    def items(self, step: int) -> int:
        """Images, or tokens, that step ``step`` trains on."""
        x = self.input(step)
        return x.shape[0] if self.unit == "images/s" else x.numel()


SMOKE_SIZES = {"resnet": dict(image=32, num_classes=10),
               "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab=128),
               "bert": dict(n_layer=2, hidden=64, heads=4, intermediate=128, vocab=128)}
# BERT-style with variable sequence lengths (the Mimose path): a fixed, seeded draw per run
DYNAMIC_LENGTHS = {True: (8, 32), False: (64, 512)}   # smoke: tiny; GPU: GLUE-like range
DYNAMIC_STEPS = 16                                    # distinct inputs cycled through


def parse_model(model: str) -> Tuple[str, Optional[int], bool]:
    """``resnet50`` / ``gpt2-s2048`` (sequence length) / ``bert-dyn`` (variable lengths)
    -> (zoo name, sequence length, dynamic)."""
    name, _, suffix = model.partition("-")
    if model.startswith("resnet") and not suffix:
        return model, None, False
    if name in ("gpt2", "bert") and suffix.startswith("s") and suffix[1:].isdigit():
        return name, int(suffix[1:]), False
    if name == "bert" and suffix == "dyn":
        return name, None, True
    raise ValueError(f"--models: cannot read {model!r} (resnet<depth>, gpt2-s<seq>, "
                     "bert-s<seq>, bert-dyn)")


def zoo_spec(model: str, smoke: bool) -> Tuple[str, str, bool, Dict[str, Any]]:
    """(zoo name, family, dynamic, the zoo builder's keyword arguments) of ``model``; a dynamic
    model is built for its longest input."""
    name, seq_len, dynamic = parse_model(model)
    family = "resnet" if name.startswith("resnet") else name
    kw: Dict[str, Any] = dict(SMOKE_SIZES[family]) if smoke else {}
    if dynamic:
        kw["seq_len"] = DYNAMIC_LENGTHS[smoke][1]
    elif seq_len is not None:
        kw["seq_len"] = seq_len
    return name, family, dynamic, kw


def build_workload(model: str, batch: int, device: torch.device, smoke: bool,
                   seed: int) -> Workload:
    from bench.models import build  # the project's own zoo (no torchvision)

    name, family, dynamic, kw = zoo_spec(model, smoke)
    lengths: List[Optional[int]] = [None]
    if dynamic:
        lo, hi = DYNAMIC_LENGTHS[smoke]
        g = torch.Generator().manual_seed(seed + 2)
        lengths = [int(v) for v in torch.randint(lo, hi + 1, (DYNAMIC_STEPS,), generator=g)]
    torch.manual_seed(seed)  # the same weights for every method
    zm = build(name, batch=batch, device=device, **kw)
    blocks = [b.to(device) for b in zm.blocks]
    inputs = [zm.sample_input(device=device, seed=seed + i,
                              shape=None if n is None else (batch, n))
              for i, n in enumerate(lengths)]
    return Workload(model, batch, blocks, inputs,
                    "images/s" if family == "resnet" else "tokens/s", seed)


def loss_of(out: torch.Tensor, wl: Workload) -> torch.Tensor:
    """Cross entropy against fixed random targets shaped after the output (the same for every
    method, so losses compare bit for bit)."""
    if wl.targets is None:
        g = torch.Generator().manual_seed(wl.seed + 1)
        wl.targets = torch.randint(0, out.shape[-1], out.shape[:-1], generator=g).to(out.device)
    if out.dim() < 2:
        return out.float().mean()
    return F.cross_entropy(out.float().flatten(0, -2), wl.targets.flatten())


# ---------------------------------------------------------------------- running one job
@dataclass
class JobResult:
    model: str
    method: str
    batch_size: int
    throughput: Optional[float]
    unit: str
    peak_bytes: Optional[int]
    budget_bytes: Optional[int]
    # ok | oom | error | infeasible (below the op floor or the host-memory floor: not run) |
    # crashed (its worker died during it: the host's OOM killer, a segfault) | timeout (its
    # worker went silent for --job-timeout and was killed) | unavailable (the method's optional
    # package does not import: torchtune). --resume runs only ``error`` rows again: the others
    # would only fail, crash or hang the same way, and leave the rest of the grid undone
    status: str
    note: str = ""
    detail: Dict[str, Any] = field(default_factory=dict)   # what the runtime did
    losses: List[float] = field(default_factory=list)
    seconds: Optional[float] = None   # the job's wall time (the --stop-at margin of its batch)
    error: Optional[str] = None       # an ``unavailable`` row's import error (also in note)

    def row(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("losses")
        if d["error"] is None:   # only unavailable rows carry it: the other rows keep their shape
            d.pop("error")
        return d


class MethodUnavailable(Exception):
    """A method's optional package (torchtune) does not import: its row says ``unavailable``."""


def _is_oom(exc: BaseException) -> bool:
    """Does not fit the budget: the allocator ran out, or a planner proved it would."""
    from scheduler.errors import InfeasibleError
    from vmalloc.errors import OutOfMemoryError
    if isinstance(exc, (torch.OutOfMemoryError, OutOfMemoryError, InfeasibleError)):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and "out of memory" in str(exc).lower()


@contextlib.contextmanager
def method_context(method: Method, wl: Workload, budget: Optional[int], device: torch.device,
                   segments: Optional[int]) -> Iterator[Tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], Dict[str, Any]]]]:
    """Yield ``(forward, stats)`` running ``wl``'s blocks the way ``method`` trains."""
    seq = nn.Sequential(*wl.blocks)
    none: Callable[[], Dict[str, Any]] = dict
    if method.kind == "plain":
        yield seq, none
    elif method.kind == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
            yield seq, none
    elif method.kind == "torchtune":
        try:
            from torchtune.training import OffloadActivations
        except ImportError as exc:   # not installed, or a peer of its own missing (torchao)
            raise MethodUnavailable(f"{type(exc).__name__}: {exc}") from exc
        with OffloadActivations(use_streams=device.type == "cuda"):
            yield seq, none
    elif method.kind == "ckpt_seq":
        from torch.utils.checkpoint import checkpoint_sequential
        n = segments or max(2, int(math.sqrt(len(wl.blocks))))
        yield (lambda x: checkpoint_sequential(seq, n, x, use_reentrant=False)), \
            (lambda: {"segments": n})
    elif method.kind == "swap":
        import scheduler
        # on the CPU the simulated budget is small: let the window look ahead over all of it
        window = "2GiB" if device.type == "cuda" else budget
        with scheduler.swap(window=window, budget=budget, planner=method.planner,
                            device=device) as ctx:
            yield seq, ctx.stats
    elif method.kind == "wrap":
        import scheduler
        bw = 12e9 if method.planner == "pofo" else None
        sample = None if method.planner == "mimose" else wl.input(0)   # Mimose learns online
        # the chain's loss stage is the loss trained on (a vocabulary's logits are large)
        # (Mimose measures the tail itself in its collection steps: it takes no loss=)
        loss = {} if method.planner == "mimose" else {"loss": lambda out: loss_of(out, wl)}
        model = scheduler.wrap(wl.blocks, budget, planner=method.planner, bandwidth=bw,
                               sample_input=sample, track_memory=device.type != "cuda", **loss)
        yield model, model.stats
    else:  # pragma: no cover - METHODS is closed
        raise AssertionError(method.kind)


# runtime figures worth keeping per row: swap runtime, chain runtime, checkpoint_sequential
DETAIL_KEYS = ("swapped_out_bytes", "swapped_in_bytes", "reattached_bytes", "stall_seconds",
               "plans_computed", "last_recomputed_forwards", "offloaded_bytes",
               "last_predicted_peak", "segments")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    """Start a job's peak from what it holds: the memory the previous job's tensors left in
    the allocator's cache (they were freed only when it returned) is released first, else
    ``max_memory_reserved`` would count it in this job's peak."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device, stats: Dict[str, Any]) -> Optional[int]:
    """Peak physical bytes: the allocator's on CUDA (vmalloc answers torch's queries while it
    is enabled); on the CPU the runtime's own count of saved activation bytes, if it keeps one."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    for key in ("peak_resident_bytes", "last_peak_bytes"):
        if stats.get(key) is not None:
            return int(stats[key])
    return None


def activation_budget(budget: int, static: int) -> int:
    """The runtimes' budget (bytes of activations they keep on the device) inside a physical
    ``budget``: less the static state (weights, gradients, momentum: ``static``), less 15%
    for the transients and the loss, as ``bench/swap.py`` does; at least 1 MiB."""
    return max(int((budget - static) * 0.85), 1 << 20)


def _static_bytes(params: List[torch.Tensor], opt: torch.optim.Optimizer,
                  device: torch.device) -> int:
    """The device bytes of the weights, their gradients and the optimizer's state: the
    state made by one step on zero gradients (SGD's momentum then starts at 0, which its
    first real step turns into exactly that step's gradient, as without it: losses stay
    bit-identical), plus the gradients the backward makes (freed again here)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    return torch.cuda.memory_allocated(device) + sum(p.numel() * p.element_size()
                                                     for p in params)


def step_counts(n_inputs: int, warmup: int, steps: int, gpu: bool) -> Tuple[int, int]:
    """(warm-up steps, timed steps) for a workload cycling through ``n_inputs`` inputs. On a
    GPU a dynamic workload (bert-dyn: a new sequence length each step) warms up over every
    input once or more (a whole number of cycles: rotor, pofo and the swap runtimes profile
    and plan each new shape, Mimose collects its samples) and times at least one full cycle
    again, so its throughput is the steady state over the run's lengths, not the learning.
    The CPU smoke keeps its few steps (it checks that the methods run, not their speed)."""
    if not gpu or n_inputs <= 1:
        return warmup, steps
    return -(-max(warmup, n_inputs) // n_inputs) * n_inputs, max(steps, n_inputs)


def run_job(method: Method, wl_factory: Callable[[], Workload], budget: Optional[int],
            device: torch.device, steps: int, warmup: int, seed: int,
            segments: Optional[int] = None,
            beat: Optional[Callable[[], None]] = None,
            alive: Optional[Callable[[], None]] = None) -> JobResult:
    """Train ``steps`` SGD steps after ``warmup`` ones (``step_counts``); time them; never
    raise. ``beat()``: called after every step (a GPU worker's heartbeat); ``alive()``: once
    the model is built and once the method is set up (planned), before the first step."""
    wl: Optional[Workload] = None
    beat = beat or (lambda: None)
    alive = alive or (lambda: None)
    try:
        wl = wl_factory()
        alive()   # (the watchdog hears each phase of a job: built, planned, every step)
        warmup, steps = step_counts(len(wl.inputs), warmup, steps, device.type == "cuda")
        _reset_peak(device)
        # dict: tied weights (GPT-2's embedding and head) are one parameter
        params = list({id(p): p for b in wl.blocks for p in b.parameters()}.values())
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
        # on a GPU ``budget`` caps the whole process: the runtimes get what is left for
        # activations (on the CPU the smoke's budgets are activation budgets already)
        runtime_budget = budget
        if device.type == "cuda" and budget is not None:
            runtime_budget = activation_budget(budget, _static_bytes(params, opt, device))
        losses: List[torch.Tensor] = []
        torch.manual_seed(seed)  # dropout draws the same numbers for every method
        with method_context(method, wl, runtime_budget, device, segments) as (forward, stats):
            alive()
            # the peak is training's: not what planning measured on entering (wrap's chain)
            _sync(device)
            _reset_peak(device)
            t0, items = 0.0, 0
            for step in range(warmup + steps):
                if step == warmup:
                    _sync(device)
                    t0 = time.perf_counter()
                if step >= warmup:
                    items += wl.items(step)
                opt.zero_grad(set_to_none=True)
                loss = loss_of(forward(wl.input(step)), wl)
                loss.backward()
                opt.step()
                losses.append(loss.detach())  # (.item() here would sync every step)
                beat()
            _sync(device)
            elapsed = time.perf_counter() - t0
            st = stats()
        detail = {k: st[k] for k in DETAIL_KEYS if st.get(k) is not None}
        if runtime_budget != budget:
            detail["activation_budget"] = runtime_budget
        return JobResult(wl.model, method.name, wl.batch, items / elapsed, wl.unit,
                         _peak(device, st), budget, "ok", detail=detail,
                         losses=[float(v) for v in losses])
    except MethodUnavailable as exc:
        return JobResult(wl.model if wl else "?", method.name, wl.batch if wl else 0, None,
                         wl.unit if wl else "", None, budget, "unavailable", str(exc),
                         error=str(exc))
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row, the run goes on
        model = wl.model if wl else "?"
        status = "oom" if _is_oom(exc) else "error"
        note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return JobResult(model, method.name, wl.batch if wl else 0, None,
                         wl.unit if wl else "", None, budget, status, note)
    # (the caches are emptied by the caller, release_memory, once this frame and its
    # references to the job's model and pools are gone)


# ----------------------------------------------------------------------------- the grid
Key = Tuple[str, str, int]    # (model, method, batch size): one job, one row


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
                 durations: Sequence[Sequence[Any]] = ()):
        self.stop_at = stop_at
        self.done = {(str(m), str(n), int(b)) for m, n, b in done}
        self.longest = 0.0          # seconds, the longest job this process has run
        self.last = 0.0             # seconds, the last job's
        self.durations: Dict[Tuple[str, int], float] = {}
        for m, b, sec in durations:
            self.note(str(m), int(b), float(sec))
        self.stopped = False
        self.left: List[Key] = []   # jobs not started because of stop_at

    @classmethod
    def of(cls, grid: "Grid") -> "Plan":
        return cls(grid.stop_at, grid.done, grid.durations)

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
                    r = run_job(m, _factory(model, b, device, grid), budget, device,
                                grid.steps, grid.warmup, grid.seed, beat=beat, alive=alive)
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
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


def stopped_note(n: int) -> str:
    return f"stopped at --stop-at: {n} jobs left for a later run (--resume)"


def check_losses(method: Method, losses: List[float], ref: JobResult) -> str:
    if ref.status != "ok":
        return f"loss not checked: plain training failed ({ref.note})"
    if method.exact and losses != ref.losses:
        return f"LOSS MISMATCH vs plain training: {losses} != {ref.losses}"
    return f"loss bitwise equal to plain training ({len(losses)} steps)"


def op_floor_note(model: str, batch: int, budget: Optional[int]) -> str:
    """Why no method can train ``model`` at ``batch`` within ``budget``, or "" when the floor
    fits: its largest operator's tensors (scheduler.profile.op_floor, on the meta device) plus
    what lives throughout (weights, gradients and SGD's momentum: 3 x the parameters) exceed
    the budget. Such jobs are not run: on a GPU each would spend minutes finding out."""
    if budget is None:
        return ""
    from bench.models import build
    from scheduler.profile.op_floor import op_floor

    name, _, _, kw = zoo_spec(model, smoke=False)   # a GPU job's model: full size
    zm = build(name, batch=batch, device="meta", **kw)
    floor = op_floor(zm.blocks, zm.input_shape, input_dtype=zm.input_dtype)
    need = floor.bytes + 3 * floor.param_bytes
    if need <= budget:
        return ""
    return (f"no method fits: its largest op ({floor.op}) holds {format_size(floor.bytes)} "
            f"+ weights, gradients, momentum {format_size(3 * floor.param_bytes)} > budget "
            f"{format_size(budget)}")


# ------------------------------------------------------------ the host-memory floor
HOST_FRACTION = 0.8   # of MemAvailable the pinned offload may take (the rest: the process, page cache)


def pinned_size(nbytes: int) -> int:
    """What PyTorch's pinned-memory cache holds for a block of ``nbytes``: it rounds every
    block up to a power of two (CachingHostAllocator), and keeps it for the process's life."""
    return 1 << max(0, int(nbytes) - 1).bit_length() if nbytes > 0 else 0


def pool_size(nbytes: int) -> int:
    """What the swap runtimes' and pofo's host pool holds for a buffer of ``nbytes``: carved
    out of a slab at its size rounded to ``ALIGN`` (a small one gets its own pinned block)."""
    from scheduler.runtime.host_pool import ALIGN, DIRECT_BELOW
    if nbytes < DIRECT_BELOW:
        return pinned_size(nbytes)
    return -(-int(nbytes) // ALIGN) * ALIGN


@lru_cache(maxsize=None)
def saved_activations(model: str, batch: int) -> Tuple[Tuple[int, ...], Tuple[int, ...], int]:
    """What one training step of ``model`` at ``batch`` saves for its backward, from the
    full-size model on the meta device (as ``op_floor_note`` builds it; a dynamic model at its
    longest input): (bytes of every saved tensor, as ``save_on_cpu`` copies each one, weights
    included; bytes of each distinct saved storage that is not a parameter or buffer, as the
    swap and chain runtimes offload them; the parameters' bytes)."""
    from bench.models import build
    from scheduler.profile import _trace as T
    from scheduler.profile.meta import _check_dtypes, _input_shapes

    name, _, _, kw = zoo_spec(model, smoke=False)
    zm = build(name, batch=batch, device="meta", **kw)
    state = [t for b in zm.blocks for t in list(b.parameters()) + list(b.buffers())]
    exclude = {T.storage_key(t) for t in state}
    in_shapes = _input_shapes(zm.input_shape)
    dtypes = _check_dtypes(zm.input_dtype, len(in_shapes))
    every: List[int] = []
    storages: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        every.append(t.numel() * t.element_size())
        key = T.storage_key(t)
        if key not in exclude:
            storages[key] = t.untyped_storage().nbytes()
        return t

    values: Any = tuple(torch.empty(sh, dtype=d, device="meta") for sh, d in zip(in_shapes, dtypes))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for i, block in enumerate(zm.blocks):
            values = T.call_block(block, values, i)
        T.make_loss("cross_entropy")(*values)
    params = T.storage_bytes([q for b in zm.blocks for q in b.parameters()])
    return tuple(every), tuple(storages.values()), params


def pinned_need(model: str, method: Method, batch: int, budget: Optional[int]) -> int:
    """Pinned host bytes ``method`` would hold training ``model`` at ``batch`` (0: it offloads
    nothing). ``save_on_cpu`` and torchtune copy every saved tensor to its own pinned block;
    the swap runtimes and pofo offload the saved storages beyond the activation budget (taken
    in proportion: which ones stay is the planner's choice), each in its own block; with
    dynamic shapes their host pool also caches up to ``CACHE_FACTOR`` x its peak for the sizes
    of past steps. ``save_on_cpu``'s and torchtune's blocks are rounded up to a power of two
    (``pinned_size``); the host pool carves its buffers out of slabs (``pool_size``)."""
    offloads = method.kind in ("save_on_cpu", "torchtune", "swap") or method.planner == "pofo"
    if not offloads:
        return 0
    every, storages, params = saved_activations(model, batch)
    if method.kind in ("save_on_cpu", "torchtune"):
        return sum(pinned_size(n) for n in every)
    raw = sum(storages)
    if raw == 0:
        return 0
    kept = activation_budget(budget, 3 * params) if budget is not None else 0
    need = sum(pool_size(n) for n in storages) * max(0, raw - kept) // raw
    if parse_model(model)[2]:
        from scheduler.runtime.host_pool import CACHE_FACTOR
        need *= 1 + CACHE_FACTOR
    return need


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> Optional[int]:
    """The host's MemAvailable in bytes, or None where ``meminfo`` cannot say (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemAvailable":
                number, _, unit = value.strip().partition(" ")
                return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    except (OSError, ValueError):
        return None
    return None


HOST_NOTE = "host memory:"   # how a row infeasible for host memory starts its note


def host_floor_note(model: str, method: Method, batch: int, budget: Optional[int],
                    meminfo: Path = Path("/proc/meminfo")) -> str:
    """Why ``method`` cannot train ``model`` at ``batch`` in this host's memory, or "": the
    pinned bytes it would offload (``pinned_need``) exceed ``HOST_FRACTION`` of MemAvailable
    (read just before the job, after the previous one's pinned cache was given back). Such a
    job would end its worker (the host's OOM killer, or a failed ``cudaHostAlloc``) and, the
    grid being method-major, the rest of that worker's jobs for the session."""
    need = pinned_need(model, method, batch, budget)
    if not need:
        return ""
    available = mem_available(meminfo)
    if available is None or need <= HOST_FRACTION * available:
        return ""
    how = "each rounded up to a power of two by PyTorch's pinned cache" \
        if method.kind in ("save_on_cpu", "torchtune") else "carved from the host pool's slabs"
    return (f"{HOST_NOTE} offloads ~{format_size(need)} pinned (saved activations, {how}) > "
            f"{HOST_FRACTION:g} x MemAvailable {format_size(available)}")


def _factory(model: str, batch: int, device: torch.device, grid: Grid) -> Callable[[], Workload]:
    return lambda: build_workload(model, batch, device, device.type == "cpu", grid.seed)


# ------------------------------------------------------------------------ GPU: workers
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


ROW, REF = "E2E-ROW", "E2E-REF"   # the lines a worker prints for the parent
LEFT = "E2E-LEFT"                 # the jobs it did not start (--stop-at)
START = "E2E-START"               # the job it starts now (a worker dying in it: crashed)
BEAT = "E2E-BEAT"                 # a training step done (the parent's watchdog hears it)
ALIVE = "E2E-ALIVE"               # a job's model built, its method set up (heard too)
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
    return subprocess.Popen([sys.executable, __file__, "--worker", allocator,
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
    (kept by --resume) and a new worker for the same allocator goes on with the next job."""
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
        while todo or refs:
            if not plan.may_start():
                plan.left += todo
                break
            got, unfinished, again = _one_worker(grid, plan, allocator, methods, todo, refs,
                                                 done, ref, references.get("native", {}),
                                                 tell, job_timeout)
            rows += got
            if not again:
                break
            # a job timed out: the next worker goes on with the jobs after it (the references
            # it already gave are not run again, unless its own jobs need them)
            done |= {row_key(r) for r in got}
            todo, refs = unfinished, [m for m in refs if m not in ref]
    return rows


def _one_worker(grid: Grid, plan: Plan, allocator: str, methods: Sequence[Method],
                todo: List[Key], refs: List[str], done: set, ref: Dict[str, List[float]],
                base: Dict[str, List[float]], tell: Callable[[str, Any], None],
                job_timeout: float) -> Tuple[List[JobResult], List[Key], bool]:
    """Run one worker process over ``todo``: (its rows, the jobs it left unfinished, whether
    a new worker should go on with those: it timed out in a job, now a ``timeout`` row)."""
    spec = dict(grid.__dict__, methods=[m.name for m in methods], references=refs,
                done=sorted(done), durations=plan.duration_list())
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
        if watch.timed_out and unfinished:
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


# ------------------------------------------------------------------------------ output
def meta(device: torch.device, command: str) -> Dict[str, Any]:
    gpu, driver = "cpu", None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(0)
        driver = driver_version()
    return {"gpu": gpu, "driver": driver, "torch": torch.__version__,
            "date": _dt.date.today().isoformat(), "command": command,
            "host": platform.node(), "cuda": torch.version.cuda}


def table(rows: Sequence[JobResult]) -> str:
    head = f"{'model':<10} {'method':<22} {'batch':>6} {'throughput':>14} {'peak':>12} {'status':<6} note"
    lines = [head, "-" * len(head)]
    for r in rows:
        tp = f"{r.throughput:,.1f} {r.unit.split('/')[0][:3]}/s" if r.throughput else "-"
        peak = format_size(r.peak_bytes) if r.peak_bytes is not None else "-"
        lines.append(f"{r.model:<10} {r.method:<22} {r.batch_size:>6} {tp:>14} {peak:>12} "
                     f"{r.status:<6} {r.note[:60]}")
    return "\n".join(lines)


def plots(rows: Sequence[JobResult], stem: Path, grid: Grid) -> List[str]:
    if not rows:   # a run stopped (--stop-at) before its first job
        return []
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    for what, key, ylabel in (("throughput", "throughput", "throughput"),
                              ("memory", "peak_bytes", "peak physical memory (GiB)")):
        models = sorted({r.model for r in rows})
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
        for ax, model in zip(axes[0], models):
            for name in dict.fromkeys(r.method for r in rows if r.model == model):
                pts = [(r.batch_size, getattr(r, key)) for r in rows
                       if r.model == model and r.method == name and r.status == "ok"
                       and getattr(r, key) is not None]
                if pts:
                    xs, ys = zip(*pts)
                    ys = [y / 2**30 for y in ys] if key == "peak_bytes" else ys
                    ax.plot(xs, ys, marker="o", label=name)
            budget = grid.budget_for(model)
            if key == "peak_bytes" and budget:
                ax.axhline(budget / 2**30, color="k", ls="--", lw=1, label="budget")
            unit = next((r.unit for r in rows if r.model == model and r.unit), "")
            ax.set(title=model, xlabel="batch size",
                   ylabel=f"{ylabel} ({unit})" if what == "throughput" else ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = f"{stem}-{what}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out


# -------------------------------------------------------------------------------- main
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
                        "FILE starts from nothing")
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
        from bench.models import ZOO
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        if not names:
            usage_error(f"--models {args.models!r}: no model named", parser=p,
                        value_error=True)
        for n in names:   # (a ValueError too, as main raised for them before this check)
            try:
                zoo_name = parse_model(n)[0]
            except ValueError as exc:
                usage_error(f"{exc}", parser=p, value_error=True)
            if zoo_name not in ZOO:
                usage_error(f"--models {n!r}: the model zoo has no {zoo_name!r} "
                            f"(it has {', '.join(k for k in ZOO if k.startswith('resnet'))}, "
                            "gpt2-s<seq>, bert-s<seq>, bert-dyn)", parser=p, value_error=True)
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


def load_resume(path: Path) -> List[JobResult]:
    """The rows of an earlier results file to keep: every one whose status is not ``error``
    (those run again): ``ok``, ``oom``, ``infeasible``, and ``crashed``, ``timeout`` and
    ``unavailable``, which would only crash, hang or fail to import again. Except rows
    infeasible for host memory (``HOST_NOTE``): judged again (it takes a second), as they rest
    on an estimate and on the host's free memory at the time, not on the GPU. A missing file
    keeps nothing; a file we cannot read is an error."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        print(f"--resume {path}: no such file yet, starting from nothing", file=sys.stderr)
        return []
    names = set(JobResult.__dataclass_fields__) - {"losses"}
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
            rows.append(JobResult(**{k: v for k, v in row.items() if k in names}))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SystemExit(f"--resume {path}: not a bench/e2e.py results file "
                         f"({type(exc).__name__}: {exc})") from None
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
    command = "python bench/e2e.py " + " ".join(argv if argv is not None else sys.argv[1:])
    kept = load_resume(Path(args.resume)) if args.resume else []
    grid = make_grid(args, cuda)
    grid.stop_at = args.stop_at
    grid.done = sorted({row_key(r) for r in kept})
    grid.durations = [(r.model, r.batch_size, r.seconds) for r in kept if r.seconds is not None]
    plan = Plan.of(grid)
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and grid.budget is None:
        grid.budgets = cpu_budgets(grid)
    budgets = ", ".join(f"{m} {format_size(b)}" for m, b in grid.budgets.items()) or (
        format_size(grid.budget) if grid.budget else "none")
    print(f"e2e: {device}, budget {budgets}, "
          f"{len(grid.methods)} methods, models {grid.models}", file=sys.stderr)
    if kept:
        print(f"--resume {args.resume}: {len(kept)} rows kept, {len(grid.done)} jobs not run "
              "again", file=sys.stderr)
    info = meta(device, command.strip())
    if args.resume:
        info["resumed_from"] = len(kept)
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
