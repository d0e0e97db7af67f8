"""Module buffers (batch-norm running statistics and the like) kept across recomputation.

Running a block's forward again in training mode would update its running statistics a
second time; plain training updates them once. ``frozen_buffers`` snapshots them before a
re-execution and writes the snapshot back afterwards.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Tuple

import torch
from torch import nn


def snapshot(module: nn.Module) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    return [(b, b.detach().clone()) for b in module.buffers() if b is not None]


def restore(saved: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    # through .data: the recomputed graph may have saved a buffer (batch norm saves its
    # running statistics, unused by its training-mode backward); writing through .data does
    # not bump the version counter that autograd checks
    with torch.no_grad():
        for buf, copy in saved:
            buf.data.copy_(copy)


@contextlib.contextmanager
def frozen_buffers(module: nn.Module) -> Iterator[None]:
    """Buffers of ``module`` are the same after the body as before it."""
    saved = snapshot(module)
    try:
        yield
    finally:
        restore(saved)
