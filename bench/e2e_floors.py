"""bench/e2e.py's floors: the jobs not worth running on a GPU, judged before they start. The
op floor (``op_floor_note``: a job whose largest operator cannot fit the device budget) and
the host-memory floor (``host_floor_note``: an offloading job whose pinned host memory would
pass the host's available memory, and end its worker)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from bench.e2e_job import activation_budget, proc_bytes
from bench.e2e_methods import Method
from bench.e2e_workloads import parse_model, zoo_spec
from vmalloc.sizes import format_size


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
    return proc_bytes(meminfo, "MemAvailable")


HOST_NOTE = "host memory:"   # how a row infeasible for host memory starts its note


def host_floor_note(model: str, method: Method, batch: int, budget: Optional[int],
                    meminfo: Path = Path("/proc/meminfo")) -> str:
    """Why ``method`` cannot train ``model`` at ``batch`` in this host's memory, or "": the
    pinned bytes it would offload (``pinned_need``) exceed ``HOST_FRACTION`` of MemAvailable
    (read just before the job, after the previous one's pinned cache was given back). Such a
    job would end its worker (the host's OOM killer, or a failed ``cudaHostAlloc``): a
    ``crashed`` row, and a new worker started (with its own warm-up) for the jobs after it."""
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
