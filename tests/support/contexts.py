"""The one-process reference's micro-batch: a whole global batch at CP 1, as one context."""

from __future__ import annotations

from collections.abc import Sequence

from dyncp.ring_attention import make_ring_layout
from dyncp.runtime import MicroBatchContext


def whole_batch_context(lengths: Sequence[int]) -> MicroBatchContext:
    """Every sequence of the batch in one CP-1 micro-batch on one rank, weighted by
    ``1 / label tokens`` (s - 1 per sequence): its loss is the global batch's mean token loss,
    what a dyncp plan's micro-batches sum to over the ranks."""
    lengths = tuple(int(s) for s in lengths)
    return MicroBatchContext(
        step_wave=0,
        group_start=0,
        cp=1,
        rank_in_group=0,
        seq_ids=tuple(range(len(lengths))),
        sample_ids=None,
        seqlens=lengths,
        layout=make_ring_layout(seqlens=lengths, cp=1),
        loss_scale=1.0 / sum(s - 1 for s in lengths),
    )
