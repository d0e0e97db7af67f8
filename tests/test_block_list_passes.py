"""A block list run more than once in one forward of the model: a whole second pass (ALBERT's
shared layers, Perceiver's num_blocks) is planned per pass with the whole budget, so the
budget cannot hold: a warning says so and the gradients stay exact; a block run again at once
(Funnel's block_repeats: 0, 0, 1, 1) raises at the forward, naming the list. Two forwards of
the model before one backward (SimCSE, R-Drop) are two steps, not passes: both hold their
activations until the backward, which the runner says once (another warning)."""
import copy
import warnings

import pytest
import torch
from torch import nn

import scheduler

BUDGET = 1 << 30


class Repeats(nn.Module):
    """Runs its list ``passes`` times per forward, each block ``each`` times in a row."""

    def __init__(self, passes: int = 1, each: int = 1):
        super().__init__()
        self.passes, self.each = passes, each
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.1))
                                    for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for _ in range(self.passes):
            for b in self.blocks:
                for _ in range(self.each):
                    x = b(x)
        return self.head(x).sum()


def _grads(model, steps=3):
    out = []
    for i in range(steps):
        torch.manual_seed(i)
        model.zero_grad()
        model(torch.randn(4, 16)).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def _checkpointed(model):
    m = copy.deepcopy(model)
    scheduler.checkpoint(m, BUDGET, "rotor", blocks="blocks")
    return m


def test_a_second_pass_in_one_forward_is_said_and_exact():
    torch.manual_seed(0)
    plain = Repeats(passes=2)
    m = _checkpointed(plain)
    with pytest.warns(UserWarning, match="'blocks' ran a second time in one forward"):
        got = _grads(m)
    for a, b in zip(_grads(plain), got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_block_run_again_at_once_raises_at_the_forward():
    torch.manual_seed(0)
    m = _checkpointed(Repeats(each=2))
    with pytest.raises(RuntimeError, match="block 0 of 'blocks' was called again before "
                                           "block 1, in the same forward"):
        m(torch.randn(4, 16))


def test_two_forwards_before_one_backward_are_two_steps_said_once():
    """Not a second pass (each forward of the model is a step of its own), but both steps
    hold their activations until the one backward: the budget does not hold for the pair,
    which is said once (``_stacked_forwards``), never as a repeated pass."""
    torch.manual_seed(0)
    plain = Repeats()
    m = _checkpointed(plain)
    for model in (plain, m):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for i in range(3):
                torch.manual_seed(i)
                model.zero_grad()
                x = torch.randn(4, 16)
                (model(x) + model(x)).backward()
        texts = [str(w.message) for w in said]
        if model is plain:
            assert texts == []
        else:
            assert len(texts) == 1 and "was still waiting for its backward" in texts[0], texts
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_forward_that_raised_between_blocks_does_not_count_as_a_repeat():
    torch.manual_seed(0)
    m = _checkpointed(Repeats())
    boom = m.blocks[1].register_forward_hook(lambda *a: (_ for _ in ()).throw(KeyError("x")))
    with pytest.raises(KeyError):
        m(torch.randn(4, 16))
    boom.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(torch.randn(4, 16)).backward()


def test_no_list_found_names_the_models_own_lists():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32,
                                    num_hidden_layers=3, num_attention_heads=4,
                                    intermediate_size=64)
    model = transformers.AlbertForMaskedLM(cfg)
    with pytest.raises(ValueError, match="found no repeated block list in AlbertForMaskedLM "
                                         r"\(its lists: 'albert.encoder.albert_layer_groups'"):
        scheduler.checkpoint(model, BUDGET)


class RetriesInItsForward(Repeats):
    """Breaks a pass off after its first ``done`` blocks (its own code raises) and runs the
    list again from its own input, in the same forward: what worked before the repeat check
    must go on working."""

    def __init__(self, done: int):
        super().__init__()
        self.done = done

    def forward(self, x):
        try:
            h = x
            for b in self.blocks[:self.done]:
                h = b(h)
            raise OverflowError("too large: again at a smaller scale")
        except OverflowError:
            for b in self.blocks:
                x = b(x * 0.5)
        return self.head(x).sum()


@pytest.mark.parametrize("done", [1, 2])   # right after block 0; between blocks 1 and 2
def test_a_pass_broken_off_and_begun_again_in_one_forward_runs(done):
    torch.manual_seed(0)
    plain = RetriesInItsForward(done)
    m = _checkpointed(plain)
    for a, b in zip(_grads(plain), _grads(m)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_with_loss_given_a_second_pass_is_said_too():
    torch.manual_seed(0)
    m = copy.deepcopy(Repeats(passes=2))
    scheduler.checkpoint(m, BUDGET, "rotor", blocks="blocks", loss="sum")
    with pytest.warns(UserWarning, match="ran a second time in one forward"):
        _grads(m, steps=2)


def test_a_sync_batch_norm_in_a_block_makes_the_ranks_agree(monkeypatch):
    from scheduler.runtime import distributed
    from scheduler.runtime.checkpoint import checkpointed
    monkeypatch.setattr(distributed, "active", lambda group=None: True)
    for sync, agrees in ((False, False), (True, True)):
        net = Repeats()
        if sync:
            net.blocks[1].append(nn.SyncBatchNorm(16))
        scheduler.checkpoint(net, BUDGET, "rotor", blocks="blocks")
        assert checkpointed(net).runners[0]._agrees() is agrees
