"""Attention kernels' tile sizes, read from their source: what a tiny ring chunk really costs.

A flash-attention kernel runs a (block_q x block_kv) tile of queries against keys per thread
block; a sequence of n tokens is cut into ceil(n / block) tiles along each dimension, and a
causal one runs only the tiles on or below the diagonal. A tile is paid in full whatever part of
it holds real tokens, so a 128-token sequence at CP 4 (two 16-token zigzag pieces per rank,
``p / c`` = 32 tokens a ring step) pays the tiles of a whole block.

The block sizes below are read from the kernels' source, for head dimension 128 in bf16/fp16
(the shape every bundled GPU profile prices), not fitted to any timing:

- ``fa3-sm90``: FlashAttention 3 (Hopper). Forward: ``tile_size_fwd_sm90`` returns
  ``{128, use_blockN_128 ? 128 : 176}`` with ``use_blockN_128 = is_causal || is_local ||
  paged_kv_non_TMA`` for 2-byte types and ``headdim <= 128`` (hopper/tile_size.h, lines 31-33);
  backward: ``run_mha_bwd_hdim128`` dispatches ``kBlockM = 64, kBlockN = 128`` for
  ``Arch >= 90`` when causal (hopper/flash_bwd_launch_template.h, lines 347-351).
- ``fa2-sm80``: FlashAttention 2 on A100 (sm80) and, through the same code path, H100.
  Forward: ``run_mha_fwd_hdim128`` uses ``Flash_fwd_kernel_traits<128, 128, 64, 4>`` (kBlockM
  128, kBlockN 64) when not sm86/sm89 and without dropout
  (csrc/flash_attn/src/flash_fwd_launch_template.h, lines 247-262); backward:
  ``run_mha_bwd_hdim128`` uses ``Flash_bwd_kernel_traits<128, 64, 128, ...>`` (kBlockM 64,
  kBlockN 128) where the GPU offers >= 144 KB of shared memory per block, as A100 and H100 do
  (csrc/flash_attn/src/flash_bwd_launch_template.h, lines 231-248).

  Both: Dao-AILab/flash-attention, commit 0251105a2fb19d2957484b7f023cd8c115286ced.
- ``sdpa-cpu``: torch's CPU flash attention (``at::native::cpu_flash_attention``,
  aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, pytorch/pytorch commit
  008ec6b1840c94ff6d0f685bc10fbf585167c673). The dispatch ``flash_attention_kernel_impl`` /
  ``flash_attention_backward_kernel_impl`` picks q_split_size 256 for q length >= 768, 64 for
  >= 192, else 32, and kv_split_size 512 (the entry records the largest); but the forward kernel
  clamps both to the sequence (``qSplitSize = q_split_size > qSize ? qSize : q_split_size``,
  likewise kv) and runs the tail block at its real size. It pads no work, so it quantises
  nothing: a short chunk costs its own length (``pads`` False).

Head dimensions other than 128 were not read and are refused rather than guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["KernelTiles", "KERNELS", "kernel_tiles", "tile_length"]


@dataclass(frozen=True, slots=True)
class KernelTiles:
    """One kernel's (block_q, block_kv) tiles, forward and backward, with where they are read."""

    kernel: str
    forward_block_q: int
    forward_block_kv: int
    backward_block_q: int
    backward_block_kv: int
    pads: bool  # whether a partial tile costs a whole one (GPU flash attention: yes)
    source: str


_FA = "Dao-AILab/flash-attention@0251105a2fb19d2957484b7f023cd8c115286ced"
_TORCH = (
    "pytorch/pytorch@008ec6b1840c94ff6d0f685bc10fbf585167c673 "
    "aten/src/ATen/native/cpu/FlashAttentionKernel.cpp"
)

#: Per kernel name, per head dimension: the tiles read from the kernel's source.
KERNELS: dict[str, dict[int, KernelTiles]] = {
    "fa3-sm90": {
        128: KernelTiles(
            kernel="fa3-sm90",
            forward_block_q=128,
            forward_block_kv=128,
            backward_block_q=64,
            backward_block_kv=128,
            pads=True,
            source=f"{_FA}: hopper/tile_size.h:31-33 (tile_size_fwd_sm90, causal: 128 x 128); "
            "hopper/flash_bwd_launch_template.h:347-351 (run_mha_bwd_hdim128, Arch >= 90, "
            "causal: 64 x 128)",
        )
    },
    "fa2-sm80": {
        128: KernelTiles(
            kernel="fa2-sm80",
            forward_block_q=128,
            forward_block_kv=64,
            backward_block_q=64,
            backward_block_kv=128,
            pads=True,
            source=f"{_FA}: csrc/flash_attn/src/flash_fwd_launch_template.h:247-262 "
            "(run_mha_fwd_hdim128: Flash_fwd_kernel_traits<128, 128, 64, 4>); "
            "csrc/flash_attn/src/flash_bwd_launch_template.h:231-248 (run_mha_bwd_hdim128, "
            ">= 144 KB smem: Flash_bwd_kernel_traits<128, 64, 128, ...>)",
        )
    },
    "sdpa-cpu": {
        128: KernelTiles(
            kernel="sdpa-cpu",
            forward_block_q=256,
            forward_block_kv=512,
            backward_block_q=256,
            backward_block_kv=512,
            pads=False,
            source=f"{_TORCH}: flash_attention_kernel_impl / flash_attention_backward_kernel_impl "
            "(q split 256 / 64 / 32 by q length, kv split 512); cpu_flash_attention clamps "
            "both splits to the sequence, so no work is padded",
        )
    },
}


def kernel_tiles(kernel: str, head_dim: int) -> KernelTiles:
    """The tiles of ``kernel`` at ``head_dim``; a ValueError naming what was read otherwise."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; read from source: {', '.join(KERNELS)}")
    by_dim = KERNELS[kernel]
    if head_dim not in by_dim:
        raise ValueError(
            f"kernel {kernel!r}: tiles read for head dim {sorted(by_dim)} only, not {head_dim}"
        )
    return by_dim[head_dim]


def tile_length(n: np.ndarray | float, block_q: int, block_kv: int) -> np.ndarray:
    """The causal length whose tiles cost what a causal chunk of ``n`` tokens pays.

    The kernel pads the chunk to ``ceil(n / block_q)`` query tiles and ``ceil(n / block_kv)``
    key tiles; its work is that padded rectangle's, which a causal block of side
    ``sqrt(padded_q x padded_kv)`` matches. With square tiles this is ``ceil(n / block) x
    block``, the causal tiles on and below the diagonal exactly; ``n`` a multiple of both
    blocks is unchanged, and any chunk up to one tile costs one whole tile.
    """
    x = np.asarray(n, dtype=np.float64)
    q = np.ceil(x / block_q) * block_q
    kv = np.ceil(x / block_kv) * block_kv
    if block_q == block_kv:
        return q
    return np.sqrt(q * kv)
