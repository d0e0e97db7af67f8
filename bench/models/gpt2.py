"""A GPT-2-style decoder (Radford et al. 2019; the layout of Hugging Face's ``GPT2LMHeadModel``).

Parameter shapes follow GPT-2 exactly: ``Conv1D`` weights stored ``(in, out)``, fused ``c_attn``,
learned position embeddings, pre-LN blocks, a final LayerNorm and an LM head tied to the token
embedding (GPT-2 small: 124,439,808 parameters). Attention is written out (scores, causal mask,
softmax, dropout, weighted sum) as in GPT-2's reference code, so its memory grows with the square
of the sequence length, as the papers' models do.

Chain stages: embeddings (tokens + positions + dropout), one stage per transformer block, then
LayerNorm + LM head. The input is token ids ``(batch, seq_len)``, int64.
"""
from __future__ import annotations

import math
from typing import List, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import ZooModel, check_positive, on_device


class Conv1D(nn.Module):
    """GPT-2's linear layer: ``y = x @ W + b`` with ``W`` of shape ``(nx, nf)``."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], self.nf)


class Embeddings(nn.Module):
    def __init__(self, vocab: int, n_positions: int, n_embd: int, dropout: float):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(n_positions, n_embd)
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[-1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(pos))


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.c_attn = Conv1D(3 * n_embd, n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(v.size(-1))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        w = torch.where(causal, w, torch.finfo(w.dtype).min)
        w = self.attn_dropout(F.softmax(w, dim=-1))
        y = torch.matmul(w, v).transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float):
        super().__init__()
        self.c_fc = Conv1D(4 * n_embd, n_embd)
        self.c_proj = Conv1D(n_embd, 4 * n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, eps: float = 1e-5):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=eps)
        self.attn = Attention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd, eps=eps)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final LayerNorm and the LM head, whose weight is the token embedding's (tied)."""

    def __init__(self, wte: nn.Embedding, n_embd: int, eps: float = 1e-5):
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, eps=eps)
        self.weight = wte.weight  # the same Parameter: GPT-2 ties input and output embeddings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln_f(x), self.weight)


def gpt2(batch: int = 1, seq_len: int = 1024, n_layer: int = 12, n_embd: int = 768, n_head: int = 12,
         vocab: int = 50257, n_positions: int = 1024, dropout: float = 0.1,
         device: Union[str, torch.device, None] = None) -> ZooModel:
    """GPT-2 (defaults: small, 124M). Medium: ``n_layer=24, n_embd=1024, n_head=16``; large:
    ``36, 1280, 20``. ``n_positions`` grows to ``seq_len`` when that is longer."""
    check_positive(batch=batch, seq_len=seq_len, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                   vocab=vocab, n_positions=n_positions)
    if n_embd % n_head:
        raise ValueError(f"n_head: must divide n_embd={n_embd}, got {n_head}")
    with on_device(device):
        emb = Embeddings(vocab, max(n_positions, seq_len), n_embd, dropout)
        blocks: List[nn.Module] = [emb]
        blocks += [Block(n_embd, n_head, dropout) for _ in range(n_layer)]
        blocks.append(Head(emb.wte, n_embd))
    return ZooModel(blocks, (batch, seq_len), name="gpt2", input_dtype=torch.long, vocab=vocab)
