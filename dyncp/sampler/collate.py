"""The dataset wrapper and the collate: a micro-batch's items become this rank's zigzag shard.

``PlannedDataset`` passes the sampler's meta from the indices to the items; ``ZigzagCollate``
packs them in THD layout and keeps the rank's zigzag chunks (helpers from
``dyncp.ring_attention.sharding``). Both run in DataLoader workers as well as the main process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dyncp.plan import padded_length
from dyncp.ring_attention.sharding import zigzag_positions, zigzag_shard
from dyncp.sampler.microbatches import MicroBatchMeta

__all__ = ["PackedMicroBatch", "PlannedDataset", "PlannedItems", "ZigzagCollate"]


@dataclass(frozen=True, slots=True)
class PlannedItems:
    """The dataset items of one micro-batch and its meta (what the collate receives)."""

    items: list[Any]
    meta: MicroBatchMeta


class PlannedDataset(torch.utils.data.Dataset):
    """Wraps a map-style dataset so that a DataLoader passes each micro-batch's meta on.

    The DataLoader calls ``__getitems__`` with the ``MicroBatchIndices`` the sampler yielded (in
    the main process or in a worker); items come from the wrapped dataset's ``__getitem__`` (or its
    own ``__getitems__``). Items are 1-D token sequences (tensor, array, list), or mappings whose
    ``ZigzagCollate.key`` holds one.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> PlannedItems:
        meta = getattr(indices, "meta", None)
        if meta is None:
            raise TypeError(
                "PlannedDataset needs the MicroBatchIndices of a DynamicCPSampler: pass the "
                "sampler as batch_sampler= of the DataLoader"
            )
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(list(indices)) if getitems else [self.dataset[i] for i in indices]
        return PlannedItems(list(items), meta)


@dataclass(slots=True)
class PackedMicroBatch:
    """This rank's shard of one micro-batch in THD layout (tokens first, sequences packed).

    ``input_ids``/``labels``/``position_ids`` hold, per sequence, the rank's zigzag chunks r and
    2cp-1-r of the sequence padded to a multiple of 2cp (unpadded when cp == 1). ``labels`` are
    the next tokens, ``ignore_index`` at each sequence's last token and on padding;
    ``position_ids`` are positions within the sequence (for RoPE). ``cu_seqlens_padded`` and
    ``cu_seqlens_local`` (int32) are the cumulative padded global and local sequence lengths.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    cu_seqlens_local: torch.Tensor
    max_seqlen_padded: int
    max_seqlen_local: int
    meta: MicroBatchMeta

    _TENSORS = ("input_ids", "labels", "position_ids", "cu_seqlens_padded", "cu_seqlens_local")

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedMicroBatch:
        moved = {n: getattr(self, n).to(device, non_blocking=non_blocking) for n in self._TENSORS}
        return dataclasses.replace(self, **moved)

    def pin_memory(self) -> PackedMicroBatch:
        """Called by a DataLoader with ``pin_memory=True``."""
        return dataclasses.replace(
            self, **{n: getattr(self, n).pin_memory() for n in self._TENSORS}
        )


@dataclass(frozen=True, slots=True)
class ZigzagCollate:
    """Packs a micro-batch's items into this rank's zigzag shard (a DataLoader ``collate_fn``).

    Args:
        pad_id: token id of padding.
        ignore_index: label of positions without a target.
        key: take the tokens from ``item[key]`` when items are mappings.

    Raises:
        ValueError: an item is not 1-D or its token count differs from the planned length (a
            longer item is accepted only for a sample the sampler truncated).
    """

    pad_id: int = 0
    ignore_index: int = -100
    key: str | None = None

    def __call__(self, batch: PlannedItems) -> PackedMicroBatch:
        if not isinstance(batch, PlannedItems):
            raise TypeError(
                "ZigzagCollate needs PlannedItems: wrap the dataset with sampler.wrap(dataset)"
            )
        meta = batch.meta
        cp, rank = meta.cp, meta.rank_in_group
        if meta.is_empty:
            empty = torch.empty(0, dtype=torch.int64)
            zero = torch.zeros(1, dtype=torch.int32)
            return PackedMicroBatch(empty, empty, empty, zero, zero, 0, 0, meta)
        tokens, labels = [], []
        for j, (item, length) in enumerate(zip(batch.items, meta.seqlens)):
            x = torch.as_tensor(item if self.key is None else item[self.key]).long()
            if x.dim() != 1 or (
                x.numel() != length and not (j in meta.truncated and x.numel() > length)
            ):
                raise ValueError(
                    f"sample {meta.sample_indices[j]}: dataset item has shape {tuple(x.shape)}, "
                    f"expected 1-D with {length} tokens (its length in the sampler's lengths)"
                )
            x = x[:length]
            tokens.append(x)
            labels.append(torch.cat([x[1:], x.new_full((1,), self.ignore_index)]))
        seqlens = meta.seqlens
        padded = torch.tensor([padded_length(s, cp) for s in seqlens], dtype=torch.int32)
        zero = torch.zeros(1, dtype=torch.int32)
        return PackedMicroBatch(
            input_ids=zigzag_shard(
                torch.cat(tokens), seqlens=seqlens, cp=cp, rank=rank, pad_value=self.pad_id
            ),
            labels=zigzag_shard(
                torch.cat(labels), seqlens=seqlens, cp=cp, rank=rank, pad_value=self.ignore_index
            ),
            position_ids=zigzag_positions(seqlens=seqlens, cp=cp, rank=rank),
            cu_seqlens_padded=torch.cat([zero, padded.cumsum(0, dtype=torch.int32)]),
            cu_seqlens_local=torch.cat([zero, (padded // cp).cumsum(0, dtype=torch.int32)]),
            max_seqlen_padded=int(padded.max()),
            max_seqlen_local=int(padded.max()) // cp,
            meta=meta,
        )
