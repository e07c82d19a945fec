"""The global batches of every epoch: a seeded permutation of the dataset cut by tokens or count.

Every rank computes the same cut from (lengths, seed, epoch), so the schedule needs no
communication; the plan service and ``python -m dyncp.service`` read batches from it as well.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["OVERLONG", "BatchSchedule"]

OVERLONG = ("error", "truncate", "skip")


class BatchSchedule:
    """The global batches of every epoch: a pure function of (lengths, seed, epoch).

    Args:
        lengths: tokens of each dataset sample (index = dataset index).
        max_length: longest sequence the largest group holds (``Topology.max_length()``).
        overlong: what to do with longer samples: ``"error"`` (default, names them),
            ``"truncate"`` (to ``max_length``) or ``"skip"``.
        seed, shuffle: the permutation is ``default_rng([seed, epoch])``; no shuffle: index order.
        global_batch_tokens: a batch takes samples until it holds at least this many tokens.
        global_batch_size: a batch takes this many samples (give exactly one of the two).
        drop_last: drop the last, partial batch of each epoch (see ``dropped``).

    Raises:
        ValueError: bad lengths or options; overlong samples with ``overlong="error"``.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        max_length: int,
        overlong: str = "error",
        seed: int = 0,
        shuffle: bool = True,
        global_batch_tokens: int | None = None,
        global_batch_size: int | None = None,
        drop_last: bool = False,
    ) -> None:
        raw = np.asarray(lengths)
        if raw.ndim != 1 or raw.dtype.kind not in "iu" or (raw < 1).any():
            raise ValueError("lengths must be a 1-D sequence of positive integers")
        if overlong not in OVERLONG:
            raise ValueError(f"overlong={overlong!r}; choose one of {', '.join(OVERLONG)}")
        if (global_batch_tokens is None) == (global_batch_size is None):
            raise ValueError("give exactly one of global_batch_tokens and global_batch_size")
        limit = global_batch_tokens if global_batch_size is None else global_batch_size
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"global batch tokens/size must be a positive integer, got {limit!r}")
        raw = raw.astype(np.int64)
        over = np.flatnonzero(raw > max_length)
        if over.size and overlong == "error":
            shown = ", ".join(f"{i} ({raw[i]} tokens)" for i in over[:10])
            raise ValueError(
                f"{over.size} samples are longer than {max_length} tokens, the most the largest "
                f"group holds: {shown}{', ...' if over.size > 10 else ''}; pass "
                "overlong='truncate' or overlong='skip' to admit the rest"
            )
        self.max_length = max_length
        self.overlong = overlong
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.global_batch_tokens, self.global_batch_size = global_batch_tokens, global_batch_size
        self.truncated = over if overlong == "truncate" else over[:0]
        self.skipped = over if overlong == "skip" else over[:0]
        self.is_truncated = np.zeros(len(raw), dtype=bool)
        self.is_truncated[self.truncated] = True
        self.lengths = np.minimum(raw, max_length) if overlong == "truncate" else raw
        self.eligible = (
            np.flatnonzero(raw <= max_length) if overlong == "skip" else np.arange(len(raw))
        )
        self.lengths_digest = hashlib.blake2b(raw.tobytes(), digest_size=8).hexdigest()
        self._lock = threading.Lock()
        self._cuts: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order, batch bounds into order, dropped indices) of one epoch.

        The last two epochs are cached: planning ahead reads the next epoch near the end of one.
        """
        with self._lock:
            if epoch not in self._cuts:
                self._cuts[epoch] = self._cut_epoch(epoch)
                if len(self._cuts) > 2:
                    self._cuts.popitem(last=False)
            return self._cuts[epoch]

    def _cut_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        order = self.eligible
        if self.shuffle:
            order = order[np.random.default_rng([self.seed, epoch]).permutation(len(order))]
        n = len(order)
        if n == 0:
            return order, np.zeros(1, dtype=np.int64), order
        if self.global_batch_size is not None:
            bounds = list(range(0, n, self.global_batch_size)) + [n]
            partial = n % self.global_batch_size != 0
        else:
            cs = np.cumsum(self.lengths[order])
            bounds, base = [0], 0
            while bounds[-1] < n:
                end = min(int(np.searchsorted(cs, base + self.global_batch_tokens)) + 1, n)
                bounds.append(end)
                base = int(cs[end - 1])
            last_tokens = cs[-1] - (cs[bounds[-2] - 1] if bounds[-2] else 0)
            partial = last_tokens < self.global_batch_tokens
        dropped = order[:0]
        if self.drop_last and partial:
            dropped = order[bounds[-2] :]
            bounds = bounds[:-1]
        return order, np.asarray(bounds, dtype=np.int64), dropped

    def num_steps(self, epoch: int) -> int:
        return len(self._epoch(epoch)[1]) - 1

    def batch(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset indices, admitted lengths) of one global batch."""
        order, bounds, _ = self._epoch(epoch)
        if not 0 <= step < len(bounds) - 1:
            raise IndexError(f"epoch {epoch} has {len(bounds) - 1} steps, no step {step}")
        ids = order[bounds[step] : bounds[step + 1]]
        return ids, self.lengths[ids]

    def dropped(self, epoch: int) -> np.ndarray:
        """Dataset indices dropped from ``epoch`` by ``drop_last`` (the partial last batch)."""
        return self._epoch(epoch)[2]

    def config(self) -> dict[str, Any]:
        """What the epochs depend on (saved with the sampler state and checked on load)."""
        return {
            "lengths_digest": self.lengths_digest,
            "num_samples": len(self.lengths),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch_tokens": self.global_batch_tokens,
            "global_batch_size": self.global_batch_size,
            "drop_last": self.drop_last,
            "overlong": self.overlong,
            "max_length": self.max_length,
        }
