"""A small GPT-like language model and synthetic token data, for the demo, tests and benchmarks.

minGPT-shaped: token and position embeddings, pre-LayerNorm blocks of causal
self-attention (``scaled_dot_product_attention``, as nanoGPT) and a GELU MLP, a tied-free head.

``GPTConfig(unit_scaled=True)`` builds a unit-scaled variant (after Graphcore's unit
scaling, forward scales only): every weight is N(0, 1), every matmul output is scaled by
1/sqrt(fan_in) (``UnitLinear``) and every residual or embedding add ``a + b`` becomes
``(a + b) / sqrt(2)``, so unit-scale inputs give unit-scale outputs at any width. The
default (``unit_scaled=False``) is PyTorch's standard parametrisation, unchanged.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "GPTConfig", "UnitLinear", "synthetic_tokens"]


class GPTConfig:
    """Sizes of a ``GPT``; ``unit_scaled`` picks the unit-scaled parametrisation."""

    def __init__(
        self,
        vocab: int = 256,
        seq: int = 64,
        layers: int = 4,
        dim: int = 128,
        heads: int = 4,
        dropout: float = 0.0,
        unit_scaled: bool = False,
    ) -> None:
        self.vocab, self.seq, self.layers, self.dim, self.heads, self.dropout = vocab, seq, layers, dim, heads, dropout
        self.unit_scaled = unit_scaled

    def linear(self, fan_in: int, fan_out: int, bias: bool = True) -> nn.Linear:
        """A ``UnitLinear`` when unit-scaled, else an ``nn.Linear``."""
        return (UnitLinear if self.unit_scaled else nn.Linear)(fan_in, fan_out, bias=bias)

    def residual_scale(self) -> Optional[float]:
        """Factor of a sum of two unit-scale tensors (None: the plain sum)."""
        return 2**-0.5 if self.unit_scaled else None


class UnitLinear(nn.Linear):
    """``x W^T / sqrt(fan_in) + b`` with ``W ~ N(0, 1)`` and ``b = 0``.

    For an input of unit scale the output has unit scale at any ``fan_in``. The factor is
    applied to the weight (``W / sqrt(fan_in)``), so the ``linear`` node itself carries the
    output's scale.
    """

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight * self.in_features**-0.5, self.bias)


def _add(a: Tensor, b: Tensor, scale: Optional[float]) -> Tensor:
    return a + b if scale is None else (a + b) * scale


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = cfg.linear(cfg.dim, 3 * cfg.dim)
        self.proj = cfg.linear(cfg.dim, cfg.dim)
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
        self.fc1 = cfg.linear(cfg.dim, 4 * cfg.dim)
        self.fc2 = cfg.linear(4 * cfg.dim, cfg.dim)
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
        self.scale = cfg.residual_scale()

    def forward(self, x: Tensor) -> Tensor:
        x = _add(x, self.attn(self.ln1(x)), self.scale)
        return _add(x, self.mlp(self.ln2(x)), self.scale)


class GPT(nn.Module):
    """A GPT-like language model: ``forward(idx)`` returns logits ``(B, T, vocab)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = cfg.linear(cfg.dim, cfg.vocab, bias=False)
        self.scale = cfg.residual_scale()

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = _add(self.tok(idx), self.pos(pos), self.scale)  # (B, T, C)
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
