"""Plans that agree across ranks (data-parallel training: one plan where ranks must join
the same collectives).

Each rank measures its own chain, and measured times differ from rank to rank (and sizes too,
when the ranks see different shapes), so planning on each rank's own measurement can give the
ranks different plans with different peaks. ``agree_chain`` makes every rank plan on the same
chain: the element-wise maximum of the ranks' chains (every time, size and transient), so the
plan is made for the slowest rank's timing and fits every rank's memory. A runner calls it
right after measuring a chain and before planning where the ranks must run one plan (its
recomputations run collectives: FSDP units, SyncBatchNorm; ``ChainRunner._agrees``); under
DDP otherwise each rank plans alone. Outside a process group (or with one rank) it returns
the chain unchanged and costs nothing.

Every rank must call it at the same point: the runners call it when they measure, which is on
a new input signature, so the ranks must see the same sequence of new signatures (fixed
shapes, or dynamic shapes that every rank draws alike, e.g. padded to the longest batch of
the step). When they do not, the ranks find out here: the agreement first compares the
ranks' signature fingerprints and stages and raises on every rank with a message naming the
difference; a rank that never arrives turns into the process group's timeout error
(``init_process_group(timeout=...)``), not a silent hang.

The exchange is two all-reduces (4 and ``7 (L + 1)`` float64 values) on the group's own
backend (CPU tensors for gloo, CUDA for NCCL): microseconds next to measuring a chain. Integer sizes stay integers (float64 holds them exactly below
2**53).

``shutdown`` ends a process group so the process can exit without a race (see there).
"""
from __future__ import annotations

import gc
import hashlib
import re
import threading
import weakref
from typing import Any, Dict, Hashable, List, Sequence, Tuple

import torch

from ..chain import FIELDS, Chain

def active(group: Any = None) -> bool:
    """A process group is initialised and has more than one rank."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _device(group: Any) -> torch.device:
    """Where the exchanged tensor lives: CUDA for an NCCL-only group, else the CPU (gloo, or a
    group with a CPU backend beside NCCL)."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fingerprint(key: Hashable, L: int) -> float:
    """A number equal on two ranks iff they agree on what they are planning for (float64
    holds 48 bits of the hash exactly). Device indices are left out of ``key``: rank k
    trains on ``cuda:k``, the same input signature otherwise."""
    text = re.sub(r"\b([a-z]+):\d+\b", r"\1", repr((key, L)))
    h = hashlib.sha256(text.encode()).digest()
    return float(int.from_bytes(h[:6], "little"))


def agree_chain(chain: Chain, key: Hashable = None, group: Any = None) -> Chain:
    """The element-wise maximum of ``chain`` over the ranks of ``group`` (default: the world),
    the same ``Chain`` on every rank; ``chain`` itself without an initialised process group.

    ``key`` names what the chain is for (the runner passes the input signature and budget):
    ranks planning for different keys, or for chains of different lengths, raise
    ``RuntimeError`` on every rank rather than mixing unrelated chains (or hanging later)."""
    if not isinstance(chain, Chain):
        raise TypeError(f"agree_chain: expected a scheduler.Chain, got {type(chain).__name__}")
    if not active(group):
        return chain
    dist = torch.distributed
    dev = _device(group)
    try:
        same_key, same_length = _same_everywhere([_fingerprint(key, chain.L), chain.L], group)
    except RuntimeError as exc:
        raise RuntimeError(
            f"agree_chain: rank {dist.get_rank()} waited for the other ranks to plan (input "
            f"{key!r}) and they did not come: every rank must meet a new input signature at "
            f"the same step (same shapes on every rank, or none in a process group). "
            f"Underlying error: {exc}") from exc
    if not (same_key and same_length):
        raise RuntimeError(
            f"agree_chain: the ranks are planning for different inputs at the same step "
            f"(rank {dist.get_rank()}: {key!r}, {chain.L} stages; the runner's key holds the "
            f"input signature and the budget, so a budget that differs across ranks differs "
            f"here too); give every rank the same shapes and budget at the same step (e.g. "
            f"pad each step's batches to one length), or plan once and pass the plan "
            f"(planner=Plan) to every rank")
    values = torch.tensor([v for f in FIELDS for v in getattr(chain, f)], dtype=torch.float64,
                          device=dev)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    values = values.cpu()
    n = len(chain)
    agreed: Dict[str, Any] = {}
    for i, f in enumerate(FIELDS):
        mine = getattr(chain, f)
        got = values[i * n:(i + 1) * n].tolist()
        agreed[f] = tuple(int(v) if isinstance(m, int) else float(v) for v, m in zip(got, mine))
    meta = dict(chain.meta)
    meta["agreed_over_ranks"] = dist.get_world_size(group)
    return chain.replace(meta=meta, **agreed)


def ranks_with(flag: bool, group: Any = None) -> int:
    """How many ranks of ``group`` hold ``flag`` (``int(flag)`` without a group). Every rank
    must call it at the same point."""
    if not active(group):
        return int(flag)
    dist = torch.distributed
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return int(t.item())


def _same_everywhere(values: Sequence[float], group: Any) -> List[bool]:
    """For each of ``values``, whether every rank of ``group`` holds the same (its maximum
    over the ranks is minus the maximum of its negation), in one all-reduce. Every rank must
    call it at the same point, with as many values."""
    dist = torch.distributed
    t = torch.tensor([float(v) for v in values] + [-float(v) for v in values],
                     dtype=torch.float64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    got = t.tolist()
    n = len(values)
    return [got[i] == -got[n + i] for i in range(n)]


def differ(flag: bool, key: Hashable, group: Any = None) -> Tuple[bool, bool]:
    """Whether the ranks of ``group`` hold ``flag`` differently, and whether their ``key``s
    differ (``_fingerprint``), in one all-reduce; (False, False) without a group. Every rank
    must call it at the same point."""
    if not active(group):
        return False, False
    same_flag, same_key = _same_everywhere([flag, _fingerprint(key, 0)], group)
    return not same_flag, not same_key


def gathered(obj: Any, group: Any = None) -> List[Any]:
    """``obj`` of every rank of ``group``, in rank order (``[obj]`` without a group): for an
    error message that says what differs. Every rank must call it at the same point."""
    if not active(group):
        return [obj]
    out: List[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def any_rank(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` holds on any rank of ``group`` (``flag`` itself without a group). Every
    rank must call it at the same point."""
    return ranks_with(flag, group) > 0


# ------------------------------------------------------------------------------ exit
_EXIT_MARK = "vmalloc.scheduler.shutdown"


class _ExitMark:
    """A Python object only the collectives' thread-local-state copies hold (see shutdown)."""


def _check_no_python_state() -> None:
    """The final barrier's state copy must hold no Python object but the marker: PyTorch frees
    the marker first, so the wait would end before a gloo thread dropped the others."""
    held = []
    if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        held.append("saved-tensor hooks (a scheduler.swap or saved_tensors_hooks context)")
    if torch._C._len_torch_function_stack() > 0:
        held.append("a TorchFunctionMode")
    if torch._C._len_torch_dispatch_stack() > 0:
        held.append("a TorchDispatchMode")
    if held:
        raise RuntimeError(f"shutdown: call it outside {' and '.join(held)}: the final "
                           f"collective would keep it, and the process could abort at exit")


def shutdown(timeout: float = 300.0) -> None:
    """End the default process group (every group) so that the process exits cleanly: call
    it last, on every rank, instead of ``torch.distributed.destroy_process_group()``.

    Why: a gloo collective keeps a copy of the caller's thread-local state, and that copy
    holds Python objects (the saved-tensor hooks of ``scheduler.swap`` / ``VMALLOC_WINDOW``,
    which are on for the whole process; PyTorch's ``contextvars`` context in collectives a
    backward starts). The gloo thread that ran a collective drops its copy a moment after the
    caller saw it complete, and dropping it takes the GIL. If the interpreter is finalizing by
    then, CPython ends that thread inside a C++ destructor and the process aborts with
    "terminate called without an active exception" after everything ran (PyTorch never joins
    those threads before exit: caches keep the group alive).

    So: the global swap context is uninstalled (no more swapping; this is the end), garbage
    is collected (a model in a reference cycle keeps its collectives' state until the
    interpreter finalizes: with a DDP wrapper in one, torch 2.11 aborted there in 5 of 15
    launches of the distributed test, 0 of 16 with the collection), a final barrier runs
    with a marker object in the thread-local state, and we wait, the GIL
    released, until the marker is freed: the barrier's copy of the state is then destroyed,
    and with it every earlier collective it still referenced (a gloo thread drops each
    collective under the lock the barrier takes to list the collectives in flight). Raises
    ``RuntimeError`` when that does not happen within ``timeout`` seconds."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    from .swap import global_context, uninstall_global  # noqa: PLC0415 - heavier module
    if global_context() is None:
        _check_no_python_state()  # refuse before changing anything
    uninstall_global()
    _check_no_python_state()      # what lay under the global swap context
    # garbage in reference cycles (a model of the user's, a DDP module in one) can hold work
    # objects of earlier collectives, and with them copies of the thread-local state, until
    # the interpreter finalizes: free it now, while dropping them is safe
    gc.collect()
    stash = getattr(torch._C, "_stash_obj_in_tls", None)
    remove = getattr(torch._C, "_remove_obj_from_tls", None)
    if stash is None or remove is None:  # an older PyTorch: no marker, the race stays
        dist.barrier()
        dist.destroy_process_group()
        return
    freed = threading.Event()
    mark = _ExitMark()
    weakref.finalize(mark, freed.set)
    stash(_EXIT_MARK, mark)
    del mark
    try:
        dist.barrier()
    finally:
        remove(_EXIT_MARK)
    if not freed.wait(timeout):
        raise RuntimeError(
            f"shutdown: the final barrier's copy of the thread-local state was not freed "
            f"within {timeout} s: a thread of the process group still holds it, and the "
            f"process could abort at exit when that thread drops it")
    dist.destroy_process_group()
