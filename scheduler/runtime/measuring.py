"""Measuring a chain on the real blocks without changing training: ``measure_chain`` between a
snapshot of the blocks' random state, buffers and gradients and their restoration
(``PreservedState``), with Hugging Face's output capture off (a measurement may run inside the
model's forward). The chain runner measures with it (a bare chain's blocks, or the calls a
profiling step recorded, each bound as a ``BoundBlock``), and so does ``InputAwareChain``.
"""
from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import torch
from torch import nn

from ..chain import Chain
from .block_calls import BlockCall, tensor_leaves
from .hf_outputs import outputs_not_captured
from .preserved import PreservedState


def measure_preserved(blocks: Sequence[nn.Module], stages: Sequence[nn.Module],
                      x0: Tuple[Any, ...], loss: Any, measure_options: Dict[str, Any]) -> Chain:
    """``measure_chain`` of ``stages`` on ``x0`` (block 0's arguments), with ``loss`` as the
    loss stage; the random state, buffers and gradients of ``blocks`` are put back afterwards.
    The input's gradient is measured when one of ``x0`` wants it."""
    from ..profile import measure_chain  # rotor's chain parameters, measured per stage
    keep = PreservedState(blocks, x0)
    grad_in = any(isinstance(a, torch.Tensor) and a.requires_grad for a in x0)
    try:
        with outputs_not_captured():  # inside the model's forward: not its outputs
            return measure_chain(stages, x0[0] if len(x0) == 1 else x0, loss=loss,
                                 input_grad=grad_in, **measure_options)
    finally:
        keep.restore()


class BoundBlock(nn.Module):
    """Block ``s`` as a chain stage for ``measure_chain``: called on the chain's value, with
    the other arguments of the loop's call; returns the tensors of its output."""

    def __init__(self, block: nn.Module, call: BlockCall, anchored: bool,
                 counted_outside: bool = False):
        super().__init__()
        self.block = block
        self.call = call
        self.anchored = anchored
        # the call's other tensors (masks, rotary embeddings), when the step's memory outside
        # the chain counts them once: ``measure_chain`` leaves them out of the stage's own
        # numbers, as weights (else every stage that saves them would count them again)
        self.held_outside = call.shared_tensors() if counted_outside else []

    def forward(self, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if self.anchored:  # the loop changed the value between blocks: use what it passed
            xs = tuple(t.detach().requires_grad_(r) for t, r in zip(self.call.x, self.call.rg))
        args, kwargs = self.call.bind(xs)
        return tensor_leaves(self.block(*args, **kwargs))
