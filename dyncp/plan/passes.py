"""Passes: the forward+backward slots every rank runs in lockstep when collectives span all ranks.

FSDP2 with full sharding all-gathers each block's parameters in every forward (and backward) and
reduce-scatters its gradients over all ranks, so every rank must run the same number of
forward+backward passes, and the k-th pass of every rank must meet the k-th pass of every other
rank. A plan does not say that by itself: within a wave each group runs its own number of
micro-batches, and a rank outside every group of a wave runs none there.

This module reads a plan as passes, the one rule every consumer shares (the planner that prices
them, the runner that executes them, the simulator): wave by wave, a wave takes as many passes as
its busiest group has micro-batches; in pass p of a wave each group runs its p-th micro-batch, and a
rank whose group has fewer (or that is in no group) runs an *empty pass* there (a forward+backward
on no token that issues the block collectives and adds nothing). Because the passes follow the
waves, the members of a group always reach its micro-batches at the same pass index: a ring never
waits on a peer that is still in another pass's all-gather.

A plan is *pass-aligned* when it has no empty pass: every rank runs a micro-batch in every pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from dyncp.plan.contract import Group, MicroBatch, StepPlan

__all__ = ["Pass", "PassSchedule", "pass_schedule"]


@dataclass(frozen=True, slots=True)
class Pass:
    """One rank's slot in one pass: the micro-batch it runs there, or none (an empty pass)."""

    wave: int
    index: int  # the pass within its wave
    group: Group | None  # the rank's group in the wave (None: the rank is idle in the whole wave)
    microbatch: MicroBatch | None  # None: an empty pass

    @property
    def empty(self) -> bool:
        return self.microbatch is None


@dataclass(frozen=True, slots=True)
class PassSchedule:
    """A plan read as passes (see the module docstring)."""

    plan: StepPlan
    per_wave: tuple[int, ...]  # passes in each wave: its busiest group's micro-batch count

    @property
    def passes(self) -> int:
        """Passes in the step: every rank runs this many forward+backward passes."""
        return sum(self.per_wave)

    @property
    def rank_passes(self) -> int:
        """Rank-passes in the step (``passes`` x world), empty or not."""
        return self.passes * self.plan.topology.world

    @property
    def busy(self) -> int:
        """Rank-passes that run a micro-batch (a micro-batch counts once per rank of its group)."""
        return sum(g.size * len(g.microbatches) for w in self.plan.waves for g in w.groups)

    @property
    def empty(self) -> int:
        """Rank-passes that run no micro-batch: 0 exactly when the plan is pass-aligned."""
        return self.rank_passes - self.busy

    @property
    def aligned(self) -> bool:
        return self.empty == 0

    def of_rank(self, rank: int) -> list[Pass]:
        """``rank``'s passes in execution order (``passes`` of them)."""
        world = self.plan.topology.world
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        out = []
        for w, (wave, count) in enumerate(zip(self.plan.waves, self.per_wave)):
            group = next((g for g in wave.groups if g.start <= rank < g.start + g.size), None)
            mbs = group.microbatches if group is not None else ()
            out += [Pass(w, p, group, mbs[p] if p < len(mbs) else None) for p in range(count)]
        return out

    def empty_of_rank(self, rank: int) -> int:
        """Empty passes ``rank`` runs."""
        return sum(p.empty for p in self.of_rank(rank))


def pass_schedule(plan: StepPlan) -> PassSchedule:
    """``plan`` read as passes."""
    per_wave = tuple(max((len(g.microbatches) for g in w.groups), default=0) for w in plan.waves)
    return PassSchedule(plan, per_wave)
