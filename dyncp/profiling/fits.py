"""From the profiler's measurements to a Profile: the fits, and the profile they make.

``build_profile`` takes what ``dyncp.profiling.measure.measure`` returns: the attention table
and its quadratic fit, the packs fit (linear work per token, a cost per sequence and one per
micro-batch), the ring-step link and its latency as training pays it, the all-to-all links of
hybrid groups, and the wave constant. Every fit but the soft-L1 link fit of the all-to-all
(``fit_link_robust``: contention bursts on a shared machine) is the relative-error fit of
``dyncp.cost_model.fitting``, and its relative error goes into the provenance.
"""

from __future__ import annotations

import datetime as dt
import os
import platform

import numpy as np
import torch
from scipy.optimize import least_squares, nnls

from dyncp.cost_model.fitting import fit_link, fit_quadratic, fit_relative
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile
from dyncp.profiling.decoder import TinyConfig
from dyncp.profiling.measure import run_context

__all__ = [
    "all_to_all_section",
    "build_profile",
    "calibrate_latency",
    "fit_link_robust",
    "model_section",
]


def fit_link_robust(nbytes: np.ndarray, seconds: np.ndarray) -> tuple[float, float, np.ndarray]:
    """``seconds = latency + bytes / bandwidth`` with a soft-L1 loss on relative error.

    On a shared machine a burst of contention can slow every repeat of one point; the loss
    (``f_scale`` 10%) keeps such a point from pulling the fit the way plain least squares
    does. Starts from ``fit_link``; returns (latency, bandwidth, relative errors).
    """
    latency0, bandwidth0, _ = fit_link(nbytes, seconds)
    scale = np.array([max(float(seconds.min()), 1e-9), 1.0 / max(bandwidth0, 1.0)])

    def residuals(x: np.ndarray) -> np.ndarray:
        latency, per_byte = x * scale
        return (latency + per_byte * nbytes - seconds) / seconds

    x0 = np.array([latency0, 1.0 / bandwidth0]) / scale
    sol = least_squares(
        residuals,
        np.maximum(x0, 1e-12),
        bounds=([0.0, 1e-12], [np.inf, np.inf]),
        loss="soft_l1",
        f_scale=0.1,
    )
    latency, per_byte = sol.x * scale
    return float(latency), 1.0 / float(per_byte), residuals(sol.x)


def all_to_all_section(
    points: dict[int, list[tuple[int, float]]], dtype: torch.dtype = torch.float32
) -> tuple[list[dict], str]:
    """``communication.all_to_all_links`` fitted per group size (``fit_link_robust``) and the
    provenance note that gives each fit's errors and its points (measured in ``dtype``)."""
    links, parts = [], []
    for c in sorted(points):
        nbytes = np.asarray([p[0] for p in points[c]], dtype=float)
        secs = np.asarray([p[1] for p in points[c]])
        latency, bandwidth, rel = fit_link_robust(nbytes, secs)
        links.append(
            {"group_size": c, "latency_seconds": latency, "bandwidth_bytes_per_second": bandwidth}
        )
        measured = ", ".join(f"{int(b)} B {t * 1e3:.3f} ms" for b, t in zip(nbytes, secs))
        parts.append(
            f"{c}: latency {latency:.3e} s, bandwidth {bandwidth / 1e9:.3f} GB/s, relative "
            f"error median {np.median(np.abs(rel)):.1%}, max {np.abs(rel).max():.1%}, "
            f"{int((np.abs(rel) > 0.25).sum())} of {len(rel)} points beyond 25% (measured: "
            f"{measured})"
        )
    name = str(dtype).removeprefix("torch.")
    note = (
        f"all-to-all fit (the runtime's head exchange of {name}: q|k|v to the ring layout and "
        "the output back, forward and backward, timed together and counted as four exchanges; "
        "contiguous blocks of ranks, all blocks at once, median over interleaved rounds of the "
        "slowest rank; latency + bytes per rank / bandwidth, soft-L1 on relative error), "
        "per group size: " + "; ".join(parts)
    )
    return links, note


def model_section(cfg: TinyConfig, *, dtype_bytes: int) -> dict:
    """The profile's ``model`` section for a tiny-decoder config."""
    return {
        "name": "tiny",
        "num_layers": cfg.layers,
        "hidden_size": cfg.dim,
        "num_heads": cfg.heads,
        "num_kv_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "ffn_hidden_size": cfg.ffn,
        "vocab_size": cfg.vocab,
        "dtype_bytes": dtype_bytes,
    }


def calibrate_latency(
    packs: list,
    cfg: TinyConfig,
    attention: dict,
    lin: float,
    const: float,
    bandwidth: float,
    floor: float,
) -> float:
    """The per-step latency that makes the cost model match the measured tiny ring packs.

    A tiny pack is communication-bound: per layer its time grows by (2(c-1) + 1) x latency; least
    squares over every (c, pack), never below the raw P2P fit.
    """
    rows, rhs = [], []
    for c, seqlens, measured in packs:
        probe = {
            "schema_version": 1,
            "name": "probe",
            "description": "ring probe",
            "provenance": {"source": "-", "device": "-", "date": "-", "method": "-"},
            "model": model_section(cfg, dtype_bytes=4),
            "linear_seconds_per_token": lin,
            "attention": attention,
            "communication": {
                "kv_bytes_per_token": float(2 * cfg.kv_heads * cfg.head_dim * 4),
                "intra_node": {"latency_seconds": 0.0, "bandwidth_bytes_per_second": bandwidth},
                "inter_node": {"latency_seconds": 0.0, "bandwidth_bytes_per_second": bandwidth},
            },
            "overheads": {"microbatch_seconds": const, "wave_seconds": 0.0},
        }
        base = CostModel(Profile.model_validate(probe), ranks_per_node=int(c))
        rest = measured - base.microbatch_seconds(int(c), seqlens)
        rows.append([cfg.layers * (2 * (c - 1) + 1)])
        rhs.append(rest)
    coef, _ = nnls(np.asarray(rows, dtype=float), np.asarray(rhs))
    return max(floor, float(coef[0]))


def build_profile(
    name: str, cfg: TinyConfig, raw: dict, *, dtype: torch.dtype, device: torch.device, command: str
) -> Profile:
    """Fit the measurements into a validated Profile."""
    lengths = np.asarray(raw["attn_len"])
    fwdbwd = np.asarray(raw["attn_fwdbwd"])
    fwd = np.asarray(raw["attn_fwd"])
    a, b, k, attn_err = fit_quadratic(lengths, fwdbwd)
    k = min(k, 0.99 * float(fwdbwd.min()))  # the schema wants every entry above k
    ratio = float(np.median((fwdbwd - fwd) / fwd))
    # Packs: t = lin * tokens + layers * n * (kernel(s) + o) + C, kernel(s) = a s^2 + b s from
    # the bare-kernel fit; least squares for lin (per token), o (per sequence), C (per pack).
    packs = np.asarray(raw["packs"], dtype=float)
    s_len, n_seq, t_pack = packs[:, 0], packs[:, 1], packs[:, 2]
    rest = t_pack - cfg.layers * n_seq * (a * s_len**2 + b * s_len)
    basis = np.stack([s_len * n_seq, cfg.layers * n_seq, np.ones(len(packs))], 1)
    coef, errors = fit_relative(basis, rest, scale=t_pack)
    per_token, per_sequence, constant = (float(x) for x in coef)
    lin_err = float(np.max(errors))
    k = 0.0  # a ring step's own fixed cost is calibrated into the link latency below
    if raw.get("single_len"):
        # Attention per layer as the model sees it: one sequence's time minus linear work and
        # the micro-batch constant, per layer (it includes the per-sequence cost).
        single = np.asarray(raw["single_seconds"])
        in_model = (single - per_token * np.asarray(raw["single_len"]) - constant) / cfg.layers
        # Short sequences: attention is a sliver of the model's time, so the residual is mostly
        # timing noise; there the bare-kernel fit (plus the per-sequence cost) is used instead.
        kernel = a * lengths**2 + b * lengths + per_sequence
        trusted = in_model >= 0.25 * (single / cfg.layers)
        fwdbwd = np.maximum(np.where(trusted, in_model, kernel), per_sequence * 1.01 + 1e-9)
    else:
        fwdbwd = a * lengths**2 + b * lengths + per_sequence
    attention_section = {
        "form": "table",
        "lengths": lengths.tolist(),
        "seconds": fwdbwd.tolist(),
        "step_overhead_seconds": k,
        "backward_forward_ratio": max(ratio, 1e-3),
        "sequence_overhead_seconds": per_sequence,
    }
    links = raw.get("links", {})
    notes = [
        f"attention fwd+bwd fit a*s^2+b*s+k: a={a:.3e} b={b:.3e} k={k:.3e} s, max relative "
        f"error {attn_err:.1%}; the measured table is used",
        f"packs fit (model fwd+bwd minus kernel attention): {per_token:.3e} s/token + "
        f"{per_sequence:.3e} s per sequence per layer + {constant:.3e} s per micro-batch, max "
        f"relative error {lin_err:.1%}",
        "attention table: the model's fwd+bwd on one sequence of each length, minus linear "
        "work and the micro-batch constant, per layer, where attention is at least a quarter of "
        "the layer's time; the bare-kernel fit below that",
    ]
    assumptions = []
    if links:
        largest = max(links)
        nbytes = np.asarray([p[0] for p in links[largest]], dtype=float)
        secs = np.asarray([p[1] for p in links[largest]])
        latency, bandwidth, link_err = fit_link(nbytes, secs)
        notes.append(
            f"ring step fit (group of {largest}): latency {latency:.3e} s, bandwidth "
            f"{bandwidth / 1e9:.3f} GB/s, max relative error {link_err:.1%}; all group sizes: "
            + "; ".join(
                f"{c}: {links[c][-1][1] * 1e3:.3f} ms/{links[c][-1][0]} B" for c in sorted(links)
            )
        )
        inter = {"latency_seconds": latency, "bandwidth_bytes_per_second": bandwidth}
        assumptions.append(
            {
                "name": "inter-node link",
                "value": "same as intra-node",
                "source": "one machine: no node boundary to measure",
            }
        )
        wave = raw.get("wave_seconds", 0.0)
        if raw.get("ring_packs"):
            latency = calibrate_latency(
                raw["ring_packs"], cfg, attention_section, per_token, constant, bandwidth, latency
            )
            notes.append(
                f"ring step latency calibrated on the model's tiny packs (1 and 4 sequences per CP "
                f"size): {latency:.3e} s per step (kernel calls, merges, autograd, P2P set-up)"
            )
            inter["latency_seconds"] = latency
    else:
        latency, bandwidth = 1e-5, 1e10
        inter = {"latency_seconds": latency, "bandwidth_bytes_per_second": bandwidth}
        assumptions.append(
            {
                "name": "ring links",
                "value": "10 us + bytes / 10 GB/s",
                "source": "assumed: single process, no peers to measure",
            }
        )
        wave = 0.0
    a2a_links: list[dict] = []
    if raw.get("all_to_all"):
        a2a_links, a2a_note = all_to_all_section(raw["all_to_all"], dtype)
        notes.append(a2a_note)
    run = run_context(device)
    device_name, world = run.device_name, run.processes
    data = {
        "schema_version": 1,
        "name": name,
        "description": f"{cfg} measured with {world} process(es) on {device_name} ({device.type})",
        "provenance": {
            "source": "measured by dyncp.profiling.profile",
            "device": f"{device_name}, {os.cpu_count()} CPUs, {world} processes",
            "date": dt.date.today().isoformat(),
            "method": command,
            "assumptions": assumptions,
            "notes": notes + [f"torch {torch.__version__}, python {platform.python_version()}"],
            "run": run.model_dump(),
        },
        "model": model_section(cfg, dtype_bytes=torch.empty((), dtype=dtype).element_size()),
        "linear_seconds_per_token": per_token,
        "attention": attention_section,
        "communication": {
            "kv_bytes_per_token": float(
                2 * cfg.kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
            ),
            "backward_bytes_factor": 2.0,
            "overlap": True,
            "intra_node": {"latency_seconds": latency, "bandwidth_bytes_per_second": bandwidth},
            "inter_node": inter,
            "all_to_all_links": a2a_links,
        },
        "overheads": {"microbatch_seconds": constant, "wave_seconds": wave},
    }
    return Profile.model_validate(data)
