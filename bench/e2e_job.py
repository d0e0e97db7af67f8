"""bench/e2e.py's one job: a method training a workload under a budget for some steps
(``run_job``), timed, its peak memory measured, every failure turned into a row
(``JobResult``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from bench.e2e_methods import Method, MethodUnavailable, method_context
from bench.e2e_workloads import Workload, loss_of


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

    @classmethod
    def of_row(cls, row: Dict[str, Any]) -> "JobResult":
        """A results file's row back (``row()`` left out the losses; keys it lacks are ignored)."""
        names = set(cls.__dataclass_fields__) - {"losses"}
        return cls(**{k: v for k, v in row.items() if k in names})



STATUS = Path("/proc/self/status")


def proc_bytes(path: Path, name: str) -> Optional[int]:
    """A ``name: N kB`` line of a /proc file (meminfo, self/status) in bytes, or None where
    it cannot say (not Linux, no such line)."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            if key == name:
                number, _, unit = value.strip().partition(" ")
                return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    except (OSError, ValueError):
        return None
    return None


def host_peak_reset() -> Optional[int]:
    """Start this process's peak resident memory (``VmHWM``) over from now (Linux: ``5``
    written to /proc/self/clear_refs) and return the resident bytes now (``VmRSS``); None
    where either cannot be done (not Linux, a sandbox without clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return proc_bytes(STATUS, "VmRSS")


def host_peak() -> Optional[int]:
    """This process's peak resident bytes since ``host_peak_reset`` (pinned host memory is
    resident: the offloading methods' copies count), or None."""
    return proc_bytes(STATUS, "VmHWM")


def _is_oom(exc: BaseException) -> bool:
    """Does not fit the budget: the allocator ran out, or a planner proved it would."""
    from scheduler.errors import InfeasibleError
    from vmalloc.errors import OutOfMemoryError
    if isinstance(exc, (torch.OutOfMemoryError, OutOfMemoryError, InfeasibleError)):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and "out of memory" in str(exc).lower()



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


# A job's timed steps stop early once they have taken this long (and at least MIN_TIMED ran):
# the slow methods at large batches (offloading everything, 5-10 s a step) would otherwise
# spend a GPU session's minutes on steps 4-10 of a steady state the first three already show
TIMED_SECONDS = 15.0
MIN_TIMED = 3


def run_job(method: Method, wl_factory: Callable[[], Workload], budget: Optional[int],
            device: torch.device, steps: int, warmup: int, seed: int,
            segments: Optional[int] = None,
            beat: Optional[Callable[[], None]] = None,
            alive: Optional[Callable[[], None]] = None,
            timed_seconds: Optional[float] = None) -> JobResult:
    """Train ``steps`` SGD steps after ``warmup`` ones (``step_counts``); time them; never
    raise. ``beat()``: called after every step (a GPU worker's heartbeat); ``alive()``: once
    the model is built and once the method is set up (planned), before the first step.
    ``timed_seconds``: stop timing once the timed steps took that long, after at least
    ``MIN_TIMED`` of them (a dynamic workload: all of them); the row's
    ``detail.timed_steps`` then says how many ran (None: all ``steps``)."""
    wl: Optional[Workload] = None
    beat = beat or (lambda: None)
    alive = alive or (lambda: None)
    try:
        wl = wl_factory()
        alive()   # (the watchdog hears each phase of a job: built, planned, every step)
        host_base = host_peak_reset()   # (after the model is built: the job's own growth)
        warmup, steps = step_counts(len(wl.inputs), warmup, steps, device.type == "cuda")
        # (a dynamic workload's throughput is over every input length: never cut its cycle)
        min_timed = steps if len(wl.inputs) > 1 else min(steps, MIN_TIMED)
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
            t0, items, timed = 0.0, 0, 0
            for step in range(warmup + steps):
                if step == warmup:
                    _sync(device)
                    t0 = time.perf_counter()
                if step >= warmup:
                    items += wl.items(step)
                    timed += 1
                opt.zero_grad(set_to_none=True)
                loss = loss_of(forward(wl.input(step)), wl)
                loss.backward()
                opt.step()
                losses.append(loss.detach())  # (.item() here would sync every step)
                beat()
                # (the host's clock, unsynchronized: it runs ahead of the GPU by at most the
                # launch queue, and the elapsed time below is measured after a sync)
                if timed_seconds is not None and timed >= min_timed and timed < steps \
                        and time.perf_counter() - t0 >= timed_seconds:
                    break
            _sync(device)
            elapsed = time.perf_counter() - t0
            st = stats()
        detail = {k: st[k] for k in DETAIL_KEYS if st.get(k) is not None}
        if timed < steps:
            detail["timed_steps"] = timed
        top = host_peak() if host_base is not None else None
        if top is not None:   # what the host held: the offloading methods' pinned copies
            detail["host_rss_base_bytes"], detail["host_rss_peak_bytes"] = host_base, top
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
