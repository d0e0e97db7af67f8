"""The loss stage ``L`` the profilers close a chain with: a named loss (``LOSSES``) or the
caller's callable, as ``measure_chain``'s and ``meta_chain``'s ``loss=`` take it."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .autograd_graph import differentiable

LOSSES = ("cross_entropy", "sum", "mse")


def make_loss(loss: Any) -> Callable[..., torch.Tensor]:
    """The loss stage L. ``"cross_entropy"`` (default): classes along the last dimension of the
    network output, fixed targets (class 0), mean reduction: what classifiers and language models
    train with. ``"sum"``: the sum of every differentiable output. ``"mse"``: mean squared error
    against zeros. Or any callable ``loss(*outputs) -> scalar tensor``."""
    if callable(loss):
        return loss
    if loss in ("sum", "mse"):
        def reduce(*outs: torch.Tensor) -> torch.Tensor:
            total = None
            for o in outs:
                if differentiable(o):
                    term = o.sum() if loss == "sum" else o.square().mean()
                    total = term if total is None else total + term
            if total is None:
                raise ValueError(f"loss={loss!r}: the last block returned no floating tensor")
            return total
        return reduce
    if loss == "cross_entropy":
        def cross_entropy(*outs: torch.Tensor) -> torch.Tensor:
            if len(outs) != 1 or not differentiable(outs[0]) or outs[0].dim() < 1:
                raise ValueError(
                    "loss='cross_entropy' needs the last block to return one floating tensor of "
                    "logits (classes along the last dimension); pass loss='sum' or a callable")
            logits = outs[0].reshape(-1, outs[0].shape[-1])
            target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
            return F.cross_entropy(logits, target)
        return cross_entropy
    raise ValueError(f"loss: expected one of {LOSSES} or a callable, got {loss!r}")
