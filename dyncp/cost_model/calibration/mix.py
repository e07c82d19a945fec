"""Calibration of layer-mix profiles (sliding windows, SSM mixers): the exact model, refitted.

A layer mix's price (``dyncp.cost_model.layer_mix``) adds window and SSM terms whose
communication hops depend on the pack, so it is not written out in coefficients as the dense
formula is (``features.predict``). Instead each evaluation builds the profile the coefficients
describe (``coefficients.apply_coefficients``) and prices the measurements with
``LayerMixCostModel`` itself, vectorised per CP size (``packs_seconds``): slower per evaluation
than the dense path (a profile validation and one call per CP size, about a millisecond), exact
by construction, and with the same robust passes, regimes and natural scaling
(``fit.fit_profile``).

Coefficients: the dense ones (``lin``, ``att`` scaling the attention table that full and window
layers share, ``seq``, ``step``, ``mb``, each measured ring size's latency and 1 / bandwidth),
then ``ssm``: ``layer_mix.ssm_seconds_per_token``. The overlap rule is kept as profiled.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dyncp.cost_model.calibration.coefficients import apply_coefficients, profile_coefficients
from dyncp.cost_model.calibration.measurements import Measurement
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile

__all__ = ["MixFeatures", "mix_coefficients", "mix_profile", "mix_scales"]


class MixFeatures:
    """What ``features.predict`` and the robust passes need, for a layer-mix profile."""

    def __init__(
        self,
        profile: Profile,
        ms: Sequence[Measurement],
        sizes: Sequence[int],
        ranks_per_node: int,
        regime: np.ndarray,
        weight: np.ndarray,
    ) -> None:
        self.profile = profile
        self.ms = list(ms)
        self.sizes = list(sizes)
        self.ranks_per_node = ranks_per_node
        self.model = CostModel(profile, ranks_per_node)
        self.measured = np.array([m.seconds for m in self.ms], dtype=np.float64)
        self.regime = regime
        self.weight = weight
        self.n_sizes = len(self.sizes)
        self.split = np.full(len(self.ms), -1)  # no head splits in a layer mix
        groups: dict[int, list[int]] = {}
        for i, m in enumerate(self.ms):
            groups.setdefault(m.cp, []).append(i)
        self._groups = []
        for cp, idx in sorted(groups.items()):
            lengths = [np.asarray(self.ms[i].lengths) for i in idx]
            starts = np.cumsum([0] + [len(x) for x in lengths[:-1]])
            self._groups.append((cp, np.array(idx), np.concatenate(lengths), starts))

    def subset(self, keep: np.ndarray) -> MixFeatures:
        return MixFeatures(
            self.profile,
            [m for m, k in zip(self.ms, keep) if k],
            self.sizes,
            self.ranks_per_node,
            self.regime[keep],
            self.weight[keep],
        )

    def predict(self, theta: np.ndarray, overlap: bool) -> np.ndarray:
        model = CostModel(
            mix_profile(self.profile, theta, self.sizes, self.model, overlap), self.ranks_per_node
        )
        out = np.empty(len(self.ms))
        for cp, idx, lengths, starts in self._groups:
            out[idx] = model.packs_seconds(cp, lengths, starts)
        return out

    def tokens(self) -> np.ndarray:
        """Priced tokens per rank of each measurement."""
        return np.array(
            [self.model.priced(m.cp, np.asarray(m.lengths)).sum() / m.cp for m in self.ms],
            dtype=np.float64,
        )


def mix_coefficients(model: CostModel, sizes: Sequence[int]) -> np.ndarray:
    """The dense coefficients (``coefficients.profile_coefficients``) then
    ``ssm_seconds_per_token``."""
    mix = model.profile.layer_mix
    assert mix is not None
    return np.append(profile_coefficients(model, sizes), mix.ssm_seconds_per_token)


def mix_scales(f: MixFeatures, model: CostModel) -> np.ndarray:
    """Natural magnitude of each coefficient (see ``features.natural_scales``)."""
    med = float(np.median(f.measured))
    mix = model.profile.layer_mix
    assert mix is not None
    layers = model.profile.model.num_layers
    cp = np.array([m.cp for m in f.ms], dtype=np.float64)
    n = np.array([len(m.lengths) for m in f.ms], dtype=np.float64)
    tokens = f.tokens()
    usage = [
        float(np.median(tokens)),
        1.0,
        float(np.median(layers * cp * n)),
        float(np.median(layers * cp)),
        1.0,
    ]
    for size in f.sizes:
        sel = cp == size
        hops = layers * (2 * size - 1)
        usage += [hops, hops * model.kvb * (float(np.median(tokens[sel])) if sel.any() else 1.0)]
    usage.append(max(mix.ssm_layers, 1) * float(np.median(tokens)))
    out = np.array([med / max(u, 1e-300) for u in usage])
    out[1] = 1.0
    return out


def mix_profile(
    profile: Profile,
    theta: np.ndarray,
    sizes: Sequence[int],
    model: CostModel,
    overlap: bool | None = None,
    wave: float | None = None,
) -> Profile:
    """``profile`` with the coefficients ``theta`` (``mix_coefficients``' layout) written in."""
    wave = profile.overheads.wave_seconds if wave is None else wave
    new = apply_coefficients(profile, theta[:-1], wave, sizes, model, overlap)
    mix = new.layer_mix
    assert mix is not None
    return new.model_copy(
        update={"layer_mix": mix.model_copy(update={"ssm_seconds_per_token": float(theta[-1])})}
    )
