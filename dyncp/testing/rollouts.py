"""A toy GRPO rollout generator: variable-length sequences per prompt group (examples, benches).

Assumptions (stated, not measured here; every one is a field so that a bench can sweep it):

* A step samples ``prompts`` prompts and ``group_size`` rollouts per prompt (GRPO compares the
  rollouts of one prompt; DAPO, arXiv:2503.14476, uses 512 prompts x 16 rollouts and caps
  generation at 20,480 tokens; 16,384 is a common cap in verl GRPO recipes).
* Prompt tokens are uniform in ``prompt_tokens`` (math and code prompts are short).
* Response lengths are long-tailed and correlated within a group: a prompt's median response is
  ``median_response * exp(N(0, prompt_sigma))`` (hard prompts make every rollout long) and each
  rollout is that median times ``exp(N(0, within_sigma))`` (the intra-prompt long tail reported
  by DARTS, arXiv:2605.30859). Log-normal is an assumption, not a fit.
* Generation stops at ``max_response`` tokens, so the cap collects the tail's mass (truncated
  rollouts), as it does in RL training when responses grow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RolloutLengths"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutLengths:
    """Draws one step's rollouts: ids ``prompt * group_size + k`` and prompt + response lengths."""

    prompts: int = 64
    group_size: int = 8
    prompt_tokens: tuple[int, int] = (64, 512)
    median_response: int = 4096
    prompt_sigma: float = 0.6
    within_sigma: float = 0.5
    max_response: int = 16384

    def __post_init__(self) -> None:
        lo, hi = self.prompt_tokens
        if self.prompts < 1 or self.group_size < 1:
            raise ValueError(
                f"prompts and group_size must be >= 1, got {self.prompts}, {self.group_size}"
            )
        if not 1 <= lo <= hi:
            raise ValueError(f"prompt_tokens must be (lo, hi) with 1 <= lo <= hi, got {lo, hi}")
        if not 1 <= self.median_response <= self.max_response:
            raise ValueError("median_response must be in [1, max_response]")
        if self.prompt_sigma < 0 or self.within_sigma < 0:
            raise ValueError("prompt_sigma and within_sigma must be >= 0")

    @property
    def max_length(self) -> int:
        """The longest sequence a step can hold (longest prompt + the response cap)."""
        return self.prompt_tokens[1] + self.max_response

    def draw(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(ids, lengths) of one step, in prompt-group order."""
        ids, prompt, response = self.draw_parts(rng)
        return ids, prompt + response

    def draw_parts(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, prompt tokens, response tokens) of one step; ``response == max_response`` marks
        a rollout cut at the cap."""
        p, g = self.prompts, self.group_size
        prompt = rng.integers(self.prompt_tokens[0], self.prompt_tokens[1] + 1, p)
        median = self.median_response * np.exp(rng.normal(0.0, self.prompt_sigma, p))
        response = np.repeat(median, g) * np.exp(rng.normal(0.0, self.within_sigma, p * g))
        response = np.clip(np.round(response), 1, self.max_response).astype(np.int64)
        return np.arange(p * g, dtype=np.int64), np.repeat(prompt, g), response
