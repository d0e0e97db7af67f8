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
from scheduler.runtime.input_aware import InputAwareChain

from test_checkpoint_hf import FAST, make, step
import wrap_models
from wrap_models import token_batch, transformer_blocks, wrapped_step

one_thread = wrap_models.one_thread  # the autouse fixture, in this module's namespace

TWO_WAYS = "vary along more than one direction"


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
    assert "'encoder.block' gets 3/6 of the budget (a share of 2048 B" in str(e.value) and \
        "the whole budget must be at least" in str(e.value), str(e.value)
    assert e.value.min_memory > 4096
