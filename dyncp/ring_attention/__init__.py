"""Varlen zigzag ring attention for micro-batches whose CP size changes from one to the next.

Usage on each rank of a ring (the runtime does this once per micro-batch)::

    layout = make_ring_layout(seqlens=lengths, cp=4, group=group)      # group: ProcessGroup
    q_local = zigzag_shard(q_packed, seqlens=lengths, cp=4, rank=layout.rank)   # same for k, v
    out_local = ring_attention(q_local, k_local, v_local, layout, causal=True)

Modules: ``layout`` (RingLayout), ``sharding`` (zigzag pad/split/unsplit, positions),
``steps`` (the zigzag causal schedule), ``block`` (the kernel interface), ``math_kernel`` /
``sdpa_kernel`` / ``flash_kernel`` (block kernels), ``kernels`` (choosing one), ``merge`` (the
log-sum-exp update), ``comm`` (ring send/recv), ``ring`` (the autograd Function), ``window``
(sliding-window causal attention that skips ring steps outside the window), ``hybrid``
(HybridLayout: heads exchanged by all-to-all over u ranks around a ring of r = cp / u),
``autocast`` (under torch.autocast: inputs cast to its dtype as for SDPA, math with it off).
"""

from dyncp.ring_attention.block import BlockKernel, BlockSpec
from dyncp.ring_attention.flash_kernel import FlashAttnKernel
from dyncp.ring_attention.hybrid import HybridLayout, make_hybrid_layout
from dyncp.ring_attention.kernels import (
    KERNEL_NAMES,
    KernelFallbackWarning,
    make_kernel,
    select_kernel,
)
from dyncp.ring_attention.layout import RingLayout, make_ring_layout
from dyncp.ring_attention.math_kernel import MathKernel
from dyncp.ring_attention.merge import merge_block
from dyncp.ring_attention.ring import ring_attention
from dyncp.ring_attention.sdpa_kernel import SdpaKernel
from dyncp.ring_attention.sharding import (
    zigzag_positions,
    zigzag_shard,
    zigzag_token_index,
    zigzag_unshard,
)
from dyncp.ring_attention.window import WindowPlan, window_plan

__all__ = [
    "KERNEL_NAMES",
    "BlockKernel",
    "BlockSpec",
    "FlashAttnKernel",
    "HybridLayout",
    "KernelFallbackWarning",
    "MathKernel",
    "RingLayout",
    "SdpaKernel",
    "WindowPlan",
    "make_hybrid_layout",
    "make_kernel",
    "make_ring_layout",
    "merge_block",
    "ring_attention",
    "select_kernel",
    "window_plan",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_token_index",
    "zigzag_unshard",
]
