"""SamplerConfig: the typed, frozen options of a DynamicCPSampler, checked once when built.

A sampler takes some twenty options; gathered in one frozen, keyword-only record they can be
built, checked and varied apart from the sampler (``dataclasses.replace(config, rank=r)`` gives
another rank's), and ``sampler.config`` says what a sampler runs with. The options that need the
planner or the Store (the planner's topology, ``slices=True`` and ``calibrate`` without a store, a
non-deterministic planner without one) are checked by the sampler, which holds them; the batch
options by ``BatchSchedule``, the deadlines by ``PlanClient``, with the messages they always had.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dyncp.planner.budget import DEFAULT_STEP_BUDGET, StepBudget
from dyncp.service.run_check import RUN_CHECK_SECONDS

__all__ = ["SamplerConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplerConfig:
    """The options of a :class:`~dyncp.sampler.DynamicCPSampler` (all keyword-only).

    Args:
        world_size, rank: the DP x CP ranks and this process's place among them.
        capacity: tokens per rank per micro-batch (must match the planner's topology).
        global_batch_tokens, global_batch_size: how each global batch is cut (give one).
        seed, shuffle, drop_last, overlong: see ``BatchSchedule``.
        lookahead: steps planned ahead of the one being consumed (local thread, or this rank's
            plan service).
        prefix: job namespace of the Store keys.
        serve: run the plan service in this process (default: rank 0 when a store is given);
            False on every rank when ``python -m dyncp.service`` runs it.
        deadline, late_deadline: seconds to wait for a published plan (see ``PlanClient``).
        secret: the per-job secret plans are signed with (default: ``$DYNCP_PLAN_SECRET`` or
            the file ``$DYNCP_PLAN_SECRET_FILE``; see ``dyncp.control.signing``). Not shown in
            the config's repr.
        agree_ahead: steps ahead of the one being yielded whose plans are fetched and compared
            early (default 0: at the step boundary). The comparison of step N waits until every
            rank's sampler has reached step N - agree_ahead; a DataLoader that prefetches P
            micro-batches (``prefetch_factor * num_workers``) lets a rank's sampler run up to P
            steps ahead of its training, so give ``agree_ahead >= P + 1`` with ``num_workers >
            0``: then no comparison waits for a rank whose training waits for this one.
        slices: read each step's slice header and this rank's span record from the plan
            service (``dyncp.plan.slice``: a node's groups, a few kilobytes, checked against the
            header's Merkle root, whose digest the ranks compare) instead of the whole plan;
            ``on_step`` then receives this rank's :class:`~dyncp.plan.slice.PlanSlice`. True
            needs ``store``; the service must publish slices too (in-process it follows this
            option; ``python -m dyncp.service`` has ``--slices``, default auto alike). Default
            ``"auto"``: slices from ``dyncp.plan.SLICES_FROM`` ranks (2: a reader of slices
            spent less per step at every world measured, ``bench/slices_crossover_bench.py``)
            when a store is given and the planner does not pipeline; whole plans otherwise
            (give False for code that needs every rank's part, e.g. FSDP full sharding).
        budget: how long each step is planned, by the plan service or the local lookahead
            thread: a share of its predicted seconds (``dyncp.planner.budget``; default 0.25
            within [0.1 s, 2 s]). ``None``: the planner's own ``time_limit``.
        run_id: the run the plan records are bound to (a record of an earlier run of the same
            job does not verify; see ``dyncp.control.signing``). Default: ``$DYNCP_RUN_ID``; else,
            when a rank of the job serves in-process (the default), an id drawn for this run and
            shared over the agreement group; else none. A standalone ``python -m dyncp.service``
            must be given the ranks' id (``--run-id`` or ``$DYNCP_RUN_ID``).
        service_wait: with a store and a secret, seconds a rank waits before its first step
            for the plan service to announce that it serves this run
            (``dyncp.service.run_check``; it may start after the ranks); a service of another
            run, without the secret, or none by then is one ``ServiceRunError`` on every rank.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``, ``lookahead`` / ``agree_ahead`` not
            an integer >= 0, ``slices`` not True, False or "auto", or ``service_wait`` not
            seconds in [0, 1e7).
    """

    world_size: int
    rank: int
    capacity: int
    global_batch_tokens: int | None = None
    global_batch_size: int | None = None
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    lookahead: int = 2
    overlong: str = "error"
    prefix: str = "default"
    serve: bool | None = None
    deadline: float = 1.0
    late_deadline: float = 0.05
    secret: bytes | str | None = field(default=None, repr=False)
    agree_ahead: int = 0
    run_id: str | None = None
    slices: bool | str = "auto"
    budget: StepBudget | None = DEFAULT_STEP_BUDGET
    service_wait: float = RUN_CHECK_SECONDS

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ValueError(f"lookahead must be an integer >= 0, got {self.lookahead!r}")
        if not isinstance(self.agree_ahead, int) or self.agree_ahead < 0:
            raise ValueError(f"agree_ahead must be an integer >= 0, got {self.agree_ahead!r}")
        if self.slices not in (True, False, "auto") or type(self.slices) not in (bool, str):
            raise ValueError(f"slices must be True, False or 'auto', got {self.slices!r}")
        if not isinstance(self.service_wait, int | float) or not 0 <= self.service_wait < 1e7:
            raise ValueError(f"service_wait must be seconds in [0, 1e7), got {self.service_wait!r}")
