"""FullAttentionModel: predicted seconds of a micro-batch whose layers are all full attention.


For a micro-batch of sequences s_i run by a ring of c ranks (each s_i padded to p_i, a multiple of
2c), per rank::

    linear       lin * sum(p_i) / c                                  GEMMs, norms, MLP, head
    attention    layers * c * (sum_i [A(p_i / c) + rs] + k)           c ring steps per layer
    ring comm    layers * (c-1) * [exposed fwd step + exposed bwd step] + final dK/dV hop
    constant     microbatch overhead

Why ``c * A(p/c)``: in a zigzag ring every step on every rank is one block of p/c queries against
p/c keys with half of the pairs masked, i.e. the work of a causal sequence of length p/c. Summing
A over sequences and paying the fixed kernel cost ``k`` once per step models one varlen call per
step for the whole pack; short blocks thus pay their real inefficiency (A is measured, not FLOPs).
``rs`` (``attention.ring_sequence_step_seconds``) is a fixed cost per sequence and ring step at
c > 1 only: the per-chunk correction and launch kernels of a ring; CP 1 pays no ring cost (no
rs, no link latency, no transfer). With ``attention.tiles`` (``dyncp.cost_model.kernels``), A of
a chunk of n tokens is taken at the causal length its kernel tiles cover, forward and backward
each with the block sizes read from the kernel's source: ``ceil(n / block)`` tiles along each
dimension, so a 16-token zigzag piece pays a whole tile and a multiple of the block costs what
it did without tiles.

A ring step moves the KV block of the local tokens (kv_bytes_per_token * sum(p_i)/c); the backward
also moves dK/dV. With overlap, a step costs max(compute, transfer); without, their sum. Groups
larger than ``ranks_per_node`` cross the node boundary and use the inter-node link (the cliff),
unless the profile lists a link per group size (``communication.links``).

An all-to-all group (``communication.kind = "all_to_all"``) instead runs, per layer, the whole of
each sequence for 1/c of the heads plus one exchange that is never hidden::

    attention    layers * (sum_i A(p_i) / c + k)
    a2a comm     layers * (latency + kv_bytes_per_token * sum(p_i) / (c * bandwidth))   c > 1

A hybrid group (``heads`` = u > 1: heads exchanged by all-to-all, rings over the rest) is priced
by the terms of ``dyncp.cost_model.head_split``, mixed in.

``p_i`` is s_i padded as the profile says (``padding.multiple_per_rank``; memory always uses the
plan contract's zigzag padding). The protocol the planner, bound and simulator rely on, including
the additive lower-bound split ``fixed_seconds`` + ``bound_rank_seconds``, is in
``dyncp.cost_model.protocol``.

Planner, cost model and simulator import no torch; everything here is numpy.

Users build a :class:`~dyncp.cost_model.model.CostModel`: a subclass of this one for a profile
of full attention, and a ``LayerMixCostModel`` (``dyncp.cost_model.layer_mix``, also derived
from this class) for a profile with a layer mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dyncp.cost_model.head_split import HeadSplit, HeadSplitPricing
from dyncp.cost_model.kernels import tile_length
from dyncp.cost_model.schema import AttentionTable, Link, Profile, load_profile
from dyncp.plan import padded_lengths

__all__ = ["FullAttentionModel"]


class FullAttentionModel(HeadSplitPricing):
    """Predicts micro-batch seconds and memory of a profile of full-attention layers.

    Args:
        profile: the validated profile.
        ranks_per_node: groups larger than this use the profile's inter-node link.
    """

    def __init__(self, profile: Profile, ranks_per_node: int) -> None:
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        self.profile = profile
        self.ranks_per_node = ranks_per_node
        self.layers = profile.model.num_layers
        # The whole step's per-token embedding and LM head + loss are paid by every micro-batch
        # like its linear work (a version-1 profile has none: ``lin`` exactly as before).
        step = profile.step
        self.embed_head = (
            0.0
            if step is None
            else step.embedding_seconds_per_token + step.head_loss_seconds_per_token
        )
        self.lin = profile.linear_seconds_per_token
        if self.embed_head:
            self.lin = self.lin + self.embed_head
        att = profile.attention
        self.k = att.step_overhead_seconds
        self.per_sequence = att.sequence_overhead_seconds
        self.ring_sequence = att.ring_sequence_step_seconds
        self.fwd_fraction = 1.0 / (1.0 + att.backward_forward_ratio)
        tiles = att.tiles
        self._tiles = (
            None
            if tiles is None or not tiles.pads
            else (
                (tiles.forward_block_q, tiles.forward_block_kv),
                (tiles.backward_block_q, tiles.backward_block_kv),
            )
        )
        comm = profile.communication
        self.kvb = comm.kv_bytes_per_token
        self.bwd_bytes = comm.backward_bytes_factor
        self.overlap = comm.overlap
        self.all_to_all = comm.kind == "all_to_all"
        self._links = {link.group_size: link for link in comm.links}
        self._a2a_links = {link.group_size: link for link in comm.all_to_all_links}
        self._splits: dict[tuple[int, int], HeadSplit] = {}
        self.pad_multiple = profile.padding.multiple_per_rank
        self.microbatch_overhead = profile.overheads.microbatch_seconds
        self.wave_overhead = profile.overheads.wave_seconds
        if isinstance(att, AttentionTable):
            lengths = np.asarray(att.lengths, dtype=np.float64)
            net = (
                np.asarray(att.seconds, dtype=np.float64)
                - att.step_overhead_seconds
                - att.sequence_overhead_seconds
            )
            self._log_len = np.log(lengths)
            self._log_net = np.log(net)
            self._len0, self._net0 = lengths[0], net[0]
            self._len1, self._net1 = lengths[-1], net[-1]
            self._quad: tuple[float, float] | None = None
        else:
            self._quad = (att.alpha, att.beta)

    @classmethod
    def load(cls, name_or_path: str | Path, ranks_per_node: int) -> FullAttentionModel:
        """Build from a bundled profile name or a profile path."""
        return cls(load_profile(name_or_path), ranks_per_node)

    @property
    def name(self) -> str:
        return self.profile.name

    # ------------------------------------------------------------------------------ pieces
    def attention_seconds(self, length: np.ndarray | float) -> np.ndarray:
        """Attention fwd+bwd seconds per layer of causal sequences at CP 1, without the step cost.

        Includes the profile's fixed cost per sequence (kernels that loop over sequences pay it
        once per sequence in every ring step).
        """
        x = np.asarray(length, dtype=np.float64)
        return self._net_attention(x) + self.per_sequence

    def _net_attention(self, x: np.ndarray) -> np.ndarray:
        """Net (fixed costs removed) attention of causal chunks of ``x`` tokens; with the
        profile's kernel tiles, the forward and the backward each at the causal length their
        padded tiles cover (``kernels.tile_length``): a chunk smaller than a tile pays a tile."""
        if self._tiles is None:
            return self._net_length(x)
        (fq, fkv), (bq, bkv) = self._tiles
        fwd = self._net_length(tile_length(x, fq, fkv))
        bwd = self._net_length(tile_length(x, bq, bkv))
        return self.fwd_fraction * fwd + (1.0 - self.fwd_fraction) * bwd

    def _net_length(self, x: np.ndarray) -> np.ndarray:
        if self._quad is not None:
            alpha, beta = self._quad
            return alpha * x * x + beta * x
        inside = np.exp(np.interp(np.log(np.maximum(x, 1e-9)), self._log_len, self._log_net))
        below = self._net0 * x / self._len0  # fixed cost already removed: linear below the table
        above = self._net1 * (x / self._len1) ** 2  # quadratic growth past the longest measured
        return np.where(x < self._len0, below, np.where(x > self._len1, above, inside))

    def link(self, cp: int) -> tuple[float, float]:
        """(latency, bandwidth) of one transfer in a group of ``cp`` ranks.

        From ``communication.links`` when the profile lists them (the entry of that size, else of
        the next larger size listed: never an optimistic guess), else intra- or inter-node.

        Any size of a menu (``dyncp.plan.menu``): ``ranks_per_node`` is the NVLink domain, and the
        placement rules put a group of ``cp <= ranks_per_node`` inside one domain (the
        ``intra_node`` link: NVLink, whether cp divides the domain or not -- 3, 9, 64 on an
        NVL72) and a larger one on whole domains (``inter_node``). A table measured at some sizes
        prices a size it lacks (3, 6, 12) with the next larger measured size: a figure that was
        measured (on a ring at least as large), never an interpolated one.
        """
        comm = self.profile.communication
        if self._links:
            link = self._listed(self._links, cp, "links", f"a group of {cp} ranks")
        else:
            link = comm.intra_node if cp <= self.ranks_per_node else comm.inter_node
        return link.latency_seconds, link.bandwidth_bytes_per_second

    def _listed(self, table: dict[int, Link], size: int, what: str, whom: str) -> Link:
        """The entry of ``size`` in a per-group-size table, else of the next larger size listed
        (never an optimistic guess); a ValueError naming the sizes when none is large enough."""
        key = next((s for s in sorted(table) if s >= size), None)
        if key is None:
            raise ValueError(
                f"profile {self.name!r} lists {what} for group sizes {sorted(table)}; none "
                f"covers {whom}"
            )
        return table[key]

    @staticmethod
    def padded(cp: int, lengths: np.ndarray) -> np.ndarray:
        """Memory footprint of each sequence in a group of ``cp`` (the plan contract's padding)."""
        return padded_lengths(lengths, cp)

    def priced(self, cp: int, lengths: np.ndarray) -> np.ndarray:
        """Tokens each sequence is priced at in a group of ``cp`` (the profile's padding)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if cp == 1 or self.pad_multiple == 0:
            return lengths
        unit = self.pad_multiple * cp
        return -(-lengths // unit) * unit

    def _sequence_attention(self, cp: int, p: np.ndarray) -> np.ndarray:
        """Per sequence: A(p/c) (one ring step's block) or A(p)/c (all-to-all: 1/c of heads);
        a ring of c > 1 adds the fixed cost per (sequence x ring step), which CP 1 never pays."""
        if self.all_to_all:
            return self.attention_seconds(p) / cp
        if cp > 1 and self.ring_sequence:
            return self.attention_seconds(p / cp) + self.ring_sequence
        return self.attention_seconds(p / cp)

    def _seconds(self, cp: int, tokens: np.ndarray, step_attention: np.ndarray) -> np.ndarray:
        """Micro-batch seconds given priced tokens and the summed ``_sequence_attention``."""
        step = step_attention + self.k
        total = self.lin * tokens / cp + self.microbatch_overhead
        if cp == 1:
            return total + self.layers * step
        latency, bandwidth = self.link(cp)
        block = self.kvb * tokens / cp / bandwidth
        if self.all_to_all:
            return total + self.layers * (step + latency + block)
        return total + self.layers * self._ring_layer(cp, step, latency, block)

    def _ring_layer(
        self, steps: int, step: np.ndarray, latency: float, block: np.ndarray
    ) -> np.ndarray:
        """One layer of a ring of ``steps`` ranks: compute ``step`` and move ``block`` seconds
        of K/V per step (fwd; dK/dV too in the bwd), then send dK/dV home."""
        comm_f = latency + block
        comm_b = latency + self.bwd_bytes * block
        home = latency + max(self.bwd_bytes - 1.0, 0.0) * block  # dK/dV back to their owner
        if self.overlap:
            comp_f = step * self.fwd_fraction
            comp_b = step - comp_f
            ring = (steps - 1) * (np.maximum(comp_f, comm_f) + np.maximum(comp_b, comm_b))
            return step + ring + home
        return steps * step + (steps - 1) * (comm_f + comm_b) + home

    def _ring_exposed(self, att: np.ndarray, block: np.ndarray) -> np.ndarray:
        """Per sequence and ring step: transfer seconds its own compute ``att`` cannot hide."""
        if self.overlap:
            return np.maximum(block - att * self.fwd_fraction, 0.0) + np.maximum(
                self.bwd_bytes * block - att * (1 - self.fwd_fraction), 0.0
            )
        return (1 + self.bwd_bytes) * block

    def _ring_bound(self, steps: int, block: np.ndarray) -> np.ndarray:
        """Per sequence: ring transfer seconds a layer pays whatever the compute (bound_rank)."""
        home = max(self.bwd_bytes - 1.0, 0.0) * block
        if self.overlap:
            return home
        return (steps - 1) * (1.0 + self.bwd_bytes) * block + home

    # ------------------------------------------------------------------------------ public API
    def microbatch_seconds(
        self, cp: int, lengths: Sequence[int] | np.ndarray, *, heads: int = 1
    ) -> float:
        """Predicted seconds of one forward+backward of ``lengths`` packed at CP size ``cp``
        (split into ``heads`` x ``cp // heads`` when ``heads`` > 1)."""
        if heads != 1:
            arr = np.asarray(lengths)
            if arr.size == 0:
                self.head_split(cp, heads)
                return 0.0
            return float(self._split_packs(cp, heads, arr, np.array([0]))[0])
        p = self.priced(cp, np.asarray(lengths))
        if p.size == 0:
            return 0.0
        tokens = np.float64(p.sum())
        step_att = np.float64(self._sequence_attention(cp, p).sum())
        return float(self._seconds(cp, tokens, step_att))

    def packs_seconds(
        self, cp: int, lengths: np.ndarray, starts: np.ndarray, *, heads: int = 1
    ) -> np.ndarray:
        """Seconds of many micro-batches at CP ``cp`` at once (vectorised microbatch_seconds).

        ``lengths`` concatenates the packs; ``starts`` holds each pack's first index (non-empty
        packs, increasing).
        """
        if heads != 1:
            return self._split_packs(cp, heads, lengths, starts)
        p = self.priced(cp, lengths).astype(np.float64)
        tokens = np.add.reduceat(p, starts)
        step_att = np.add.reduceat(self._sequence_attention(cp, p), starts)
        return self._seconds(cp, tokens, step_att)

    def memory_tokens(self, cp: int, lengths: Sequence[int] | np.ndarray) -> int:
        """Tokens per rank (padding included) of ``lengths`` packed at CP size ``cp`` (whatever
        the head split: every rank keeps its zigzag shard at ``cp``)."""
        p = self.padded(cp, np.asarray(lengths))
        return int(-(-int(p.sum()) // cp))

    def alone_seconds(self, cp: int, lengths: np.ndarray, *, heads: int = 1) -> np.ndarray:
        """Seconds of each sequence as its own micro-batch at CP size ``cp`` (vectorised)."""
        if heads != 1:
            arr = np.asarray(lengths)
            if arr.size == 0:
                self.head_split(cp, heads)
                return np.zeros(0)
            return self._split_packs(cp, heads, arr, np.arange(arr.size))
        p = self.priced(cp, lengths).astype(np.float64)
        return self._seconds(cp, p, self._sequence_attention(cp, p))

    def marginal_seconds(self, cp: int, lengths: np.ndarray, *, heads: int = 1) -> np.ndarray:
        """Additive estimate of what each sequence adds to a micro-batch at CP ``cp``.

        Linear and attention work plus communication that its own compute cannot hide; the
        per-micro-batch and per-step constants are excluded (they are shared by the pack).
        Used by planners for balancing; plans are always priced with microbatch_seconds.
        """
        if heads != 1:
            return self._split_marginal(cp, heads, lengths)
        p = self.priced(cp, lengths).astype(np.float64)
        att = self._sequence_attention(cp, p)
        if self.all_to_all:
            out = self.lin * p / cp + self.layers * att
            if cp > 1:
                out = out + self.layers * self.kvb * p / cp / self.link(cp)[1]
            return out
        out = self.lin * p / cp + self.layers * cp * att
        if cp > 1:
            _, bandwidth = self.link(cp)
            block = self.kvb * p / cp / bandwidth
            out = out + self.layers * (cp - 1) * self._ring_exposed(att, block)
        return out

    def work_rank_seconds(self, cp: int, lengths: np.ndarray, *, heads: int = 1) -> np.ndarray:
        """A lower bound on the rank-seconds each sequence costs in any micro-batch at CP ``cp``.

        Linear plus attention work only (no communication, no shared constants), times cp ranks.
        """
        if heads != 1:
            return self._split_work(cp, heads, lengths)
        p = self.priced(cp, lengths).astype(np.float64)
        steps = 1 if self.all_to_all else cp
        return self.lin * p + self.layers * cp * steps * self._sequence_attention(cp, p)

    def fixed_seconds(self, cp: int, *, heads: int = 1) -> float:
        """Seconds every micro-batch at CP size ``cp`` pays whatever it holds (see below)."""
        if heads != 1:
            return self._split_fixed(cp, heads)
        fixed = self.k if (cp == 1 or self.all_to_all) else cp * self.k
        if cp > 1:
            latency, _ = self.link(cp)
            fixed += latency if (self.all_to_all or self.overlap) else (2 * cp - 1) * latency
        return self.microbatch_overhead + self.layers * fixed

    def bound_rank_seconds(self, cp: int, lengths: np.ndarray, *, heads: int = 1) -> np.ndarray:
        """Additive lower bound of each sequence's rank-seconds in any micro-batch at CP ``cp``.

        For every pack S at size c: ``microbatch_seconds(c, S) >= fixed_seconds(c) +
        sum(bound_rank_seconds(c, S)) / c``, with equality when communication is not
        overlapped (all-to-all, or a ring without overlap: every term is then a sum over
        sequences plus constants). With overlap a ring step costs max(compute, transfer) >=
        compute, so the bound keeps the compute of all c steps, the dK/dV return hop and the
        latencies (the ``home`` hop is never hidden). The same holds for every head split
        (``heads`` > 1: its ring has cp // heads steps; the head exchange is never hidden).
        """
        if heads != 1:
            return self._split_bound(cp, heads, lengths)
        p = self.priced(cp, lengths).astype(np.float64)
        out = self.work_rank_seconds(cp, lengths)
        if cp == 1:
            return out
        block = self.kvb * p / cp / self.link(cp)[1]
        per_rank = block if self.all_to_all else self._ring_bound(cp, block)
        return out + cp * self.layers * per_rank
