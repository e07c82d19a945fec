"""Build an H100 reference profile for a layer-mix model (``mix_shapes``) from measured data.

    python -m dyncp.cost_model.mix_reference --model falcon-h1-7b   # h100-falcon-h1-7b-like
    python -m dyncp.cost_model.mix_reference --all

Attention (full and sliding-window layers), NVLink and the overheads come from the dense builder
(``dyncp.cost_model.reference``: DistCA's measured flash-attention and NCCL tables). On top:

- MoE experts are priced by their active parameters at the grouped-GEMM throughput *measured* in
  DistCA's ``compute-profile-mlp-only.csv`` (Qwen3-235B-A22B MoE MLP on one H100: slope of time
  over tokens from 16K to 64K tokens), plus the expert-parallel all-to-all (dispatch and combine,
  forward and backward) at the measured NVLink bandwidth;
- FP8 GEMMs run at twice the bf16 throughput (stated: the H100 datasheet's dense FP8 peak is twice
  its BF16 peak; same efficiency assumed);
- the SSM scan is priced from its FLOPs at a stated efficiency; its CP exchange is the chunk-state
  all-gather of ``dyncp.ssm``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

from dyncp.cost_model.distca import REFERENCE_SOURCE, fit_nvlink
from dyncp.cost_model.mix_shapes import MIX_SHAPES, LayerMixShape
from dyncp.cost_model.reference import GEMM_FLOPS, build_reference_profile
from dyncp.cost_model.schema import PROFILES_DIR, Profile

__all__ = ["build_mix_profile", "fit_moe_throughput", "MOE_REFERENCE"]

# Qwen3-235B-A22B (its config.json on Hugging Face): hidden 4096, 128 experts, top-8, expert FFN
# 1536 (SwiGLU). The measured MLP table is this model's.
MOE_REFERENCE = {"hidden": 4096, "experts": 128, "top_k": 8, "ffn": 1536}
FP8_SPEEDUP = 2.0
SSM_SCAN_FLOPS = 0.3 * 989e12
EXPERT_PARALLEL = 8
BWD_FLOPS_RATIO = 2.0


def fit_moe_throughput(src: Path) -> tuple[float, list[tuple[int, float]]]:
    """Forward FLOP/s of the measured MoE MLP (marginal: slope over the long contexts)."""
    with (src / "compute-profile-mlp-only.csv").open(newline="") as fh:
        rows = [(int(r["ctx_len"]), float(r["layer_mlp_time"]) * 1e-3) for r in csv.DictReader(fh)]
    long = [(n, t) for n, t in rows if n >= 16384]
    tokens = np.array([n for n, _ in long], dtype=float)
    seconds = np.array([t for _, t in long])
    slope = float(np.polyfit(tokens, seconds, 1)[0])
    ref = MOE_REFERENCE
    flops = 2.0 * (ref["top_k"] * 3 * ref["hidden"] * ref["ffn"] + ref["hidden"] * ref["experts"])
    return flops / slope, rows


def build_mix_profile(src: Path, mix: LayerMixShape, *, name: str | None = None) -> Profile:
    """The profile of ``mix``: the dense reference of its attention geometry plus the mix."""
    dense = build_reference_profile(src, shape=mix.base, name=name or f"h100-{mix.name}")
    latency, bandwidth, _ = fit_nvlink(src)
    speed = FP8_SPEEDUP if mix.gemm_dtype == "fp8" else 1.0
    dense_seconds = 6.0 * mix.dense_gemm_params / (GEMM_FLOPS * speed)
    moe_flops, _ = fit_moe_throughput(src)
    expert_seconds = (1.0 + BWD_FLOPS_RATIO) * 2.0 * mix.expert_params / (moe_flops * speed)
    dispatch_bytes = (
        4.0 * mix.moe_top_k * mix.base.hidden_size * mix.base.dtype_bytes
        * (EXPERT_PARALLEL - 1) / EXPERT_PARALLEL
    )  # fmt: skip
    dispatch_seconds = mix.moe_layers * dispatch_bytes / bandwidth
    ssm_seconds = 3.0 * mix.ssm_scan_flops_per_token / SSM_SCAN_FLOPS if mix.ssm_layers else 0.0
    data = dense.model_dump(mode="json")
    data["linear_seconds_per_token"] = dense_seconds + expert_seconds + dispatch_seconds
    data["layer_mix"] = {
        "full_attention_layers": mix.full_attention_layers,
        "window": (
            [{"window": mix.window, "layers": mix.window_layers}] if mix.window_layers else []
        ),
        "ssm_layers": mix.ssm_layers,
        "ssm_seconds_per_token": ssm_seconds,
        "ssm_chunk_state_bytes": mix.ssm_chunk_state_bytes if mix.ssm_layers else 0.0,
        "ssm_all_to_all_bytes_per_token": (
            mix.ssm_all_to_all_bytes_per_token if mix.ssm_layers else 0.0
        ),
    }
    kinds = [f"{mix.full_attention_layers} full attention"]
    if mix.window_layers:
        kinds.append(f"{mix.window_layers} sliding-window ({mix.window}) attention")
    if mix.ssm_layers:
        kinds.append(f"{mix.ssm_layers} Mamba-2 SSM")
    if mix.moe_experts:
        kinds.append(f"MoE {mix.moe_experts} experts top-{mix.moe_top_k}")
    data["description"] = (
        f"{mix.name} ({', '.join(kinds)} of {mix.base.num_layers} layers; {mix.gemm_dtype} "
        "GEMMs) on H100 SXM nodes of 8 GPUs: attention, NVLink and the MoE MLP measured on H100 "
        "(DistCA data); GEMM throughput, FP8 speed-up, SSM scan, backward ratio, InfiniBand and "
        "overheads assumed (see provenance)."
    )
    prov = data["provenance"]
    prov["method"] = f"python -m dyncp.cost_model.mix_reference --model {_key(mix)}"
    prov["source"] += (
        f"; compute-profile-mlp-only.csv (MoE MLP of Qwen3-235B-A22B, {REFERENCE_SOURCE})"
    )
    # The dense builder's GEMM line counts every layer as attention + dense MLP: replace it.
    prov["assumptions"] = [a for a in prov["assumptions"] if a["name"] != "linear FLOPs per token"]
    prov["assumptions"] += [
        {
            "name": "dense GEMM FLOPs per token (fwd+bwd)",
            "value": 6.0 * mix.dense_gemm_params,
            "source": f"6 x {mix.dense_gemm_params} weights: attention/SSM projections, dense "
            "MLPs, router, output layer",
        },
        {
            "name": "GEMM precision speed-up",
            "value": speed,
            "source": "fp8: H100 SXM dense FP8 peak 1979 TFLOP/s is 2x its BF16 peak (NVIDIA "
            "H100 datasheet), same 40% efficiency assumed; bf16: 1",
        },
        {
            "name": "MoE grouped-GEMM forward throughput (FLOP/s, measured)",
            "value": moe_flops,
            "source": "slope of compute-profile-mlp-only.csv over 16K-64K tokens, Qwen3-235B-A22B "
            "(hidden 4096, top-8 of 128 experts, expert FFN 1536: its config.json); backward "
            "assumed 2x forward FLOPs at the same rate",
        },
        {
            "name": "MoE active expert weights per token",
            "value": mix.expert_params,
            "source": "top-k x 3 (SwiGLU) x hidden x expert FFN, every MoE layer",
        },
        {
            "name": "expert-parallel all-to-all bytes per token (all MoE layers)",
            "value": mix.moe_layers * dispatch_bytes,
            "source": f"dispatch + combine, forward + backward: 4 x top-k x hidden x 2 bytes x "
            f"(EP-1)/EP with EP = {EXPERT_PARALLEL} inside a node (assumed), at the NVLink "
            "bandwidth fitted to nccl_perf.csv",
        },
        {
            "name": "SSM scan throughput (FLOP/s)",
            "value": SSM_SCAN_FLOPS,
            "source": "assumed 30% of the H100 BF16 peak for the chunked SSD scan (Mamba-2, Dao "
            "and Gu 2024: the scan is matmuls over chunks of 256); scan FLOPs per token from "
            "LayerMixShape.ssm_scan_flops_per_token, backward 2x forward",
        },
        {
            "name": "SSM CP exchange",
            "value": "cheaper of chunk-state all-gather and all-to-all to channels",
            "source": "dyncp.ssm: every chunk's fp32 state (heads x head_dim x state) and decay, "
            "one all-gather forward and one backward; or the scan's bf16 inputs (x, B, C, dt) "
            "and output y to and from channel parallelism, two all-to-alls each way; neither "
            "overlapped",
        },
    ]
    return Profile.model_validate(data)


def _key(mix: LayerMixShape) -> str:
    return next((k for k, v in MIX_SHAPES.items() if v is mix), "<shape>")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=Path("../shared/reference/h100-distca"))
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--model", choices=sorted(MIX_SHAPES))
    group.add_argument("--all", action="store_true", help="every named mix except llama3-8b")
    args = parser.parse_args(argv)
    if not (args.src / "compute-profile-mlp-only.csv").exists():
        parser.error(f"--src {args.src} does not hold the DistCA reference CSVs")
    keys = [k for k in MIX_SHAPES if k != "llama3-8b"] if args.all else [args.model]
    for key in keys:
        profile = build_mix_profile(args.src, MIX_SHAPES[key])
        out = PROFILES_DIR / f"{profile.name}.json"
        out.write_text(profile.to_json())
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
