"""The pricing of a hybrid group: heads exchanged by all-to-all, rings over the rest.

A hybrid group (every pricing method's ``heads=u`` > 1; ``dyncp.plan.Group.heads``) of
c = u x r ranks keeps the zigzag layout at c (memory unchanged). Per layer its head groups of u
contiguous ranks exchange heads by all-to-all (scatter heads, gather tokens: each rank then holds
its ring position's shard for 1/u of the heads), rings of r ranks (stride u) run attention, and
the output goes back the same way::

    linear       lin * sum(p_i) / c                                       unchanged
    attention    layers * r * (sum_i A(p_i / r) / u + k)                  r steps of p_i/r tokens
    ring comm    full_attention's ring terms, r steps and a block of      r > 1, link(c): the
                 kv_bytes_per_token * (held / kv) * sum(p_i) / r          ring's hops span c
    a2a comm     layers * (4 latency + 2 b sum(p_i) / (c bandwidth))      never overlapped

The attention of 1/u of the heads is A / u times ``head_scale(u)``: 1 (the plain assumption)
unless calibration measured it (``attention.head_scales``).

``held = max(kv, u) / u`` KV heads per rank (kv < u: replicated); ``b = (2 query heads +
2 max(kv, u)) x head_dim x dtype_bytes`` is a token's q, k, v and output (forward; the backward
moves their gradients, as many bytes) and (latency, bandwidth) is ``all_to_all_link(u)``: four
exchanges a layer (q, k, v fused, and the output, each way), each rank holding b/2 x
sum(p_i)/c bytes on average. r = 1 prices attention A(p_i)/u + k, with no ring. Only ring
profiles of full attention split (``head_split``).

This is a mixin of :class:`~dyncp.cost_model.full_attention.FullAttentionModel` (every pricing
method's ``heads`` > 1 lands here): it reads the model's links, padding and attention pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["HeadSplit", "HeadSplitPricing"]


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """Per-layer constants of a group of ``ranks`` = ``heads`` x ``ring`` (CostModel.head_split).

    ``ring_seconds_per_token``: one ring step's K/V transfer per priced token of the pack (the
    block of the ring position's shard, the heads this rank holds); ``exchange_*``: the four
    all-to-alls of a layer (q, k, v and the output, forward and backward), never overlapped.
    """

    ranks: int
    heads: int
    ring: int
    ring_latency: float
    ring_seconds_per_token: float
    exchange_latency: float
    exchange_seconds_per_token: float
    attention_scale: float = 1.0  # measured cost of 1/heads of the heads, x A / heads


class HeadSplitPricing:
    """Head-split terms of a cost model (the module docstring); mixed into FullAttentionModel."""

    def all_to_all_link(self, heads: int) -> tuple[float, float]:
        """(latency, bandwidth) of an all-to-all over ``heads`` contiguous ranks: one in which
        every rank holds B bytes takes ``latency + B / bandwidth``.

        From ``communication.all_to_all_links`` when the profile lists them (that size, else the
        next larger listed: never an optimistic guess); else derived from the ring link of a
        group of ``heads`` ranks, ``link(heads)``, with bandwidth x heads / (heads - 1): each
        rank keeps 1/heads of its bytes and sends the rest at its ring link's rate, all ranks at
        once (a full-bisection switch such as NVSwitch inside a node).

        A head group larger than ``ranks_per_node`` crosses nodes whatever the table says (a
        table describes the node size it was measured on): it is priced at the slower of the
        listed link and the one derived from the inter-node link.
        """
        if heads < 2:
            raise ValueError(f"an all-to-all needs at least 2 ranks, got {heads}")
        derived_latency, derived_bandwidth = self.link(heads)
        derived = (derived_latency, derived_bandwidth * heads / (heads - 1))
        if not self._a2a_links:
            return derived
        link = self._listed(
            self._a2a_links, heads, "all-to-all links", f"a head group of {heads} ranks"
        )
        listed = (link.latency_seconds, link.bandwidth_bytes_per_second)
        if heads > self.ranks_per_node:
            return (max(listed[0], derived[0]), min(listed[1], derived[1]))
        return listed

    def head_split(self, cp: int, heads: int) -> HeadSplit:
        """The constants of a group of ``cp`` ranks split into ``heads`` x ``cp // heads``.

        Raises ValueError naming the values when the split is not one this profile prices:
        ``heads`` must divide ``cp`` and the model's query heads, and the KV heads must be a
        multiple of ``heads`` or divide it (replicated); the profile must be a ring profile
        of full attention (an all-to-all profile or a layer mix is priced at heads = 1 only).
        """
        if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)) or heads < 1:
            raise ValueError(f"heads must be a positive integer, got {heads!r}")
        if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1:
            raise ValueError(f"the group size must be a positive integer, got {cp!r}")
        key = (int(cp), int(heads))
        if key in self._splits:
            return self._splits[key]
        if cp % heads:
            raise ValueError(f"heads {heads} must divide the group size {cp}")
        if self.all_to_all:
            raise ValueError(
                f"profile {self.name!r} has communication.kind 'all_to_all' (every group "
                f"exchanges heads already); heads {heads} > 1 is priced for ring profiles"
            )
        if self.profile.layer_mix is not None:
            raise ValueError(
                f"profile {self.name!r} has a layer_mix; heads {heads} > 1 is priced for ring "
                "profiles of full attention only"
            )
        shape = self.profile.model
        query, kv = shape.num_heads, shape.num_kv_heads
        if query % heads:
            raise ValueError(f"heads {heads} must divide the model's {query} query heads")
        if kv % heads and heads % kv:
            raise ValueError(
                f"heads {heads} and the model's {kv} KV heads: the KV heads must be a multiple "
                "of heads, or divide heads (each then replicated on heads / KV heads ranks)"
            )
        ring = cp // heads
        held = max(kv, heads)  # KV heads in the exchange: replicated up to one per rank
        bytes_per_token = (2 * query + 2 * held) * shape.head_dim * shape.dtype_bytes
        a2a_latency, a2a_bandwidth = self.all_to_all_link(heads)
        ring_latency, ring_seconds = 0.0, 0.0
        if ring > 1:
            ring_latency, bandwidth = self.link(cp)  # the ring's hops span the whole group
            ring_seconds = self.kvb * (held / heads / kv) / ring / bandwidth
        split = HeadSplit(
            ranks=cp,
            heads=heads,
            ring=ring,
            ring_latency=ring_latency,
            ring_seconds_per_token=ring_seconds,
            exchange_latency=4.0 * a2a_latency,
            exchange_seconds_per_token=2.0 * bytes_per_token / cp / a2a_bandwidth,
            attention_scale=self.head_scale(heads),
        )
        self._splits[key] = split
        return split

    def head_scale(self, heads: int) -> float:
        """Measured cost of the attention of 1/``heads`` of the heads, as a multiple of A /
        ``heads`` (``attention.head_scales``; 1 where not measured)."""
        for h in self.profile.attention.head_scales:
            if h.heads == heads:
                return h.scale
        return 1.0

    def _split_attention(self, s: HeadSplit, p: np.ndarray) -> np.ndarray:
        """Per sequence: one ring step's block of p/r tokens for 1/u of the heads (plus the
        fixed cost per sequence and ring step when the ring has r > 1 steps)."""
        att = s.attention_scale * self.attention_seconds(p / s.ring) / s.heads
        return att + self.ring_sequence if s.ring > 1 else att

    def _split_seconds(
        self, s: HeadSplit, tokens: np.ndarray, step_attention: np.ndarray
    ) -> np.ndarray:
        """Micro-batch seconds of a head split given priced tokens and summed attention."""
        step = step_attention + self.k
        total = self.lin * tokens / s.ranks + self.microbatch_overhead
        exchange = s.exchange_latency + s.exchange_seconds_per_token * tokens
        if s.ring == 1:
            return total + self.layers * (step + exchange)
        block = s.ring_seconds_per_token * tokens
        layer = self._ring_layer(s.ring, step, s.ring_latency, block)
        return total + self.layers * (layer + exchange)

    def _split_packs(
        self, cp: int, heads: int, lengths: np.ndarray, starts: np.ndarray
    ) -> np.ndarray:
        s = self.head_split(cp, heads)
        p = self.priced(cp, lengths).astype(np.float64)
        tokens = np.add.reduceat(p, starts)
        step_att = np.add.reduceat(self._split_attention(s, p), starts)
        return self._split_seconds(s, tokens, step_att)

    def _split_marginal(self, cp: int, heads: int, lengths: np.ndarray) -> np.ndarray:
        s = self.head_split(cp, heads)
        p = self.priced(cp, lengths).astype(np.float64)
        att = self._split_attention(s, p)
        out = self.lin * p / cp + self.layers * (s.ring * att + s.exchange_seconds_per_token * p)
        if s.ring > 1:
            block = s.ring_seconds_per_token * p
            out = out + self.layers * (s.ring - 1) * self._ring_exposed(att, block)
        return out

    def _split_work(self, cp: int, heads: int, lengths: np.ndarray) -> np.ndarray:
        s = self.head_split(cp, heads)
        p = self.priced(cp, lengths).astype(np.float64)
        return self.lin * p + self.layers * cp * s.ring * self._split_attention(s, p)

    def _split_fixed(self, cp: int, heads: int) -> float:
        s = self.head_split(cp, heads)
        fixed = s.ring * self.k + s.exchange_latency
        if s.ring > 1:
            fixed += s.ring_latency if self.overlap else (2 * s.ring - 1) * s.ring_latency
        return self.microbatch_overhead + self.layers * fixed

    def _split_bound(self, cp: int, heads: int, lengths: np.ndarray) -> np.ndarray:
        s = self.head_split(cp, heads)
        p = self.priced(cp, lengths).astype(np.float64)
        per_rank = s.exchange_seconds_per_token * p
        if s.ring > 1:
            per_rank = per_rank + self._ring_bound(s.ring, s.ring_seconds_per_token * p)
        return self._split_work(cp, heads, lengths) + cp * self.layers * per_rank
