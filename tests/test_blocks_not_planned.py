"""Forwards that ``scheduler.checkpoint`` cannot plan must not pass for planned ones: the
budget silently not holding is the failure to avoid. A list of lists (never called: the model
loops through its lists) is not taken for the block list; a list the forward never calls is
said at the first training forward; blocks that a trainable tensor reaches another way than
block 0's arguments (a forward hook, a KV cache holding a trained prefix) are said too."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import scheduler
from scheduler.runtime.checkpoint import checkpointed, find_blocks
from wrap_models import every_block, mlp_blocks


class Staged(nn.Module):
    """Stages of blocks (a ModuleList of ModuleLists), as HF's Funnel encoder."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stages = nn.ModuleList(nn.ModuleList(mlp_blocks(3, 16)) for _ in range(2))

    def forward(self, x):
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return x.square().mean()


class Bypassed(nn.Module):
    """A forward that uses its blocks' layers, never the blocks themselves."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(mlp_blocks(3, 16))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block.lin(x))
        return x.square().mean()


def test_a_list_of_lists_is_not_the_block_list():
    plain = Staged()
    model = scheduler.checkpoint(copy.deepcopy(plain), None, every_block)
    assert [n for n, _ in find_blocks(model)] == ["stages.0", "stages.1"]
    x = torch.randn(4, 16)
    for m in (plain, model):
        torch.manual_seed(1)
        m(x).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))
    assert all(r.last_stats.recomputed_forwards == 3 for r in checkpointed(model).runners)
    with pytest.raises(TypeError, match="holds ModuleLists, which the model loops through"):
        scheduler.checkpoint(Staged(), None, blocks="stages")


def test_a_list_the_forward_never_calls_is_said():
    model = scheduler.checkpoint(Bypassed(), None, every_block, blocks="blocks")
    x = torch.randn(4, 16)
    with torch.no_grad():
        model(x)  # (no gradients: nothing to say)
    with pytest.warns(UserWarning, match="never called the blocks of 'blocks'"):
        model(x).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).backward()  # said once


def test_blocks_a_trainable_tensor_reaches_another_way_are_said():
    """Frozen blocks and a trainable steering vector added by a forward hook (ReFT-style): the
    forward cannot be planned (it is decided at block 0), and that is said once."""
    net = nn.Sequential(*mlp_blocks(4, 16))
    for p in net.parameters():
        p.requires_grad_(False)
    steer = nn.Parameter(torch.zeros(16))
    net[1].register_forward_hook(lambda m, args, out: out + steer)
    model = scheduler.checkpoint(net, None, every_block)
    x = torch.randn(4, 16)
    with pytest.warns(UserWarning, match="block 2 of 'Sequential' returned a tensor that needs a gradient"):
        model(x).sum().backward()
    assert steer.grad is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()  # said once
    frozen = scheduler.checkpoint(nn.Sequential(*mlp_blocks(4, 16)).requires_grad_(False), None,
                                  every_block)
    with warnings.catch_warnings():  # no trainable tensor at all: nothing to say
        warnings.simplefilter("error")
        frozen(x).sum()


class TwoLists(nn.Module):
    """A wide list and a narrow one (T5's long encoder input, short decoder output)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.ModuleList(mlp_blocks(3, 64))
        self.narrow = nn.ModuleList(mlp_blocks(3, 16, seed=1))
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        for b in self.wide:
            x = b(x)
        x = self.down(x)
        for b in self.narrow:
            x = b(x)
        return x.square().mean()


def test_a_list_whose_share_of_the_budget_is_too_small_says_the_total_needed():
    """The lists share the budget by block count: the refusal names the share and the whole
    budget that would give this list enough."""
    from scheduler.planners import rotor
    probe = scheduler.checkpoint(TwoLists(), "1GiB", "rotor")
    x = torch.randn(32, 64)
    for _ in range(2):
        probe(x).backward()
    need = rotor.min_memory(checkpointed(probe).runners[0].last_plan.chain, slots=500,
                            memory=1 << 20)
    model = scheduler.checkpoint(TwoLists(), int(need * 1.5), "rotor")  # wide: half of it
    with pytest.raises(scheduler.InfeasibleError, match=r"'wide' gets 3/6 of the budget") as e:
        model(x).backward()
    assert e.value.min_memory >= 2 * need * 0.99
    assert "the whole budget must be at least" in str(e.value)
