"""A checkpointed model's lifetime: ``del model`` frees it (weights, and so device memory)
at once, without waiting for the garbage collector, and a deep copy (an EMA model, a copy
for evaluation) or a pickled one (``torch.save(model)``) is a model of its own that trains
like plain training, checkpointed as the original was."""
from __future__ import annotations

import copy
import io
import pickle
import weakref

import pytest
import torch

import scheduler
from scheduler.runtime.checkpoint import checkpointed
from test_block_wrappers import Net, _step
from test_checkpoint_hf import FAST, assert_same, make, step


def _trained(model, run, steps=3):
    for _ in range(steps):  # the profiling step, then planned ones
        run(model)
    return model


@pytest.mark.parametrize("planner", ["rotor", "pofo", "mimose"])
def test_del_frees_a_checkpointed_model_at_once(no_gc, planner):
    net = Net()
    scheduler.checkpoint(net, "64KiB", planner=planner, blocks="blocks",
                         **({"samples": 3} if planner == "mimose" else {}))
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


def _torch_round_trip(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)),
          "torch.save": _torch_round_trip}


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("planner", ["rotor", "pofo", "mimose"])
def test_a_copy_is_a_model_of_its_own(how, planner):
    net = Net()
    ref = copy.deepcopy(net)
    scheduler.checkpoint(net, "64KiB", planner=planner, blocks="blocks",
                         **({"samples": 3} if planner == "mimose" else {}))
    _trained(net, lambda m: _step(m), steps=3)
    twin = COPIES[how](net)
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
    assert twin.blocks[0].forward._block() is twin.blocks[0]
    assert checkpointed(twin).tail.model is twin
    # the copy ran under plans (the ones it carried: keyed by device, so no new profiling)
    assert copied.last_stats is not None and copied.profiling_steps == runner.profiling_steps


def test_a_pickled_hf_model_trains_as_plain_and_stays_checkpointed():
    ref, batch = make("gpt2")
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, "200KiB", "rotor", measure_options=FAST)  # (175 KiB: least)
    _trained(model, lambda m: m(**batch).loss.backward(), steps=2)
    loaded, plain = _torch_round_trip(model), copy.deepcopy(ref)
    assert_same(plain, loaded, step(plain, batch, 3), step(loaded, batch, 3), "torch.load")
    runner = checkpointed(loaded).runners[0]
    assert runner.blocks[0] is loaded.transformer.h[0]
    assert runner.last_stats is not None and runner.last_stats.recomputed_forwards > 0


def test_del_frees_a_wrapped_chain_at_once(no_gc):
    blocks = list(Net().blocks)
    chain = scheduler.wrap(blocks, "64KiB", planner="rotor")
    del blocks
    x = torch.randn(4, 16)
    _trained(chain, lambda m: m(x).square().mean().backward())
    weight = weakref.ref(chain.blocks[0].lin.weight)
    del chain
    assert weight() is None


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copied_wrapped_chain_trains_as_the_original(how):
    torch.manual_seed(0)
    chain = scheduler.wrap(list(Net().blocks), "64KiB", planner="pofo")
    x = torch.randn(4, 16)

    def step(m):
        for p in m.parameters():
            p.grad = None
        torch.manual_seed(4)
        m(x).square().mean().backward()
        return [p.grad for p in m.parameters()]
    _trained(chain, step, steps=2)
    twin = COPIES[how](chain)
    assert all(torch.equal(a, b) for a, b in zip(step(chain), step(twin)))
    assert twin.runner is not chain.runner and twin.runner.blocks[0] is twin.blocks[0]
    assert twin.stats()["chains_measured"] == chain.stats()["chains_measured"]
