"""A tiny decoder-only transformer (RoPE, GQA, causal) whose attention is dyncp's ring attention.

Small enough to run in fp64 on CPU, real enough to prove that dynamic CP trains exactly the model
the user asked for: the same module runs a whole packed batch on one process (CP 1) or a zigzag
shard of a micro-batch on a ring, and the gradients must agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dyncp.ring_attention import RingLayout, ring_attention

if TYPE_CHECKING:
    from dyncp.runtime import MicroBatchContext

__all__ = [
    "LossSum",
    "ThroughDDP",
    "TinyConfig",
    "TinyDecoder",
    "microbatch_loss",
    "next_token_labels",
]

IGNORE = -100


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


def next_token_labels(tokens: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor:
    """Labels of a packed batch: the next token inside each sequence, IGNORE at its last one."""
    labels = torch.full_like(tokens, IGNORE)
    start = 0
    for s in seqlens:
        labels[start : start + s - 1] = tokens[start + 1 : start + s]
        start += s
    return labels


def microbatch_loss(
    model: nn.Module, ctx: MicroBatchContext, packed: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """This rank's summed next-token loss of one micro-batch, times ``ctx.loss_scale``.

    ``packed`` holds the micro-batch's sequences in ``ctx.seq_ids`` order, unpadded; labels are
    shifted before sharding (the next token inside each sequence), tokens, labels and positions
    sharded with the micro-batch's zigzag layout and moved to the model's device. ``model`` is
    a ``TinyDecoder`` or any decoder with its ``loss_sum(tokens, labels, positions, layout,
    **kwargs)``; ``kwargs`` go to it (e.g. ``kernel="auto"``). The twin of
    ``dyncp.integrations.hf.causal_lm_loss`` for dyncp's test decoders.
    """
    device = next(model.parameters()).device
    labels = next_token_labels(packed, ctx.seqlens)
    loss = model.loss_sum(
        ctx.shard(packed).to(device),
        ctx.shard(labels, pad_value=IGNORE).to(device),
        ctx.positions().to(device),
        ctx.layout,
        **kwargs,
    )
    return loss * ctx.loss_scale


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
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
        q, k = _rope(q, positions, cfg.rope_base), _rope(k, positions, cfg.rope_base)
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


class LossSum(nn.Module):
    """What DDP wraps for the tiny decoder: its forward is the decoder's summed loss (DDP hooks
    the gradients of what its forward computes)."""

    def __init__(self, inner: TinyDecoder) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.loss_sum(*args, **kwargs)


class ThroughDDP:
    """``microbatch_loss``'s view of a DDP-wrapped :class:`LossSum` (its loss goes through
    DDP's forward)."""

    def __init__(self, ddp: nn.Module) -> None:
        self.ddp = ddp

    def loss_sum(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.ddp(*args, **kwargs)

    def parameters(self):  # noqa: ANN201 - what nn.Module.parameters returns
        return self.ddp.parameters()
