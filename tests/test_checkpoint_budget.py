"""``checkpointed(model).budget``: the whole model's budget, read and set after
``scheduler.checkpoint`` (shared among its block lists as checkpoint shares it, planned again
on the next forward); any other attribute set there is refused, not taken silently (a new
user's walk-through set ``.budget`` on it before it existed: accepted, ignored)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import scheduler
from scheduler.runtime.checkpoint import checkpointed

from wrap_models import one_thread  # noqa: F401  (autouse fixture)


class Layer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


class TwoLists(nn.Module):
    """An encoder of 4 layers and a decoder of 2: two block lists, shares 2/3 and 1/3."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.encoder = nn.ModuleList(Layer(d) for _ in range(4))
        self.decoder = nn.ModuleList(Layer(d) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder:
            x = layer(x)
        for layer in self.decoder:
            x = layer(x)
        return x


def test_a_new_budget_is_shared_and_planned_on_the_next_forward():
    torch.manual_seed(0)
    model = scheduler.checkpoint(TwoLists(), 3_000_000, loss="sum")
    c = checkpointed(model)
    assert c.budget == 3_000_000
    assert [r.budget for r in c.runners] == [2_000_000, 1_000_000]
    x = torch.randn(64, 32)
    for _ in range(2):   # the profiling step, then a planned one
        model(x).sum().backward()
    before = [r.last_plan.predicted_peak for r in c.runners]
    for name, st in c.stats().items():   # the top of the budget's range, beside the plan's
        assert st["last_store_all_peak"] >= st["last_predicted_peak"] > 0, (name, st)
    c.budget = "160kB"
    assert c.budget == 160_000 and [r.budget for r in c.runners] == [106_666, 53_333]
    model(x).sum().backward()
    after = [r.last_plan.predicted_peak for r in c.runners]
    assert all(a <= r.budget for a, r in zip(after, c.runners)), (after, before)
    assert after != before
    # a budget too small names the list, its input and the other end of the range
    c.budget = "30kB"
    with pytest.raises(scheduler.InfeasibleError,
                       match=r"block 0's tensors \(64, 32\) of 'encoder'; without checkpointing "
                             r"the step holds \d+ B") as e:
        model(x)
    assert e.value.min_memory > 30_000
    c.budget = None
    assert c.budget is None and [r.budget for r in c.runners] == [None, None]


def test_other_attributes_are_refused():
    model = scheduler.checkpoint(TwoLists(), "1MB", loss="sum")
    c = checkpointed(model)
    with pytest.raises(AttributeError, match="'budgt'"):
        c.budgt = 1
    with pytest.raises(ValueError, match="budget"):
        c.budget = "lots"
    assert c.budget == 1_000_000
    with pytest.raises(AttributeError, match="'total'"):
        c.total = 5


def test_a_list_set_on_its_own_shows_in_the_whole():
    model = scheduler.checkpoint(TwoLists(), "3MB", loss="sum")
    c = checkpointed(model)
    c.runners[0].budget = "5MB"
    assert c.budget == 6_000_000   # 5 MB + the decoder's 1 MB share
    c.runners[1].budget = None
    assert c.budget is None        # one list without a limit: no limit on the whole


@pytest.mark.parametrize("remove", ["undo", "again"])
def test_a_removed_installation_refuses_a_budget(remove):
    model = scheduler.checkpoint(TwoLists(), "3MB", loss="sum")
    old = checkpointed(model)
    if remove == "undo":
        scheduler.runtime.checkpoint.undo(model)
    else:
        scheduler.checkpoint(model, "5MB", loss="sum")
    with pytest.raises(RuntimeError, match="was removed"):
        old.budget = "1MB"
    if remove == "again":
        assert checkpointed(model).budget == 5_000_000


def test_mimose_infeasible_names_the_input_and_the_list():
    torch.manual_seed(0)
    model = scheduler.checkpoint(TwoLists(), "20kB", planner="mimose", samples=3)
    with pytest.raises(scheduler.InfeasibleError,
                       match=r"Mimose: budget .* \(block 0's tensors \(\d+, 32\) of 'encoder'\)"):
        for n in (16, 24, 32, 48, 64):   # collection steps, then planned ones
            model(torch.randn(n, 32)).sum().backward()

