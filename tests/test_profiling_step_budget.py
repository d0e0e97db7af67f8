"""The first step of each new input shape checkpoints every block while its chain is measured;
where that holds more than the budget (by the chain's model), the runner says so once: planned
steps hold the budget, that step does not, and a budget chosen to fit a device must not fail
there without a word of why."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import scheduler
from scheduler.planners import rotor
from scheduler.runtime.checkpoint import checkpointed
from _live_bytes import LiveStorageBytes
from test_checkpoint_hf import budgets, fast, make, step

SAID = "first step of each new input shape"


def _said(model, batch, steps: int = 2) -> list:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for i in range(steps):
            step(model, batch, seed=i)
    return [w for w in got if SAID in str(w.message)]


@pytest.mark.parametrize("which", [0, 2])   # just above rotor's least budget; store-all
def test_said_once_exactly_when_the_profiling_step_exceeds_the_budget(which):
    model, batch = make("gpt2")
    budget = budgets("gpt2")[which]
    scheduler.checkpoint(model, budget=budget, **fast("rotor"))
    said = _said(model, batch)
    runners = checkpointed(model).runners
    over = [r for r in runners if r.profiling_peak(next(iter(r._measured.values()))) > r.budget]
    assert len(said) == len(over)   # once per block list whose first step holds more
    if which == 2:
        assert not said
    for w in said:
        assert "above the budget" in str(w.message) and "chain=" in str(w.message)


class _Deep(nn.Module):
    """16 blocks, each keeping 4x its input: checkpointing every block keeps 16 inputs, where
    rotor's least budget keeps a few."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.GELU(),
                                                  nn.Linear(128, 32)) for _ in range(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _deep_steps(budget, steps: int = 3) -> list:
    torch.manual_seed(0)
    model, x = _Deep(), torch.randn(64, 32, requires_grad=True)
    scheduler.checkpoint(model, budget=budget, blocks="layers", **fast("rotor"))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(steps):
            model(x).backward()
    runner = checkpointed(model).runners[0]
    chain = next(iter(runner._measured.values()))
    return [w for w in got if SAID in str(w.message)], chain, runner.profiling_peak(chain)


def test_said_once_for_a_budget_between_rotors_least_and_every_block():
    _, chain, every = _deep_steps("1GiB")
    least = rotor.min_memory(chain)
    assert every > 1.5 * least  # (what the model is made for)
    said, _, _ = _deep_steps(int(1.2 * least))
    assert len(said) == 1
    assert f"above the budget {scheduler.units.format_bytes(int(1.2 * least))}" in \
        str(said[0].message)
    said, _, _ = _deep_steps(int(every) + 1)
    assert not said


def test_not_said_for_a_plan_given_by_the_caller():
    model, batch = make("gpt2")
    n = len(model.transformer.h)
    plan = scheduler.plan.checkpoint_plan(n, range(n), planner="mine")
    scheduler.checkpoint(model, budget=1, planner=plan)
    assert not _said(model, batch)


class _TwoLists(nn.Module):
    """Two 16-block lists: each gets half the budget (by block count)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = _Deep().layers, _Deep().layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in [*self.enc, *self.dec]:
            x = layer(x)
        return x.square().mean()


def test_a_shares_warning_names_the_share_and_the_whole_budget_needed():
    _, chain, every = _deep_steps("1GiB")
    least = rotor.min_memory(chain)
    torch.manual_seed(0)
    model, x = _TwoLists(), torch.randn(64, 32, requires_grad=True)
    scheduler.checkpoint(model, budget=int(2.4 * least), blocks=["enc", "dec"], **fast("rotor"))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        model(x).backward()
    said = [str(w.message) for w in got if SAID in str(w.message)]
    assert said and all("share of the budget (16/32 of it" in m for m in said)
    for m, r in zip(said, checkpointed(model).runners):
        every_here = r.profiling_peak(next(iter(r._measured.values())))
        assert f"at least about {scheduler.units.format_bytes(-(-int(every_here) * 2 // 1))}" in m


def test_the_measurement_holds_no_more_than_its_figure():
    """The profiling step's real memory (a live-storage counter; weight gradients exist
    before, so the activations alone) stays within the figure the warning is checked
    against. The CPU measurement once kept what its traced forward saved through its own
    backward: a 4-block GPT-2's first step at 1.38x a budget above the model's figure."""
    model, batch = make("gpt2")
    scheduler.checkpoint(model, budget="1GiB", **fast("rotor"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    counter = LiveStorageBytes()
    with counter:
        model(**batch).loss.backward()   # the profiling step
    for r in checkpointed(model).runners:
        figure = r.profiling_peak(next(iter(r._measured.values())))
        assert 0 < counter.peak <= figure, (counter.peak, figure)


MIMOSE_SAID = "Mimose's collection steps"


def _mimose_steps(budget, sizes=(48, 64, 56, 40)) -> tuple:
    """_Deep under Mimose, one step per batch size (each a collection step)."""
    torch.manual_seed(0)
    model = _Deep()
    scheduler.checkpoint(model, budget=budget, blocks="layers", planner="mimose")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for n in sizes:
            model(torch.randn(n, 32)).backward()
    runner = checkpointed(model).runners[0]
    assert runner.collections == len(sizes)
    return [w for w in got if MIMOSE_SAID in str(w.message)], runner


def test_said_once_when_a_mimose_collection_step_exceeds_the_budget():
    """Mimose's collection steps checkpoint every block whatever the budget, and measure each
    block besides: their memory is the profiling step's figure of the sample's chain. A
    budget below it was passed over without a word (1.05-1.22x the budget at runtime)."""
    from scheduler.planners.mimose import chain_from_estimate
    said, runner = _mimose_steps("1GiB")
    assert not said
    figure = runner.profiling_peak(chain_from_estimate(runner.mimose.estimator.measured(48 * 32)))
    budget = int(figure * 0.9)
    said, _ = _mimose_steps(budget)
    assert len(said) == 1
    message = str(said[0].message)
    # the first collection step's input (48 x 32), in the user's terms too
    assert "input size 1536 (block 0's tensors (48, 32))" in message
    assert f"above the budget {scheduler.units.format_bytes(budget)}" in message
    assert said[0].filename == __file__
