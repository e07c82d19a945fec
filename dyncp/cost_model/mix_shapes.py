"""Models as layer mixes: which mixer and which MLP each layer runs, and the GEMM precision.

A :class:`LayerMixShape` extends a :class:`DecoderShape` (which keeps the attention geometry,
vocabulary and dtype) with how many layers run full attention, sliding-window attention, a
Mamba-2-style SSM mixer (alone or in parallel with attention, as in Falcon-H1), a dense or MoE
MLP, and whether GEMMs run in bf16 or fp8. ``dyncp.cost_model.mix_reference`` turns one into a
profile with a ``layer_mix`` section.

Named shapes are "-like": their numbers come from the cited model cards and configs; whatever a
source does not give is marked as assumed in ``source``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dyncp.cost_model.shapes import FFN_KINDS, SHAPES, DecoderShape, ShapeError

__all__ = ["GEMM_DTYPES", "LayerMixShape", "MIX_SHAPES"]

GEMM_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerMixShape:
    """A decoder whose layers mix attention, sliding-window attention, SSM and MoE.

    Args:
        base: attention geometry, dense FFN, vocabulary (``base.num_layers`` is the depth).
        full_attention_layers / window_layers: layers with full causal / sliding-window
            attention of ``window`` keys.
        ssm_layers: layers with a Mamba-2 mixer of ``ssm_heads`` x ``ssm_head_dim`` channels,
            state size ``ssm_state`` and ``ssm_groups`` B/C groups; a layer may hold both.
        mlp_layers: layers with an MLP (Nemotron-H interleaves MLP-only layers).
        moe_experts / moe_top_k / moe_ffn_hidden_size: MoE MLP (SwiGLU experts) when > 0.
        gemm_dtype: ``bf16`` or ``fp8`` GEMMs (attention and the scan stay bf16).
    """

    base: DecoderShape
    full_attention_layers: int
    window_layers: int = 0
    window: int = 0
    ssm_layers: int = 0
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_state: int = 0
    ssm_groups: int = 1
    mlp_layers: int | None = None
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    gemm_dtype: str = "bf16"

    def __post_init__(self) -> None:
        depth = self.base.num_layers
        if self.full_attention_layers + self.window_layers > depth or self.ssm_layers > depth:
            raise ShapeError(
                f"{self.name}: {self.full_attention_layers} full + {self.window_layers} window "
                f"attention and {self.ssm_layers} SSM layers do not fit {depth} layers"
            )
        if self.window_layers and self.window < 1:
            raise ShapeError(f"{self.name}: window_layers need window >= 1, got {self.window}")
        if self.ssm_layers and min(self.ssm_heads, self.ssm_head_dim, self.ssm_state) < 1:
            raise ShapeError(f"{self.name}: SSM layers need ssm_heads, ssm_head_dim, ssm_state")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ShapeError(
                f"{self.name}: moe_top_k must be in 1..moe_experts={self.moe_experts}, "
                f"got {self.moe_top_k}"
            )
        if self.gemm_dtype not in GEMM_DTYPES:
            raise ShapeError(
                f"{self.name}: gemm_dtype {self.gemm_dtype!r}; allowed: {', '.join(GEMM_DTYPES)}"
            )

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def attention_layers(self) -> int:
        return self.full_attention_layers + self.window_layers

    @property
    def ssm_inner(self) -> int:
        return self.ssm_heads * self.ssm_head_dim

    @property
    def dense_gemm_params(self) -> int:
        """Weights every token meets in dense GEMMs: attention and SSM projections, dense MLPs,
        the MoE router and the output layer (MoE experts are counted in ``expert_params``)."""
        b = self.base
        q = b.num_heads * b.head_dim
        attention = b.hidden_size * (q + 2 * b.num_kv_heads * b.head_dim) + q * b.hidden_size
        ssm_in = 2 * self.ssm_inner + 2 * self.ssm_groups * self.ssm_state + self.ssm_heads
        ssm = b.hidden_size * ssm_in + self.ssm_inner * b.hidden_size
        mlp_layers = b.num_layers if self.mlp_layers is None else self.mlp_layers
        if self.moe_experts:
            mlp = b.hidden_size * self.moe_experts  # router
        else:
            mlp = FFN_KINDS[b.ffn_kind] * b.hidden_size * b.ffn_hidden_size
        return (
            self.attention_layers * attention
            + self.ssm_layers * ssm
            + mlp_layers * mlp
            + b.hidden_size * b.vocab_size
        )

    @property
    def expert_params(self) -> int:
        """Active expert weights per token over all MoE layers (top-k SwiGLU experts)."""
        if not self.moe_experts:
            return 0
        mlp_layers = self.base.num_layers if self.mlp_layers is None else self.mlp_layers
        per_layer = self.moe_top_k * 3 * self.base.hidden_size * self.moe_ffn_hidden_size
        return mlp_layers * per_layer

    @property
    def moe_layers(self) -> int:
        if not self.moe_experts:
            return 0
        return self.base.num_layers if self.mlp_layers is None else self.mlp_layers

    @property
    def ssm_scan_flops_per_token(self) -> float:
        """Forward FLOPs per token of one chunked SSD scan (Mamba-2, chunk of 256 tokens):
        intra-chunk ``C B^T`` and its product with X, plus the chunk-state in/out products."""
        chunk = 256
        heads, p, n, g = self.ssm_heads, self.ssm_head_dim, self.ssm_state, self.ssm_groups
        return 2.0 * chunk * n * g + 2.0 * chunk * p * heads + 4.0 * n * p * heads

    @property
    def ssm_chunk_state_bytes(self) -> float:
        """One chunk's fp32 summary: the state (heads x head_dim x state), a decay per head."""
        return 4.0 * (self.ssm_heads * self.ssm_head_dim * self.ssm_state + self.ssm_heads)

    @property
    def ssm_all_to_all_bytes_per_token(self) -> float:
        """bf16 bytes per token to and from channel parallelism: x, B, C, dt in, y out."""
        inputs = 2 * self.ssm_inner + 2 * self.ssm_groups * self.ssm_state + self.ssm_heads
        return 2.0 * (inputs + self.ssm_inner)


_LLAMA = SHAPES["llama3-8b"]

MIX_SHAPES: dict[str, LayerMixShape] = {
    "llama3-8b": LayerMixShape(base=_LLAMA, full_attention_layers=_LLAMA.num_layers),
    "falcon-h1-7b": LayerMixShape(
        base=DecoderShape(
            name="falcon-h1-7b-like",
            num_layers=44,
            hidden_size=3072,
            num_heads=12,
            num_kv_heads=2,
            head_dim=128,
            ffn_hidden_size=12288,
            ffn_kind="swiglu",
            vocab_size=130048,
            source="Falcon-H1 model table (Hugging Face transformers FalconH1 docs): 44 layers, "
            "dim 3072, 12 attention heads, 2 KV, 24 Mamba heads, head dims 128/128, d_state 256, "
            "attention and Mamba in parallel in every layer; assumed: FFN 12288 (4x dim, "
            "SwiGLU), 1 B/C group, vocabulary 130048",
        ),
        full_attention_layers=44,
        ssm_layers=44,
        ssm_heads=24,
        ssm_head_dim=128,
        ssm_state=256,
        ssm_groups=1,
    ),
    "nemotron-h-8b": LayerMixShape(
        base=DecoderShape(
            name="nemotron-h-8b-like",
            num_layers=52,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            ffn_hidden_size=21504,
            ffn_kind="gelu",
            vocab_size=131072,
            source="Nemotron-H paper (arXiv 2504.03624) and Megatron-Bridge docs: 52 layers "
            "(24 Mamba-2, 24 MLP, 4 attention), dim 4096, 32 heads, 8 KV, head dim 128, FFN "
            "21504 (squared ReLU: 2 GEMMs), 128 Mamba heads x 64, state 128, 8 groups "
            "(in_proj 18560 wide), vocabulary 131072; FP8 GEMMs as in its FP8 training recipe",
        ),
        full_attention_layers=4,
        ssm_layers=24,
        ssm_heads=128,
        ssm_head_dim=64,
        ssm_state=128,
        ssm_groups=8,
        mlp_layers=24,
        gemm_dtype="fp8",
    ),
    "gpt-oss-20b": LayerMixShape(
        base=DecoderShape(
            name="gpt-oss-20b-like",
            num_layers=24,
            hidden_size=2880,
            num_heads=64,
            num_kv_heads=8,
            head_dim=64,
            ffn_hidden_size=2880,
            ffn_kind="swiglu",
            vocab_size=201088,
            source="openai/gpt-oss-20b config: 24 layers alternating sliding (window 128) and "
            "full attention, dim 2880, 64 heads, 8 KV, head dim 64, 32 experts, top-4, expert "
            "FFN 2880 (SwiGLU), vocabulary 201088; bf16 GEMMs assumed for training (the "
            "released MXFP4 weights are a serving format); attention sinks not modelled",
        ),
        full_attention_layers=12,
        window_layers=12,
        window=128,
        moe_experts=32,
        moe_top_k=4,
        moe_ffn_hidden_size=2880,
    ),
}
