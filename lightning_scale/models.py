"""A small GPT-like language model and synthetic token data, for the demo, tests and benchmarks.

minGPT-shaped: token and position embeddings, pre-LayerNorm blocks of causal
self-attention (``scaled_dot_product_attention``, as nanoGPT) and a GELU MLP, a tied-free head.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "GPTConfig", "synthetic_tokens"]


class GPTConfig:
    """Sizes of a ``GPT``."""

    def __init__(self, vocab: int = 256, seq: int = 64, layers: int = 4, dim: int = 128, heads: int = 4, dropout: float = 0.0) -> None:
        self.vocab, self.seq, self.layers, self.dim, self.heads, self.dropout = vocab, seq, layers, dim, heads, dropout


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-like language model: ``forward(idx)`` returns logits ``(B, T, vocab)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.tok(idx) + self.pos(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def synthetic_tokens(n: int, seq: int, vocab: int, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """Token sequences with learnable structure: each next token is a fixed function of the
    previous two, with 10% noise. Returns inputs and next-token targets, ``(n, seq)`` each."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(vocab, (vocab, vocab), generator=g)
    toks = torch.empty(n, seq + 1, dtype=torch.long)
    toks[:, :2] = torch.randint(vocab, (n, 2), generator=g)
    for t in range(2, seq + 1):
        toks[:, t] = table[toks[:, t - 2], toks[:, t - 1]]
        noise = torch.rand(n, generator=g) < 0.1
        toks[noise, t] = torch.randint(vocab, (int(noise.sum()),), generator=g)
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
