"""torch.compile under the swap runtime: the backward of a compiled region is one autograd node
that reads every tensor the region saved at once, so a whole-model compile leaves swapping
nothing to split: a budget below those bytes is refused, and the error names torch.compile as a
likely cause. Compiled per block, each block's backward is its own node and the budget holds."""
import warnings

import pytest
import torch
from torch import nn

import scheduler
from scheduler.errors import InfeasibleError


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])


def run(model, budget, steps=2):
    ctx = scheduler.swap(window=4096, budget=budget, device="cpu")
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the window is smaller than a tensor)
        with ctx:
            for _ in range(steps):
                model(x).square().mean().backward()
    return ctx.stats()


def test_a_whole_model_compile_is_named_when_its_backward_passes_the_budget():
    budget = 28672  # half of the 57344 bytes the model saves
    with pytest.raises(InfeasibleError, match=r"step \d+ \(backward\) uses 57344 bytes .*"
                                              r"torch.compile'd.*compile each block") as e:
        run(torch.compile(build(), backend="aot_eager"), budget)
    assert e.value.min_memory == 57344
    blocks = build()
    for block in blocks:
        block.compile(backend="aot_eager")
    assert run(blocks, budget)["peak_resident_bytes"] <= budget
