"""Weights shared by several stages of a chain (GPT-2's LM head tied to its token embedding, one
block object repeated): their gradients wait in autograd's input buffer from the backward of the
last stage using them down to the first, where they are summed; ``measure_chain`` and
``meta_chain`` count them there (``scheduler.profile.shared_grads``), so the simulated peak
bounds the real one. Real peaks come from the CPU allocator's events (``torch.profiler``), as
``bench/hf.py`` reads them."""
from __future__ import annotations

import sys
from typing import Any, Callable, Sequence, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from scheduler import simulate
from scheduler.plan import checkpoint_plan
from scheduler.profile import measure_chain, meta_chain
from scheduler.profile.shared_grads import shared_grad_bytes, shared_weights

from _subproc import ROOT

sys.path.insert(0, f"{ROOT}/bench")
from hf import cpu_peak  # noqa: E402  (one implementation of the real peak)
from bench.models import build  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Real peaks with one intra-op thread (a kernel's buffers can depend on the count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def ce(out: torch.Tensor) -> torch.Tensor:
    flat = out.reshape(-1, out.shape[-1])
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long))


def as_tuple(out: Any) -> Tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def real_peak(blocks: Sequence[nn.Module], make_x: Callable[[], torch.Tensor],
              checkpointed: Sequence[int], input_grad: bool) -> int:
    """A training step's peak above what was held before it (weights and .grad not counted),
    from the second step on (every .grad exists), the blocks in ``checkpointed`` recomputed."""
    for p in (p for b in blocks for p in b.parameters()):
        p.grad = torch.zeros_like(p)

    def step() -> None:
        x = make_x()
        if input_grad:
            x.requires_grad_(True)
        vals: Tuple[Any, ...] = (x,)
        for i, b in enumerate(blocks):
            vals = as_tuple(checkpoint(b, *vals, use_reentrant=False) if i in checkpointed
                            else b(*vals))
        loss = ce(*vals)
        del vals  # the logits: only what the loss saved of them stays
        loss.backward()

    return cpu_peak(step)


def assert_peaks_bounded(blocks, make_x, input_grad, **meta_kw):
    x0 = make_x()
    chains = {"measure_chain": measure_chain(blocks, x0, input_grad=input_grad, repeat=1,
                                             warmup=0),
              "meta_chain": meta_chain(blocks, tuple(x0.shape), input_dtype=x0.dtype,
                                       input_grad=input_grad, cuda_dropout=False, **meta_kw)}
    L = len(blocks)
    for plan_name, ck in (("store-all", ()), ("every-block", tuple(range(L)))):
        real = real_peak(blocks, make_x, ck, input_grad)
        for name, chain in chains.items():
            sim = simulate(chain, checkpoint_plan(L, ck), memory=None).peak_memory
            # before: 2.6 MB and 0.32 MB simulated for real 6.1 MB and 0.82 MB
            assert real <= sim <= 1.05 * real, f"{name} {plan_name}: simulated {sim}, real {real}"
    return chains


def test_gpt2_with_tied_embedding_and_head():
    torch.manual_seed(0)
    zm = build("gpt2", batch=1, seq_len=16, n_layer=2, n_embd=128, n_head=4, vocab=4000,
               n_positions=16, dropout=0.0)
    blocks = zm.blocks
    tied = blocks[0].wte.weight
    assert blocks[-1].weight is tied
    chains = assert_peaks_bounded(blocks, zm.sample_input, input_grad=False)
    grad = tied.numel() * 4
    for chain in chains.values():
        assert chain.meta["shared_weights"] == [{"stages": [0, 3], "grad_bytes": grad}]


def test_one_block_repeated():
    torch.manual_seed(0)
    shared = nn.Sequential(nn.Linear(256, 256), nn.Tanh())
    blocks = [shared] * 4 + [nn.Linear(256, 10)]
    assert_peaks_bounded(blocks, lambda: torch.randn(8, 256), input_grad=True)


def test_bytes_per_stage():
    # A used at stages 0 and 2, B at 1, 3 and 4: each gradient waits from its last user's
    # backward down to its first's; the first sum (at the second-to-last user) is a new tensor
    a, b, c = nn.Linear(4, 4), nn.Linear(8, 8), nn.Linear(2, 2)
    ga, gb = (4 * 4 + 4) * 4, (8 * 8 + 8) * 4
    blocks = [a, b, a, b, b, c]
    assert shared_weights(blocks) == {(0, 2): ga, (1, 3, 4): gb}
    assert shared_grad_bytes(blocks) == [2 * ga, ga + gb, ga + gb, 2 * gb, gb, 0, 0]
    # frozen weights have no gradient; a block used once shares nothing
    c.weight.requires_grad_(False)
    assert shared_weights([c, c]) == {(0, 1): 2 * 4}
    assert shared_grad_bytes([a, b, c]) == [0, 0, 0, 0]


def test_views_of_one_buffer_are_not_shared():
    # distinct parameters in one storage are distinct autograd leaves: no gradient waits
    flat = torch.zeros(32)
    a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    a.weight = nn.Parameter(flat[:16].view(4, 4))
    b.weight = nn.Parameter(flat[16:].view(4, 4))
    assert shared_weights([a, b]) == {}


def test_chains_without_shared_weights_are_unchanged():
    blocks = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)]
    chain = meta_chain(blocks, (2, 4))
    assert "shared_weights" not in chain.meta
    assert shared_grad_bytes(blocks) == [0] * 4


@pytest.mark.parametrize("profiler", ["measure_chain", "meta_chain"])
def test_only_backward_transients_change(profiler):
    shared = nn.Linear(16, 16)
    blocks = [shared, nn.Tanh(), shared]
    x = torch.randn(2, 16)
    if profiler == "measure_chain":
        chain = measure_chain(blocks, x, repeat=1, warmup=0)
        alone = measure_chain([nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)], x, repeat=1,
                              warmup=0)
    else:
        chain = meta_chain(blocks, (2, 16))
        alone = meta_chain([nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)], (2, 16))
    g = (16 * 16 + 16) * 4
    for f in ("x", "xbar", "delta", "fw_tmp", "fck_tmp"):
        assert getattr(chain, f) == getattr(alone, f), f
    assert [s - a for s, a in zip(chain.bw_tmp, alone.bw_tmp)] == [2 * g, g, g, 0]


def test_mimose_counts_the_gradients_of_a_repeated_block():
    """Mimose learns each block alone (its collector), so a block object repeated had its
    waiting gradient left out: a plan predicted 377,856 B for a step that really held 853,000 B
    (2.26x). The runner gives its Mimose the same per-stage bytes (``Mimose.extra_bw_tmp``)."""
    import scheduler
    torch.manual_seed(0)
    shared = nn.Sequential(nn.Linear(256, 256), nn.Tanh())
    blocks = [shared] * 4 + [nn.Linear(256, 10)]
    for p in {id(p): p for b in blocks for p in b.parameters()}.values():
        p.grad = torch.zeros_like(p)
    model = scheduler.wrap(blocks, 1 << 30, planner="mimose", samples=3)

    def step(n: int) -> None:
        model(torch.randn(n, 256)).square().mean().backward()

    for n in (8, 12, 16, 16):
        step(n)
    assert model.mimose.extra_bw_tmp == shared_grad_bytes(blocks)
    real = cpu_peak(lambda: step(16))
    assert real <= model.last_plan.predicted_peak, (real, model.last_plan.predicted_peak)
