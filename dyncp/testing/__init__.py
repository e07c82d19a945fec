"""Helpers for testing dyncp with real models on CPU (used by the tests and the examples)."""

from dyncp.testing.pipeline_model import TinyChunk, measured_steps, tiny_chunks
from dyncp.testing.tiny_model import (
    LossSum,
    ThroughDDP,
    TinyConfig,
    TinyDecoder,
    microbatch_loss,
    next_token_labels,
)

__all__ = [
    "LossSum",
    "ThroughDDP",
    "TinyChunk",
    "TinyConfig",
    "TinyDecoder",
    "measured_steps",
    "microbatch_loss",
    "tiny_chunks",
    "next_token_labels",
]
