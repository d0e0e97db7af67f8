"""A recomputation calls a block again with the loop's own arguments (masks, position tables):
if the loop changed one of them in place between the forward and the backward, plain autograd
raises (the saved tensor's version moved); the runner must raise too, never recompute with the
new values and hand back wrong gradients."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import scheduler
from scheduler.planners.mimose import plan_from_checkpoints

from wrap_models import one_thread  # noqa: F401  (autouse fixture)


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * mask


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Blk() for _ in range(4)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x, mask)
        return x


def _every_block_recomputed(chain, budget):
    return plan_from_checkpoints(4, range(4), planner="test")


@pytest.mark.parametrize("changed", ["mask", "anchor"])
def test_an_argument_changed_in_place_before_the_backward_raises(changed):
    torch.manual_seed(0)
    plain = Net()
    x, mask = torch.randn(8, 16), torch.ones(8, 16)
    if changed == "mask":  # plain autograd refuses it: so must the runner
        loss = plain(x, mask).sum()
        mask.mul_(0.5)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        mask.fill_(1.0)
    model = scheduler.checkpoint(Net(), budget="1GiB", planner=_every_block_recomputed)
    if changed == "mask":
        loss = model(x, mask).sum()
        mask.mul_(0.5)
    else:  # block 0's input (the chain's anchored value) changed by the caller
        x.requires_grad_(False)
        loss = model(x, mask).sum()
        x.mul_(0.5)
    with pytest.raises(RuntimeError, match="in place"):
        loss.backward()


def test_unchanged_arguments_still_match_plain_training():
    torch.manual_seed(0)
    plain = Net()
    model = scheduler.checkpoint(Net(), budget="1GiB", planner=_every_block_recomputed)
    model.load_state_dict(plain.state_dict())
    x, mask = torch.randn(8, 16), torch.rand(8, 16)
    plain(x, mask).sum().backward()
    model(x, mask).sum().backward()
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


class Scaled(Net):
    """The loop changes the value between blocks (anchored values) and keeps what it passed."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.passed = []
        for b in self.layers:
            y = x * 2
            self.passed.append(y)
            x = b(y, mask)
        return x


def test_an_anchored_value_changed_in_place_before_the_backward_raises():
    model = scheduler.checkpoint(Scaled(), budget="1GiB", planner=_every_block_recomputed)
    loss = model(torch.randn(8, 16), torch.ones(8, 16)).sum()
    model.passed[2].mul_(0.5)
    with pytest.raises(RuntimeError, match="in place"):
        loss.backward()


class NormBlk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.lin(x)))


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([NormBlk() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return x


def test_eval_between_forward_and_backward_recomputes_in_the_first_runs_mode():
    # model.eval() before the backward: plain autograd's backward uses what the train-mode
    # forward saved; a recomputation in eval mode would save other tensors (batch norm: other
    # shapes, read out of bounds by the backward: a segfault before this was fixed)
    torch.manual_seed(0)
    plain = NormNet()
    model = scheduler.checkpoint(NormNet(), budget="1GiB", planner=_every_block_recomputed)
    model.load_state_dict(plain.state_dict())
    x = torch.randn(8, 16)
    for m in (plain, model):
        loss = m(x).pow(2).sum()
        m.eval()
        loss.backward()
        assert not any(mod.training for mod in m.modules())  # the caller's mode stays
        m.train()
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)
    for a, b in zip(plain.buffers(), model.buffers()):
        assert torch.equal(a, b)


class Scale(nn.Module):
    """A block whose saved tensor's shape follows an attribute changed between forward and
    backward: what it saves when recomputed cannot be handed to the first run's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scale = torch.ones(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


class ScaleNet(NormNet):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.layers = nn.ModuleList([Scale() for _ in range(4)])


def test_a_recomputation_saving_other_shapes_raises_instead_of_crashing(tmp_path):
    # in a child: a crash stays there
    script = r'''
import torch, scheduler
from torch import nn
from scheduler.planners.mimose import plan_from_checkpoints
import test_chain_changed_args as T
model = scheduler.checkpoint(T.ScaleNet(), budget="1GiB",
                             planner=lambda c, b: plan_from_checkpoints(4, range(4), planner="t"))
loss = model(torch.randn(8, 16)).pow(2).sum()
for b in model.layers:
    b.scale = torch.ones(1)
try:
    loss.backward()
except RuntimeError as e:
    assert "block 3" in str(e) and "shape" in str(e), e
    print("OK")
'''
    import os
    import subprocess
    import sys
    from _subproc import python_env
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, env=python_env(here), cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), (r.returncode, r.stdout,
                                                                     r.stderr[-2000:])


def _watch_steps(runner) -> list:
    """Weak references to every step the runner begins."""
    import weakref
    refs = []
    begin = runner._begin

    def watched(*a, **k):
        step = begin(*a, **k)
        refs.append(weakref.ref(step))
        return step
    runner._begin = watched
    return refs


def test_a_forward_that_raises_mid_chain_lets_go_of_its_step():
    # an OOM in block k: what the step held (checkpoints x[0..k]) must not stay allocated
    # until the next forward (a retry with a smaller batch would find that memory taken)
    import gc
    from scheduler.runtime.checkpoint import checkpointed

    def boom(self: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        raise ValueError("out of memory, say")

    net = Net()
    net.layers[2].forward = boom.__get__(net.layers[2])
    model = scheduler.checkpoint(net, budget="1GiB", planner=_every_block_recomputed)
    runner = checkpointed(model).runners[0]
    steps = _watch_steps(runner)
    raised = False
    try:  # (not pytest.raises: its traceback would keep the frames, and the step, alive)
        model(torch.randn(8, 16), torch.ones(8, 16))
    except ValueError:
        raised = True
    assert raised and runner.current is None
    gc.collect()
    assert len(steps) == 1 and steps[0]() is None


class StopsBetweenBlocks(Net):
    stop = True

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.layers):
            if i == 2 and self.stop:
                raise ValueError("the loop itself raised")
            x = b(x, mask)
        return x


def test_a_forward_stopped_between_blocks_lets_go_of_its_step_at_once():
    # the model's own code raised between two blocks (an OOM, say): the checkpoints the step
    # holds go when the forward raises, not when the next forward begins (a retry with a
    # smaller batch would find that memory taken)
    import gc
    from scheduler.runtime.checkpoint import checkpointed
    model = scheduler.checkpoint(StopsBetweenBlocks(), budget="1GiB",
                                 planner=_every_block_recomputed)
    runner = checkpointed(model).runners[0]
    steps = _watch_steps(runner)
    gc.collect()
    gc.disable()
    try:
        try:  # (not pytest.raises: its traceback would keep the frames, and the step, alive)
            model(torch.randn(8, 16), torch.ones(8, 16))
        except ValueError:
            pass
        assert runner.current is None and len(steps) == 1 and steps[0]() is None
    finally:
        gc.enable()


def test_a_forward_stopped_between_blocks_is_freed_by_the_next_forward():
    import gc
    from scheduler.runtime.checkpoint import checkpointed
    model = scheduler.checkpoint(StopsBetweenBlocks(), budget="1GiB",
                                 planner=_every_block_recomputed)
    steps = _watch_steps(checkpointed(model).runners[0])
    try:
        model(torch.randn(8, 16), torch.ones(8, 16))
    except ValueError:
        pass
    model.stop = False
    model(torch.randn(8, 16), torch.ones(8, 16)).sum().backward()
    gc.collect()
    assert len(steps) == 2 and all(r() is None for r in steps)


def test_training_steps_are_freed_after_their_backward():
    # a recomputation's own graph (never run backward) must not keep itself alive through its
    # saved outputs: it would keep the recomputed activations, the frames and the step, every
    # step (on a GPU: out of memory after a few steps)
    import gc
    from scheduler.runtime.checkpoint import checkpointed
    model = scheduler.checkpoint(Net(), budget="1GiB", planner=_every_block_recomputed)
    steps = _watch_steps(checkpointed(model).runners[0])
    for _ in range(3):
        model(torch.randn(8, 16), torch.ones(8, 16)).sum().backward()
    gc.collect()
    assert len(steps) == 3 and all(r() is None for r in steps)


@pytest.mark.parametrize("planner", ["every-block", "rotor", "pofo"])
def test_a_step_whose_backward_never_runs_is_freed_without_the_collector(planner):
    # a loop that skips the backward of a bad loss: dropping the loss must free the step and
    # its checkpoints at once, as plain training frees its activations, not at Python's next
    # cyclic collection (a cycle step -> frames -> step would hold several steps' checkpoints)
    import gc
    from scheduler.runtime.checkpoint import checkpointed
    from wrap_models import tight_rotor
    chosen = {"every-block": _every_block_recomputed, "rotor": tight_rotor, "pofo": "pofo"}
    extra = {"bandwidth": 1e8} if planner == "pofo" else {}
    model = scheduler.checkpoint(Net(), budget="1GiB", planner=chosen[planner], **extra)
    x, mask = torch.randn(8, 16), torch.ones(8, 16)
    model(x, mask).sum().backward()   # (a profiling step where the planner measures)
    steps = _watch_steps(checkpointed(model).runners[0])
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            loss = model(x, mask).sum()
            del loss   # not finite, say: skipped
            assert all(r() is None for r in steps), "a dropped step is alive"
    finally:
        gc.enable()
    assert len(steps) == 3


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * x + x


class _RoundedNet(nn.Module):
    """Straight-through quantization between blocks through ``.data``: the loop's output
    object is given other values, and no version counter moves."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Gated() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
            x.data = torch.round(x.data * 16) / 16
        return x


@pytest.mark.parametrize("planner", ["every-block", "rotor", "mimose"])
def test_an_output_given_new_data_between_blocks_is_the_next_blocks_input(planner):
    """The recomputation reads what the first run read (the new values), as plain autograd
    does: the step's own copy of the output still shows the old ones."""
    from wrap_models import every_block, tight_rotor
    torch.manual_seed(0)
    plain = _RoundedNet()
    model = _RoundedNet()
    model.load_state_dict(plain.state_dict())
    chosen = {"every-block": every_block, "rotor": tight_rotor, "mimose": "mimose"}[planner]
    extra = {"samples": 3} if planner == "mimose" else {}
    scheduler.checkpoint(model, "1GiB", planner=chosen, blocks="layers", **extra)
    for step in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        grads = []
        for net in (plain, model):
            net.zero_grad(set_to_none=True)
            net(x).square().sum().backward()
            grads.append([p.grad for p in net.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads)), step
    assert scheduler.runtime.checkpoint.checkpointed(model).runners[0].last_stats \
        .recomputed_forwards > 0 or planner == "mimose"
