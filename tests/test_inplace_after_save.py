"""A tensor autograd saved and then modified in place before the backward: plain autograd
raises ("modified by an inplace operation"), but it skips that check for tensors packed by
saved-tensor hooks, which both runtimes use. Without their own check the backward would
silently use the modified values; with it, they raise as plain training does, and a step
that modifies nothing saved still trains."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import scheduler

INPLACE = "modified by an inplace operation"


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 64), nn.Tanh())


def _plain_raises(change) -> None:
    model = _mlp()
    with pytest.raises(RuntimeError, match=INPLACE):
        out = model(torch.randn(16, 64, requires_grad=True))
        change(model, out)
        out.sum().backward()


# ---------------------------------------------------------------------- swap runtime
@pytest.mark.parametrize("window", ["1KiB", "1MiB"])  # swapped out by the backward, or not
def test_swap_raises_on_a_saved_activation_changed_in_place(window):
    def keep(model, out):
        out.mul_(1)  # (the graph's last tanh saved ``out``: plain raises)

    _plain_raises(keep)
    model = _mlp()
    for step in range(3):  # a recorded step, then scheduled ones (which swap)
        with scheduler.swap(window=window, device="cpu", min_bytes=0):
            out = model(torch.randn(16, 64, requires_grad=True))
            if step < 2:
                out.sum().backward()
                continue
            out.mul_(1)
            with pytest.raises(RuntimeError, match=INPLACE):
                out.sum().backward()


def test_swap_raises_on_a_weight_changed_between_forward_and_backward():
    # the weight is left in place (a parameter), autograd's check skipped all the same
    def step_weights(model, out):
        with torch.no_grad():
            model[2].weight.add_(1)

    _plain_raises(step_weights)
    model = _mlp()
    with scheduler.swap(window="1MiB", device="cpu", min_bytes=0):
        out = model(torch.randn(16, 64, requires_grad=True))
        step_weights(model, out)
        with pytest.raises(RuntimeError, match=INPLACE):
            out.sum().backward()


def test_swap_unchanged_steps_train():
    model = _mlp()
    for _ in range(3):
        with scheduler.swap(window="1KiB", device="cpu", min_bytes=0):
            model(torch.randn(16, 64, requires_grad=True)).sum().backward()


# A tensor the program holds, saved, sent to the host by the budget (its device bytes are the
# program's, still there), then saved again: its storage serves again (re-attach, no copy).
N = 256
EVICTING = dict(budget=N * 4, device="cpu", min_bytes=0)  # one saved tensor at a time


def _evicted_then_saved_again(change, alias=False, used=True):
    """Saves x, saves z (x goes to the host), maybe changes x in place, saves x again (as
    ``x.data`` with ``alias``: the same storage under a version counter of its own), saves
    z2 (x goes to the host again). ``used``: the first save of x reaches the loss."""
    torch.manual_seed(0)
    w = [torch.randn(N, requires_grad=True) for _ in range(4)]
    x, z, z2 = torch.randn(N), torch.randn(N), torch.randn(N)
    x.add_(1)  # (x's counter is at 1 when it is first saved)
    a = x * w[0]
    b = z * w[1]
    if change:
        x.mul_(2)
    c = (x.data if alias else x) * w[2]
    d = z2 * w[3]
    loss = (b + c + d + (a if used else 0)).sum()
    loss.backward()
    return [p.grad for p in w]


def test_swap_raises_on_an_evicted_tensor_changed_then_saved_again():
    with pytest.raises(RuntimeError, match=INPLACE):
        _evicted_then_saved_again(change=True)
    with scheduler.swap(**EVICTING) as s, pytest.raises(RuntimeError, match=INPLACE):
        _evicted_then_saved_again(change=True)
    assert s.stats()["budget_evictions"] >= 2


@pytest.mark.parametrize("change", [False, True])
@pytest.mark.parametrize("alias", [False, True])
def test_swap_saves_an_evicted_tensor_again_with_its_bytes_of_now(change, alias):
    """The first save unused (plain autograd does not raise): the second save's backward
    reads x as it is now, not the host copy made before the change (which a later swap-out
    reused: wrong gradients without a word); unchanged, or the same bytes under another
    counter, nothing raises."""
    want = _evicted_then_saved_again(change, alias, used=False)
    with scheduler.swap(**EVICTING) as s:
        got = _evicted_then_saved_again(change, alias, used=False)
    assert s.stats()["budget_evictions"] >= 2
    for a, b in zip(want, got):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    if not change:
        with scheduler.swap(**EVICTING):  # the first save used: still no error
            _evicted_then_saved_again(change, alias)


# ---------------------------------------------------------------------- chain runtime
class _Tanh(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.lin(x))  # saves its output


@pytest.mark.parametrize("planner", ["none", "rotor"])
def test_chain_raises_on_a_kept_block_output_changed_in_place(planner):
    torch.manual_seed(0)
    blocks = [_Tanh() for _ in range(4)]
    x = torch.randn(8, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match=INPLACE):  # plain
        out = nn.Sequential(*blocks)(x)
        out.mul_(2)
        out.sum().backward()
    # the last block's F_all (every plan keeps what the loss's block saved) holds ``out``
    model = scheduler.wrap(blocks, None if planner == "none" else "1MiB", planner=planner)
    for _ in range(2):  # (rotor: a profiling step first)
        model(x).sum().backward()
    out = model(x)
    out.mul_(2)
    with pytest.raises(RuntimeError, match=INPLACE):
        out.sum().backward()


def test_swap_raises_on_a_tensor_changed_after_its_copy_went_to_the_host():
    """The change comes after the swap-out released the device copy (the view that carried
    the version counter is gone): seen on the saved tensor itself, which the program holds."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)

    def step(inplace):
        x = torch.randn(64, 64) @ w
        y = x.sin()                 # saves x
        z = (x * 2).tanh()          # later saves: x goes to the host after its last save
        u = (x * 3).tanh()
        if inplace:
            x.add_(1)
        (y.sum() + z.sum() + u.sum()).backward()

    with pytest.raises(RuntimeError, match=INPLACE):
        step(True)
    for budget in (None, "40KiB"):
        with scheduler.swap(window="1KiB", budget=budget, device="cpu", min_bytes=0) as s:
            step(False)  # recorded
            for _ in range(2):
                with pytest.raises(RuntimeError, match=INPLACE):
                    step(True)
        assert s.stats()["swapped_out_bytes"] > 0


def test_swap_saves_again_a_tensor_swapped_back_in_with_its_bytes_of_now():
    """The schedule swaps x back in before the forward saves it again (a save is a use), and
    the program changed x in between: the new saves read x as it is now (they read the host
    copy made before the change, which a later swap-out reused: wrong gradients), and the
    first save raises at its use as plain autograd does."""
    torch.manual_seed(0)
    x0, w2, w3, w4 = (torch.randn(64, 64, requires_grad=True) for _ in range(4))

    def step(first_used):
        x = x0 * 1.0
        y1 = x * w2                       # saves x
        e = x.repeat(2, 1).exp()          # a larger save: the budget sends x to the host
        with torch.no_grad():
            x.mul_(0.5)
        y2, y3 = x * w3, x * w4           # saves x again, twice
        loss = (y2 * y3).sum() + e.sum() + (y1.sum() if first_used else 0)
        return torch.autograd.grad(loss, [w2, w3, w4] if first_used else [w3, w4])

    want = step(False)
    with pytest.raises(RuntimeError, match=INPLACE):
        step(True)
    with scheduler.swap(window="16KiB", budget="40KiB", device="cpu", min_bytes=0) as s:
        for _ in range(3):
            got = step(False)
            assert all(torch.equal(a, b) for a, b in zip(want, got))
        for _ in range(2):
            with pytest.raises(RuntimeError, match=INPLACE):
                step(True)
    # x is the program's: swapped back in, its own storage is re-attached (no copy)
    assert s.stats()["reattached_bytes"] > 0


def test_swap_sees_a_change_to_the_base_of_a_view_made_inside_an_op():
    """``nn.Linear`` on a 3-D input saves ``x.view(-1, d)``, a view that dies with the forward
    while the loop holds ``x`` (a static input buffer the next batch is copied into before the
    backward). Swapped out and re-attached, the backward read the new bytes without a word;
    the view shared ``x``'s version counter, so the runtime asks ``x`` now."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def step(change):
        x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
        h = torch.tanh(lin2(torch.tanh(lin1(x))))
        loss = h.square().mean()
        if change:
            with torch.no_grad():
                x.mul_(2)
        loss.backward()

    _raises_as_plain_does(step, window=4096, budget=20000)


def _raises_as_plain_does(step, **swap):
    """``step(change)`` raises in plain autograd when ``change``; under ``scheduler.swap``
    (a step recorded first) it raises too, having re-attached a held storage."""
    with pytest.raises(RuntimeError, match=INPLACE):
        step(True)
    with scheduler.swap(device="cpu", min_bytes=0, **swap) as s:
        step(False)
        with pytest.raises(RuntimeError, match=INPLACE):
            step(True)
    assert s.stats()["reattached_bytes"] > 0


def test_swap_sees_a_change_after_a_reattached_use():
    """retain_graph: the first backward reads ``x`` through a re-attached view (a counter of
    its own); the program then changes ``x``; the second backward raises as plain does."""
    def step(change):
        torch.manual_seed(0)
        w, w2 = (torch.randn(64, 64, requires_grad=True) for _ in range(2))
        x = torch.randn(64, 64)
        loss = ((((x * w).tanh() @ w2).exp() @ w2).sin()).sum()
        loss.backward(retain_graph=True)
        if change:
            with torch.no_grad():
                x.mul_(2)
        loss.backward()

    _raises_as_plain_does(step, window="1KiB", budget=40000)
