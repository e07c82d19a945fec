"""What the Trainer tests share: their documents (random tokens, every third with a masked
'prompt') and the environment torchrun would give a rank."""

from __future__ import annotations

import os

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


def torchrun_env(rank: int, world: int, port: int) -> None:
    """Set what torchrun would set for ``rank`` of ``world`` on this host (the Trainer's
    accelerate reads it), the rendezvous on ``port``."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
