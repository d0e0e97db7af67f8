"""A checkpointed model's lifetime: ``del model`` frees it (weights, and so device memory)
at once, without waiting for the garbage collector, and a deep copy (an EMA model, a copy
for evaluation) is a model of its own that trains like plain training."""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import scheduler
from scheduler.runtime.checkpoint import checkpointed
from test_block_wrappers import Net, _step
from test_checkpoint_hf import FAST, make


@pytest.fixture
def no_gc():
    """Reference counting alone: what the cyclic collector would free does not count."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _trained(model, run, steps=3):
    for _ in range(steps):  # the profiling step, then planned ones
        run(model)
    return model


@pytest.mark.parametrize("planner", ["rotor", "pofo", "mimose"])
def test_del_frees_a_checkpointed_model_at_once(no_gc, planner):
    net = Net()
    scheduler.checkpoint(net, "64KiB", planner=planner, blocks="blocks", samples=3)
    _trained(net, lambda m: _step(m))
    assert checkpointed(net).runners[0].last_stats is not None
    weight = weakref.ref(net.blocks[0].lin.weight)
    del net
    assert weight() is None, "a reference cycle keeps the deleted model's weights"


def test_del_frees_a_checkpointed_hf_model_at_once(no_gc):
    ref, batch = make("gpt2")
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, "1GiB", "rotor", measure_options=FAST)
    _trained(model, lambda m: m(**batch).loss.backward())
    weight = weakref.ref(model.transformer.h[0].mlp.c_fc.weight)
    del model
    assert weight() is None, "a reference cycle keeps the deleted model's weights"


def test_a_deep_copy_is_a_model_of_its_own():
    net = Net()
    ref = copy.deepcopy(net)
    scheduler.checkpoint(net, "64KiB", planner="rotor", blocks="blocks")
    _trained(net, lambda m: _step(m), steps=2)
    twin = copy.deepcopy(net)
    twin_ref = copy.deepcopy(ref)
    for seed in (5, 6):
        for m in (net, twin, ref, twin_ref):
            for p in m.parameters():
                p.grad = None
        got, want = _step(twin, seed), _step(twin_ref, seed)
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        assert all(p.grad is None for p in net.parameters())  # the original was not run
    runner, copied = checkpointed(net).runners[0], checkpointed(twin).runners[0]
    assert copied is not runner and copied.blocks[0] is twin.blocks[0]
    assert twin.blocks[0].forward._runner() is copied
    assert checkpointed(twin).tail.model is twin


def test_del_frees_a_wrapped_chain_at_once(no_gc):
    blocks = list(Net().blocks)
    chain = scheduler.wrap(blocks, "64KiB", planner="rotor")
    del blocks
    x = torch.randn(4, 16)
    _trained(chain, lambda m: m(x).square().mean().backward())
    weight = weakref.ref(chain.blocks[0].lin.weight)
    del chain
    assert weight() is None
