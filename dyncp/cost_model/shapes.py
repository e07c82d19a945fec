"""Decoder model shapes: what a reference GPU profile needs to know about the model.

A shape is the handful of numbers that set a decoder layer's work and its ring traffic: layers,
hidden size, query and KV heads, head dim, FFN size and kind, vocabulary and dtype. The reference
builder (``dyncp.cost_model.reference``) turns one into a profile; the planner never sees it.

    shape = load_shape("megatron-dcp-gpt")           # a named shape
    shape = load_shape("my-model.json")              # or a JSON file with the same fields

Named shapes cite where their numbers come from (``source``), so a profile built from them can.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["DecoderShape", "ShapeError", "SHAPES", "load_shape", "FFN_KINDS"]

# Gated MLPs (SwiGLU, GeGLU) run three hidden x ffn GEMMs, plain ones (GELU, ReLU) two.
FFN_KINDS = {"swiglu": 3, "gelu": 2}


class ShapeError(ValueError):
    """A model shape is unknown, unreadable or inconsistent (the message names the field)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderShape:
    """A dense decoder-only transformer.

    Args:
        name: what profiles call the model.
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim: the attention stack.
        ffn_hidden_size: MLP inner size; ``ffn_kind`` ``swiglu`` (3 GEMMs) or ``gelu`` (2).
        vocab_size: output-layer width (its GEMM runs whether or not embeddings are tied).
        tied_embeddings: the output layer reuses the input embedding's weights, so they are
            trained (reduced, updated) once: it changes the step's parameter count, not its FLOPs.
        position_embeddings: rows of a learned absolute position table (0 for RoPE or none),
            parameters a token's GEMMs never multiply by.
        dtype_bytes: bytes per activation element (2 for bf16/fp16).
        source: where the numbers come from.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    ffn_kind: str
    vocab_size: int
    tied_embeddings: bool = False
    position_embeddings: int = 0
    dtype_bytes: int = 2
    source: str = "user-supplied"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name == "position_embeddings" else 1
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
                raise ShapeError(f"shape field {f.name!r} must be an integer, got {value!r}")
            if f.type == "int" and value < least:
                raise ShapeError(f"shape field {f.name!r} must be >= {least}, got {value}")
            if f.type == "bool" and not isinstance(value, bool):
                raise ShapeError(f"shape field {f.name!r} must be true or false, got {value!r}")
        if self.ffn_kind not in FFN_KINDS:
            raise ShapeError(
                f"shape field 'ffn_kind' is {self.ffn_kind!r}; allowed: {', '.join(FFN_KINDS)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ShapeError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def layer_gemm_params(self) -> int:
        """Weights one layer multiplies every token by: QKV, output projection and MLP."""
        q = self.num_heads * self.head_dim
        kv = 2 * self.num_kv_heads * self.head_dim
        mlp = FFN_KINDS[self.ffn_kind] * self.hidden_size * self.ffn_hidden_size
        return self.hidden_size * (q + kv) + q * self.hidden_size + mlp

    @property
    def gemm_params(self) -> int:
        """All GEMM weights a token meets: every layer plus the output layer (hidden x vocab)."""
        return self.num_layers * self.layer_gemm_params + self.hidden_size * self.vocab_size

    @property
    def parameters(self) -> int:
        """Weights a step reduces and updates: the GEMM weights, the input embedding unless the
        output layer shares it, and learned positions. Norms and biases are left out: under 0.1%
        of every named shape, and a shape does not say whether it has biases."""
        embedding = 0 if self.tied_embeddings else self.hidden_size * self.vocab_size
        return self.gemm_params + embedding + self.position_embeddings * self.hidden_size

    @property
    def linear_flops_per_token(self) -> float:
        """Forward + backward GEMM FLOPs per token: 2 (multiply-add) x 3 (fwd, two bwd GEMMs)."""
        return 6.0 * self.gemm_params

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of K and V per token per layer: what one ring step moves per local token."""
        return float(2 * self.num_kv_heads * self.head_dim * self.dtype_bytes)

    def profile_model(self) -> dict[str, Any]:
        """The ``model`` section of a profile (the schema's fields)."""
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "ffn_hidden_size": self.ffn_hidden_size,
            "vocab_size": self.vocab_size,
            "dtype_bytes": self.dtype_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "<dict>") -> DecoderShape:
        """Build from a mapping; unknown or missing fields give an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ShapeError(
                f"shape {origin}: unknown field(s) {', '.join(unknown)}; allowed: "
                f"{', '.join(sorted(known))}"
            )
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ShapeError(f"shape {origin}: missing field(s) {', '.join(missing)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SHAPES: dict[str, DecoderShape] = {
    "llama3-8b": DecoderShape(
        name="llama3-8b-like",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=14336,
        ffn_kind="swiglu",
        vocab_size=128256,
        source="Meta Llama 3 model card: 32 layers, hidden 4096, 32 heads, 8 KV heads, FFN "
        "14336 (SwiGLU), vocabulary 128256",
    ),
    "megatron-dcp-gpt": DecoderShape(
        name="megatron-dcp-gpt",
        num_layers=12,
        hidden_size=2048,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        ffn_hidden_size=8192,
        ffn_kind="gelu",
        vocab_size=131072,
        tied_embeddings=True,
        position_embeddings=8192,
        source="NVIDIA/Megatron-LM dev examples/dynamic_context_parallel/benchmark_dcp.sh "
        "defaults: 12 layers, hidden 2048, FFN 8192, 16 attention heads (no query groups: "
        "16 KV heads, head dim 2048/16), GPT MLP without --swiglu (GELU), NullTokenizer "
        "vocabulary 131072, bf16; embeddings tied and positions learned, Megatron-LM's "
        "defaults the script keeps (no --untie-embeddings-and-output-weights; "
        "--position-embedding-type learned_absolute, --max-position-embeddings 8192)",
    ),
}


def load_shape(name_or_path: str | Path) -> DecoderShape:
    """A named shape (``SHAPES``) or a JSON file holding ``DecoderShape``'s fields."""
    if str(name_or_path) in SHAPES:
        return SHAPES[str(name_or_path)]
    path = Path(name_or_path)
    if not path.exists():
        raise ShapeError(
            f"model {str(name_or_path)!r} is neither a named shape ({', '.join(SHAPES)}) nor a "
            "JSON file"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ShapeError(f"cannot read model shape {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ShapeError(f"model shape {path} must hold a JSON object of fields")
    return DecoderShape.from_dict(data, origin=str(path))
