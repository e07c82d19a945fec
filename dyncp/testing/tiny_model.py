"""The tiny decoder as tests and examples drive it: its loss on a micro-batch, and through DDP.

The decoder itself (``TinyConfig``, ``TinyDecoder``) is the one the profiler measures and lives
in ``dyncp.profiling.decoder``; the label rule (``IGNORE``, ``next_token_labels``) is the
runtime's (``dyncp.runtime.labels``). Both are re-exported here, so tests and examples import
them from ``dyncp.testing`` as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dyncp.profiling import TinyConfig, TinyDecoder
from dyncp.runtime import IGNORE, next_token_labels

if TYPE_CHECKING:
    from dyncp.runtime import MicroBatchContext

__all__ = [
    "IGNORE",
    "LossSum",
    "ThroughDDP",
    "TinyConfig",
    "TinyDecoder",
    "microbatch_loss",
    "next_token_labels",
]


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
