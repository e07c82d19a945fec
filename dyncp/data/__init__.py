"""Sequence lengths from files, and the bundled samples; torch-free.

``readers`` loads one length per document from parquet / csv / jsonl / txt / npy with errors that
name what is wrong; ``schedule`` cuts them into the global batches of every epoch (a seeded
permutation, the same on every rank and in the plan service); ``samples/`` holds the bundled
samples of real length distributions (package data: a wheel carries them).
"""

from dyncp.data.readers import (
    BUNDLED,
    DEFAULT_DATASET,
    SUPPORTED_SUFFIXES,
    DatasetError,
    describe,
    load_lengths,
    resolve_dataset,
)
from dyncp.data.schedule import OVERLONG, BatchSchedule

__all__ = [
    "OVERLONG",
    "BatchSchedule",
    "BUNDLED",
    "DEFAULT_DATASET",
    "SUPPORTED_SUFFIXES",
    "DatasetError",
    "describe",
    "load_lengths",
    "resolve_dataset",
]
