"""bench/e2e.py's methods: the table of what is compared (each with the CUDA allocator its
process needs) and ``method_context``, which runs a workload's blocks the way a method trains."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn as nn

from bench.e2e_workloads import Workload, loss_of

# name -> (allocator it needs, what it does). The allocator is a process-wide choice.
ALLOCATORS = ("native", "expandable", "vmalloc")


@dataclass(frozen=True)
class Method:
    name: str
    allocator: str
    kind: str                 # plain | save_on_cpu | torchtune | ckpt_seq | swap | wrap
    planner: Optional[str] = None
    # why the loss may differ from plain training's in its last bits ("": it must not)
    inexact: str = ""


# PyTorch's save_on_cpu on a GPU (pin_memory=True) copies each saved tensor into a new
# contiguous pinned buffer (``torch.empty(tensor.size())``), and brings that back: a transposed
# view (an attention's key) returns with other strides, and cuBLAS may take another kernel
# (GPT-2 on an H100: losses equal to 6-7 digits). Values are equal; bits need not be.
SAVE_ON_CPU_STRIDES = ("save_on_cpu(pin_memory=True) brings saved tensors back contiguous, "
                       "whatever their strides were, so a backward kernel may differ")


METHODS: Tuple[Method, ...] = (
    Method("native", "native", "plain"),
    Method("native+expandable", "expandable", "plain"),
    Method("save_on_cpu", "native", "save_on_cpu", inexact=SAVE_ON_CPU_STRIDES),
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


class MethodUnavailable(Exception):
    """A method's optional package (torchtune) does not import: its row says ``unavailable``."""



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
