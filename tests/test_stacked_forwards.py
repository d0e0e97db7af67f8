"""Two forwards before one backward hold both forwards' activations, each planned with the
whole budget: said once (``ChainRunner._stacked_forwards``), never in a loop that runs each
backward, drops a graph unrun, or evaluates under no_grad; gradients stay exact either way.
Found by a new user's walk-through: an 8-layer Llama at 1.88x its budget without a word."""
from __future__ import annotations

import warnings

import pytest
import torch

import scheduler
from scheduler.planners.mimose import plan_from_checkpoints

from wrap_models import loss_of, mlp_blocks, one_thread, twins  # noqa: F401  (autouse fixture)

L, D = 4, 16
STACKED = "began a forward while the last forward's graph was still waiting"


@pytest.fixture(params=[(1, 2), ()], ids=["checkpoints", "keeps_everything"])
def make(request):
    """A wrapped model whose plan checkpoints blocks 1 and 2, or keeps everything (its steps
    leave all but the last block to autograd, whose output nodes' pre-hooks still tell the
    runner the backward began)."""
    return lambda blocks: scheduler.wrap(blocks, None,
                                         planner=plan_from_checkpoints(L, list(request.param)))


def no_stacked_warning(record) -> bool:
    return not any(STACKED in str(w.message) for w in record)


def test_two_forwards_then_one_backward_is_said_once_and_exact(make):
    blocks, ref = twins(lambda: mlp_blocks(L, D))
    a, b = torch.randn(8, D), torch.randn(8, D)
    model = make(blocks)
    torch.manual_seed(1)   # (dropout)
    with pytest.warns(UserWarning, match=STACKED) as record:
        (loss_of(model(a)) + loss_of(model(b))).backward()
    said = [w for w in record if STACKED in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__   # the user's line
    got = [p.grad.clone() for blk in blocks for p in blk.parameters()]
    # exact: the gradients of plain training of the same sum
    torch.manual_seed(1)
    losses = []
    for x in (a, b):
        for blk in ref:
            x = blk(x)
        losses.append(loss_of(x))
    (losses[0] + losses[1]).backward()
    assert all(torch.equal(g, p.grad) for g, p in
               zip(got, [p for blk in ref for p in blk.parameters()]))
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        (loss_of(model(a)) + loss_of(model(b))).backward()
    assert no_stacked_warning(again)   # once per block list


def test_usual_loops_say_nothing(make):
    blocks, _ = twins(lambda: mlp_blocks(L, D))
    model = make(blocks)
    x = torch.randn(8, D)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):            # forward, backward
            loss = loss_of(model(x))
            loss.backward()
        for _ in range(3):            # evaluation with gradients on, outputs dropped
            model(x)
        with torch.no_grad():         # evaluation keeping its outputs (no graph)
            outs = [model(x) for _ in range(3)]
        loss = loss_of(model(x))      # a skipped backward whose loss is let go
        del loss
        loss_of(model(x)).backward()
    assert outs and no_stacked_warning(record), [str(w.message) for w in record]


def test_said_once_per_model_with_two_block_lists():
    from torch import nn

    class TwoLists(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
            self.decoder = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

        def forward(self, x):
            for layer in list(self.encoder) + list(self.decoder):
                x = torch.tanh(layer(x))
            return x

    model = scheduler.checkpoint(TwoLists(), "1MB", loss="sum")
    x = torch.randn(8, D)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            (model(x).sum() + model(x).sum()).backward()
    assert sum(STACKED in str(w.message) for w in record) == 1, [str(w.message) for w in record]
