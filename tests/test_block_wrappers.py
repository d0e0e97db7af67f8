"""Modules that replace a block in the list the model loops over (``scheduler/runtime/fsdp.py``):
an FSDP1 unit (a stand-in of its shape here; real FSDP1 with 2 ranks in
``tests/test_distributed.py``) is what runs the block again, since only the unit's forward
gathers the block's parameters; torch's activation-checkpoint wrapper is refused, at the call
and at a step."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

import scheduler
from scheduler.planners.mimose import plan_from_checkpoints
from scheduler.runtime import fsdp
from wrap_models import loss_of, mlp_blocks


class Unit(nn.Module):
    """FSDP1's shape: the wrapped module as ``_fsdp_wrapped_module``, called by ``forward``
    (where the real unit gathers the parameters first)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self._fsdp_wrapped_module = inner
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self._fsdp_wrapped_module(*args, **kwargs)


class Net(nn.Module):
    def __init__(self, L: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList(mlp_blocks(L))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _step(model: nn.Module, seed: int = 3):
    torch.manual_seed(seed)  # the blocks' dropout
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    loss = loss_of(model(x))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _units(net: Net) -> list:
    units = [Unit(b) for b in net.blocks]
    for s, u in enumerate(units):
        net.blocks[s] = u  # as FSDP1's auto-wrap policy does, after scheduler.checkpoint
    return units


def test_recomputations_run_through_the_unit_that_replaced_the_block():
    net = Net()
    ref = copy.deepcopy(net)
    want = _step(ref)
    # every block recomputed in its own backward: each unit runs twice
    scheduler.checkpoint(net, None, planner=plan_from_checkpoints(5, range(5)), blocks="blocks")
    units = _units(net)
    got = _step(net)
    assert [u.calls for u in units] == [2] * 5
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_units_are_found_and_make_the_chain_measured_forward_only():
    net = Net()
    blocks = list(net.blocks)
    assert not fsdp.sharded(blocks, net.blocks) and fsdp.unit_of(net.blocks, 1, blocks[1]) is None
    units = _units(net)
    assert fsdp.wrappers(net.blocks, 1, blocks[1]) == [units[1]]
    assert fsdp.unit_of(net.blocks, 1, blocks[1]) is units[1]
    assert fsdp.unit_of(net.blocks, 1, blocks[2]) is None  # another block's unit
    assert fsdp.sharded(blocks, net.blocks) and fsdp.fsdp1(blocks, net.blocks)
    # the call after the wrapping: the blocks are the units
    assert fsdp.units(units, net.blocks) and fsdp.unit_of(net.blocks, 1, units[1]) is None


def test_what_a_block_holds_is_its_weights_and_fsdp1_views_not_any_tensor_attribute():
    """A block may keep an activation as an attribute (router logits, a cached output): not
    a weight, so it is counted and may move. FSDP1's views of its flat parameter are."""
    block = mlp_blocks(1)[0]
    flat = torch.zeros(16 * 16 + 16, requires_grad=True)
    flat._is_flat_param = True  # FSDP1's mark on a FlatParameter
    block.kept = torch.ones(3)                # an activation the block kept
    block.lin.view_of_flat = flat[:16]        # what FSDP1 sets with use_orig_params=False
    held = list(fsdp.block_tensors(block))
    assert any(t is block.lin.view_of_flat for t in held)
    assert not any(t is block.kept for t in held)
    for p in block.parameters():
        p.requires_grad_(False)
    assert fsdp.trains([block])  # the view requires a gradient: not a frozen block
    del block.lin.view_of_flat
    assert not fsdp.trains([block])


def _checkpoint_wrap(net: Net) -> None:
    blocks = list(net.blocks)
    apply_activation_checkpointing(
        net, checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: any(m is b for b in blocks))


def test_torch_activation_checkpointing_is_refused_at_the_call():
    net = Net()
    _checkpoint_wrap(net)
    with pytest.raises(ValueError, match="block 0 is wrapped by CheckpointWrapper"):
        scheduler.checkpoint(net, "1MiB", blocks="blocks")
    with pytest.raises(ValueError, match="recomputed or moved twice"):
        scheduler.wrap(list(net.blocks), "1MiB")


def test_a_checkpoint_wrapper_inside_a_unit_is_refused_when_the_units_are_the_blocks():
    """checkpoint called after accelerate's FSDP wrapped the model with activation
    checkpointing: the list holds Unit(CheckpointWrapper(block))."""
    net = Net()
    for s, b in enumerate(list(net.blocks)):
        net.blocks[s] = Unit(checkpoint_wrapper(b))
    with pytest.raises(ValueError, match="block 0 is wrapped by CheckpointWrapper"):
        scheduler.checkpoint(net, "1MiB", blocks="blocks")


@pytest.mark.parametrize("inside_unit", [False, True])
def test_torch_activation_checkpointing_added_afterwards_is_refused_at_the_step(inside_unit):
    """Applied after the call (as accelerate's FSDP activation_checkpointing does, inside
    the FSDP1 unit it made), the step raises before the block runs twice."""
    net = Net()
    scheduler.checkpoint(net, None, planner=plan_from_checkpoints(5, range(5)), blocks="blocks")
    if inside_unit:
        _units(net)
        for u in net.blocks:
            inner = u._fsdp_wrapped_module
            u._fsdp_wrapped_module = checkpoint_wrapper(inner)
    else:
        _checkpoint_wrap(net)
    with pytest.raises(RuntimeError, match="block 0 is wrapped by CheckpointWrapper"):
        _step(net)
    with torch.no_grad():  # no step, nothing refused: the blocks run plainly
        net(torch.randn(2, 16))


def test_units_in_the_list_at_the_call_are_looked_through_and_undo_finds_the_blocks():
    """The call after FSDP1 wrapped the blocks intercepts what each unit wraps, as the call
    before the wrapping does; undo() restores the forwards where they were installed, also
    when units replaced the blocks in the list since."""
    from scheduler.runtime.checkpoint import checkpointed, undo
    net = Net()
    inner = list(net.blocks)
    _units(net)
    scheduler.checkpoint(net, None, planner=plan_from_checkpoints(5, range(5)), blocks="blocks")
    assert checkpointed(net).runners[0].blocks == inner
    assert all("forward" in b.__dict__ for b in inner)
    _step(net)
    assert [u.calls for u in net.blocks] == [2] * 5  # recomputed through the unit
    undo(net)
    assert not any("forward" in b.__dict__ for b in [*inner, *net.blocks])

    net = Net()
    inner = list(net.blocks)
    scheduler.checkpoint(net, None, planner=plan_from_checkpoints(5, range(5)), blocks="blocks")
    _units(net)  # after the call
    undo(net)
    assert not any("forward" in b.__dict__ for b in inner)


def _flat_view(n: int) -> torch.Tensor:
    flat = torch.zeros(n)
    flat._is_flat_param = True  # FSDP1's mark on a FlatParameter
    return flat[:n]


def test_storages_left_out_of_the_activations_keep_their_addresses_while_in_use():
    # a storage's key is its address; FSDP1 gives a block new views at each unshard, so a view
    # that was current when a block was measured (or offloaded) may die during its run, and a
    # new activation could take its address and be left out of xbar with it (seen: the CNN's
    # chain under FSDP1 in bfloat16 measured 18 KB less per block in some runs)
    from scheduler.runtime import accounting
    from scheduler.runtime.chain_exec import ChainStep
    from scheduler.runtime.compiled_plan import CompiledPlan
    blocks = [nn.Module() for _ in range(2)]
    for b in blocks:
        b.w = _flat_view(64)  # as FSDP1 holds its views: plain attributes
    step = ChainStep(blocks, CompiledPlan.of(plan_from_checkpoints(2, []), 2),
                     lambda *a: None)
    taken = 0
    for _ in range(50):
        with step.offloader.not_activations(0) as skip:   # e.g. around a block's measuring run
            blocks[0].w = _flat_view(64)   # the next unshard: a new view, the old one dropped
            activations = [torch.empty(16) for _ in range(8)]
            taken += sum(accounting.storage_key(a) in skip for a in activations)
    assert taken == 0
