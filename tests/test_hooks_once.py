"""A checkpointed model's gradient hooks (``Tensor.register_hook``, post-accumulate-grad hooks)
and its blocks' module backward hooks fire once per step, as in plain training, also on the
steps that measure the chain (profiling, Mimose's collection): a measurement runs the
backward on a random gradient, several times (``profile._trace.hooks_silenced``). A hook that
rewrites the gradient from its own state got a different ``.grad`` before."""
from __future__ import annotations

import collections
import copy

import pytest
import torch

import scheduler
from test_block_wrappers import Net, _step


def _install(net, counts):
    for i, p in enumerate(net.parameters()):
        # rewrites the gradient from its own call count: an extra call changes every later .grad
        p.register_hook(lambda g, i=i: (counts.update([("tensor", i)]),
                                        g * (1 + counts[("tensor", i)]))[1])
        p.register_post_accumulate_grad_hook(lambda p, i=i: counts.update([("post", i)]))
    for j, b in enumerate(net.blocks):
        b.register_full_backward_hook(lambda m, gi, go, j=j: counts.update([("module", j)]))


@pytest.mark.filterwarnings("ignore::UserWarning")  # (full backward hooks, tail not replayed)
@pytest.mark.parametrize("planner", ["rotor", "pofo", "mimose"])
def test_hooks_fire_once_per_step(planner):
    torch.manual_seed(0)
    plain = Net()
    model = scheduler.checkpoint(copy.deepcopy(plain), "34KiB", planner, blocks="blocks",
                                 **mimose_samples(planner))
    want, got = collections.Counter(), collections.Counter()
    _install(plain, want)
    _install(model, got)
    for step in range(4):  # the measuring steps, then planned ones
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
        a, b = _step(plain, step), _step(model, step)
        assert got == want, f"step {step}"
        assert all(torch.equal(x, y) for x, y in zip(a[1], b[1])), f"step {step}"
    assert set(got.values()) == {4}
    assert checkpointed_recomputes(model)


def mimose_samples(planner: str) -> dict:
    """samples=3 for Mimose (the others refuse an option they do not read)."""
    return {"samples": 3} if planner == "mimose" else {}


def checkpointed_recomputes(model) -> bool:
    runner = scheduler.runtime.checkpoint.checkpointed(model).runners[0]
    return runner.last_stats.recomputed_forwards + runner.last_stats.offloaded > 0


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("planner", ["rotor", "mimose"])
def test_global_module_backward_hooks_fire_once_per_step(planner):
    torch.manual_seed(0)
    plain = Net()
    model = scheduler.checkpoint(copy.deepcopy(plain), "34KiB", planner, blocks="blocks",
                                 **mimose_samples(planner))
    calls = []
    handle = torch.nn.modules.module.register_module_full_backward_hook(
        lambda m, gi, go: calls.append(type(m).__name__))
    try:
        for step in range(4):
            calls.clear()
            _step(plain, step)
            want = sorted(calls)
            calls.clear()
            _step(model, step)
            assert sorted(calls) == want, f"step {step}"
    finally:
        handle.remove()
