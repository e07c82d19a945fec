"""Replay a length distribution: admit documents, draw global batches, plan them with each policy.

Nothing here imports torch; a laptop replays a million documents in seconds per policy.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from dyncp.cost_model.evaluate import PlanCost, time_waves
from dyncp.cost_model.model import CostModel
from dyncp.plan import StepPlan
from dyncp.planner.improvement.head_split import layout_histogram
from dyncp.planner.planner import Planner

__all__ = [
    "OVERLONG_ACTIONS",
    "Admission",
    "plural",
    "admit",
    "batch_notes",
    "draw_batch_indices",
    "draw_batches",
    "PolicyRun",
    "replay",
    "SyntheticMeasurement",
    "synthetic_measurement",
]

OVERLONG_ACTIONS = ("skip", "truncate", "split")


@dataclass(frozen=True, slots=True)
class Admission:
    """What ``admit`` did to documents longer than ``max_length`` (never silent)."""

    max_length: int
    action: str
    overlong_documents: int
    overlong_tokens: int
    dropped_tokens: int
    admitted_documents: int

    def summary(self) -> str:
        """One sentence: how many documents were over ``max_length`` and what became of their
        tokens (``skip`` drops them all, ``truncate`` the part beyond, ``split`` none)."""
        n = self.overlong_documents
        if not n:
            return f"no document exceeds --max-length {self.max_length}"
        over = f"{plural(n, 'document')} longer than --max-length {self.max_length}"
        if self.action == "skip":
            return f"{over} skipped ({self.overlong_tokens:,} tokens dropped)"
        if self.action == "truncate":
            return (
                f"{over} truncated to it ({self.dropped_tokens:,} of their "
                f"{self.overlong_tokens:,} tokens dropped)"
            )
        return f"{over} split into pieces of at most {self.max_length} (no token dropped)"


def batch_notes(batches: list[np.ndarray], *, world: int) -> list[str]:
    """What a reader of the table should know about the batches drawn: the steps that hold the
    longest documents (they set the step time and the CP sizes), and a warning when steps hold
    fewer documents than there are ranks (most ranks then idle, whatever the policy)."""
    if not batches:
        return []
    longest = [int(np.max(b)) if len(b) else 0 for b in batches]
    top = sorted(range(len(batches)), key=lambda k: (-longest[k], k))[:3]
    notes = ["longest documents: " + ", ".join(f"{longest[k]:,} tokens (step {k})" for k in top)]
    mean = sum(len(b) for b in batches) / len(batches)
    if mean < world:
        notes.append(
            f"warning: {mean:.1f} documents per step on {world} ranks: most ranks have nothing "
            f"to run in any policy; raise --global-batch-tokens or --global-batch-size"
        )
    return notes


def plural(n: int, noun: str) -> str:
    """``1 document``, ``2 documents`` (with thousands separators)."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def admit(lengths: np.ndarray, max_length: int, action: str) -> tuple[np.ndarray, Admission]:
    """Apply the overlong-document policy; returns the admitted lengths and a report."""
    if action not in OVERLONG_ACTIONS:
        raise ValueError(f"overlong action {action!r}; choose one of {', '.join(OVERLONG_ACTIONS)}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    lengths = np.asarray(lengths, dtype=np.int64)
    over = lengths > max_length
    n_over = int(over.sum())
    over_tokens = int(lengths[over].sum())
    if action == "skip":
        out, dropped = lengths[~over], over_tokens
    elif action == "truncate":
        out, dropped = np.minimum(lengths, max_length), over_tokens - n_over * max_length
    else:
        pieces = []
        for s in lengths.tolist():
            full, tail = divmod(s, max_length) if s > max_length else (0, s)
            pieces.extend([max_length] * full + ([tail] if tail else []))
        out, dropped = np.asarray(pieces, dtype=np.int64), 0
    report = Admission(max_length, action, n_over, over_tokens, int(dropped), len(out))
    return out, report


def draw_batches(
    lengths: np.ndarray,
    *,
    steps: int,
    seed: int,
    global_batch_tokens: int | None = None,
    global_batch_size: int | None = None,
) -> Iterator[np.ndarray]:
    """The lengths of the batches :func:`draw_batch_indices` draws (same arguments)."""
    lengths = np.asarray(lengths)
    for ids in draw_batch_indices(
        lengths,
        steps=steps,
        seed=seed,
        global_batch_tokens=global_batch_tokens,
        global_batch_size=global_batch_size,
    ):
        yield lengths[ids].astype(np.int64)


def draw_batch_indices(
    lengths: np.ndarray,
    *,
    steps: int,
    seed: int,
    global_batch_tokens: int | None = None,
    global_batch_size: int | None = None,
) -> Iterator[np.ndarray]:
    """Global batches, as indices into ``lengths``, drawn from a seeded shuffle of the
    documents (reshuffled each epoch).

    With ``global_batch_tokens`` a batch takes documents until it holds at least that many tokens;
    with ``global_batch_size`` it takes that many documents. A batch never holds a document twice:
    when an epoch ends inside a batch, the next shuffle puts that batch's documents last.

    Raises:
        ValueError: bad options, or a dataset smaller than one global batch (it would have to
            repeat documents within a step).
    """
    if (global_batch_tokens is None) == (global_batch_size is None):
        raise ValueError("give exactly one of global_batch_tokens and global_batch_size")
    if len(lengths) == 0:
        raise ValueError("no documents to draw batches from")
    if global_batch_size is not None and len(lengths) < global_batch_size:
        raise ValueError(
            f"the dataset has {len(lengths)} documents, fewer than one global batch of "
            f"{global_batch_size}: a step would repeat documents; lower the batch size"
        )
    total = int(np.sum(lengths))
    if global_batch_tokens is not None and total < global_batch_tokens:
        raise ValueError(
            f"the dataset holds {total} tokens, fewer than one global batch of "
            f"{global_batch_tokens}: a step would repeat documents; lower the batch tokens"
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    pos = 0
    for _ in range(steps):
        taken: list[int] = []
        tokens = 0
        while (
            tokens < global_batch_tokens
            if global_batch_tokens is not None
            else len(taken) < global_batch_size  # type: ignore[operator]
        ):
            if pos == len(order):
                order, pos = _next_epoch(rng.permutation(len(lengths)), taken), 0
            doc = int(order[pos])
            pos += 1
            taken.append(doc)
            tokens += int(lengths[doc])
        yield np.asarray(taken, dtype=np.int64)


def _next_epoch(order: np.ndarray, taken: list[int]) -> np.ndarray:
    """``order`` with the documents already in the current batch moved last (kept in order)."""
    if not taken:
        return order
    last = np.isin(order, taken)
    return np.concatenate([order[~last], order[last]])


@dataclass(slots=True)
class PolicyRun:
    """Per-step results of one policy."""

    step_seconds: list[float] = field(default_factory=list)
    imbalance: list[float] = field(default_factory=list)
    efficiency: list[float] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)
    plan_seconds: list[float] = field(default_factory=list)
    waves: list[int] = field(default_factory=list)
    cp_sequences: Counter = field(default_factory=Counter)
    cp_tokens: Counter = field(default_factory=Counter)
    layouts: Counter = field(default_factory=Counter)  # sequences per group layout (head split)
    #: Per step: the share of its sequences that run at CP > 1.
    multi_cp_share: list[float] = field(default_factory=list)
    #: Per step, pipelined plans only: the bubble fraction (their balance; no imbalance).
    bubble: list[float] = field(default_factory=list)
    #: Per step: the whole step's named parts (``plan.stats["step_parts"]``), when priced.
    step_parts: list[dict[str, float]] = field(default_factory=list)


def replay(
    batches: list[np.ndarray],
    planners: dict[str, Planner],
    progress: Callable[[], None] | None = None,
    *,
    on_plan: Callable[[int, str, StepPlan], None] | None = None,
) -> tuple[dict[str, PolicyRun], list[float]]:
    """Plan every batch with every planner; returns per-policy runs and per-step lower bounds.

    ``on_plan(step, policy, plan)`` sees every plan as it is made (metrics, plots); ``progress()``
    is called after each step.
    """
    runs = {name: PolicyRun() for name in planners}
    bounds: list[float] = []
    for step, batch in enumerate(batches):
        for name, planner in planners.items():
            plan = planner.wait_bound(planner.plan(batch))  # a deferred bound is reported too
            if on_plan is not None:
                on_plan(step, name, plan)
            st = plan.stats
            run = runs[name]
            run.step_seconds.append(st["predicted_step_seconds"])
            # A pipelined plan's balance is its bubble (stats["pipeline"]); it has no imbalance.
            run.imbalance.append(math.nan if st["imbalance"] is None else st["imbalance"])
            run.efficiency.append(math.nan if st["efficiency"] is None else st["efficiency"])
            if isinstance(st.get("pipeline"), dict):
                run.bubble.append(st["pipeline"]["bubble_fraction"])
            run.gap.append(st["gap_to_lower_bound"])
            if isinstance(st.get("step_parts"), dict):
                run.step_parts.append(st["step_parts"])
            run.plan_seconds.append(st["timings"]["plan_seconds"])
            run.waves.append(st["waves"])
            ringed = 0
            for _, group, mb in plan.microbatches():
                run.cp_sequences[group.size] += len(mb.seq_ids)
                run.cp_tokens[group.size] += int(batch[list(mb.seq_ids)].sum())
                ringed += len(mb.seq_ids) if group.size > 1 else 0
            run.multi_cp_share.append(ringed / max(len(batch), 1))
            run.layouts.update(layout_histogram(plan))
        bounds.append(st["lower_bound_seconds"])
        if progress is not None:
            progress()
    return runs, bounds


@dataclass(frozen=True, slots=True)
class SyntheticMeasurement:
    """A made-up "measured" step (for trying dashboards without a GPU): seconds and rank busy."""

    step_seconds: float
    rank_busy_seconds: np.ndarray


def synthetic_measurement(
    plan: StepPlan, cost: PlanCost, model: CostModel, rng: np.random.Generator, sigma: float
) -> SyntheticMeasurement:
    """Perturb each micro-batch's predicted seconds by a log-normal factor exp(N(0, sigma)).

    The step is re-timed as ``cost`` was (``cost.timing``): under dataflow each group starts
    when its last rank is free, under barrier a wave lasts as long as its slowest group's
    summed (perturbed) micro-batches, plus the wave overhead either way; a rank's busy time
    sums its micro-batches.
    """
    if not sigma >= 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    measured = [
        np.asarray(seconds) * (np.exp(rng.normal(0.0, sigma, len(seconds))) if sigma else 1.0)
        for seconds in cost.microbatch_seconds
    ]
    flat = np.concatenate(measured) if measured else np.zeros(0)
    timed = time_waves(plan, flat, model.wave_overhead, timing=cost.timing)
    return SyntheticMeasurement(timed.step_seconds, timed.rank_busy_seconds)
