"""A tiny hybrid decoder: attention and an SSM mixer side by side in every layer (as Falcon-H1).

Each block adds, to the residual stream, ring attention (full causal, or a sliding window on the
layers listed in ``window_layers``) and a gated diagonal linear recurrence (``dyncp.ssm``), both
reading the same normalised input, then a SiLU MLP. The SSM's CP exchange is chunk-state
passing or all-to-all to channel parallelism (``ssm_exchange``). Small enough for fp64 on CPU;
under dynamic CP the same module runs a whole packed batch on one process or a zigzag shard on a
ring, and the gradients must agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dyncp.profiling import rope
from dyncp.ring_attention import RingLayout, ring_attention
from dyncp.runtime import IGNORE
from dyncp.ssm import channel_parallel_scan, diagonal_scan

__all__ = ["HybridConfig", "HybridDecoder"]


@dataclass(frozen=True, slots=True)
class HybridConfig:
    vocab: int = 97
    dim: int = 32
    heads: int = 4
    kv_heads: int = 2
    layers: int = 3
    ffn: int = 64
    ssm_channels: int = 16
    window: int = 5
    window_layers: tuple[int, ...] = (1,)
    ssm_exchange: str = "state"  # "state" (chunk states) or "all_to_all" (channel parallel)
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        bad = [i for i in self.window_layers if not 0 <= i < self.layers]
        if bad:
            raise ValueError(f"window_layers {bad} are not layer indices 0..{self.layers - 1}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.ssm_exchange not in ("state", "all_to_all"):
            raise ValueError(
                f"ssm_exchange must be 'state' or 'all_to_all', got {self.ssm_exchange!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


class _HybridBlock(nn.Module):
    def __init__(self, cfg: HybridConfig, *, window: int | None) -> None:
        super().__init__()
        self.cfg, self.window = cfg, window
        kv = cfg.kv_heads * cfg.head_dim
        self.norm1 = nn.RMSNorm(cfg.dim)
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.kv = nn.Linear(cfg.dim, 2 * kv, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.ssm_in = nn.Linear(cfg.dim, 2 * cfg.ssm_channels, bias=False)  # input and decay
        self.ssm_out = nn.Linear(cfg.ssm_channels, cfg.dim, bias=False)
        self.norm2 = nn.RMSNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, layout: RingLayout) -> torch.Tensor:
        cfg = self.cfg
        h = self.norm1(x)
        q = self.q(h).view(-1, cfg.heads, cfg.head_dim)
        k, v = self.kv(h).view(-1, 2, cfg.kv_heads, cfg.head_dim).unbind(1)
        q, k = rope(q, positions, cfg.rope_base), rope(k, positions, cfg.rope_base)
        a = ring_attention(q, k, v, layout, causal=True, kernel="math", window=self.window)
        u, g = self.ssm_in(h).chunk(2, dim=-1)
        scan = diagonal_scan if cfg.ssm_exchange == "state" else channel_parallel_scan
        s = scan(torch.sigmoid(g), u, layout)
        x = x + self.o(a.reshape(-1, cfg.dim)) + self.ssm_out(s)
        return x + self.down(torch.nn.functional.silu(self.up(self.norm2(x))))


class HybridDecoder(nn.Module):
    """Embedding, ``layers`` hybrid blocks (attention + SSM in parallel, SiLU MLP), LM head."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(
            _HybridBlock(cfg, window=cfg.window if i in cfg.window_layers else None)
            for i in range(cfg.layers)
        )
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, layout: RingLayout
    ) -> torch.Tensor:
        """Logits (local tokens, vocab) of the packed (or zigzag-sharded) tokens."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, layout)
        return self.head(self.norm(x))

    def loss_sum(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        positions: torch.Tensor,
        layout: RingLayout,
    ) -> torch.Tensor:
        """Summed next-token cross-entropy over the labelled tokens."""
        logits = self(tokens, positions, layout)
        return nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
