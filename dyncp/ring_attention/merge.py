"""Merging the partial results of ring steps with the stable log-sum-exp update.

Two partial attentions of the same queries over disjoint key sets, ``(out_a, lse_a)`` and
``(out_b, lse_b)``, combine exactly into ``lse = log(e^lse_a + e^lse_b)`` and
``out = (e^lse_a out_a + e^lse_b out_b) / e^lse``. Written with sigmoids::

    out = out_a - sigmoid(lse_b - lse_a) * (out_a - out_b)
    lse = lse_b - logsigmoid(lse_b - lse_a)

no exponential of a large lse is ever formed, and the empty accumulator (``lse_a = -inf``,
``out_a = 0``) needs no special case: the weight is sigmoid(+inf) = 1 and the lse becomes lse_b.
A block whose lse is ``-inf`` (a row that saw no key) leaves the accumulator unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["merge_block"]


def merge_block(
    out: torch.Tensor,
    lse: torch.Tensor,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one block into the accumulator and return the new ``(out, lse)``.

    Args:
        out: accumulated output ``(T, H, D)`` in the accumulation dtype (float32 or float64).
        lse: accumulated log-sum-exp ``(T, H)``, same dtype; ``-inf`` where nothing is merged yet.
        block_out: the block's output ``(T, H, D)``, any float dtype (upcast here).
        block_lse: the block's log-sum-exp ``(T, H)``.

    Returns:
        The merged ``(out, lse)`` in the dtype of ``out`` / ``lse``.
    """
    block_out = block_out.to(out.dtype)
    block_lse = block_lse.to(lse.dtype)
    seen = block_lse > -math.inf
    diff = block_lse - lse
    new_out = out - torch.sigmoid(diff).unsqueeze(-1) * (out - block_out)
    new_out = torch.where(seen.unsqueeze(-1), new_out, out)
    new_lse = torch.where(seen, block_lse - F.logsigmoid(diff), lse)
    return new_out, new_lse
