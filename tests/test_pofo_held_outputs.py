"""pofo offloads block outputs by emptying their storages (chain_transfers.py). A block output the
model keeps beyond the loop (deep supervision, HF's output_hidden_states) must stay readable:
it comes back at the end of the forward, with a warning, and training matches plain."""
import copy
import warnings

import pytest
import torch
from torch import nn

import scheduler


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin, self.lin2, self.drop = nn.Linear(d, d), nn.Linear(d, d), nn.Dropout(0.25)

    def forward(self, x):
        return self.lin2(self.drop(torch.tanh(self.lin(x)))) + x


class DeepSupervision(nn.Module):
    """Returns block 2's output (``keep`` of it: itself, a view, a detached alias) next to the
    head's: the caller reads and trains on both."""

    def __init__(self, L=6, d=64, keep=lambda h: h):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(L)])
        self.head = nn.Linear(d, 10)
        self.keep = keep

    def forward(self, x):
        h, mid = self.inp(x), None
        for i, b in enumerate(self.blocks):
            h = b(h)
            if i == 2:
                mid = self.keep(h)
        return self.head(h), mid


def run(model, steps=3):
    out = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        torch.manual_seed(100 + i)
        fin, mid = model(x)
        mid_value = mid.detach().clone()  # read before the backward (was: an empty storage)
        loss = nn.functional.cross_entropy(fin, y)
        (loss + mid.square().mean() if mid.requires_grad else loss).backward()
        out.append((mid_value, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("keep", [lambda h: h, lambda h: h[:, :32], lambda h: h.detach()],
                         ids=["itself", "a view", "a detached alias"])
def test_a_block_output_the_model_returns_stays_readable_under_pofo(keep):
    plain = DeepSupervision(keep=keep)
    model = copy.deepcopy(plain)
    scheduler.checkpoint(model, "150KB", "pofo", blocks="blocks")
    with pytest.warns(RuntimeWarning, match=r"outputs of blocks \[2\] are held outside"):
        got = run(model)
    for (mid_a, grads_a), (mid_b, grads_b) in zip(got, run(plain)):
        assert torch.equal(mid_a, mid_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert scheduler.runtime.checkpoint.checkpointed(model).runners[0].stats()["last_offloads"] > 0


def test_frozen_blocks_are_offloaded_without_a_warning():
    # a frozen block's input is saved as itself (no autograd history to unlink): the step's
    # own reference, not the caller's
    model = DeepSupervision(L=8, keep=lambda h: None)
    for b in model.blocks[:4]:
        b.requires_grad_(False)
    plain = copy.deepcopy(model)
    scheduler.checkpoint(model, "300KB", "pofo", blocks="blocks")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for i in range(3):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(i))
            for m in (model, plain):
                torch.manual_seed(100 + i)
                m(x)[0].square().mean().backward()
            assert all(torch.equal(p.grad, q.grad) for p, q in
                       zip(model.head.parameters(), plain.head.parameters()))
            model.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
    assert scheduler.runtime.checkpoint.checkpointed(model).runners[0].stats()["last_offloads"] > 0


def _stopped_forward(model, x, where, exc):
    """Run ``model`` on ``x`` with ``exc`` raised as block 5 begins (``where``: in the block's
    own pre-hook, between blocks; or in its first layer, inside the runner's call of it), the
    block outputs a forward hook kept, and the traceback's ``mid`` (what a debugger reads)."""
    kept = {}
    handles = [b.register_forward_hook(lambda m, a, out, i=i: kept.__setitem__(i, out))
               for i, b in enumerate(model.blocks)]

    def boom(m, a):
        raise exc("stopped in block 5")

    target = model.blocks[5] if where == "between" else model.blocks[5].lin
    handles.append(target.register_forward_pre_hook(boom))
    try:
        torch.manual_seed(7)
        model(x)
    except exc as e:
        tb = e.__traceback__
        while tb is not None and "mid" not in tb.tb_frame.f_locals:
            tb = tb.tb_next
        mid = tb.tb_frame.f_locals["mid"]
    for h in handles:
        h.remove()
    return kept, mid


@pytest.mark.parametrize("where,exc", [("inside", KeyboardInterrupt), ("inside", ValueError),
                                       ("between", ValueError)])
def test_outputs_held_outside_stay_readable_when_the_forward_stops_under_pofo(where, exc):
    # the step lets go of an interrupted forward; an output it offloaded (its storage emptied)
    # that a hook or the traceback still holds gets its memory back, as at a forward's end.
    # (Sizes are checked before any read: reading an emptied storage crashes the process)
    plain = DeepSupervision().eval()  # (no dropout: the values compare without the rng)
    model = copy.deepcopy(plain)
    scheduler.checkpoint(model, "150KB", "pofo", blocks="blocks")
    x = torch.randn(32, 64, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="held outside"):
        model(x)[0].sum().backward()  # the profiling step, then a planned one
        model(x)[0].sum().backward()
    runner = scheduler.runtime.checkpoint.checkpointed(model).runners[0]
    assert any(op.kind == "offload" for op in runner.last_plan.ops)
    kept, mid = _stopped_forward(model, x, where, exc)
    want, want_mid = _stopped_forward(plain, x, where, exc)
    assert sorted(kept) == [0, 1, 2, 3, 4] and runner.current is None
    sizes = {i: t.untyped_storage().nbytes() for i, t in kept.items()}
    assert sizes == {i: t.numel() * t.element_size() for i, t in kept.items()}
    assert mid.untyped_storage().nbytes() == mid.numel() * mid.element_size()
    assert all(torch.equal(kept[i], want[i]) for i in kept) and torch.equal(mid, want_mid)
