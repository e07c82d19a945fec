"""dyncp's step plans as a torch DataLoader batch sampler (see ``dyncp.sampler.sampler``)."""

from dyncp.sampler.sampler import (
    OVERLONG,
    BatchSchedule,
    DynamicCPSampler,
    MicroBatchIndices,
    MicroBatchMeta,
    PackedMicroBatch,
    PlannedDataset,
    PlannedItems,
    SamplerCounters,
    StepInfo,
    ZigzagCollate,
    rank_microbatches,
)

__all__ = [
    "OVERLONG",
    "BatchSchedule",
    "DynamicCPSampler",
    "MicroBatchIndices",
    "MicroBatchMeta",
    "PackedMicroBatch",
    "PlannedDataset",
    "PlannedItems",
    "SamplerCounters",
    "StepInfo",
    "ZigzagCollate",
    "rank_microbatches",
]
