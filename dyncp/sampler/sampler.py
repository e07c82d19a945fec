"""DynamicCPSampler: yields this rank's micro-batches of dyncp step plans to a torch DataLoader.

Per step it obtains the plan (``dyncp.sampler.sources``), optionally compares the plan's digest
with every other rank's (``dyncp.control.agreement``), and yields this rank's micro-batches
(``dyncp.sampler.microbatches``); it keeps the position and recent plans for ``state_dict``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dyncp.control.agreement import AgreementGroup, PendingAgreement, PlanUnusable
from dyncp.control.model_channel import ModelChannel, ServiceCalibration
from dyncp.control.signing import RUN_ENV, SECRET_ENV, SECRET_FILE_ENV, PlanSigner
from dyncp.cost_model.calibration.online import OnlineCalibrator
from dyncp.data.schedule import BatchSchedule
from dyncp.plan import PlanSlice, SliceUnavailable, StepPlan, check_slice_header, use_slices
from dyncp.planner.planner import Planner
from dyncp.sampler.collate import PlannedDataset, ZigzagCollate
from dyncp.sampler.config import SamplerConfig
from dyncp.sampler.microbatches import MicroBatchIndices, MicroBatchMeta, rank_microbatches
from dyncp.sampler.sources import LocalPlans, SamplerCounters, StepInfo, StorePlans
from dyncp.service import (
    Fetched,
    PlanClient,
    PlanService,
    check_plan,
    plan_digest,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

__all__ = ["DynamicCPSampler"]

RECENT_PLANS = 32  # plans kept for state_dict(consumed=...) behind the sampler's position

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A step whose plan is known and whose comparison is in flight."""

    fetched: Fetched
    wait: float
    digest: int
    agreement: PendingAgreement | None
    unavailable: SliceUnavailable | None = None  # this rank's slice could not be used


@dataclass(frozen=True, slots=True)
class _Resume:
    epoch: int
    step: int
    offset: int
    plan: StepPlan | PlanSlice | None


def _agreement(
    group: ProcessGroup | bool | None, store: Store | None, world_size: int
) -> AgreementGroup | None:
    """The sampler's plan agreement (see ``group`` in :class:`DynamicCPSampler`)."""
    if group is False:
        return None
    if group is True or group is None:
        import torch.distributed as dist

        if world_size == 1 or not dist.is_initialized() or dist.get_world_size() == 1:
            return None  # one process: nothing to compare with
        return AgreementGroup(store=store)
    return AgreementGroup(group, store=store)


def _run_id(
    given: str | None, agreement: AgreementGroup | None, serves: bool, secret: object
) -> str:
    """The run plan records are bound to (see ``run_id`` in :class:`DynamicCPSampler`).

    With a secret and no rank serving (a standalone ``python -m dyncp.service``), a run id is
    required: one the service cannot know cannot be drawn here, and without one the records
    are bound to no run, so an earlier run's records replay. Every rank raises the same error
    at construction rather than fall back at every step.

    Raises:
        ValueError: a secret is set, nobody serves in-process and no run id was given.
    """
    if given is not None:
        return given
    if os.environ.get(RUN_ENV):
        return os.environ[RUN_ENV]
    anyone = agreement.any(serves) if agreement is not None else serves
    if anyone and agreement is not None:
        return agreement.derive("plan-service run")
    signed = secret is not None or os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV)
    if signed and not anyone:
        raise ValueError(
            "plans are signed but no rank serves them and no run_id is set: give run_id= (or "
            f"${RUN_ENV}) on every rank and the same --run-id to python -m dyncp.service"
        )
    return ""


class DynamicCPSampler:
    """Yields this rank's micro-batches of dyncp step plans; a DataLoader ``batch_sampler``.

    Args:
        lengths: tokens of each dataset sample.
        planner: plans the steps (the service's planner when this rank serves).
        config: the sampler's options (:class:`~dyncp.sampler.config.SamplerConfig`); or give
            them as keywords, as always (``world_size=..., rank=..., capacity=..., ...``), which
            also override the fields of a ``config`` given with them.
        store: the job's torch.distributed Store; plans come from the plan service through it.
            None: every rank plans locally (``planner`` must be deterministic if world_size > 1).
        group: the plan agreement. Before the first micro-batch of each step is yielded, every
            rank compares the step's plan digest with the others' (one all_reduce of 48 bytes)
            and, if any differs, every rank raises ``PlanMismatchError`` in that step; a rank
            that does not arrive within the timeout makes the others raise
            ``PlanAgreementError`` naming it. None (default): on whenever torch.distributed is
            initialised with more than one process -- the sampler creates its own gloo group
            over the whole job with the job's timeout (a collective: construct the sampler on
            every rank of the job, in the same order as other groups). A gloo ProcessGroup:
            compare on that group (it should use the job's timeout, not torch's 30 minutes).
            False: no agreement (ranks holding different plans then go undetected).
        on_step: called as ``on_step(plan, info)`` once per step when its plan is known.
        calibrate: online calibration of the cost model (needs ``store``): readers' fallbacks
            use the newest model version published in the Store; the rank that serves refits
            from the measurements trainers push (``dyncp.runtime.measure.StoreMeasurements``)
            with this calibrator (True: a default ``OnlineCalibrator`` of the planner's profile).
            ``sampler.calibration`` is the service side (set its ``metrics``/``save_path``).

    Attributes:
        config: the options it runs with (a ``SamplerConfig``).
        slices: whether plans are read as slices (``config.slices`` resolved: ``"auto"`` by
            ``dyncp.plan.use_slices``; never without a store).

    Raises:
        ValueError: inconsistent options (each names the option and what is allowed).
        TypeError: an option that is not a field of ``SamplerConfig``, or a required one
            (``world_size``, ``rank``, ``capacity``) missing.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        planner: Planner,
        config: SamplerConfig | None = None,
        store: Store | None = None,
        group: ProcessGroup | bool | None = None,
        on_step: Callable[[StepPlan, StepInfo], None] | None = None,
        calibrate: bool | OnlineCalibrator = False,
        **options: Any,
    ) -> None:
        config = SamplerConfig(**options) if config is None else replace(config, **options)
        topo = planner.topology
        slices = use_slices(config.slices, topo, pipelined=planner.pipeline is not None)
        if config.slices is True and store is None:
            raise ValueError("slices=True needs store= (slices come from the plan service)")
        self.slices = slices and store is not None  # planned locally: whole plans
        if calibrate is not False and store is None:
            raise ValueError(
                "calibrate= needs store= (model versions reach the ranks through the plan "
                "service); without a store use dyncp.runtime.measure.CollectiveCalibration"
            )
        if config.world_size != topo.world or config.capacity != topo.capacity:
            raise ValueError(
                f"world_size={config.world_size}, capacity={config.capacity} differ from the "
                f"planner's world={topo.world}, capacity={topo.capacity}"
            )
        if store is None and config.world_size > 1 and not planner.deterministic:
            raise ValueError(
                "without a store every rank plans locally, so the planner must be deterministic "
                "(Planner(..., deterministic=True)); or pass store= to use the plan service"
            )
        self.schedule = BatchSchedule(
            lengths,
            max_length=topo.max_length(),
            overlong=config.overlong,
            seed=config.seed,
            shuffle=config.shuffle,
            global_batch_tokens=config.global_batch_tokens,
            global_batch_size=config.global_batch_size,
            drop_last=config.drop_last,
        )
        self.config = config
        self.world_size, self.rank, self.planner = config.world_size, config.rank, planner
        self.lookahead, self.on_step = config.lookahead, on_step
        self.counters = SamplerCounters(
            truncated_samples=len(self.schedule.truncated),
            skipped_samples=len(self.schedule.skipped),
        )
        if len(self.schedule.truncated) or len(self.schedule.skipped):
            log.warning(
                "%d samples longer than %d tokens were %s",
                len(self.schedule.truncated) + len(self.schedule.skipped),
                topo.max_length(),
                "truncated" if config.overlong == "truncate" else "skipped",
            )
        self.calibration: ServiceCalibration | None = None
        self.run_id = ""
        self.agreement = _agreement(group, store, config.world_size)
        self.group = None if self.agreement is None else self.agreement.group
        self._source: LocalPlans | StorePlans
        if store is None:
            self._source = LocalPlans(
                self.schedule, planner, config.lookahead, budget=config.budget
            )
        else:
            serves = config.rank == 0 if config.serve is None else bool(config.serve)
            self.run_id = _run_id(config.run_id, self.agreement, serves, config.secret)
            signer = None
            if calibrate is not False:
                signer = PlanSigner.from_env(config.secret, run=self.run_id)
            client = PlanClient(
                store,
                source=self.schedule,
                planner=planner,
                prefix=config.prefix,
                rank=config.rank,
                deadline=config.deadline,
                late_deadline=config.late_deadline,
                secret=config.secret,
                models=None
                if calibrate is False
                else ModelChannel(store, config.prefix, signer=signer),
                run_id=self.run_id,
                slices="auto" if config.slices == "auto" else self.slices,
            )
            service = None
            if serves:
                if calibrate is not False:
                    calibrator = (
                        calibrate
                        if isinstance(calibrate, OnlineCalibrator)
                        else OnlineCalibrator(
                            planner.model.profile, ranks_per_node=topo.ranks_per_node
                        )
                    )
                    self.calibration = ServiceCalibration(
                        store, config.prefix, calibrator, signer=signer
                    )
                service = PlanService(
                    store,
                    source=self.schedule,
                    planner=planner,
                    prefix=config.prefix,
                    lookahead=config.lookahead,
                    secret=config.secret,
                    calibration=self.calibration,
                    run_id=self.run_id,
                    slices=self.slices,
                    budget=config.budget,
                )
            agree = None if self.agreement is None else self.agreement.max
            self._source = StorePlans(
                client, service, service_wait=config.service_wait, agree=agree
            )
        self.agree_ahead = config.agree_ahead
        self._recent: OrderedDict[tuple[int, int], StepPlan] = OrderedDict()
        self.epoch = 0
        self._position = (0, 0, 0)  # (epoch, step, offset) after the last micro-batch yielded
        self._resume: _Resume | None = None

    # ------------------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration runs (a restored position in it is kept)."""
        self.epoch = int(epoch)
        if self._resume is not None and self._resume.epoch != self.epoch:
            self._resume = None
        if self._resume is None:
            self._position = (self.epoch, 0, 0)

    @property
    def num_steps(self) -> int:
        """Global batches (steps) in the current epoch."""
        return self.schedule.num_steps(self.epoch)

    def __len__(self) -> int:
        raise TypeError(
            "a DynamicCPSampler has no length: this rank's micro-batches per step depend on the "
            "plans; use sampler.num_steps for the steps of the epoch"
        )

    @property
    def dropped(self) -> np.ndarray:
        """Dataset indices ``drop_last`` drops from the current epoch."""
        return self.schedule.dropped(self.epoch)

    # ------------------------------------------------------------------------------ DataLoader
    def wrap(self, dataset: Any) -> PlannedDataset:
        """The dataset to give the DataLoader together with this sampler."""
        return PlannedDataset(dataset)

    @property
    def collate(self) -> ZigzagCollate:
        """The default collate_fn (pad id 0, ignore index -100)."""
        return ZigzagCollate()

    def __iter__(self) -> Iterator[MicroBatchIndices]:
        epoch, start, offset, restored = self.epoch, 0, 0, None
        if self._resume is not None:
            start, offset, restored = self._resume.step, self._resume.offset, self._resume.plan
            self._resume = None
        if start == 0 and offset == 0:
            dropped = self.schedule.dropped(epoch)
            if len(dropped):
                self.counters.dropped_samples += len(dropped)
                log.info("drop_last drops %d samples from epoch %d", len(dropped), epoch)
        steps = self.schedule.num_steps(epoch)
        ahead: dict[int, _Prepared] = {}
        for step in range(start, steps):
            for s in range(step, min(step + self.agree_ahead, steps - 1) + 1):
                if s not in ahead:  # in step order on every rank: the comparisons' order
                    ahead[s] = self._prepare(epoch, s, restored if s == start else None)
            batches = self._finish(epoch, step, ahead.pop(step))
            if offset > len(batches):
                raise ValueError(
                    f"restored offset {offset} but rank {self.rank} has {len(batches)} "
                    f"micro-batches in epoch {epoch} step {step}"
                )
            for mb in batches[offset:]:
                m = mb.meta
                self._position = (
                    (epoch, step + 1, 0) if m.last_in_step else (epoch, step, m.position + 1)
                )
                yield mb
            offset = 0

    def _prepare(self, epoch: int, step: int, plan: StepPlan | PlanSlice | None) -> _Prepared:
        """Obtain a step's plan and start comparing its digest with the other ranks'."""
        start = time.perf_counter()
        unavailable: SliceUnavailable | None = None
        if plan is not None:
            ids, lengths = self.schedule.batch(epoch, step)
            if isinstance(plan, PlanSlice):
                check_slice_header(plan.header, topology=self.planner.topology, lengths=lengths)
            else:
                check_plan(plan, topology=self.planner.topology, sample_ids=ids, lengths=lengths)
            fetched = Fetched(plan, "restored", None, True)
        else:
            try:
                fetched = self._source.fetch(epoch, step)
            except SliceUnavailable as exc:  # said in the comparison: all fall back alike
                if self.agreement is None:
                    raise
                unavailable = exc
        wait = time.perf_counter() - start
        code = 0
        if unavailable is not None:  # the header's digest, and why this rank cannot run it
            digest, code = unavailable.digest, 1 if unavailable.missing else 2
            fetched = Fetched(None, "fallback", "rejected", False)  # type: ignore[arg-type]
        else:
            plan = fetched.plan
            digest = plan.digest if isinstance(plan, PlanSlice) else plan_digest(plan)
        pending = None
        if self.agreement is not None:
            label = f"epoch {epoch} step {step}"
            pending = self.agreement.start(
                where=(epoch, step), digest=digest, label=label, unusable=code
            )
        return _Prepared(fetched, wait, digest, pending, unavailable)

    def _finish(self, epoch: int, step: int, prepared: _Prepared) -> list[MicroBatchIndices]:
        """Wait for the step's comparison (raises on a mismatch), then its micro-batches.

        When every rank holds the same header but some cannot use their slices, every rank
        is told so by the comparison (:class:`PlanUnusable`, the same on all) and runs its
        slice of the deterministic fallback plan of the step instead, as with a rejected
        whole plan; the slice error is logged, naming the ranks and why."""
        try:
            if prepared.agreement is not None:
                prepared.agreement.result()
        except PlanUnusable as exc:
            prepared = self._slice_fallback(epoch, step, prepared, str(exc))
        fetched, wait, digest = prepared.fetched, prepared.wait, prepared.digest
        plan = fetched.plan
        batches = rank_microbatches(
            plan,
            rank=self.rank,
            epoch=epoch,
            step=step,
            digest=digest,
            is_truncated=self.schedule.is_truncated,
        )
        self._remember(epoch, step, plan)
        info = StepInfo(
            epoch, step, fetched.source, fetched.reason, fetched.ready, wait, digest, len(batches)
        )
        self.counters.record(info)
        if self.on_step is not None:
            self.on_step(plan, info)
        return batches

    def _slice_fallback(self, epoch: int, step: int, prepared: _Prepared, why: str) -> _Prepared:
        """Every rank's slice of the step's deterministic fallback (see :meth:`_finish`)."""
        own = f"; here: {prepared.unavailable}" if prepared.unavailable is not None else ""
        log.warning("%s: every rank runs the fallback plan%s", why, own)
        assert isinstance(self._source, StorePlans)
        mine = self._source.client.fallback_slice(epoch, step)
        fetched = Fetched(mine, "fallback", "rejected", prepared.fetched.ready)
        return _Prepared(fetched, prepared.wait, mine.digest, None)

    def _remember(self, epoch: int, step: int, plan: StepPlan) -> None:
        self._recent[(epoch, step)] = plan
        while len(self._recent) > RECENT_PLANS:
            self._recent.popitem(last=False)

    # ------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the lookahead thread or this rank's plan service."""
        self._source.close()

    def __enter__(self) -> DynamicCPSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ state
    def state_dict(self, consumed: MicroBatchMeta | None = None) -> dict[str, Any]:
        """The position to resume from: after the last micro-batch yielded, or after
        ``consumed`` (pass the meta of the last micro-batch trained on when a DataLoader
        prefetches, e.g. with worker processes).

        Raises:
            ValueError: ``consumed`` is older than the plans the sampler keeps (32 steps).
        """
        if consumed is None:
            epoch, step, offset = self._position
        elif consumed.last_in_step:
            epoch, step, offset = consumed.epoch, consumed.step + 1, 0
        else:
            epoch, step, offset = consumed.epoch, consumed.step, consumed.position + 1
        state: dict[str, Any] = {
            "version": 1,
            "epoch": epoch,
            "step": step,
            "offset": offset,
            "rank": self.rank,
            **self.schedule.config(),
        }
        if offset:
            if (epoch, step) in self._recent:
                plan = self._recent[(epoch, step)]
            elif self._resume is not None and self._resume.plan is not None:
                plan = self._resume.plan
            else:
                raise ValueError(
                    f"the plan of epoch {epoch} step {step} is no longer held (the sampler keeps "
                    f"the last {RECENT_PLANS} steps); save the state closer to training"
                )
            state["plan"] = plan.to_json()
            state["plan_kind"] = "slice" if isinstance(plan, PlanSlice) else "plan"
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position (the next iteration starts there).

        Raises:
            ValueError: the state comes from a sampler with other lengths or batching, or a
                mid-step state from another rank.
        """
        if state.get("version") != 1:
            raise ValueError(f"sampler state version {state.get('version')!r} not supported (1)")
        config = self.schedule.config()
        differ = [k for k in config if state.get(k) != config[k]]
        if differ:
            raise ValueError(
                "sampler state does not match this sampler: "
                + ", ".join(f"{k}: saved {state.get(k)!r}, now {config[k]!r}" for k in differ)
            )
        offset = int(state["offset"])
        if offset and state["rank"] != self.rank:
            raise ValueError(
                f"state saved mid-step by rank {state['rank']} cannot resume rank {self.rank}; "
                "save at a step boundary (or each rank's own state)"
            )
        plan: StepPlan | PlanSlice | None = None
        if offset:
            kind = state.get("plan_kind", "plan")
            plan = (PlanSlice if kind == "slice" else StepPlan).from_json(state["plan"])
        self.epoch = int(state["epoch"])
        self._resume = _Resume(self.epoch, int(state["step"]), offset, plan)
        self._position = (self.epoch, int(state["step"]), offset)
