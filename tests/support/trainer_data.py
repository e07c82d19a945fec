"""The documents the Trainer tests train on: random tokens, every third with a masked 'prompt'."""

from __future__ import annotations

import torch

VOCAB = 61


def masked_documents(n: int) -> list[dict]:
    """``n`` documents of 2..150 tokens; every third has its first half masked (a 'prompt')."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 150, (n,), generator=gen).tolist()
    rows = []
    for i, length in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
        row = {"input_ids": ids}
        if i % 3 == 0:
            row["labels"] = [-100] * (length // 2) + ids[length // 2 :]
        rows.append(row)
    return rows
