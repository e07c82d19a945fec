"""Build an H100 reference profile for any decoder shape from the measured data in ../shared.

    python -m dyncp.cost_model.reference                          # llama3-8b -> h100-reference
    python -m dyncp.cost_model.reference --model megatron-dcp-gpt # h100-megatron-dcp-gpt
    python -m dyncp.cost_model.reference --model my-model.json --out profiles/mine.json
    python -m dyncp.cost_model.reference --analytic               # quadratic fit -> h100-analytic
    python -m dyncp.cost_model.reference --model megatron-dcp-gpt --kernel fa3-sm90  # tile-aware
    python -m dyncp.cost_model.reference --heads 32 --kv-heads 8 --head-dim 128 --kernel fa2-sm80

Measured inputs: DistCA's attention forward table and NCCL all-gathers on H100, read and fitted
by ``dyncp.cost_model.distca`` (what they are, and how each fit is made).

Kernel-aware form (``--kernel``, see ``dyncp.cost_model.kernels``): every attention call is
quantised to the named kernel's tiles (block sizes read from its source, not fitted), and the
constant of the attention fit is read as what it is. DistCA's ``duration_per_doc`` is the time
of one varlen call over 32768 / L documents of L tokens divided by their number
(``run_amortized_batch_sequence`` in distca/profiling/modal-scripts/attn-prof.py), so the fitted
constant k0 is a cost per *document* in a call, not per call: the kernel-aware profile prices it
as ``sequence_overhead_seconds`` (paid by each sequence in each ring step's call) and no cost
per call (a per-call constant is not separable in these data: it is spread over 32768 tokens
and sits in the linear term). ``ring_sequence_step_seconds`` (per-chunk correction kernels of a
ring, CP > 1 only) is not measured in these data and is written as 0 for calibration to learn.
Without ``--kernel`` the profile is built exactly as before (k0 per call, no tiles).

GEMMs are priced from their FLOPs (``DecoderShape.linear_flops_per_token``) at a stated
throughput. Everything else is a stated assumption, written into the profile's provenance with its
source; a shape outside what the data covers is named in the profile's notes and on stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from dyncp.cost_model.distca import (
    MEASURED_DTYPE_BYTES,
    MEASURED_HEAD_DIM,
    MEASURED_HEADS,
    REFERENCE_SOURCE,
    AttentionFit,
    fit_all_to_all,
    fit_attention,
    fit_nvlink,
    measured_heads,
)
from dyncp.cost_model.kernels import KERNELS, kernel_tiles
from dyncp.cost_model.schema import PROFILES_DIR, Profile
from dyncp.cost_model.shapes import SHAPES, DecoderShape, ShapeError, load_shape

# The DistCA fits (AttentionFit, fit_attention, fit_nvlink, fit_all_to_all, REFERENCE_SOURCE)
# moved to dyncp.cost_model.distca; imported here, they keep their 0.1 path for one release.
__all__ = ["all_to_all_links", "build_reference_profile", "coverage_warnings", "main"]

DEFAULT_MODEL = "llama3-8b"

BWD_FWD_RATIO = 2.5
GEMM_FLOPS = 400e12
INTER_NODE_BW = 40e9
INTER_NODE_LATENCY = 20e-6
MICROBATCH_SECONDS_PER_LAYER = 5e-3 / 32
WAVE_SECONDS = 1e-3

# KV heads up to this multiple of the measured ones are taken as not changing kernel time (the
# attention FLOPs are set by query heads); beyond it the profile says the data do not cover it.
KV_HEADS_NO_CORRECTION = 4


def all_to_all_links(src: Path, shape: DecoderShape) -> list[dict]:
    """``communication.all_to_all_links`` of the reference: the NVLink fits of
    ``fit_all_to_all`` for 2, 4 and 8 GPUs, then head groups across nodes up to the model's
    query heads (a head group never outgrows them): the stated InfiniBand link, every byte
    that leaves a GPU assumed to cross its own port (``INTER_NODE_BW`` x u / (u - 1))."""
    links = [
        {"group_size": n, "latency_seconds": lat, "bandwidth_bytes_per_second": bw}
        for n, (lat, bw, _) in fit_all_to_all(src).items()
    ]
    u = 2 * links[-1]["group_size"]
    while u < 2 * shape.num_heads:
        links.append(
            {
                "group_size": u,
                "latency_seconds": INTER_NODE_LATENCY,
                "bandwidth_bytes_per_second": INTER_NODE_BW * u / (u - 1),
            }
        )
        u *= 2
    return links


def coverage_warnings(shape: DecoderShape) -> list[str]:
    """What about ``shape`` the measured data does not cover (empty when it is all measured)."""
    out = []
    lo, hi = min(MEASURED_HEADS), max(MEASURED_HEADS)
    if not lo <= shape.num_heads <= hi:
        out.append(
            f"num_heads {shape.num_heads} is outside the measured {lo}..{hi} query heads: "
            "attention time extrapolated in proportion to heads"
        )
    elif shape.num_heads not in MEASURED_HEADS:
        out.append(
            f"num_heads {shape.num_heads} was not measured (measured: "
            f"{', '.join(str(h) for h in sorted(MEASURED_HEADS))}): attention time interpolated "
            "in proportion to heads"
        )
    heads = measured_heads(shape.num_heads)
    measured_kv = max(4 // int(MEASURED_HEADS[heads]), 1)
    if shape.num_kv_heads > KV_HEADS_NO_CORRECTION * measured_kv:
        out.append(
            f"num_kv_heads {shape.num_kv_heads}: the {heads}-head kernel rows were measured with "
            f"{measured_kv} KV head(s); kernel time is not corrected for the extra K/V reads "
            "(ring traffic does use the model's KV heads)"
        )
    if shape.head_dim != MEASURED_HEAD_DIM:
        out.append(
            f"head_dim {shape.head_dim} was not measured (only {MEASURED_HEAD_DIM}): attention "
            "time scaled in proportion to head_dim, which ignores the kernel's tile efficiency"
        )
    if shape.dtype_bytes != MEASURED_DTYPE_BYTES:
        out.append(
            f"dtype_bytes {shape.dtype_bytes}: attention was measured in bf16 (2 bytes); "
            "kernel times are used unchanged, ring traffic uses the model's dtype"
        )
    return out


def _assumptions(shape: DecoderShape, att: AttentionFit) -> list[dict]:
    layers = shape.num_layers
    return [
        {
            "name": "attention backward/forward ratio",
            "value": BWD_FWD_RATIO,
            "source": "FlashAttention-2 (Dao, 2023): the backward runs 5 matmuls to the "
            "forward's 2; the DistCA data README gives 2-2.5x",
        },
        {
            "name": f"attention measured with {att.kv_heads} KV heads, model has "
            f"{shape.num_kv_heads}",
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
            "value": shape.linear_flops_per_token,
            "source": f"6 x {shape.gemm_params} GEMM parameters ({layers} layers of QKV/O/MLP "
            "+ head)",
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
            "name": "all-to-all inside a node (2, 4, 8 GPUs)",
            "value": "the all_gather of the same bytes per GPU",
            "source": "nccl_perf.csv measured no all-to-all; an all_gather of output size B and "
            "an all-to-all in which each GPU holds B bytes both move (n-1)/n x B bytes out of "
            "and into every GPU, and NVSwitch gives every GPU its full NVLink bandwidth to all "
            "peers at once (full bisection), so the bytes per GPU set the time",
        },
        {
            "name": "all-to-all across nodes (16 GPUs and more)",
            "value": f"{INTER_NODE_LATENCY} s + B / ({INTER_NODE_BW:.3g} B/s x u / (u - 1))",
            "source": "assumed: all (u-1)/u of the bytes a GPU sends cross its own InfiniBand "
            "port at the inter-node ring bandwidth above; the 7/u that stay inside its node go "
            "over NVLink and are counted as InfiniBand, so the time is overstated by up to "
            "(u-1)/(u-8) (x1.9 at 16 GPUs)",
        },
        {
            "name": "per-micro-batch overhead (s)",
            "value": MICROBATCH_SECONDS_PER_LAYER * layers,
            "source": f"assumed: 5 ms per 32 layers (launches of ~100 kernels per layer fwd+bwd "
            f"at ~1.5 us), here {layers} layers",
        },
        {
            "name": "per-wave overhead (s)",
            "value": WAVE_SECONDS,
            "source": "assumed: one barrier over the DP x CP ranks and a group switch",
        },
    ]


def _kernel_assumptions(kernel: str, per_document: float) -> list[dict]:
    return [
        {
            "name": f"attention kernel {kernel}",
            "value": kernel,
            "source": "assumed to be the kernel the DistCA rows were measured with and the one "
            "the priced run uses: DistCA timed vllm-flash-attn's flash_attn_varlen_func on "
            "H100 (attn-prof.py), whose 32K-token causal forward at 64 heads runs at ~340 "
            "TFLOP/s, a FlashAttention-3 rate on Hopper; tiles in "
            "dyncp.cost_model.kernels, read from the kernel's source",
        },
        {
            "name": "attention fixed cost per document and call, fwd+bwd (s)",
            "value": per_document,
            "source": "the constant k0 of the fit x (1 + backward/forward ratio): DistCA's "
            "duration_per_doc divides one varlen call over 32768 / L documents by their count "
            "(run_amortized_batch_sequence in distca/profiling/modal-scripts/attn-prof.py), so "
            "k0 is paid per document; priced per sequence in every ring step's call",
        },
        {
            "name": "per (sequence x ring step) cost at CP > 1 (s)",
            "value": 0.0,
            "source": "not measured in these data (no ring was timed); 0 until calibration "
            "learns it (dyncp.cost_model.calibration.fit fits ring_sequence_step_seconds)",
        },
    ]


def build_reference_profile(
    src: Path,
    analytic: bool = False,
    *,
    shape: DecoderShape | None = None,
    name: str | None = None,
    kernel: str | None = None,
) -> Profile:
    """The reference profile of ``shape`` (default: the Llama-3-8B-like shape).

    Args:
        src: folder holding the DistCA CSVs.
        analytic: swap the measured table for its quadratic fit (no comm/compute overlap).
        shape: the decoder to price.
        name: the profile's name (default ``h100-reference`` for the default shape,
            ``h100-<shape name>`` otherwise; ``h100-analytic`` with ``analytic``).
        kernel: the attention kernel (``dyncp.cost_model.kernels.KERNELS``, a GPU one) for the
            kernel-aware form (module docstring); None builds the profile as before.

    Raises:
        ValueError: a kernel not read from source, or a head dim its tiles were not read for.
    """
    tiles = None
    if kernel is not None:
        shape_dim = (SHAPES[DEFAULT_MODEL] if shape is None else shape).head_dim
        tiles = kernel_tiles(kernel, shape_dim)
        if not tiles.pads:
            raise ValueError(
                f"kernel {kernel!r} is not a GPU kernel; the H100 reference takes one of "
                f"{', '.join(k for k, v in KERNELS.items() if next(iter(v.values())).pads)}"
            )
    default = shape is None
    shape = SHAPES[DEFAULT_MODEL] if shape is None else shape
    if name is None:
        name = "h100-reference" if default else f"h100-{shape.name}"
        if analytic:
            name = "h100-analytic" if default else f"{name}-analytic"
    att = fit_attention(src, measured_heads(shape.num_heads))
    scale_heads = shape.num_heads * shape.head_dim / (att.heads * MEASURED_HEAD_DIM)
    k0 = float(att.coef[2])
    fwd = [k0 + (t - k0) * scale_heads for t in att.forward_seconds]
    quad = att.coef[:2] * scale_heads
    latency, bandwidth, nccl_err = fit_nvlink(src)
    a2a = fit_all_to_all(src)
    scale = 1.0 + BWD_FWD_RATIO
    tp = MEASURED_HEADS[att.heads]
    warnings = coverage_warnings(shape)
    method = "python -m dyncp.cost_model.reference --src ../shared/reference/h100-distca"
    if not default:
        method += f" --model {shape.name if shape.name in SHAPES else '<shape json>'}"
    notes = [
        f"model shape from: {shape.source}",
        f"attention fwd fit a*s^2+b*s+k0 ({att.heads} heads): a={att.coef[0]:.3e}, "
        f"b={att.coef[1]:.3e}, k0={k0:.3e} s (the per-call fixed cost), max relative error "
        f"{att.max_relative_error:.1%}",
        f"NVLink ring step fit over all_gather 2/4/8 GPUs: latency {latency:.2e} s, "
        f"bandwidth {bandwidth / 1e9:.1f} GB/s, max relative error {nccl_err:.1%}",
        "all-to-all fit latency + B / bandwidth over all_gather of output size B, per GPU "
        "count: "
        + "; ".join(
            f"{n}: {lat:.2e} s, {bw / 1e9:.1f} GB/s, max relative error {err:.1%}"
            for n, (lat, bw, err) in a2a.items()
        ),
        "seconds = measured forward x (1 + backward/forward ratio), per layer",
    ]
    if scale_heads != 1.0:
        notes.append(
            f"attention: measured {att.heads} heads x {MEASURED_HEAD_DIM} scaled by "
            f"{scale_heads:.4g} to {shape.num_heads} heads x {shape.head_dim} (fixed cost k0 "
            "not scaled)"
        )
    notes += [f"outside the measured data: {w}" for w in warnings]
    data = {
        "schema_version": 1,
        "name": name,
        "description": (
            f"{shape.name} model (bf16) on H100 SXM nodes of 8 GPUs: attention and NVLink "
            "measured on H100 (DistCA data); GEMM throughput, backward ratio, InfiniBand and "
            "overheads assumed (see provenance)."
        ),
        "provenance": {
            "source": (
                f"{REFERENCE_SOURCE}: compute-attn-H100.csv rows cp=1 tp={tp} ({att.heads} query "
                f"heads, head dim {MEASURED_HEAD_DIM}, causal flash-attention varlen forward), "
                "nccl_perf.csv all_gather on 2/4/8 H100 (NVLink)"
            ),
            "device": "NVIDIA H100 SXM (measured by the DistCA authors)",
            "date": dt.date.today().isoformat(),
            "method": method,
            "assumptions": _assumptions(shape, att),
            "notes": notes,
        },
        "model": shape.profile_model(),
        "linear_seconds_per_token": shape.linear_flops_per_token / GEMM_FLOPS,
        "attention": {
            "form": "table",
            "lengths": att.lengths,
            "seconds": [t * scale for t in fwd],
            "step_overhead_seconds": k0 * scale,
            "backward_forward_ratio": BWD_FWD_RATIO,
        },
        "communication": {
            "kv_bytes_per_token": shape.kv_bytes_per_token,
            "backward_bytes_factor": 2.0,
            "overlap": True,
            "intra_node": {"latency_seconds": latency, "bandwidth_bytes_per_second": bandwidth},
            "inter_node": {
                "latency_seconds": INTER_NODE_LATENCY,
                "bandwidth_bytes_per_second": INTER_NODE_BW,
            },
            "all_to_all_links": all_to_all_links(src, shape),
        },
        "overheads": {
            "microbatch_seconds": MICROBATCH_SECONDS_PER_LAYER * shape.num_layers,
            "wave_seconds": WAVE_SECONDS,
        },
    }
    if analytic:
        data["description"] = (
            f"The {name.removesuffix('-analytic') if not default else 'h100-reference'} profile "
            "in analytic form: attention alpha*s^2 + beta*s fitted to the measured table, "
            "communication not overlapped with compute."
        )
        data["provenance"]["method"] += " --analytic"
        data["attention"] = {
            "form": "quadratic",
            "alpha": float(quad[0]) * scale,
            "beta": float(quad[1]) * scale,
            "step_overhead_seconds": k0 * scale,
            "backward_forward_ratio": BWD_FWD_RATIO,
        }
        data["communication"]["overlap"] = False
    if tiles is not None:
        data["attention"].update(
            step_overhead_seconds=0.0,
            sequence_overhead_seconds=k0 * scale,
            ring_sequence_step_seconds=0.0,
            tiles={
                "kernel": tiles.kernel,
                "forward_block_q": tiles.forward_block_q,
                "forward_block_kv": tiles.forward_block_kv,
                "backward_block_q": tiles.backward_block_q,
                "backward_block_kv": tiles.backward_block_kv,
                "pads": tiles.pads,
                "source": tiles.source,
            },
        )
        data["provenance"]["method"] += f" --kernel {tiles.kernel}"
        data["provenance"]["assumptions"] += _kernel_assumptions(tiles.kernel, k0 * scale)
    return Profile.model_validate(data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=Path("../shared/reference/h100-distca"))
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"named shape ({', '.join(SHAPES)}) or a JSON file of DecoderShape fields "
        f"(default {DEFAULT_MODEL})",
    )
    parser.add_argument("--name", default=None, help="profile name (default from the model)")
    parser.add_argument("--out", type=Path, default=None, help="default profiles/<name>.json")
    parser.add_argument(
        "--analytic", action="store_true", help="write the quadratic fit instead of the table"
    )
    gpu_kernels = [k for k, v in KERNELS.items() if next(iter(v.values())).pads]
    parser.add_argument(
        "--kernel",
        choices=gpu_kernels,
        default=None,
        help="kernel-aware form: quantise attention to this kernel's tiles (read from its "
        "source) and price the fit's constant per document (default: the plain form)",
    )
    parser.add_argument("--heads", type=int, default=None, help="override the query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="override the KV heads")
    parser.add_argument("--head-dim", type=int, default=None, help="override the head dim")
    args = parser.parse_args(argv)
    if not (args.src / "nccl_perf.csv").exists():
        parser.error(f"--src {args.src} does not hold the DistCA reference CSVs")
    overrides = {
        k: v
        for k, v in (
            ("num_heads", args.heads),
            ("num_kv_heads", args.kv_heads),
            ("head_dim", args.head_dim),
        )
        if v is not None
    }
    try:
        shape = None if args.model == DEFAULT_MODEL and not overrides else load_shape(args.model)
        if overrides:
            fields = shape.to_dict() | overrides
            if args.name is None:
                fields["name"] = shape.name + "".join(
                    f"-{k.removeprefix('num_').replace('_', '-')}{v}" for k, v in overrides.items()
                )
            shape = DecoderShape.from_dict(fields, origin="--heads/--kv-heads/--head-dim")
    except ShapeError as exc:
        parser.error(f"--model: {exc}")
    try:
        profile = build_reference_profile(
            args.src, analytic=args.analytic, shape=shape, name=args.name, kernel=args.kernel
        )
    except ValueError as exc:
        parser.error(str(exc))
    for warning in coverage_warnings(shape or SHAPES[DEFAULT_MODEL]):
        print(f"warning: outside the measured data: {warning}", file=sys.stderr)
    out = args.out or PROFILES_DIR / f"{profile.name}.json"
    out.write_text(profile.to_json())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
