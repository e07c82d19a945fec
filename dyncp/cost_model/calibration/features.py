"""What a dense refit prices: per-measurement features, the vectorised prediction, the scales.

The prediction is the one of :class:`~dyncp.cost_model.model.CostModel` written in the
coefficients of ``coefficients`` (same formulas), vectorised over the measurements: what does not
depend on the coefficients (priced tokens, net attention, ring steps, head-split bytes) is
computed once per fit in :class:`DenseFeatures`, so one evaluation is a few array operations.
:func:`natural_scales` gives the units the solver works in. A layer mix is priced by the exact
model instead (``mix.MixFeatures``); :func:`predict` takes either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dyncp.cost_model.calibration.measurements import Measurement
from dyncp.cost_model.calibration.mix import MixFeatures
from dyncp.cost_model.model import CostModel

__all__ = ["OLD_REGIME_WEIGHT", "DenseFeatures", "dense_features", "natural_scales", "predict"]

#: Weight of a measurement from an older regime (before a detected change of the machine):
#: it informs how cost varies with lengths and CP sizes at half the say of a current one, so
#: that where the change was not the same factor everywhere, current data decide the shape.
OLD_REGIME_WEIGHT = 0.5


@dataclass(frozen=True, slots=True)
class DenseFeatures:
    """Per-measurement quantities that do not depend on the coefficients being fitted."""

    steps: np.ndarray  # ring steps per layer (c for a ring, r for a head split u x r, 1: none)
    link: np.ndarray  # index into the fitted group sizes (-1: no ring link)
    tokens: np.ndarray  # priced tokens per rank
    attention: np.ndarray  # sum over sequences of the profile's net attention per step
    sequences: np.ndarray  # weight of the per-sequence cost per step (n, n / c, n / u)
    rings: np.ndarray  # sequences paying the per-(sequence x ring step) cost (0: no ring)
    block: np.ndarray  # a ring step's K/V bytes per priced token per rank, / kv_bytes_per_token
    split: np.ndarray  # index into the fitted head-split sizes u (-1: not split)
    exchange: np.ndarray  # bytes a rank holds in a layer's head exchanges (forward + backward)
    measured: np.ndarray
    regime: np.ndarray  # 0: the current regime; k: k change points back (own free level)
    weight: np.ndarray  # 1 for the current regime, OLD_REGIME_WEIGHT before
    n_sizes: int  # ring group sizes fitted (then head-split sizes follow in the parameters)

    def subset(self, keep: np.ndarray) -> DenseFeatures:
        cols = [getattr(self, n)[keep] for n in DenseFeatures.__slots__ if n != "n_sizes"]
        return DenseFeatures(*cols, n_sizes=self.n_sizes)


def dense_features(
    model: CostModel,
    ms: Sequence[Measurement],
    sizes: list[int],
    regimes: np.ndarray,
    heads: Sequence[int] = (),
) -> DenseFeatures:
    n = len(ms)
    cols = {
        k: np.zeros(n)
        for k in ("steps", "tokens", "attention", "sequences", "rings", "block", "exchange")
    }
    link = np.full(n, -1, dtype=np.int64)
    split = np.full(n, -1, dtype=np.int64)
    index = {c: j for j, c in enumerate(sizes)}
    head_index = {u: j for j, u in enumerate(heads)}
    shape = model.profile.model
    for i, m in enumerate(ms):
        p = model.priced(m.cp, np.asarray(m.lengths)).astype(np.float64)
        cols["tokens"][i] = p.sum() / m.cp
        cols["block"][i] = 1.0
        if m.heads > 1:
            ring = m.cp // m.heads
            held = max(shape.num_kv_heads, m.heads)
            cols["steps"][i] = ring
            cols["attention"][i] = model._net_attention(p / ring).sum() / m.heads
            cols["sequences"][i] = len(p) / m.heads
            cols["block"][i] = held / shape.num_kv_heads
            bytes_per_token = (2 * shape.num_heads + 2 * held) * shape.head_dim * shape.dtype_bytes
            cols["exchange"][i] = 2.0 * bytes_per_token * cols["tokens"][i]
            split[i] = head_index[m.heads]
            if ring > 1:
                link[i] = index[m.cp]
                cols["rings"][i] = len(p)
        elif model.all_to_all and m.cp > 1:
            cols["steps"][i] = 1
            cols["attention"][i] = model._net_attention(p).sum() / m.cp
            cols["sequences"][i] = len(p) / m.cp
            link[i] = index[m.cp]
        else:
            cols["steps"][i] = m.cp
            cols["attention"][i] = model._net_attention(p / m.cp).sum()
            cols["sequences"][i] = len(p)
            if m.cp > 1:
                link[i] = index[m.cp]
                cols["rings"][i] = len(p)
    return DenseFeatures(
        **cols,
        link=link,
        split=split,
        measured=np.array([m.seconds for m in ms], dtype=np.float64),
        regime=regimes,
        weight=np.where(regimes == 0, 1.0, OLD_REGIME_WEIGHT),
        n_sizes=len(sizes),
    )


def predict(theta: np.ndarray, f: DenseFeatures, model: CostModel, overlap: bool) -> np.ndarray:
    """CostModel's micro-batch seconds written in the coefficients ``theta`` (same formulas,
    vectorised; the parameter layout is ``coefficients.profile_coefficients``')."""
    if isinstance(f, MixFeatures):  # a layer mix: the exact model prices it
        return f.predict(theta, overlap)
    lin, att, seq, k, mb = theta[:5]
    rest = theta[5:-1]
    n_sizes = f.n_sizes
    lat_all, ibw_all = rest[: 2 * n_sizes : 2], rest[1 : 2 * n_sizes : 2]
    heads = rest[2 * n_sizes :]
    a2a_lat, a2a_ibw, scale_all = heads[0::3], heads[1::3], heads[2::3]
    split = f.split >= 0
    h = np.where(split, f.split, 0)
    scale = np.where(split, scale_all[h] if len(scale_all) else 1.0, 1.0)
    step = scale * (att * f.attention + seq * f.sequences) + theta[-1] * f.rings + k
    total = lin * f.tokens + mb
    ring = f.link >= 0
    j = np.where(ring, f.link, 0)
    lat = np.where(ring, lat_all[j] if len(lat_all) else 0.0, 0.0)
    block = np.where(
        ring, model.kvb * f.block * f.tokens * (ibw_all[j] if len(ibw_all) else 0.0), 0.0
    )
    exchange = np.where(
        split,
        4.0 * (a2a_lat[h] if len(a2a_lat) else 0.0)
        + f.exchange * (a2a_ibw[h] if len(a2a_ibw) else 0.0),
        0.0,
    )
    c = f.steps
    if model.all_to_all:
        layer = step + lat + block
    else:
        comm_f = lat + block
        bwd = model.bwd_bytes
        comm_b = lat + bwd * block
        home = lat + max(bwd - 1.0, 0.0) * block
        if overlap:
            comp_f = step * model.fwd_fraction
            layer = (
                step
                + (c - 1) * (np.maximum(comp_f, comm_f) + np.maximum(step - comp_f, comm_b))
                + home
            )
        else:
            layer = c * step + (c - 1) * (comm_f + comm_b) + home
    layer = np.where(ring, layer, step)
    return total + model.layers * (layer + exchange)


def natural_scales(
    f: DenseFeatures, model: CostModel, sizes: list[int], heads: Sequence[int] = ()
) -> np.ndarray:
    """Natural magnitude of each coefficient: the value at which its term alone would explain
    the median measurement.

    The solver works in these units, whatever the profile's values: a coefficient profiled at
    0, or at 1e-17 s against a true millisecond, moves as freely as any other (scaling by the
    current value would freeze a tiny one: every step it may take is tiny too).
    """
    med = float(np.median(f.measured))
    L = model.layers
    usage = [
        float(np.median(f.tokens)),
        1.0,
        float(np.median(L * f.steps * f.sequences)),
        float(np.median(L * f.steps)),
        1.0,
    ]
    for j, size in enumerate(sizes):
        sel = f.link == j
        hops = L * (2 * size - 1) if not model.all_to_all else L
        tokens = float(np.median(f.tokens[sel] * f.block[sel])) if sel.any() else 1.0
        usage += [hops, hops * model.kvb * tokens]
    relative = []
    for j, _ in enumerate(heads):
        sel = f.split == j
        usage += [4.0 * L, L * (float(np.median(f.exchange[sel])) if sel.any() else 1.0), 1.0]
        relative.append(len(usage) - 1)
    rings = f.rings > 0
    usage.append(float(np.median(L * f.steps[rings] * f.rings[rings])) if rings.any() else 1.0)
    out = np.array([med / max(u, 1e-300) for u in usage])
    out[1] = 1.0  # the attention scale is already relative
    out[relative] = 1.0  # and so are the head-split scales
    return out
