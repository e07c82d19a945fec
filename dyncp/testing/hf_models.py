"""Tiny transformers causal LMs built from configs (no weights downloaded), for tests and examples.

Two families with grouped-query attention and RoPE: Llama, and Qwen3 (which adds RMS norms on
each head's queries and keys). ``tiny_causal_lm`` gives the same weights on every call and in
every process (seeded initialisation), so ranks and a one-process reference hold one model.
Needs the ``hf`` extra.
"""

from __future__ import annotations

import torch
import transformers

__all__ = ["FAMILIES", "tiny_config", "tiny_causal_lm"]

FAMILIES = ("llama", "qwen3")


def tiny_config(
    family: str,
    *,
    vocab: int = 61,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    max_positions: int = 256,
    sliding_window: int | None = None,
) -> transformers.PretrainedConfig:
    """A small config of ``family`` (head_dim = hidden / heads, MLP width 2 x hidden).

    ``sliding_window`` (Qwen3 only): the first layer attends in full, the others within a causal
    window of that many tokens (Qwen3's ``use_sliding_window`` with ``max_window_layers=1``).

    Raises:
        ValueError: an unknown family, heads that do not divide the sizes, or a window for a
            family without one.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"heads ({heads}) must divide hidden ({hidden}) and kv_heads ({kv_heads}) heads"
        )
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
    )
    if family == "llama":
        if sliding_window is not None:
            raise ValueError("sliding_window is a Qwen3 option here; Llama has no window")
        return transformers.LlamaConfig(**common)
    if sliding_window is None:
        return transformers.Qwen3Config(**common, head_dim=hidden // heads)
    return transformers.Qwen3Config(
        **common,
        head_dim=hidden // heads,
        use_sliding_window=True,
        sliding_window=sliding_window,
        max_window_layers=1,
    )


def tiny_causal_lm(
    config: transformers.PretrainedConfig,
    attn_implementation: str,
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> torch.nn.Module:
    """The causal LM of ``config`` with seeded random weights, in ``dtype``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation
    )
    return model.to(dtype)
