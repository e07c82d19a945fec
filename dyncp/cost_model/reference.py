"""Build ``profiles/h100-reference.json`` from the measured H100 data in ../shared/reference.

    python -m dyncp.cost_model.reference --src ../shared/reference/h100-distca
    python -m dyncp.cost_model.reference --src ../shared/reference/h100-distca --analytic

Measured inputs (DistCA, Apache-2.0, measured on H100 by its authors):

- ``compute-attn-H100.csv``, rows cp=1, tp=2: causal flash-attention varlen *forward* of one
  document with 32 query heads, head dim 128 -- the attention shape of a Llama-3-8B layer;
- ``nccl_perf.csv``, all_gather on 2/4/8 GPUs in one node: fitted to ``(n-1) * (latency +
  chunk / bandwidth)``, the cost of n-1 ring steps, to get one NVLink ring step's latency and
  bandwidth.

Everything else is a stated assumption, written into the profile's provenance with its source.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from dyncp.cost_model.schema import Profile

__all__ = ["build_reference_profile"]

# A Llama-3-8B-like shape (Meta Llama 3 model card: 32 layers, hidden 4096, 32 heads, 8 KV heads,
# FFN 14336, vocabulary 128256).
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, BYTES = (
    32,
    4096,
    32,
    8,
    128,
    14336,
    128256,
    2,
)

BWD_FWD_RATIO = 2.5
GEMM_FLOPS = 400e12
INTER_NODE_BW = 40e9
INTER_NODE_LATENCY = 20e-6
MICROBATCH_SECONDS = 5e-3
WAVE_SECONDS = 1e-3


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _fit_attention(src: Path) -> tuple[list[int], list[float], np.ndarray, float]:
    """Forward table of the 32-head shape and its fit (a, b, k0): fwd = a s^2 + b s + k0."""
    rows = [r for r in _rows(src / "compute-attn-H100.csv") if r["cp"] == "1" and r["tp"] == "2"]
    lengths = np.array([int(r["L"]) for r in rows])
    fwd = np.array([float(r["duration_per_doc"]) for r in rows]) * 1e-3
    order = np.argsort(lengths)
    lengths, fwd = lengths[order], fwd[order]
    # fwd(s) = a s^2 + b s + k0, non-negative, least squares on relative error.
    basis = np.stack([lengths.astype(float) ** 2, lengths.astype(float), np.ones(len(lengths))], 1)
    coef, _ = nnls(basis / fwd[:, None], np.ones(len(fwd)))
    coef[2] = min(coef[2], 0.9 * fwd.min())
    rel = np.abs(basis @ coef - fwd) / fwd
    return lengths.tolist(), fwd.tolist(), coef, float(rel.max())


def _fit_nvlink(src: Path) -> tuple[float, float, float]:
    """(latency s, bandwidth B/s, max relative error) of one ring step inside a node."""
    rows = [r for r in _rows(src / "nccl_perf.csv") if r["op"] == "all_gather"]
    n = np.array([int(r["ngpu"]) for r in rows], dtype=float)
    size = np.array([float(r["size_bytes"]) for r in rows])
    t = np.array([float(r["t_us_out"]) for r in rows]) * 1e-6
    basis = np.stack([n - 1, (n - 1) * size / n], 1)
    coef, _ = nnls(basis / t[:, None], np.ones(len(t)))
    rel = np.abs(basis @ coef - t) / t
    return float(coef[0]), float(1.0 / coef[1]), float(rel.max())


def build_reference_profile(src: Path, analytic: bool = False) -> Profile:
    """The reference profile; ``analytic`` swaps the measured table for its quadratic fit."""
    lengths, fwd, coef, attn_err = _fit_attention(src)
    k0 = float(coef[2])
    latency, bandwidth, nccl_err = _fit_nvlink(src)
    scale = 1.0 + BWD_FWD_RATIO
    per_layer_params = HIDDEN * (2 * HIDDEN + 2 * KV_HEADS * HEAD_DIM) + 3 * HIDDEN * FFN
    gemm_params = LAYERS * per_layer_params + HIDDEN * VOCAB
    linear = 6.0 * gemm_params / GEMM_FLOPS
    data = {
        "schema_version": 1,
        "name": "h100-reference",
        "description": (
            "Llama-3-8B-like model (bf16) on H100 SXM nodes of 8 GPUs: attention and NVLink "
            "measured on H100 (DistCA data); GEMM throughput, backward ratio, InfiniBand and "
            "overheads assumed (see provenance)."
        ),
        "provenance": {
            "source": (
                "hao-ai-lab/DistCA distca/profiling/data (commit 2afd2192), Apache-2.0: "
                "compute-attn-H100.csv rows cp=1 tp=2 (32 query heads, head dim 128, causal "
                "flash-attention varlen forward), nccl_perf.csv all_gather on 2/4/8 H100 (NVLink)"
            ),
            "device": "NVIDIA H100 SXM (measured by the DistCA authors)",
            "date": dt.date.today().isoformat(),
            "method": "python -m dyncp.cost_model.reference --src ../shared/reference/h100-distca",
            "assumptions": [
                {
                    "name": "attention backward/forward ratio",
                    "value": BWD_FWD_RATIO,
                    "source": "FlashAttention-2 (Dao, 2023): the backward runs 5 matmuls to the "
                    "forward's 2; the DistCA data README gives 2-2.5x",
                },
                {
                    "name": "attention measured with 2 KV heads, model has 8",
                    "value": "no correction",
                    "source": "flash-attention time is set by query heads at these lengths",
                },
                {
                    "name": "sustained GEMM throughput, fwd+bwd (FLOP/s)",
                    "value": GEMM_FLOPS,
                    "source": "40% of the H100 SXM dense BF16 peak of 989 TFLOP/s (NVIDIA H100 "
                    "datasheet); the DistCA MoE MLP table implies ~258 TFLOP/s forward on grouped "
                    "GEMMs, dense GEMMs of an 8B model run faster",
                },
                {
                    "name": "linear FLOPs per token",
                    "value": 6.0 * gemm_params,
                    "source": f"6 x {gemm_params} GEMM parameters (32 layers of QKV/O/MLP + head)",
                },
                {
                    "name": "inter-node ring step bandwidth (B/s)",
                    "value": INTER_NODE_BW,
                    "source": "DGX H100: one 400 Gb/s ConnectX-7 InfiniBand port per GPU = 50 GB/s "
                    "per direction (NVIDIA DGX H100 user guide); 80% assumed achievable",
                },
                {
                    "name": "inter-node ring step latency (s)",
                    "value": INTER_NODE_LATENCY,
                    "source": "assumed; a few microseconds of IB latency plus NCCL P2P set-up",
                },
                {
                    "name": "per-micro-batch overhead (s)",
                    "value": MICROBATCH_SECONDS,
                    "source": "assumed: launches of ~100 kernels x 32 layers fwd+bwd at ~1.5 us",
                },
                {
                    "name": "per-wave overhead (s)",
                    "value": WAVE_SECONDS,
                    "source": "assumed: one barrier over the DP x CP ranks and a group switch",
                },
            ],
            "notes": [
                f"attention fwd fit a*s^2+b*s+k0: a={coef[0]:.3e}, b={coef[1]:.3e}, "
                f"k0={k0:.3e} s (the "
                f"per-call fixed cost), max relative error {attn_err:.1%}",
                f"NVLink ring step fit over all_gather 2/4/8 GPUs: latency {latency:.2e} s, "
                f"bandwidth {bandwidth / 1e9:.1f} GB/s, max relative error {nccl_err:.1%}",
                "seconds = measured forward x (1 + backward/forward ratio), per layer",
            ],
        },
        "model": {
            "name": "llama3-8b-like",
            "num_layers": LAYERS,
            "hidden_size": HIDDEN,
            "num_heads": HEADS,
            "num_kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "ffn_hidden_size": FFN,
            "vocab_size": VOCAB,
            "dtype_bytes": BYTES,
        },
        "linear_seconds_per_token": linear,
        "attention": {
            "form": "table",
            "lengths": lengths,
            "seconds": [t * scale for t in fwd],
            "step_overhead_seconds": k0 * scale,
            "backward_forward_ratio": BWD_FWD_RATIO,
        },
        "communication": {
            "kv_bytes_per_token": float(2 * KV_HEADS * HEAD_DIM * BYTES),
            "backward_bytes_factor": 2.0,
            "overlap": True,
            "intra_node": {"latency_seconds": latency, "bandwidth_bytes_per_second": bandwidth},
            "inter_node": {
                "latency_seconds": INTER_NODE_LATENCY,
                "bandwidth_bytes_per_second": INTER_NODE_BW,
            },
        },
        "overheads": {"microbatch_seconds": MICROBATCH_SECONDS, "wave_seconds": WAVE_SECONDS},
    }
    if analytic:
        data["name"] = "h100-analytic"
        data["description"] = (
            "The h100-reference profile in analytic form: attention alpha*s^2 + beta*s fitted to "
            "the measured table, communication not overlapped with compute."
        )
        data["provenance"]["method"] += " --analytic"
        data["attention"] = {
            "form": "quadratic",
            "alpha": float(coef[0]) * scale,
            "beta": float(coef[1]) * scale,
            "step_overhead_seconds": k0 * scale,
            "backward_forward_ratio": BWD_FWD_RATIO,
        }
        data["communication"]["overlap"] = False
    return Profile.model_validate(data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=Path("../shared/reference/h100-distca"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--analytic", action="store_true", help="write the quadratic fit instead of the table"
    )
    args = parser.parse_args(argv)
    if args.out is None:
        name = "h100-analytic" if args.analytic else "h100-reference"
        args.out = Path("profiles") / f"{name}.json"
    if not (args.src / "nccl_perf.csv").exists():
        parser.error(f"--src {args.src} does not hold the DistCA reference CSVs")
    profile = build_reference_profile(args.src, analytic=args.analytic)
    args.out.write_text(profile.to_json())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
