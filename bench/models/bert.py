"""A BERT-style encoder (Devlin et al. 2019; the layout of Hugging Face's ``BertModel`` with a
sequence-classification head), for variable sequence lengths.

Parameter shapes follow BERT exactly (base: 12 layers, hidden 768, 12 heads, intermediate 3072,
vocab 30522, 512 positions, 2 token types; ``BertModel`` with pooler: 109,482,240 parameters).
Post-LN layers, explicit attention (memory quadratic in the sequence length, what Mimose's
estimator fits), GELU (erf).

The blocks do not depend on the sequence length: build once, feed ``(batch, L)`` token ids for
any ``L <= max_positions`` (``ZooModel.sample_input(shape=(batch, L))``); ``input_shape`` is just
the default. No padding mask: a batch is all one length (bucketed), as in Mimose's setting.

Chain stages: embeddings, one stage per encoder layer, then pooler + classifier.
"""
from __future__ import annotations

import math
from typing import List, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import ZooModel, check_positive, on_device


class Embeddings(nn.Module):
    def __init__(self, vocab: int, hidden: int, max_positions: int, type_vocab: int, dropout: float):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[-1]
        if T > self.position_embeddings.num_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_positions="
                             f"{self.position_embeddings.num_embeddings}")
        pos = torch.arange(T, device=ids.device)
        types = torch.zeros_like(ids)
        e = self.word_embeddings(ids) + self.token_type_embeddings(types) + self.position_embeddings(pos)
        return self.dropout(self.LayerNorm(e))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(dropout)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_out_dropout = nn.Dropout(dropout)
        self.attn_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.output = nn.Linear(intermediate, hidden)
        self.out_dropout = nn.Dropout(dropout)
        self.out_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        d = C // self.heads
        q, k, v = (lin(x).view(B, T, self.heads, d).transpose(1, 2)
                   for lin in (self.query, self.key, self.value))
        w = self.attn_dropout(F.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d), dim=-1))
        ctx = torch.matmul(w, v).transpose(1, 2).reshape(B, T, C)
        x = self.attn_norm(x + self.attn_out_dropout(self.attn_out(ctx)))
        h = F.gelu(self.intermediate(x))
        return self.out_norm(x + self.out_dropout(self.output(h)))


class Head(nn.Module):
    """BERT's pooler (dense + tanh on the first token) and a classifier."""

    def __init__(self, hidden: int, num_labels: int, dropout: float):
        super().__init__()
        self.pooler = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(torch.tanh(self.pooler(x[:, 0]))))


def bert(batch: int = 1, seq_len: int = 128, n_layer: int = 12, hidden: int = 768, heads: int = 12,
         intermediate: int = 3072, vocab: int = 30522, max_positions: int = 512, type_vocab: int = 2,
         num_labels: int = 2, dropout: float = 0.1,
         device: Union[str, torch.device, None] = None) -> ZooModel:
    """BERT (defaults: base). Large: ``n_layer=24, hidden=1024, heads=16, intermediate=4096``."""
    check_positive(batch=batch, seq_len=seq_len, n_layer=n_layer, hidden=hidden, heads=heads,
                   intermediate=intermediate, vocab=vocab, max_positions=max_positions,
                   type_vocab=type_vocab, num_labels=num_labels)
    if hidden % heads:
        raise ValueError(f"heads: must divide hidden={hidden}, got {heads}")
    if seq_len > max_positions:
        raise ValueError(f"seq_len: at most max_positions={max_positions}, got {seq_len}")
    with on_device(device):
        blocks: List[nn.Module] = [Embeddings(vocab, hidden, max_positions, type_vocab, dropout)]
        blocks += [Layer(hidden, heads, intermediate, dropout) for _ in range(n_layer)]
        blocks.append(Head(hidden, num_labels, dropout))
        for b in blocks:  # BERT's initialization (a no-op on the meta device)
            for m in b.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear):
                    nn.init.zeros_(m.bias)
    return ZooModel(blocks, (batch, seq_len), name="bert", input_dtype=torch.long, vocab=vocab)
