"""Mimose's shuttling online collector (seed 004, section 4.2), the torch half of Mimose.

While the estimator is still learning, every block is checkpointed and its forward runs
twice: first with autograd on, to measure what it saves for backward (bytes, output
included) and how long it takes, after which that output and everything it holds is
dropped; then again as the plan's checkpointed training run. The random state is put back between the two runs and the block's buffers
restored after the first, so the second run (the one training uses) draws the same numbers
plain training would: training is unchanged. Memory stays that of checkpointing every block
plus one block's activations.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from . import accounting, buffers, rng
from .block_calls import tensor_leaves


def _sync(comps: Sequence[Any]) -> None:
    for c in comps:
        if isinstance(c, torch.Tensor) and c.device.type == "cuda":
            torch.cuda.synchronize(c.device)
            return


class ShuttlingCollector:
    """Measures each block during one forward phase; ``result()`` gives the sample."""

    def __init__(self, n_blocks: int):
        self.n = n_blocks
        self.xbar = [0] * n_blocks
        self.out = [0] * n_blocks
        self.fw = [0.0] * n_blocks
        self.seen = [False] * n_blocks

    def measure(self, s: int, block: nn.Module, run: Callable[[Tuple[Any, ...]], Any],
                inp: Tuple[Any, ...], rg: Sequence[bool], state: Optional["rng.RngState"],
                exclude: Set[int]) -> None:
        """The measuring run of block ``s`` (``run`` calls it on the given chain value); the
        random state is put back afterwards, so the training run that follows draws what
        plain training draws."""
        if state is None:
            state = rng.capture(rng.cuda_devices_of(inp))
        leaves = tuple(c.detach().requires_grad_(r) if isinstance(c, torch.Tensor) else c
                       for c, r in zip(inp, rg))
        with buffers.frozen_buffers(block):
            _sync(inp)
            t0 = time.perf_counter()
            with torch.enable_grad(), accounting.SavedTensors() as rec:
                out1 = tensor_leaves(run(leaves))
            _sync(out1)
            self.fw[s] = time.perf_counter() - t0
        self.xbar[s] = accounting.xbar_bytes(rec.tensors, out1, leaves, exclude)
        in_keys = {accounting.storage_key(t) for t in accounting.tensors_of(leaves)}
        self.out[s] = accounting.tensors_bytes(out1, in_keys)
        self.seen[s] = True
        del out1, rec, leaves  # drop the first run's graph: its activations go with it
        rng.restore(state)

    def complete(self) -> bool:
        return all(self.seen)
