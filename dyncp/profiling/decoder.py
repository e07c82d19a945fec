"""The decoder the profiler measures: a small RoPE + GQA transformer on dyncp's ring attention.

A profile describes one model on one machine, so the profiler needs a model to run: this one
(``MODELS``: the shapes it can build). Small enough to run in fp64 on CPU, real enough that
its forward and backward are what training pays per token, per sequence and per ring step: the
same module runs a whole packed batch on one process (CP 1) or a zigzag shard of a micro-batch on
a ring. The tests and examples use it too, through ``dyncp.testing``, to prove that dynamic CP
trains exactly the model asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dyncp.ring_attention import RingLayout, ring_attention
from dyncp.runtime import IGNORE

__all__ = ["MODELS", "TinyConfig", "TinyDecoder", "rope"]


@dataclass(frozen=True, slots=True)
class TinyConfig:
    vocab: int = 97
    dim: int = 32
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    ffn: int = 64
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


#: Model shapes the profiler can build; "tiny" is the runtime tests' and the example's model.
MODELS = {
    "tiny": TinyConfig(vocab=256, dim=64, heads=4, kv_heads=2, layers=2, ffn=128),
}


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding of x (tokens, heads, head_dim) at integer positions (tokens,)."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=x.dtype, device=x.device) / half)
    angle = positions.to(x.dtype)[:, None] * freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class _Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kv = cfg.kv_heads * cfg.head_dim
        self.norm1 = nn.RMSNorm(cfg.dim)
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.kv = nn.Linear(cfg.dim, 2 * kv, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.norm2 = nn.RMSNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, layout: RingLayout, kernel: str
    ) -> torch.Tensor:
        cfg = self.cfg
        h = self.norm1(x)
        q = self.q(h).view(-1, cfg.heads, cfg.head_dim)
        k, v = self.kv(h).view(-1, 2, cfg.kv_heads, cfg.head_dim).unbind(1)
        q, k = rope(q, positions, cfg.rope_base), rope(k, positions, cfg.rope_base)
        a = ring_attention(q, k, v, layout, causal=True, kernel=kernel)
        x = x + self.o(a.reshape(-1, cfg.dim))
        return x + self.down(torch.nn.functional.silu(self.up(self.norm2(x))))


class TinyDecoder(nn.Module):
    """Embedding, ``layers`` pre-norm blocks (RoPE + GQA ring attention, SiLU MLP), LM head."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        layout: RingLayout,
        kernel: str = "math",
    ) -> torch.Tensor:
        """Logits (local tokens, vocab) of the packed (or zigzag-sharded) tokens."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, layout, kernel)
        return self.head(self.norm(x))

    def loss_sum(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        positions: torch.Tensor,
        layout: RingLayout,
        kernel: str = "math",
    ) -> torch.Tensor:
        """Summed next-token cross-entropy over the labelled tokens."""
        logits = self(tokens, positions, layout, kernel)
        return nn.functional.cross_entropy(
            logits.float() if logits.dtype == torch.float16 else logits,
            labels,
            ignore_index=IGNORE,
            reduction="sum",
        )
