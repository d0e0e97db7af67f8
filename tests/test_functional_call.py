"""``torch.func.functional_call`` through checkpointed blocks: the call runs the model with
other tensors in place of its parameters and buffers and puts the model's own back when it
returns, before the backward. A recomputation must run with the call's tensors
(``runtime.first_run``): with the model's own, the gradients are wrong without a word, as
under ``torch.utils.checkpoint`` (shown below, so the test knows it tests something)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

import scheduler
from scheduler.runtime.checkpoint import checkpointed
from test_checkpoint_hf import FAST, make
from wrap_models import (ConvBN, ListNet, TorchCheckpointedNet, every_block, mlp_blocks,
                         tight_rotor)

L = 4


def _functional_step(model, x, seed=1):
    """Gradients with respect to other tensors than the model's (twice its parameters, its
    buffers copied), through ``functional_call``; the model's own buffers stay as they were."""
    torch.manual_seed(seed)
    params = {k: (2 * v).detach().requires_grad_() for k, v in model.named_parameters()}
    bufs = {k: v.clone() for k, v in model.named_buffers()}
    loss = functional_call(model, {**params, **bufs}, (x,)).square().mean()
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in params.items()}, bufs


def _blocks(kind):
    if kind == "mlp":
        return mlp_blocks(L), torch.randn(8, 16)
    torch.manual_seed(0)
    return [ConvBN(4) for _ in range(L)], torch.randn(2, 4, 8, 8)


@pytest.mark.parametrize("kind", ["mlp", "convbn"])
@pytest.mark.parametrize("planner", [every_block, tight_rotor])
def test_recomputation_runs_with_the_calls_tensors(kind, planner):
    blocks, x = _blocks(kind)
    plain = ListNet(blocks)
    model = scheduler.checkpoint(copy.deepcopy(plain), None, planner, blocks="blocks")
    own = [t.clone() for t in model.state_dict().values()]
    for _ in range(2):  # (rotor: the profiling step first)
        want_loss, want, want_bufs = _functional_step(plain, x)
        got_loss, got, got_bufs = _functional_step(model, x)
    assert checkpointed(model).runners[0].last_stats.recomputed_forwards > 0
    assert torch.equal(want_loss, got_loss)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    for k in want_bufs:  # batch norm's statistics: updated once, in the call's buffers
        assert torch.equal(want_bufs[k], got_bufs[k]), k
    assert all(torch.equal(a, b) for a, b in zip(own, model.state_dict().values()))
    assert all(p.grad is None for p in model.parameters())


def test_torch_checkpoint_gets_it_wrong():
    """The failure the runner avoids, under PyTorch's own checkpointing."""
    blocks, x = _blocks("mlp")
    plain = ListNet(blocks)
    ckpt = TorchCheckpointedNet(copy.deepcopy(blocks))
    _, want, _ = _functional_step(plain, x)
    _, got, _ = _functional_step(ckpt, x)
    assert any(not torch.equal(want[k], got[k]) for k in want)


def test_hf_model_through_functional_call():
    ref, batch = make("gpt2")
    model = scheduler.checkpoint(copy.deepcopy(ref), None, every_block, measure_options=FAST)

    def step(m):
        torch.manual_seed(2)
        params = {k: (1.5 * v).detach().requires_grad_() for k, v in m.named_parameters()}
        functional_call(m, params, (), batch).loss.backward()
        return {k: v.grad for k, v in params.items()}
    want, got = step(ref), step(model)
    assert checkpointed(model).runners[0].last_stats.recomputed_forwards > 0
    for k in want:
        assert torch.equal(want[k], got[k]), k


class LazyTable(nn.Module):
    """A buffer the forward itself builds at its first call and keeps (a lazily made table,
    HF's dynamic rotary frequencies), the decision in a plain attribute."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.ready = False
        self.register_buffer("table", torch.ones(16), persistent=False)

    def forward(self, x):
        if not self.ready:
            self.ready = True
            self.table = torch.linspace(0.5, 2.0, 16)
        return torch.tanh(self.lin(x) * self.table)


def test_a_buffer_the_first_run_built_is_the_one_recomputed_with():
    """The tensors are taken as the first run left them (taken before it, the recomputation
    ran with the placeholder: wrong gradients, no error)."""
    torch.manual_seed(0)
    plain = ListNet([LazyTable() for _ in range(L)])
    model = scheduler.checkpoint(copy.deepcopy(plain), None, every_block, blocks="blocks")
    x = torch.randn(8, 16)
    for m in (plain, model):
        m(x).square().sum().backward()
    assert checkpointed(model).runners[0].last_stats.recomputed_forwards > 0
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(),
                                                          model.parameters()))
