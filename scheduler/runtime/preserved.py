"""What measuring a chain must leave as it found: the random state, the blocks' buffers
(batch-norm statistics) and their gradients, put back afterwards, so that measuring does not
change training (the chain runner's measurements and ``InputAwareChain``'s)."""
from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from . import buffers, rng


class PreservedState:
    """Random state, buffers and gradients of the blocks, put back after measuring a chain
    so that measuring does not change training."""

    def __init__(self, blocks: Sequence[nn.Module], args: Sequence[Any]):
        self.rng = rng.capture(rng.cuda_devices_of(args))
        self.bufs = [buffers.snapshot(b) for b in blocks]
        self.grads = [(p, p.grad) for b in blocks for p in b.parameters()]

    def restore(self) -> None:
        rng.restore(self.rng)
        for saved in self.bufs:
            buffers.restore(saved)
        for p, g in self.grads:
            p.grad = g
