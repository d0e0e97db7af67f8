"""Small models and helpers shared by the chain-runtime and Mimose tests."""
from __future__ import annotations

import copy
import random
from typing import Any, Callable, List, Sequence, Tuple

import pytest
import torch
from torch import nn

from scheduler.plan import Plan
from scheduler.planners import rotor
from scheduler.planners.mimose import plan_from_checkpoints


class ResidualMLP(nn.Module):
    """Linear + tanh + dropout with a skip: a block whose input is used twice."""

    def __init__(self, d: int, p: float = 0.25):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x))) + x


class Attention(nn.Module):
    """Single-head self-attention block with a padding mask passed along: memory grows with
    seq_len^2 (the scores and their softmax), the case Mimose's quadratic fit is for."""

    def __init__(self, d: int, p: float = 0.1):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.drop = nn.Dropout(p)
        self.norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~mask[:, None, :], -1e4)
        att = self.drop(torch.softmax(scores, dim=-1))
        return self.norm(h + self.out(att @ v)), mask


class Embed(nn.Module):
    """Token ids (no gradient) -> hidden states, plus the mask for the next blocks."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)

    def forward(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.emb(ids), ids != 0


class Head(nn.Module):
    def __init__(self, d: int, n: int):
        super().__init__()
        self.lin = nn.Linear(d, n)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(h)


class ConvBN(nn.Module):
    """Conv + batch norm (running statistics must be updated once per step) + relu."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x))) + x


def mlp_blocks(L: int = 4, d: int = 16, seed: int = 0) -> List[nn.Module]:
    torch.manual_seed(seed)
    return [ResidualMLP(d) for _ in range(L)]


def transformer_blocks(layers: int = 3, d: int = 16, vocab: int = 50, seed: int = 0) -> List[nn.Module]:
    torch.manual_seed(seed)
    return [Embed(vocab, d)] + [Attention(d) for _ in range(layers)] + [Head(d, vocab)]


def token_batch(batch: int, seq: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    ids[:, seq - max(1, seq // 4):] = 0  # padding at the end
    return ids


def every_block(chain: Any, budget: Any) -> Plan:
    """A ``planner=`` callable: every block checkpointed, recomputed in the backward."""
    return plan_from_checkpoints(chain.L, range(chain.L), planner="test")


def tight_rotor(chain: Any, budget: Any) -> Plan:
    """A ``planner=`` callable: rotor's plan at its least memory (some blocks recomputed)."""
    return rotor.solve(chain, rotor.min_memory(chain, slots=500, memory=chain.fw_tmp[0] + 1))


class ListNet(nn.Module):
    """Blocks in a ``ModuleList``, called in a loop (what ``scheduler.checkpoint`` finds)."""

    def __init__(self, blocks: Sequence[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class TorchCheckpointedNet(ListNet):
    """The same under PyTorch's own ``checkpoint`` (non-reentrant), for the failures it has."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return x


def loss_of(out: Any) -> torch.Tensor:
    out = out[0] if isinstance(out, tuple) else out
    return out.float().square().mean()


def plain_step(blocks: Sequence[nn.Module], args: Tuple[Any, ...], seed: int = 1):
    """Loss and parameter gradients of plain training (no plan)."""
    torch.manual_seed(seed)
    value: Any = args if len(args) > 1 else args[0]
    for b in blocks:
        value = b(*value) if isinstance(value, tuple) else b(value)
    loss = loss_of(value)
    loss.backward()
    return loss.detach(), [p.grad.clone() for b in blocks for p in b.parameters()]


def wrapped_step(model: nn.Module, args: Tuple[Any, ...], seed: int = 1):
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = loss_of(model(*args))
    loss.backward()
    return loss.detach(), [p.grad.clone() for b in model.blocks for p in b.parameters()]


def twins(make: Callable[[], List[nn.Module]]) -> Tuple[List[nn.Module], List[nn.Module]]:
    blocks = make()
    return blocks, copy.deepcopy(blocks)


def random_rotor_plan(L: int, rng: random.Random) -> Plan:
    """A random valid persistent schedule with the structure of rotor's (seed 002 Algorithm 2):
    on [s, t] either ``F_all s, [s+1, t], B s`` or ``F_ck s, F_none s+1..s'-1, [s', t], [s, s'-1]``.
    Stage L is the loss."""
    def rec(s: int, t: int) -> List[Tuple[str, int]]:
        if s == t:
            return [("F_all", s), ("B", s)]
        if rng.random() < 0.4:
            return [("F_all", s)] + rec(s + 1, t) + [("B", s)]
        sp = rng.randint(s + 1, t)
        return ([("F_ck", s)] + [("F_none", k) for k in range(s + 1, sp)] + rec(sp, t) +
                rec(s, sp - 1))
    return Plan(rec(0, L), planner="random")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tests run tiny ops: one intra-op thread avoids spin-waiting on a busy machine
    (15x faster here), and results do not depend on it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
