"""A step whose plan keeps every activation and moves none is plain training: the runner leaves
blocks 0..L-2 to autograd (no saved-tensor hooks, frames or held values: the hooks' cost, a
few us per saved tensor, buys nothing there) and keeps its hooks on the last block only, whose
backward is the step's. Steps that measure, track memory, recompute, move, or run under other
saved-tensor hooks keep every block's hooks. Gradients are plain training's either way."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import scheduler
from scheduler import InvalidPlanError, Plan
from scheduler.planners.mimose import plan_from_checkpoints

from wrap_models import loss_of, mlp_blocks, one_thread, plain_step, twins  # noqa: F401

L, D = 4, 16


def stepped(model, x, seed=1):
    """wrapped_step's loss and gradients, and the step (taken before its backward frees it)."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = loss_of(model(x))
    step = model.runner._ended()
    loss.backward()
    return (loss.detach(), [p.grad.clone() for b in model.blocks for p in b.parameters()]), step


def test_a_plan_that_keeps_everything_leaves_all_but_the_last_block_to_autograd():
    blocks, ref = twins(lambda: mlp_blocks(L, D))
    model = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(L, []))
    x = torch.randn(8, D)
    for seed in (1, 2):   # (dropout: each step's masks are plain training's)
        got, step = stepped(model, x, seed)
        for blk in ref:
            for p in blk.parameters():
                p.grad = None
        want = plain_step(ref, (x,), seed)
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        assert step.autograd_alone
        assert step.frames[:L - 1] == [None] * (L - 1) and not step.xs and not step.xbars
        assert step.bptr > 0   # the last block's backward reached the step


@pytest.mark.parametrize("setting", ["recomputes", "tracks", "other hooks"])
def test_steps_that_need_the_hooks_keep_them_and_stay_exact(setting):
    blocks, ref = twins(lambda: mlp_blocks(L, D))
    plan = plan_from_checkpoints(L, [1] if setting == "recomputes" else [])
    model = scheduler.wrap(blocks, None, planner=plan, track_memory=setting == "tracks")
    x = torch.randn(8, D)
    if setting == "other hooks":   # the blocks' saved tensors stay the chain's, as before
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(1) or t,
                                                      lambda t: t):
            got, step = stepped(model, x)
        assert seen == [1]   # the loss's own saved tensor only
    else:
        got, step = stepped(model, x)
    want = plain_step(ref, (x,))
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert not step.autograd_alone


def test_a_forward_that_skips_a_block_is_still_refused():
    blocks = mlp_blocks(L, D)
    model = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(L, []))
    x = torch.randn(8, D)
    stepped(model, x)
    runner = model.runner
    runner.call(0, (x,), {}, lambda a, k: blocks[0](*a, **k))
    with pytest.raises(RuntimeError, match="block 2 was called but block 1 was expected"):
        runner.call(2, (x,), {}, lambda a, k: blocks[2](*a, **k))


# ------------------------------------------- what the hooks told the step, still told
# (a reviewer's findings: each of these went unsaid, or was said wrongly, before the blocks
# left to autograd signalled their backward)
STACKED = "began a forward while the last forward's graph was still waiting"


class Blocks(nn.Module):
    """Four residual tanh blocks; the forward returns every block's output (HF's
    output_hidden_states), and may skip the last block."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(L))
        self.skip_last = False

    def forward(self, x):
        hidden = []
        for i, layer in enumerate(self.layers):
            if not (self.skip_last and i == L - 1):
                x = torch.tanh(layer(x)) + x
                hidden.append(x)
        return hidden


def test_a_loss_on_an_earlier_block_is_a_backward_begun():
    """CLIP's skip: the loss reads the second-to-last block's output, so the last block's
    backward never runs; the outputs kept until the next forward are not a stacked forward."""
    model = scheduler.checkpoint(Blocks(), budget=None)
    x = torch.randn(8, D)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            hidden = model(x)
            hidden[-2].sum().backward()
    assert not any(STACKED in str(w.message) for w in record), [str(w.message) for w in record]


def test_a_forward_that_skips_the_last_block_is_refused_at_its_backward():
    model = scheduler.checkpoint(Blocks(), budget=None)
    x = torch.randn(8, D)
    model(x)[-1].sum().backward()
    model.skip_last = True
    with pytest.raises(RuntimeError, match="every block must run in each forward"):
        model(x)[-1].sum().backward()
    model.skip_last = False
    model(x)[-1].sum().backward()   # and the next step trains


def test_stacked_forwards_are_said_when_the_last_block_saves_nothing():
    """Nothing of the last block's graph holds the step; the blocks' backward hooks do."""
    blocks = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(L - 1)] + [nn.Flatten()]
    model = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(L, []))
    a, b = torch.randn(8, D), torch.randn(8, D)
    with pytest.warns(UserWarning, match=STACKED):
        (model(a).sum() + model(b).sum()).backward()


@pytest.mark.parametrize("backward", [[3, 2, 0, 1], [3, 2]])
def test_a_plan_keeping_everything_with_a_wrong_backward_is_refused(backward):
    ops = [("F_all", s) for s in range(4)] + [("B", s) for s in backward]
    model = scheduler.wrap(mlp_blocks(3, D), None, planner=Plan(ops))
    with pytest.raises(InvalidPlanError):
        loss_of(model(torch.randn(4, D))).backward()


def test_with_saved_tensor_hooks_disabled_the_step_refuses_at_block_0():
    blocks = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(L)]
    model = scheduler.wrap(blocks, None, planner=plan_from_checkpoints(L, []))
    ran = []
    for b in blocks:
        b.register_forward_hook(lambda m, i, o: ran.append(1))
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        with pytest.raises(RuntimeError, match="no hooks here"):
            model(torch.randn(8, D))
    assert ran == []
