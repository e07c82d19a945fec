"""DynamicCPSampler: dyncp's step plans as a torch DataLoader batch sampler.

    sampler = DynamicCPSampler(lengths, world_size=W, rank=r, capacity=8192, planner=planner,
                               global_batch_tokens=2 * W * 8192, seed=0, store=store)
    loader = DataLoader(sampler.wrap(dataset), batch_sampler=sampler,
                        collate_fn=sampler.collate, num_workers=2)
    for mb in loader:                  # PackedMicroBatch: this rank's zigzag shard, in THD
        ...
        if mb.meta.last_in_step:
            optimizer.step()

How a sample reaches a rank:

1. ``BatchSchedule``: the epoch's global batches, a deterministic function of (lengths, seed,
   epoch): a seeded permutation cut by tokens or by count. Every rank computes the same cut.
2. The step's ``StepPlan`` (its ``sample_ids`` are dataset indices): read from the plan service
   through the Store (``store=``; see ``dyncp.service``), or planned by this process with
   ``lookahead`` steps planned ahead in a thread (no store; the planner must then be
   deterministic when there are several ranks).
3. This rank's micro-batches in plan order (wave, then the group's micro-batches): each a
   ``MicroBatchIndices``, a list of dataset indices carrying a ``MicroBatchMeta``. A rank with no
   work in a step gets one empty micro-batch, so every rank sees ``last_in_step`` every step.
4. ``PlannedDataset`` (``sampler.wrap``) fetches the items and hands the meta to
   ``ZigzagCollate`` (``sampler.collate``), which packs them into THD tensors and keeps this
   rank's zigzag shard (helpers from ``dyncp.ring_attention.sharding``).

The sampler runs in the DataLoader's main process; with ``num_workers > 0`` the workers receive the
index lists (meta included) and run only the dataset and the collate.

Modules:
``schedule`` (global batches), ``microbatches`` (a rank's share of a plan),
``collate`` (dataset wrapper and packing), ``sources`` (where plans come from),
``sampler`` (the sampler), ``config`` (SamplerConfig: its options, typed and checked),
``online`` (batches whose lengths arrive at run time, e.g. RL rollouts: ``OnlinePlanner``).
"""

from dyncp.data.schedule import OVERLONG, BatchSchedule
from dyncp.sampler.collate import PackedMicroBatch, PlannedDataset, PlannedItems, ZigzagCollate
from dyncp.sampler.config import SamplerConfig
from dyncp.sampler.microbatches import MicroBatchIndices, MicroBatchMeta, rank_microbatches
from dyncp.sampler.online import (
    OnlinePlanner,
    OnlinePlanningError,
    OnlineStep,
    PendingStep,
    RolloutBatch,
)
from dyncp.sampler.sampler import DynamicCPSampler
from dyncp.sampler.sources import SamplerCounters, StepInfo

__all__ = [
    "OVERLONG",
    "BatchSchedule",
    "DynamicCPSampler",
    "MicroBatchIndices",
    "MicroBatchMeta",
    "OnlinePlanner",
    "OnlinePlanningError",
    "OnlineStep",
    "PackedMicroBatch",
    "PendingStep",
    "PlannedDataset",
    "PlannedItems",
    "RolloutBatch",
    "SamplerConfig",
    "SamplerCounters",
    "StepInfo",
    "ZigzagCollate",
    "rank_microbatches",
]
