"""The coefficient vector of a refit: read from a profile, named, and written back into one.

Calibration (``fit``, and ``mix`` for layer mixes) works on one flat vector of coefficients; this
module is its layout, in one place for both: :func:`profile_coefficients` reads a profile's
values (what a refit starts from and is pulled back to), :func:`named_coefficients` names them
(``CalibrationResult.coefficients_*``) and :func:`apply_coefficients` writes fitted values into a
copy of the profile. The layout: ``PARAMS``, then (latency, 1 / bandwidth) per measured ring
group size, then (exchange latency, 1 / exchange bandwidth, attention scale) per measured head
split, then ``ring`` (``attention.ring_sequence_step_seconds``; ``ssm`` for a layer mix).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import AttentionTable, Profile

__all__ = [
    "LINK_SIZES_UP_TO",
    "MAX_BANDWIDTH",
    "PARAMS",
    "apply_coefficients",
    "named_coefficients",
    "profile_coefficients",
]

#: Names of the coefficients fitted from micro-batches, in parameter-vector order; then a
#: (latency, 1 / bandwidth) pair per measured group size.
PARAMS = ("lin", "att", "seq", "step", "mb")
#: Largest bandwidth a fit may write (bytes/s): "no measurable transfer cost" stays finite.
MAX_BANDWIDTH = 1e15
#: Group sizes a calibrated profile lists links for, besides the measured ones: every power of
#: two up to this (the link rule takes the next larger size listed, so all groups are covered).
LINK_SIZES_UP_TO = 1 << 16


def profile_coefficients(
    model: CostModel, sizes: Sequence[int], heads: Sequence[int] = ()
) -> np.ndarray:
    """The profile's values of ``PARAMS``, then (latency, 1/bandwidth) per ring group size, then
    (exchange latency, 1/exchange bandwidth, attention scale) per head-split size u, then
    ``ring`` (last; not for a layer mix)."""
    links = []
    for c in sizes:
        latency, bandwidth = model.link(c)
        links += [latency, 1.0 / bandwidth]
    for u in heads:
        latency, bandwidth = model.all_to_all_link(u)
        links += [latency, 1.0 / bandwidth, model.head_scale(u)]
    # A layer mix never has a ring term (the schema refuses one): its layout has no ``ring``.
    ring = [model.ring_sequence] if model.profile.layer_mix is None else []
    return np.array(
        [model.lin, 1.0, model.per_sequence, model.k, model.microbatch_overhead, *links, *ring]
    )


def named_coefficients(
    theta: np.ndarray, sizes: Sequence[int], heads: Sequence[int] = (), mix: bool = False
) -> dict[str, float]:
    """``theta`` by name: ``PARAMS``, ``ring`` (``ssm`` for a mix), then per group size
    ``latency_c``/``inverse_bandwidth_c`` and per head split ``exchange_*_u``/``head_scale_u``."""
    out = dict(zip(PARAMS, theta[:5].tolist()))
    out["ssm" if mix else "ring"] = float(theta[-1])
    for j, c in enumerate(sizes):
        out[f"latency_{c}"] = float(theta[5 + 2 * j])
        out[f"inverse_bandwidth_{c}"] = float(theta[6 + 2 * j])
    base = 5 + 2 * len(sizes)
    for j, u in enumerate(heads):
        out[f"exchange_latency_{u}"] = float(theta[base + 3 * j])
        out[f"exchange_inverse_bandwidth_{u}"] = float(theta[base + 3 * j + 1])
        out[f"head_scale_{u}"] = float(theta[base + 3 * j + 2])
    return out


def apply_coefficients(
    profile: Profile,
    theta: np.ndarray,
    wave: float,
    sizes: Sequence[int],
    model: CostModel,
    overlap: bool | None = None,
    heads: Sequence[int] = (),
) -> Profile:
    """A copy of ``profile`` with the fitted coefficients written into its fields.

    Fitted links go to ``communication.links`` by group size; sizes not measured keep the link
    the profile gave them at this node size (``model.link``), so a calibrated profile lists a
    link for every power of two up to ``LINK_SIZES_UP_TO`` and is specific to that node size.
    Fitted head splits go to ``communication.all_to_all_links`` (the same way: every power of
    two listed, unmeasured sizes at ``model.all_to_all_link``) and ``attention.head_scales``.
    """
    lin, att, seq, k, mb = (float(v) for v in theta[:5])
    data = profile.model_dump(mode="json")
    data["linear_seconds_per_token"] = lin
    a = data["attention"]
    old = profile.attention
    if isinstance(old, AttentionTable):
        net = np.asarray(old.seconds) - old.step_overhead_seconds - old.sequence_overhead_seconds
        a["seconds"] = (att * net + k + seq).tolist()
    else:
        a["alpha"], a["beta"] = att * old.alpha, att * old.beta
    a["step_overhead_seconds"], a["sequence_overhead_seconds"] = k, seq
    if profile.layer_mix is None:  # a mix's layout ends with ``ssm``, and has no ring term
        a["ring_sequence_step_seconds"] = float(theta[-1])
    fitted = {c: (float(theta[5 + 2 * j]), float(theta[6 + 2 * j])) for j, c in enumerate(sizes)}
    if fitted:
        comm = data["communication"]
        comm["links"] = _link_table(comm["links"], fitted, model.link)
    base = 5 + 2 * len(sizes)
    exchanges = {
        u: (float(theta[base + 3 * j]), float(theta[base + 3 * j + 1])) for j, u in enumerate(heads)
    }
    if exchanges:
        comm = data["communication"]
        comm["all_to_all_links"] = _link_table(
            comm["all_to_all_links"], exchanges, model.all_to_all_link, skip_unpriced=True
        )
        scales = {h["heads"]: h["scale"] for h in a.get("head_scales", [])}
        scales |= {u: float(theta[base + 3 * j + 2]) for j, u in enumerate(heads)}
        a["head_scales"] = [{"heads": u, "scale": s} for u, s in sorted(scales.items())]
    if overlap is not None:
        data["communication"]["overlap"] = overlap
    data["overheads"] = {"microbatch_seconds": mb, "wave_seconds": wave}
    return Profile.model_validate(data)


def _link_table(
    listed: list[dict],
    fitted: dict[int, tuple[float, float]],
    priced: Callable[[int], tuple[float, float]],
    *,
    skip_unpriced: bool = False,
) -> list[dict]:
    """A profile's link table after a refit: every size it listed, every power of two up to
    ``LINK_SIZES_UP_TO`` and every fitted size. A fitted size takes its fit (latency, inverse
    bandwidth); another keeps what the current model prices. With ``skip_unpriced`` a size the
    model cannot price (``ValueError``: an all-to-all size the profile never priced) stays out;
    without it the error propagates, as a refit failure."""
    sizes = {link["group_size"] for link in listed}
    powers = {1 << e for e in range(1, LINK_SIZES_UP_TO.bit_length())}
    table = []
    for c in sorted(sizes | powers | set(fitted)):
        if c in fitted:
            latency, inverse = fitted[c]
            bandwidth = min(1.0 / inverse, MAX_BANDWIDTH)
        else:
            try:
                latency, bandwidth = priced(c)
            except ValueError:
                if not skip_unpriced:
                    raise
                continue
        table.append(
            {"group_size": c, "latency_seconds": latency, "bandwidth_bytes_per_second": bandwidth}
        )
    return table
