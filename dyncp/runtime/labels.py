"""Next-token labels of a packed batch: the label rule every loss of dyncp uses.

A packed batch concatenates whole sequences; each token's label is the next token of its own
sequence, and a sequence's last token has none (``IGNORE``, the ``ignore_index`` of
``torch.nn.functional.cross_entropy``). Labels are built before sharding, so the zigzag shards of
a micro-batch carry the labels its unsharded sequences had (``MicroBatchContext.shard(labels,
pad_value=IGNORE)``). The Hugging Face integration, the Trainer, the profiler and the test
decoders all take them from here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["IGNORE", "next_token_labels"]

#: The label of a token that predicts nothing (a sequence's last token, padding).
IGNORE = -100


def next_token_labels(tokens: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor:
    """Labels of a packed batch: the next token inside each sequence, IGNORE at its last one."""
    labels = torch.full_like(tokens, IGNORE)
    start = 0
    for s in seqlens:
        labels[start : start + s - 1] = tokens[start + 1 : start + s]
        start += s
    return labels
