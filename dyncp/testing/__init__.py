"""Helpers for testing dyncp with real models on CPU (used by the tests and the examples)."""

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
    "TinyConfig",
    "TinyDecoder",
    "microbatch_loss",
    "next_token_labels",
]
