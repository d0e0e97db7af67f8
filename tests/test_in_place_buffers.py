"""Buffers a block's forward changes in place and computes with (spectral norm's power
iteration advances ``u``/``v`` at every training forward and builds the weight from them): the
recomputation must start from their values before the first run, and leave them as the first
run did. Started from the advanced vectors it iterates once more and computes another weight:
wrong gradients without a word, as under ``torch.utils.checkpoint`` (shown below, so the test
knows it tests something). ``runtime.first_run.InPlaceBuffers``."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import scheduler
from scheduler.runtime.checkpoint import checkpointed
from wrap_models import ListNet, TorchCheckpointedNet, every_block, tight_rotor

L = 4


class Block(nn.Module):
    def __init__(self, style: str, d: int = 16):
        super().__init__()
        lin = nn.Linear(d, d)
        if style == "spectral_norm":
            self.lin = nn.utils.spectral_norm(lin)
        elif style == "parametrization":
            self.lin = nn.utils.parametrizations.spectral_norm(lin)
        else:
            raise ValueError(style)
        self.norm = nn.BatchNorm1d(d)  # its statistics move too, and are not computed with

    def forward(self, x):
        return self.norm(torch.tanh(self.lin(x))) + x


def _step(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    return (loss.detach(), [p.grad.clone() for p in model.parameters()],
            [b.clone() for b in model.buffers()])


def _same(a, b):
    return torch.equal(a[0], b[0]) and all(torch.equal(p, q) for p, q in zip(a[1], b[1])) \
        and all(torch.equal(p, q) for p, q in zip(a[2], b[2]))


def _twins(style, cls=ListNet):
    torch.manual_seed(0)
    plain = ListNet([Block(style) for _ in range(L)])
    return plain, cls(copy.deepcopy(list(plain.blocks)))


@pytest.mark.parametrize("style", ["spectral_norm", "parametrization"])
@pytest.mark.parametrize("planner", [every_block, tight_rotor])
def test_spectral_norm_recomputed_as_plain_training(style, planner):
    plain, twin = _twins(style)
    model = scheduler.checkpoint(twin, None, planner, blocks="blocks")
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step is inexact, none says so
        for _ in range(3):  # (rotor: the profiling step first)
            assert _same(_step(plain, x), _step(model, x))
    assert checkpointed(model).runners[0].last_stats.recomputed_forwards > 0


def test_torch_checkpoint_gets_it_wrong():
    plain, ckpt = _twins("spectral_norm", TorchCheckpointedNet)
    x = torch.randn(8, 16)
    want, got = _step(plain, x), _step(ckpt, x)
    assert not all(torch.equal(p, q) for p, q in zip(want[1], got[1]))


def test_a_module_turned_to_training_mode_is_learned_again():
    """Spectral norm iterates in training mode only: a block first run with it in eval mode
    learned that nothing moves; turned to training mode, its buffers are copied again."""
    plain, twin = _twins("spectral_norm")
    model = scheduler.checkpoint(twin, None, every_block, blocks="blocks")
    x = torch.randn(8, 16)
    for m in (plain, model):
        for b in m.blocks:
            b.lin.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for frozen in (True, True, False, False):
            if not frozen:
                for m in (plain, model):
                    for b in m.blocks:
                        b.lin.train()
            assert _same(_step(plain, x), _step(model, x))


class Sometimes(nn.Module):
    """Changes its buffer in place and computes with it, but only when its input says so."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        if x.sum() > 0:
            with torch.no_grad():
                self.scale.mul_(1.5)
        return torch.tanh(self.lin(x) * self.scale)


def test_a_buffer_that_first_moves_late_is_said():
    """A buffer the learned set did not know (it never moved before, in these modes) has no
    copy from before the run: the step may be inexact, and a warning says so."""
    torch.manual_seed(0)
    model = scheduler.checkpoint(ListNet([Sometimes() for _ in range(L)]), None, every_block,
                                 blocks="blocks")
    neg = -torch.rand(8, 16)
    model(neg).square().mean().backward()
    with pytest.warns(RuntimeWarning, match=r"block 0's buffer 'scale' \(Sometimes\)"):
        model(-neg).square().mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # learned now (said once)
        model(-neg).square().mean().backward()


class RaisesOnce(Block):
    """A spectral-norm block whose first forward raises after it ran (an out-of-memory error
    that accelerate's find_executable_batch_size retries after)."""
    fail = False

    def forward(self, x):
        y = super().forward(x)
        if RaisesOnce.fail:
            raise torch.OutOfMemoryError("simulated")
        return y


def test_a_first_forward_that_raised_teaches_nothing():
    torch.manual_seed(0)
    plain = ListNet([RaisesOnce("parametrization") for _ in range(L)])
    model = scheduler.checkpoint(copy.deepcopy(plain), None, every_block, blocks="blocks")
    x = torch.randn(8, 16)
    RaisesOnce.fail = True
    for m in (plain, model):
        with pytest.raises(torch.OutOfMemoryError):
            m(x)
    RaisesOnce.fail = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert _same(_step(plain, x), _step(model, x))
