"""One command to check dyncp on a GPU: kernels, throughput, a measured profile and its error.

    python bench/gpu_check.py                      # CUDA, ~2-4 minutes on one H100/H200
    python bench/gpu_check.py --dry-run --out-dir /tmp/x   # CPU, tiny sizes (part of the tests)

1. **Correctness.** The ring-attention block kernels (torch SDPA; flash-attn when importable) on
   varlen packs at CP 1, 2, 4, 8: every ring step of every rank of one group is run in this one
   process (rank r's queries against the K/V of each source rank, merged with the log-sum-exp
   update; the backward adds each step's dK/dV into the source's accumulator), and the unsharded
   output and gradients are compared with an fp64 math reference of the whole pack.
2. **Throughput.** Forward and forward+backward TFLOP/s of one causal sequence per kernel and
   length, against the GPU's dense BF16 peak (NVIDIA datasheets, table below).
3. **A measured profile** of this GPU for the reference model shape (``--model``, default the
   Llama-3-8B-like shape of ``h100-reference``), written to ``<out-dir>/<gpu>-<model>.json``:
   attention table and backward/forward ratio measured through the fastest block kernel, linear
   seconds per token from the shape's GEMMs (forward and both backward GEMMs, timed). One GPU
   cannot measure a ring or a node boundary, so communication and the fixed overheads are taken
   from the base profile (``--base-profile``) and named as such in the provenance.
4. **Prediction error.** CP-1 micro-batches (packs of several lengths) of a stand-in model with the
   shape's hidden size, heads and FFN (dyncp's test decoder: RMSNorm, RoPE, 2-GEMM SiLU MLP, LM
   head, ``--mape-layers`` layers) are timed forward+backward and compared with what a profile
   measured the same way for that stand-in predicts: MAPE and the worst pack.

Prints every figure; ``--json`` writes them. Nothing is printed for a GPU that is not there.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from dyncp.cost_model.fitting import fit_quadratic
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile, load_profile
from dyncp.cost_model.shapes import DecoderShape, load_shape
from dyncp.cost_model.step_reference import HBM_BYTES_PER_SECOND, OPTIMIZER_BYTES_PER_PARAMETER
from dyncp.ring_attention import make_kernel, make_ring_layout, merge_block, zigzag_shard
from dyncp.ring_attention.block import BlockKernel, BlockSpec, acc_dtype
from dyncp.ring_attention.sharding import zigzag_unshard
from dyncp.ring_attention.steps import zigzag_steps
from dyncp.testing import TinyConfig, TinyDecoder, next_token_labels

# Dense BF16 tensor-core peak (FLOP/s, no sparsity), NVIDIA datasheets; matched in device names.
PEAK_BF16 = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
}
# Largest error (max |x - ref| / max |ref|) each input dtype may show against fp64.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-9}


@dataclass(frozen=True, slots=True)
class Sizes:
    """What each part runs; ``FULL`` on a GPU, ``DRY`` on CPU in seconds."""

    dtype: torch.dtype
    check_heads: tuple[int, int, int]  # query heads, KV heads, head dim of the correctness packs
    check_packs: tuple[tuple[int, ...], ...]
    cps: tuple[int, ...]
    throughput_lengths: tuple[int, ...]
    table_lengths: tuple[int, ...]
    gemm_tokens: int
    mape_layers: int
    mape_packs: tuple[tuple[int, ...], ...]
    repeats: int


FULL = Sizes(
    dtype=torch.bfloat16,
    check_heads=(8, 2, 128),
    check_packs=((1000, 3000, 17, 2048, 1), (4096,), (129, 255, 511, 1023, 2047, 8)),
    cps=(1, 2, 4, 8),
    throughput_lengths=(1024, 4096, 16384),
    table_lengths=(64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
    gemm_tokens=8192,
    mape_layers=2,
    mape_packs=(
        (8192,),
        (4096, 4096),
        (2048,) * 4,
        (512,) * 16,
        (128,) * 32,
        (6000, 1500, 500, 192),
        (3000, 2000, 1000, 700, 300, 100, 60),
        (1024,),
    ),
    repeats=5,
)
DRY = Sizes(
    dtype=torch.float32,
    check_heads=(4, 2, 16),
    check_packs=((37, 5, 64, 1), (48,)),
    cps=(1, 2, 4, 8),
    throughput_lengths=(64, 128),
    table_lengths=(16, 32, 64, 128, 256),
    gemm_tokens=256,
    mape_layers=1,
    mape_packs=((256,), (128, 128), (64,) * 4, (200, 40, 16)),
    repeats=3,
)
DRY_SHAPE = DecoderShape(
    name="dry-run-tiny",
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffn_hidden_size=128,
    ffn_kind="swiglu",
    vocab_size=256,
    source="bench/gpu_check.py --dry-run",
)


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def median_seconds(fn: Callable[[], object], *, device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` after one warm-up call, synchronising the device."""
    sync = _sync(device)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_flops(device: torch.device) -> tuple[str, float | None]:
    """(device name, dense BF16 peak FLOP/s or None when unknown)."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16.items():
        if key.lower() in name.lower():
            return name, peak
    return name, None


# ---------------------------------------------------------------------------- 1. correctness


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, seqlens: Sequence[int]
) -> tuple[torch.Tensor, ...]:
    """fp64 causal attention of each sequence of the pack: out, dq, dk, dv."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    outs, start = [], 0
    for s in seqlens:
        qi, ki, vi = q[start : start + s], k[start : start + s], v[start : start + s]
        ki, vi = ki.repeat_interleave(group, 1), vi.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(mask, -math.inf).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vi))
        start += s
    out = torch.cat(outs)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _take(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x[rows]


def _add(dst: torch.Tensor, rows: torch.Tensor | None, src: torch.Tensor) -> None:
    if rows is None:
        dst.add_(src.to(dst.dtype))
    else:
        dst.index_add_(0, rows, src.to(dst.dtype))


def emulate_ring(
    kernel: BlockKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    seqlens: Sequence[int],
    cp: int,
) -> tuple[torch.Tensor, ...]:
    """Every ring step of every rank of one CP group, in this process: out, dq, dk, dv."""
    device, acc = q.device, acc_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5
    shard = [
        [zigzag_shard(t, seqlens=seqlens, cp=cp, rank=r) for r in range(cp)]
        for t in (q, k, v, dout)
    ]
    qs, ks, vs, douts = shard
    steps = [
        zigzag_steps(seqlens=seqlens, cp=cp, rank=r, causal=True, device=device) for r in range(cp)
    ]
    outs, lses = [], []
    for r in range(cp):
        out = torch.zeros((*qs[r].shape[:2], vs[r].shape[2]), dtype=acc, device=device)
        lse = torch.full(qs[r].shape[:2], -math.inf, dtype=acc, device=device)
        for i in range(cp):
            s = (r - i) % cp  # the K/V block rank r holds at ring step i
            step = steps[r][s]
            if step.empty:
                continue
            b_out, b_lse = kernel.forward(
                _take(qs[r], step.q_rows),
                _take(ks[s], step.k_rows),
                _take(vs[s], step.k_rows),
                spec=step.spec,
                softmax_scale=scale,
            )
            rows = step.q_rows
            if rows is None:
                out, lse = merge_block(out, lse, b_out, b_lse.t())
            else:
                o, m = merge_block(out[rows], lse[rows], b_out, b_lse.t())
                out.index_copy_(0, rows, o)
                lse.index_copy_(0, rows, m)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    dq = [torch.zeros(x.shape, dtype=acc, device=device) for x in qs]
    dk = [torch.zeros(x.shape, dtype=acc, device=device) for x in ks]
    dv = [torch.zeros(x.shape, dtype=acc, device=device) for x in vs]
    for r in range(cp):
        for s in range(cp):
            step = steps[r][s]
            if step.empty:
                continue
            rows, krows = step.q_rows, step.k_rows
            g_q, g_k, g_v = kernel.backward(
                _take(douts[r], rows),
                _take(qs[r], rows),
                _take(ks[s], krows),
                _take(vs[s], krows),
                _take(outs[r], rows),
                _take(lses[r], rows).t(),
                spec=step.spec,
                softmax_scale=scale,
            )
            _add(dq[r], rows, g_q)
            _add(dk[s], krows, g_k)
            _add(dv[s], krows, g_v)
    return tuple(zigzag_unshard(x, seqlens=seqlens) for x in (outs, dq, dk, dv))


def check_kernels(kernels: Sequence[BlockKernel], sizes: Sizes, device: torch.device) -> list[dict]:
    """Max relative error of out, dq, dk, dv per kernel, pack and CP size, against fp64."""
    heads, kv_heads, head_dim = sizes.check_heads
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for pack in sizes.check_packs:
        total = sum(pack)
        q, k, v, dout = (
            torch.randn(total, h, head_dim, generator=gen).to(device)
            for h in (heads, kv_heads, kv_heads, heads)
        )
        ref = reference_attention(q, k, v, dout, pack)
        for kernel in kernels:
            inputs = [t.to(sizes.dtype) for t in (q, k, v, dout)]
            for cp in sizes.cps:
                got = emulate_ring(kernel, *inputs, pack, cp)
                errs = [
                    float((g.double() - r).abs().max() / r.abs().max()) for g, r in zip(got, ref)
                ]
                rows.append(
                    {
                        "kernel": kernel.name,
                        "cp": cp,
                        "pack": list(pack),
                        "dtype": str(sizes.dtype).removeprefix("torch."),
                        "errors": dict(zip(("out", "dq", "dk", "dv"), errs)),
                        "ok": max(errs) <= TOLERANCE[sizes.dtype],
                    }
                )
    return rows


# ---------------------------------------------------------------------------- 2. throughput


def _qkv(length: int, heads: int, kv_heads: int, head_dim: int, dtype, device):
    gen = torch.Generator(device="cpu").manual_seed(length)
    return tuple(
        torch.randn(length, h, head_dim, generator=gen).to(device=device, dtype=dtype)
        for h in (heads, kv_heads, kv_heads, heads)
    )


def attention_seconds(
    kernel: BlockKernel,
    length: int,
    shape: tuple[int, int, int],
    *,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
) -> tuple[float, float]:
    """(forward, forward+backward) seconds of one causal sequence through ``kernel``."""
    heads, kv_heads, head_dim = shape
    q, k, v, dout = _qkv(length, heads, kv_heads, head_dim, dtype, device)
    spec = BlockSpec(cu_seqlens_q=(0, length), cu_seqlens_k=(0, length), causal=True)
    spec = spec.on(device) if device.type == "cuda" else spec
    scale = head_dim**-0.5

    def fwd():
        return kernel.forward(q, k, v, spec=spec, softmax_scale=scale)

    def fwd_bwd():
        out, lse = fwd()
        kernel.backward(dout, q, k, v, out.to(dtype), lse, spec=spec, softmax_scale=scale)

    return (
        median_seconds(fwd, device=device, repeats=repeats),
        median_seconds(fwd_bwd, device=device, repeats=repeats),
    )


def causal_flops(length: int, heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention: two matmuls over half the score matrix."""
    return 2.0 * length * length * heads * head_dim


def throughput(
    kernels: Sequence[BlockKernel], sizes: Sizes, shape: DecoderShape, device: torch.device
) -> list[dict]:
    _, peak = peak_flops(device)
    dims = (shape.num_heads, shape.num_kv_heads, shape.head_dim)
    rows = []
    for kernel in kernels:
        for length in sizes.throughput_lengths:
            fwd, both = attention_seconds(
                kernel, length, dims, dtype=sizes.dtype, device=device, repeats=sizes.repeats
            )
            flops = causal_flops(length, shape.num_heads, shape.head_dim)
            tf_fwd, tf_both = flops / fwd, 3.5 * flops / both  # backward = 2.5 x forward FLOPs
            rows.append(
                {
                    "kernel": kernel.name,
                    "length": length,
                    "fwd_seconds": fwd,
                    "fwd_bwd_seconds": both,
                    "tflops_fwd": tf_fwd / 1e12,
                    "tflops_fwd_bwd": tf_both / 1e12,
                    "peak_share_fwd": None if peak is None else tf_fwd / peak,
                    "peak_share_fwd_bwd": None if peak is None else tf_both / peak,
                }
            )
    return rows


# ---------------------------------------------------------------------------- 3. profile


def _weights(shape: DecoderShape) -> list[tuple[int, int]]:
    """(in, out) of every GEMM weight of one layer."""
    q = shape.num_heads * shape.head_dim
    kv = 2 * shape.num_kv_heads * shape.head_dim
    ffn = shape.ffn_hidden_size
    mlp_in = 2 * ffn if shape.ffn_kind == "swiglu" else ffn
    return [(shape.hidden_size, q + kv), (q, shape.hidden_size), (shape.hidden_size, mlp_in),
            (ffn, shape.hidden_size)]  # fmt: skip


def gemm_seconds(
    n_in: int, n_out: int, tokens: int, *, dtype, device: torch.device, repeats: int
) -> float:
    """Forward (X W) and both backward GEMMs (dY W^T, X^T dY) of one weight at ``tokens`` rows."""
    gen = torch.Generator(device="cpu").manual_seed(n_in * 31 + n_out)
    x = torch.randn(tokens, n_in, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(n_in, n_out, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(tokens, n_out, generator=gen).to(device=device, dtype=dtype)

    def run():
        x @ w
        dy @ w.t()
        x.t() @ dy

    return median_seconds(run, device=device, repeats=repeats)


def linear_seconds_per_token(
    shape: DecoderShape, sizes: Sizes, device: torch.device
) -> tuple[float, float]:
    """(seconds per token of all GEMMs fwd+bwd, achieved FLOP/s) for ``shape``."""
    t = sizes.gemm_tokens
    per_weight = {
        w: gemm_seconds(*w, t, dtype=sizes.dtype, device=device, repeats=sizes.repeats)
        for w in set(_weights(shape))
    }
    layer = sum(per_weight[w] for w in _weights(shape))
    head = gemm_seconds(
        shape.hidden_size, shape.vocab_size, t, dtype=sizes.dtype, device=device,
        repeats=sizes.repeats,
    )  # fmt: skip
    total = shape.num_layers * layer + head
    return total / t, shape.linear_flops_per_token * t / total


def measured_profile(
    shape: DecoderShape,
    *,
    kernel: BlockKernel,
    base: Profile,
    sizes: Sizes,
    device: torch.device,
    name: str,
) -> tuple[Profile, dict]:
    """A profile of this device for ``shape``; communication and overheads from ``base``."""
    dims = (shape.num_heads, shape.num_kv_heads, shape.head_dim)
    fwd, both = [], []
    for length in sizes.table_lengths:
        f, b = attention_seconds(
            kernel, length, dims, dtype=sizes.dtype, device=device, repeats=sizes.repeats
        )
        fwd.append(f)
        both.append(max(b, f * 1.0001))
    lengths = np.array(sizes.table_lengths)
    a, b_, k, err = fit_quadratic(lengths, np.array(both))
    ratio = statistics.median((b - f) / f for f, b in zip(fwd, both))
    k = min(k, 0.9 * min(both))
    per_token, achieved = linear_seconds_per_token(shape, sizes, device)
    device_name, _ = peak_flops(device)
    data = base.model_dump(mode="json")
    scale_overhead = shape.num_layers / base.model.num_layers
    data.update(
        name=name,
        description=(
            f"{shape.name} on {device_name}: attention and GEMMs measured by bench/gpu_check.py; "
            f"ring links and fixed overheads from {base.name} (one GPU cannot measure them)."
        ),
        model=shape.profile_model(),
        linear_seconds_per_token=per_token,
        attention={
            "form": "table",
            "lengths": [int(x) for x in lengths],
            "seconds": both,
            "step_overhead_seconds": k,
            "backward_forward_ratio": ratio,
        },
        overheads={
            "microbatch_seconds": base.overheads.microbatch_seconds * scale_overhead,
            "wave_seconds": base.overheads.wave_seconds,
        },
    )
    data["communication"]["kv_bytes_per_token"] = shape.kv_bytes_per_token
    kept = [
        a_
        for a_ in data["provenance"]["assumptions"]
        if "ring step" in a_["name"] or "overhead" in a_["name"]
    ]
    data["provenance"] = {
        "source": f"bench/gpu_check.py on this device; links and overheads: {base.name} "
        f"({base.provenance.source})",
        "device": device_name,
        "date": dt.date.today().isoformat(),
        "method": "python bench/gpu_check.py" + (" --dry-run" if device.type == "cpu" else ""),
        "assumptions": kept
        + [
            {
                "name": "intra-node ring step (latency, bandwidth)",
                "value": f"{base.communication.intra_node.latency_seconds:.3g} s, "
                f"{base.communication.intra_node.bandwidth_bytes_per_second:.4g} B/s",
                "source": f"{base.name}: measured NVLink all_gather fit, not this machine",
            },
            {
                "name": "per-micro-batch overhead scaled by layers",
                "value": scale_overhead,
                "source": f"{base.name} overhead x {shape.num_layers}/{base.model.num_layers} "
                "layers",
            },
        ],
        "notes": [
            f"model shape from: {shape.source}",
            f"attention: kernel {kernel.name}, {str(sizes.dtype).removeprefix('torch.')}, "
            f"fwd+bwd median of {sizes.repeats}; fit a*s^2+b*s+k: a={a:.3e}, b={b_:.3e}, "
            f"k={k:.3e} s, max relative error {err:.1%}; backward/forward ratio {ratio:.2f} "
            "(median over lengths)",
            f"GEMMs: forward and both backward GEMMs of every weight at {sizes.gemm_tokens} "
            f"tokens, {achieved / 1e12:.1f} TFLOP/s achieved; norms, activations, embedding and "
            "loss are not included",
        ],
    }
    figures = {"gemm_tflops": achieved / 1e12, "attention_fit_error": err, "bwd_fwd": ratio}
    return Profile.model_validate(data), figures


# ---------------------------------------------------------------------------- 4. MAPE


def stand_in(shape: DecoderShape, layers: int) -> tuple[DecoderShape, TinyConfig]:
    """The shape dyncp's test decoder can build (2-GEMM MLP) and its config."""
    if shape.hidden_size != shape.num_heads * shape.head_dim:
        raise ValueError(
            f"the stand-in decoder needs hidden_size = num_heads x head_dim, got "
            f"{shape.hidden_size} != {shape.num_heads} x {shape.head_dim}"
        )
    standin = replace(
        shape, name=f"{shape.name}-standin", num_layers=layers, ffn_kind="gelu",
        source=f"dyncp.testing.TinyDecoder with the dims of {shape.name}",
    )  # fmt: skip
    cfg = TinyConfig(
        vocab=shape.vocab_size,
        dim=shape.hidden_size,
        heads=shape.num_heads,
        kv_heads=shape.num_kv_heads,
        layers=layers,
        ffn=shape.ffn_hidden_size,
    )
    return standin, cfg


def microbatch_mape(
    shape: DecoderShape,
    *,
    kernel: BlockKernel,
    base: Profile,
    sizes: Sizes,
    device: torch.device,
) -> dict:
    """Measured vs predicted forward+backward seconds of CP-1 micro-batches of the stand-in."""
    standin, cfg = stand_in(shape, sizes.mape_layers)
    profile, _ = measured_profile(
        standin, kernel=kernel, base=base, sizes=sizes, device=device, name="standin"
    )
    model = CostModel(profile, ranks_per_node=8)
    torch.manual_seed(0)
    net = TinyDecoder(cfg).to(device=device, dtype=sizes.dtype)
    rows = []
    for pack in sizes.mape_packs:
        total = sum(pack)
        tokens = torch.randint(0, cfg.vocab, (total,), device=device)
        labels = next_token_labels(tokens, pack)
        positions = torch.cat([torch.arange(s, device=device) for s in pack])
        layout = make_ring_layout(seqlens=pack, cp=1)

        def step(tokens=tokens, labels=labels, positions=positions, layout=layout):
            net.zero_grad(set_to_none=True)
            net.loss_sum(tokens, labels, positions, layout, kernel=kernel.name).backward()

        measured = median_seconds(step, device=device, repeats=sizes.repeats)
        predicted = model.microbatch_seconds(1, list(pack))
        rows.append(
            {
                "pack": list(pack),
                "measured": measured,
                "predicted": predicted,
                "error": predicted / measured - 1,
            }
        )
    errors = [abs(r["error"]) for r in rows]
    return {"layers": cfg.layers, "packs": rows, "mape": float(np.mean(errors)),
            "worst": float(np.max(errors))}  # fmt: skip


# ---------------------------------------------------------------------------- main


def _kernels(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[BlockKernel]:
    names = ("flash", "sdpa") if device.type == "cuda" else ("sdpa", "math")
    out = []
    for name in names:
        kernel = make_kernel(name)
        why = kernel.unsupported(device=device, dtype=dtype, head_dim=head_dim, v_head_dim=head_dim)
        if why is None:
            out.append(kernel)
        else:
            print(f"kernel {name}: skipped ({why})")
    return out


#: Parameters of the buffer AdamW is timed on: on a GPU, large enough to be memory-bound.
OPTIMIZER_PARAMETERS = {"cuda": 1 << 27, "cpu": 1 << 16}


def optimizer_check(device: torch.device, shape: DecoderShape) -> dict:
    """AdamW's update measured on ``device`` (fp32 parameters, gradients present, moments
    allocated by a first step): seconds per parameter and the bytes/s it implies at
    ``OPTIMIZER_BYTES_PER_PARAMETER``, beside the assumption of ``h100-reference-step``."""
    n = OPTIMIZER_PARAMETERS[device.type]
    param = torch.nn.Parameter(torch.zeros(n, device=device))
    param.grad = torch.full_like(param, 1e-3)
    optim = torch.optim.AdamW([param], lr=1e-6)
    seconds = median_seconds(optim.step, device=device, repeats=5)
    per_parameter = seconds / n
    return {
        "parameters_timed": n,
        "optimizer_seconds_per_parameter": per_parameter,
        "implied_bytes_per_second": OPTIMIZER_BYTES_PER_PARAMETER / per_parameter,
        "assumed_seconds_per_parameter": OPTIMIZER_BYTES_PER_PARAMETER / HBM_BYTES_PER_SECOND,
        "shape_parameters": shape.gemm_params + shape.hidden_size * shape.vocab_size,
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (seconds)")
    parser.add_argument("--model", default="llama3-8b", help="named shape or shape JSON")
    parser.add_argument("--base-profile", default="h100-reference")
    parser.add_argument("--out-dir", type=Path, default=Path("dyncp/cost_model/profiles"))
    parser.add_argument("--json", type=Path, default=None, help="write all figures here")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, sizes, shape = torch.device("cpu"), DRY, DRY_SHAPE
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on a GPU, or use --dry-run for the CPU check")
        device, sizes, shape = torch.device("cuda"), FULL, load_shape(args.model)
    base = load_profile(args.base_profile)
    device_name, peak = peak_flops(device)
    start = time.perf_counter()
    print(f"device {device_name}, peak BF16 {peak / 1e12 if peak else 'unknown'} TFLOP/s, "
          f"torch {torch.__version__}, model {shape.name}")  # fmt: skip
    kernels = _kernels(device, sizes.dtype, sizes.check_heads[2])
    if not kernels:
        print("no block kernel can run here")
        return 1

    checks = check_kernels(kernels, sizes, device)
    print(f"\n1. ring steps emulated in one process vs fp64 reference ({len(checks)} runs)")
    for row in checks:
        errs = " ".join(f"{k} {v:.1e}" for k, v in row["errors"].items())
        print(f"  {row['kernel']:>5} cp {row['cp']} {row['dtype']} pack {len(row['pack'])} seqs "
              f"/ {sum(row['pack'])} tok: {errs}  {'ok' if row['ok'] else 'FAIL'}")  # fmt: skip

    tput = throughput(kernels, sizes, shape, device)
    dims = f"{shape.num_heads} heads x {shape.head_dim} (kv {shape.num_kv_heads})"
    print(f"\n2. causal attention, {dims}")
    for row in tput:
        share = (
            "" if row["peak_share_fwd"] is None
            else f" ({row['peak_share_fwd']:.0%} / {row['peak_share_fwd_bwd']:.0%} of peak)"
        )  # fmt: skip
        print(f"  {row['kernel']:>5} L {row['length']:>6}: fwd {row['tflops_fwd']:.3g} TFLOP/s, "
              f"fwd+bwd {row['tflops_fwd_bwd']:.3g} TFLOP/s{share}")  # fmt: skip

    best = kernels[0]
    name = f"{_slug(device_name)}-{_slug(shape.name)}"
    profile, figures = measured_profile(
        shape, kernel=best, base=base, sizes=sizes, device=device, name=name
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{name}.json"
    path.write_text(profile.to_json())
    print(f"\n3. profile {path}: linear {profile.linear_seconds_per_token:.3e} s/token "
          f"({figures['gemm_tflops']:.3g} TFLOP/s GEMMs), attention fit error "
          f"{figures['attention_fit_error']:.1%}, bwd/fwd {figures['bwd_fwd']:.2f}")  # fmt: skip

    mape = microbatch_mape(shape, kernel=best, base=base, sizes=sizes, device=device)
    print(f"\n4. CP-1 micro-batches, {mape['layers']}-layer stand-in of {shape.name}")
    for row in mape["packs"]:
        print(f"  {len(row['pack']):>3} seqs / {sum(row['pack']):>6} tok: measured "
              f"{row['measured'] * 1e3:8.2f} ms, predicted {row['predicted'] * 1e3:8.2f} ms "
              f"({row['error']:+.1%})")  # fmt: skip
    print(f"  MAPE {mape['mape']:.1%}, worst {mape['worst']:.1%}")
    optimizer = optimizer_check(device, shape)
    print(f"\n5. AdamW step over {optimizer['parameters_timed']} fp32 parameters: "
          f"{optimizer['optimizer_seconds_per_parameter']:.3e} s/parameter "
          f"({optimizer['implied_bytes_per_second'] / 1e12:.3g} TB/s at "
          f"{OPTIMIZER_BYTES_PER_PARAMETER:.0f} B/parameter; h100-reference-step assumes "
          f"{optimizer['assumed_seconds_per_parameter']:.3e})")  # fmt: skip
    elapsed = time.perf_counter() - start
    print(f"\ndone in {elapsed:.0f} s")
    ok = all(row["ok"] for row in checks)
    if args.json is not None:
        report = {
            "device": device_name,
            "peak_flops": peak,
            "dry_run": args.dry_run,
            "checks": checks,
            "all_checks_ok": ok,
            "throughput": tput,
            "profile": str(path),
            "profile_figures": figures,
            "mape": mape,
            "optimizer": optimizer,
            "seconds": elapsed,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if not ok:
        print("some kernel checks FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
