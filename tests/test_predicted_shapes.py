"""Where predicting a new shape's chain from the input size goes wrong, loudly or not at all:
Mimose and ``InputAwareChain`` measure a size beyond their fit's reach (``REACH`` times the
largest measured) instead of extrapolating; inputs that vary along two directions (random batch
sizes and random lengths) are warned about, once; an ``InputAwareChain`` of other blocks is
refused; Mimose's infeasible share of a budget is named in the user's whole budget."""
from __future__ import annotations

import warnings
from typing import Any, List

import pytest
import torch

import scheduler
from scheduler.planners.mimose_estimator import REACH
from scheduler.runtime.checkpoint import checkpointed
from scheduler.runtime.input_aware import InputAwareChain

from test_checkpoint_hf import FAST, make, step
import wrap_models
from wrap_models import token_batch, transformer_blocks, wrapped_step

one_thread = wrap_models.one_thread  # the autouse fixture, in this module's namespace

TWO_WAYS = "vary in both their batch size"


def run(model: Any, shapes: List[tuple]) -> List[str]:
    """Steps at these (batch, length) token shapes; the warnings they gave."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i, (b, n) in enumerate(shapes):
            wrapped_step(model, (token_batch(b, n, seed=i),), i)
    return [str(x.message) for x in w]


# ----------------------------------------------------------------------- beyond the reach
def test_mimose_collects_a_size_beyond_its_fits_reach():
    """Before, a length 4x the longest learnt was planned from the fit (BERT's backward
    transients at length 800, learnt on 8-44: a fifth of the measured; 1.2x the budget)."""
    model = scheduler.wrap(transformer_blocks(), 1 << 30, planner="mimose", samples=3)
    run(model, [(2, 8), (2, 10), (2, 12)])
    assert model.stats()["mimose_collections"] == 3
    run(model, [(2, 16), (2, int(12 * REACH))])   # within reach: planned from the fit
    assert model.stats()["mimose_collections"] == 3
    run(model, [(2, 48)])                            # 4x: collected, learnt
    assert model.stats()["mimose_collections"] == 4 and 2 * 48 in model.mimose.estimator.sizes
    run(model, [(2, 60)])                            # now within reach of 48
    assert model.stats()["mimose_collections"] == 4


def test_input_aware_chain_measures_a_size_beyond_its_fits_reach():
    blocks = transformer_blocks()
    source = InputAwareChain(blocks, samples=3, measure_options=FAST)
    model = scheduler.wrap(blocks, 1 << 30, chain=source)
    run(model, [(2, 8), (2, 10), (2, 12), (2, 16)])
    assert source.stats()["measurements"] == 3 and source.stats()["predictions"] == 1
    run(model, [(2, 48)])
    assert source.stats()["measurements"] == 4


# ------------------------------------------------------------------------ two directions
@pytest.mark.parametrize("planner", ["mimose", "input-aware"])
def test_inputs_varying_two_ways_are_warned_about_once(planner):
    """GPT-2 learnt at batch 4 planned a 1 x 176 input as the 4 x 44 it had measured (same
    element count) and held 1.56x its budget, without a word."""
    def wrapped(**kw: Any) -> Any:
        blocks = transformer_blocks()
        if planner == "mimose":
            return scheduler.wrap(blocks, 1 << 30, planner="mimose", samples=3, **kw)
        return scheduler.wrap(blocks, 1 << 30, chain=InputAwareChain(
            blocks, samples=3, measure_options=FAST, **kw))
    one_way = [(2, 8), (2, 10), (2, 12), (2, 9)]
    assert not [m for m in run(wrapped(), one_way) if TWO_WAYS in m]
    said = [m for m in run(wrapped(), one_way + [(3, 8), (1, 12), (4, 10)]) if TWO_WAYS in m]
    assert len(said) == 1 and "(2, 8) and (3, 8)" in said[0], said
    # the batch alone varying is one direction too (linear in it)
    assert not [m for m in run(wrapped(), [(4, 8), (2, 8), (3, 8), (4, 8), (1, 8)])
                if TWO_WAYS in m]
    # an input_size= of the user's own: theirs to choose, nothing checked
    assert not [m for m in run(wrapped(input_size=lambda a: a[0].shape[1]),
                               one_way + [(3, 8)]) if TWO_WAYS in m]


# ------------------------------------------------------------------ the source's blocks
def test_an_input_aware_chain_of_other_blocks_is_refused():
    with pytest.raises(ValueError, match="InputAwareChain of other blocks than 'blocks'"):
        scheduler.wrap(transformer_blocks(), 1 << 30,
                       chain=InputAwareChain(transformer_blocks(seed=1), samples=3))
    model, _ = make("t5")
    with pytest.raises(ValueError, match="InputAwareChain of other blocks than 'decoder.block'"):
        scheduler.checkpoint(model, "1GiB", chain=InputAwareChain(model.encoder.block))


# ----------------------------------------------------------------- the budget's share
def test_mimose_names_the_whole_budget_for_a_lists_share():
    """T5's two lists share the budget; before, Mimose's error named only the share."""
    model, batch = make("t5")
    scheduler.checkpoint(model, 4096, "mimose", samples=3)
    with pytest.raises(scheduler.InfeasibleError) as e:
        for i in range(4):
            step(model, {k: torch.randint(2, 64, (2, 8 + i)) for k in batch}, i)
    assert "'encoder.block' gets 3/6 of the budget, a share of 2048 B" in str(e.value) and \
        "the whole budget must be at least" in str(e.value), str(e.value)
    assert e.value.min_memory > 4096


def test_a_smaller_last_batch_is_planned_as_the_learnt_batch_and_not_learnt():
    """The Trainer's last batch (3 of 8) at a length of its own: before, it was warned about as
    a second direction (spuriously: it holds less than the learnt batch at its length), or
    learnt at its element count. It is planned for the learnt batch (an upper bound), and
    never collected or learnt from."""
    model = scheduler.wrap(transformer_blocks(), 1 << 30, planner="mimose", samples=3)
    said = run(model, [(8, 8), (8, 10), (8, 12), (8, 9), (3, 11), (3, 30)])
    assert not [m for m in said if TWO_WAYS in m], said
    assert model.stats()["mimose_collections"] == 3
    assert sorted(model.mimose.estimator.sizes) == [64.0, 80.0, 96.0]
    # (3, 30): as (8, 30), beyond the fit's reach: run with every block checkpointed, unlearnt
    assert model.last_plan.planner == "mimose-collect"


def test_images_of_any_height_and_width_are_one_direction():
    from torch import nn
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.ReLU()) for _ in range(3)]
    model = scheduler.wrap(blocks, 1 << 30, planner="mimose", samples=3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i, (h, w_) in enumerate([(32, 24), (17, 30), (24, 24), (40, 16)]):
            wrapped_step(model, (torch.randn(2, 3, h, w_),), i)
    assert not [str(x.message) for x in w if TWO_WAYS in str(x.message)]


def test_collections_beyond_the_reach_that_keep_failing_stop(monkeypatch):
    """A size beyond the fit's reach whose collection step cannot measure the model's tail
    (an out-of-memory at the longest length yet) was collected again at every step, forever;
    after REACH_TRIES such failures it is planned from the fit, said once."""
    from torch import nn
    from scheduler.runtime import mimose_steps, tail as tail_mod
    long = [False]
    orig = tail_mod.TailProbe._tail_chain

    def failing(self, *a, **k):
        if long[0]:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return orig(self, *a, **k)
    monkeypatch.setattr(tail_mod.TailProbe, "_tail_chain", failing)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh())
                                        for _ in range(4))
            self.head = nn.Linear(32, 8)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x).square().mean()

    torch.manual_seed(0)
    net = Net()
    scheduler.checkpoint(net, 1 << 30, "mimose", blocks="blocks", samples=3)
    runner = checkpointed(net).runners[0]
    planners = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for T in [8, 10, 12] + [48] * 6:
            long[0] = T > 20
            net(torch.randn(2, T, 32)).backward()
            planners.append(runner.last_plan.planner)
    tries = mimose_steps.REACH_TRIES
    assert planners[3:] == ["mimose-collect"] * tries + ["mimose"] * (6 - tries), planners
    assert len([x for x in w if "planned from the fit (extrapolated)" in str(x.message)]) == 1
