"""Pricing models whose layers are not all full attention: sliding windows and SSM mixers.

A profile with ``layer_mix`` (``schema.LayerMix``) is priced by :class:`LayerMixCostModel`, which
``CostModel(profile, ...)`` returns for it. Per rank, for a pack of priced lengths ``p_i`` at CP
size ``c`` with ``T = sum p_i``::

    CostModel terms      linear (all GEMMs, MoE and FP8 included) + overhead
                         + full_attention_layers x (the ring layer of full_attention.py)
    window group (w, n)  n x ring layer with  W = sum_i Aw(p_i, c)  and  1 + h  steps
    SSM layers (n)       n x (ssm_seconds_per_token x T / c + min(state passing, all-to-all))

``Aw(p, c)``: a windowed sequence longer than its window does ``A(w) (1 + 2 (p - w) / (w + 1))``
work (the causal pairs of the first ``w`` tokens, then ``w`` keys per query), split over the
ring's ranks, never more than full causal attention ``c A(p / c)``; ``A`` is the profile's
measured attention table. ``h`` is the K/V transfers the window needs in the zigzag layout
(``dyncp.ring_attention.window``): chunk distance ``d = ceil((w - 1) / m)`` for chunks of
``m = p / 2c`` tokens reaches ``d`` ranks each way, so ``h = min(c - 1, 2 max_i d_i)``. The backward
sends only dK/dV (the forward keeps the K/V blocks it received). An SSM layer under CP runs its
scan on local tokens and exchanges every chunk's ``(decay, state)`` in one all-gather forward and
one backward (``dyncp.ssm.diagonal_scan``): ``(c - 1)(latency + 2 n_seq bytes / bandwidth)`` each,
not hidden. Or, when the profile gives ``ssm_all_to_all_bytes_per_token``, two all-to-alls to
channel parallelism forward and two backward (``dyncp.ssm.channel_parallel_scan``):
``4 latency + 2 B T (c - 1) / (c^2 bandwidth)``, growing with tokens rather than documents. Each
pack pays the cheaper of the two (``ssm_exchange`` says which, for the caller to run).

``layers`` keeps its meaning for the ring formula (it multiplies the full-attention ring layer),
so it is ``full_attention_layers`` here; the window and SSM terms are added on top. Calibration
(``dyncp.cost_model.calibration.fit``) fits the full-attention terms only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dyncp.cost_model.full_attention import FullAttentionModel
from dyncp.cost_model.schema import Profile

__all__ = ["LayerMixCostModel"]


class LayerMixCostModel(FullAttentionModel):
    """A CostModel for profiles with ``layer_mix`` (see the module docstring for the formula).

    Derived from ``FullAttentionModel`` (``super()`` prices the full-attention layers) and
    registered as a virtual subclass of ``CostModel`` (``dyncp.cost_model.model``), which
    returns it for such a profile.
    """

    def __init__(self, profile: Profile, ranks_per_node: int) -> None:
        if profile.layer_mix is None:
            raise ValueError(f"profile {profile.name!r} has no layer_mix; use CostModel")
        super().__init__(profile, ranks_per_node)
        mix = profile.layer_mix
        self.layers = mix.full_attention_layers
        self.windows = [(g.window, g.layers) for g in mix.window]
        self.ssm_layers = mix.ssm_layers
        self.ssm_per_token = mix.ssm_seconds_per_token
        self.ssm_state_bytes = mix.ssm_chunk_state_bytes
        self.ssm_a2a_bytes = mix.ssm_all_to_all_bytes_per_token

    # ------------------------------------------------------------------------------ pieces
    def window_work(self, cp: int, p: np.ndarray, window: int) -> np.ndarray:
        """Per-rank windowed attention seconds of each priced length (one layer, no step cost)."""
        p = np.asarray(p, dtype=np.float64)
        full = cp * self.attention_seconds(p / cp)
        pairs = 1.0 + 2.0 * np.maximum(p - window, 0.0) / (window + 1.0)
        windowed = self.attention_seconds(np.minimum(p, window)) * pairs / cp
        return np.where(p <= window, full, np.minimum(full, windowed))

    @staticmethod
    def window_distance(cp: int, p: np.ndarray, window: int) -> np.ndarray:
        """Chunk distance each sequence's window reaches in the zigzag layout (0 at cp 1)."""
        p = np.asarray(p, dtype=np.float64)
        if cp == 1 or window <= 1:
            return np.zeros(p.shape)
        chunk = np.maximum(p / (2 * cp), 1.0)
        return np.minimum(np.ceil((window - 1) / chunk), 2 * cp - 1)

    def _window_layer(
        self, cp: int, tokens: np.ndarray, work: np.ndarray, distance: np.ndarray
    ) -> np.ndarray:
        """One windowed layer of packs with summed work and their longest chunk distance."""
        hops = np.minimum(cp - 1, 2 * distance)
        comp = work + (1 + hops) * self.k
        if cp == 1:
            return comp
        latency, bandwidth = self.link(cp)
        block = self.kvb * tokens / cp / bandwidth
        comm_f = hops * (latency + block)
        comm_b = hops * (latency + max(self.bwd_bytes - 1.0, 0.0) * block)
        if not self.overlap:
            return comp + comm_f + comm_b
        comp_f = comp * self.fwd_fraction
        return np.maximum(comp_f, comm_f) + np.maximum(comp - comp_f, comm_b)

    def _ssm_state_passing(self, cp: int, p: np.ndarray) -> tuple[float, np.ndarray]:
        """(fixed, per sequence) seconds of the two chunk-state all-gathers of one layer."""
        if cp == 1:
            return 0.0, np.zeros(np.shape(p))
        latency, bandwidth = self.link(cp)
        per_seq = np.full(np.shape(p), 2.0 * (cp - 1) * 2.0 * self.ssm_state_bytes / bandwidth)
        return 2.0 * (cp - 1) * latency, per_seq

    def _ssm_all_to_all(self, cp: int, p: np.ndarray) -> tuple[float, np.ndarray] | None:
        """(fixed, per sequence) seconds of the four all-to-alls of one layer, if offered."""
        if cp == 1 or self.ssm_a2a_bytes <= 0:
            return None
        latency, bandwidth = self.link(cp)
        per_seq = 2.0 * self.ssm_a2a_bytes * np.asarray(p, dtype=np.float64) * (cp - 1) / cp**2
        return 4.0 * latency, per_seq / bandwidth

    def _ssm_exchange_packs(self, cp: int, p: np.ndarray, starts: np.ndarray) -> np.ndarray:
        fixed, per_seq = self._ssm_state_passing(cp, p)
        out = fixed + np.add.reduceat(per_seq, starts)
        a2a = self._ssm_all_to_all(cp, p)
        if a2a is not None:
            out = np.minimum(out, a2a[0] + np.add.reduceat(a2a[1], starts))
        return out

    def _ssm_exchange_bound(self, cp: int, p: np.ndarray) -> tuple[float, np.ndarray]:
        """An additive lower bound of the cheaper exchange: min of the fixed parts, and of
        each sequence's parts (a sum of minima never exceeds the minimum of the sums)."""
        fixed, per_seq = self._ssm_state_passing(cp, p)
        a2a = self._ssm_all_to_all(cp, p)
        if a2a is None:
            return fixed, per_seq
        return min(fixed, a2a[0]), np.minimum(per_seq, a2a[1])

    def ssm_exchange(self, cp: int, lengths: Sequence[int] | np.ndarray) -> str:
        """How an SSM layer of this micro-batch should exchange at ``cp``: ``"state"``
        (``diagonal_scan``) or ``"all_to_all"`` (``channel_parallel_scan``); ``"none"`` at 1."""
        if cp == 1:
            return "none"
        p = self.priced(cp, np.asarray(lengths)).astype(np.float64)
        fixed, per_seq = self._ssm_state_passing(cp, p)
        a2a = self._ssm_all_to_all(cp, p)
        if a2a is None or fixed + per_seq.sum() <= a2a[0] + a2a[1].sum():
            return "state"
        return "all_to_all"

    def _extra_packs(self, cp: int, p: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Window and SSM seconds of each pack (``p`` priced, concatenated)."""
        tokens = np.add.reduceat(p, starts)
        out = np.zeros(len(starts))
        for window, layers in self.windows:
            work = np.add.reduceat(self.window_work(cp, p, window), starts)
            distance = np.maximum.reduceat(self.window_distance(cp, p, window), starts)
            out += layers * self._window_layer(cp, tokens, work, distance)
        if self.ssm_layers:
            scan = np.add.reduceat(self.ssm_per_token * p / cp, starts)
            out += self.ssm_layers * (scan + self._ssm_exchange_packs(cp, p, starts))
        return out

    # ------------------------------------------------------------------------------ protocol
    def _ring_only(self, cp: int, heads: int) -> None:
        """Refuse a head split (``head_split`` names why): the mix is priced for rings only."""
        if heads != 1:
            self.head_split(cp, heads)

    def microbatch_seconds(
        self, cp: int, lengths: Sequence[int] | np.ndarray, *, heads: int = 1
    ) -> float:
        self._ring_only(cp, heads)
        p = self.priced(cp, np.asarray(lengths)).astype(np.float64)
        if p.size == 0:
            return 0.0
        extra = self._extra_packs(cp, p, np.array([0]))[0]
        return super().microbatch_seconds(cp, lengths) + float(extra)

    def packs_seconds(
        self, cp: int, lengths: np.ndarray, starts: np.ndarray, *, heads: int = 1
    ) -> np.ndarray:
        self._ring_only(cp, heads)
        p = self.priced(cp, lengths).astype(np.float64)
        return super().packs_seconds(cp, lengths, starts) + self._extra_packs(cp, p, starts)

    def alone_seconds(self, cp: int, lengths: np.ndarray, *, heads: int = 1) -> np.ndarray:
        self._ring_only(cp, heads)
        p = self.priced(cp, lengths).astype(np.float64)
        extra = self._extra_packs(cp, p, np.arange(len(p))) if len(p) else np.zeros(0)
        return super().alone_seconds(cp, lengths) + extra

    def marginal_seconds(self, cp: int, lengths: np.ndarray, *, heads: int = 1) -> np.ndarray:
        self._ring_only(cp, heads)
        p = self.priced(cp, lengths).astype(np.float64)
        out = super().marginal_seconds(cp, lengths)
        for window, layers in self.windows:
            work = self.window_work(cp, p, window)
            if cp > 1:
                hops = np.minimum(cp - 1, 2 * self.window_distance(cp, p, window))
                block = hops * self.kvb * p / cp / self.link(cp)[1]
                back = max(self.bwd_bytes - 1.0, 0.0) * block
                if self.overlap:
                    work = (
                        work
                        + np.maximum(block - work * self.fwd_fraction, 0.0)
                        + np.maximum(back - work * (1 - self.fwd_fraction), 0.0)
                    )
                else:
                    work = work + block + back
            out = out + layers * work
        _, exchange = self._ssm_exchange_bound(cp, p)
        return out + self.ssm_layers * (self.ssm_per_token * p / cp + exchange)

    def work_rank_seconds(self, cp: int, lengths: np.ndarray, *, heads: int = 1) -> np.ndarray:
        self._ring_only(cp, heads)
        p = self.priced(cp, lengths).astype(np.float64)
        out = super().work_rank_seconds(cp, lengths)
        for window, layers in self.windows:
            out = out + cp * layers * self.window_work(cp, p, window)
        return out + cp * self.ssm_layers * self.ssm_per_token * p / cp

    def fixed_seconds(self, cp: int, *, heads: int = 1) -> float:
        self._ring_only(cp, heads)
        window_steps = sum(layers for _, layers in self.windows) * self.k
        exchange, _ = self._ssm_exchange_bound(cp, np.zeros(0))
        return super().fixed_seconds(cp) + window_steps + self.ssm_layers * exchange

    def bound_rank_seconds(self, cp: int, lengths: np.ndarray, *, heads: int = 1) -> np.ndarray:
        """Window layers cost at least their work and one step; SSM exchanges at least the
        per-sequence minimum of the two ways (exact when only state passing is offered).

        ``FullAttentionModel.bound_rank_seconds`` starts from ``self.work_rank_seconds``, which
        already holds the window and scan work; only the SSM all-gather bytes are added here.
        """
        self._ring_only(cp, heads)
        p = self.priced(cp, lengths).astype(np.float64)
        out = super().bound_rank_seconds(cp, lengths)
        _, exchange = self._ssm_exchange_bound(cp, p)
        return out + cp * self.ssm_layers * exchange
