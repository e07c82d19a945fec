"""Profile this hardware into a cost-model profile: ``python -m dyncp.profiling.profile``.

    python -m dyncp.profiling.profile --out profiles/mine.json                 # one process
    torchrun --nproc-per-node 2 -m dyncp.profiling.profile --out profiles/cpu-gloo.json

What it measures, per transformer layer of the model shape (``--model``):

- attention forward and forward+backward of one causal sequence at CP 1 through the ring-attention
  block kernel, over a grid of lengths (median of repeats) -> the attention table; a fit
  ``a s^2 + b s + k`` gives the fixed cost ``k`` of one kernel call (the ring-step overhead) and
  the backward/forward ratio;
- the whole model's forward+backward on packs of short sequences of growing total length, minus
  the attention the table predicts for them -> linear seconds per token and the per-micro-batch
  constant (least squares);
- under torchrun with several ranks: one ring step (batched send/recv of a K/V block to the next
  rank) for each group size and a range of message sizes -> latency and bandwidth per step; all
  ranks measure at the same time, so a shared machine's contention is part of the numbers;
- under torchrun, the head exchange of hybrid groups: ``all_to_all_single`` over each group size's
  contiguous blocks of ranks (all blocks at once) for a range of bytes per rank ->
  ``communication.all_to_all_links``; ``--all-to-all-into PROFILE`` measures only this and
  writes it into an existing profile, every other number kept;
- the synchronisation at a wave boundary (the executor's status exchange) -> the wave constant;
- finally, packs of real document lengths filling ``--capacity`` tokens per rank at every CP size
  (``--calibration-packs`` per size, as ``dyncp.profiling.validate`` runs them but other packs):
  the profile built from the pieces above is the prior of a robust refit to these
  (``dyncp.cost_model.calibration.fit_profile``), so the coefficients describe whole micro-batches
  as training runs them, and settle whether ring transfers overlap compute on this machine.

Every fit's relative error is written into the provenance. The run stops measuring new points
when ``--max-seconds`` is spent (the grid is walked short to long), and prints progress on rank 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import least_squares, nnls

from dyncp.cost_model.calibration.fit import Measurement, fit_profile
from dyncp.cost_model.schema import Profile, ProfileError, RunContext, load_profile
from dyncp.data.readers import load_lengths, resolve_dataset
from dyncp.profiling.packs import measure_packs, ring_sizes
from dyncp.ring_attention import make_ring_layout, ring_attention, zigzag_positions, zigzag_shard
from dyncp.ring_attention.comm import ring_exchange
from dyncp.testing import TinyConfig, TinyDecoder, next_token_labels

__all__ = [
    "MODELS",
    "measure",
    "fit_linear",
    "fit_attention",
    "fit_link",
    "measure_all_to_all",
    "all_to_all_section",
    "fit_link_robust",
    "main",
    "run_context",
]

# Model shapes the profiler can build; "tiny" is the runtime tests' and the example's model.
MODELS = {
    "tiny": TinyConfig(vocab=256, dim=64, heads=4, kv_heads=2, layers=2, ffn=128),
}


def _median_seconds(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    """Median over repeats of the slowest rank's time (ranks start each repeat together).

    A training step waits for its slowest rank, so under torchrun every repeat is timed on all
    ranks at once and the maximum is kept -- the statistic the validation measures too.
    """
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if distributed:
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        t = time.perf_counter() - t0
        if distributed:
            slowest = torch.tensor([t], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            t = float(slowest.item())
        times.append(t)
    return statistics.median(times)


def fit_attention(lengths: np.ndarray, seconds: np.ndarray) -> tuple[float, float, float, float]:
    """Non-negative fit ``seconds = a s^2 + b s + k`` on relative error; (a, b, k, max rel err)."""
    s = lengths.astype(float)
    basis = np.stack([s * s, s, np.ones_like(s)], 1)
    coef, _ = nnls(basis / seconds[:, None], np.ones(len(s)))
    err = float(np.max(np.abs(basis @ coef - seconds) / seconds))
    return float(coef[0]), float(coef[1]), float(coef[2]), err


def fit_linear(tokens: np.ndarray, seconds: np.ndarray) -> tuple[float, float, float]:
    """Non-negative fit ``seconds = per_token * tokens + constant``; (per_token, constant, err)."""
    basis = np.stack([tokens.astype(float), np.ones(len(tokens))], 1)
    coef, _ = nnls(basis / seconds[:, None], np.ones(len(tokens)))
    err = float(np.max(np.abs(basis @ coef - seconds) / seconds))
    return float(coef[0]), float(coef[1]), err


def fit_link(nbytes: np.ndarray, seconds: np.ndarray) -> tuple[float, float, float]:
    """``seconds = latency + bytes / bandwidth``; (latency, bandwidth, max relative error)."""
    per_byte, latency, err = fit_linear(nbytes, seconds)
    return latency, 1.0 / max(per_byte, 1e-18), err


#: Tokens per rank of the timed all-to-alls (the head exchange of a layer's q, k and v).
ALL_TO_ALL_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)


def _group_sizes(world: int) -> list[int]:
    """Group sizes the profiler measures: powers of two that divide the world."""
    return [c for c in (2, 4, 8, 16, 32, 64) if c <= world and world % c == 0]


def measure_all_to_all(
    cfg: TinyConfig,
    groups: dict[int, list],
    *,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
    sync: Callable[[], None],
    log: Callable[[str], None],
    tokens: tuple[int, ...] = ALL_TO_ALL_TOKENS,
) -> dict[int, list[tuple[int, float]]]:
    """(bytes each rank holds per exchange, seconds per exchange) of the runtime's head exchange.

    What is timed is what a hybrid group runs per layer around its attention: q, k and v of
    ``tokens`` local tokens of ``cfg`` sent to the ring layout (``heads_to_ring``: one fused
    ``all_to_all_single`` plus the reshapes and the token reordering), the output sent back
    (``ring_to_heads``), and the backward of both: the four exchanges the cost model prices
    (``4 latency + 2 b tokens / bandwidth`` with ``b`` the q, k, v and output bytes of a token).
    A point is therefore (``b x tokens / 2`` bytes, a quarter of the measured seconds), so that
    ``latency + bytes / bandwidth`` fitted to the points is one exchange's link. The head group
    is a contiguous block of c ranks, all blocks exchanging at once, with heads = c (no ring).
    The median over ``repeats`` of the slowest rank's time is kept.
    """
    from dyncp.ring_attention.hybrid import (
        HybridLayout,
        heads_to_ring,
        make_hybrid_layout,
        ring_to_heads,
    )

    me = dist.get_rank()
    out: dict[int, list[tuple[int, float]]] = {}
    for c, blocks in sorted(groups.items()):
        if cfg.heads % c or (cfg.kv_heads % c and c % cfg.kv_heads):
            log(f"  head exchange over {c} ranks: skipped ({cfg.heads}/{cfg.kv_heads} heads)")
            continue
        # q, k, v and the output of a token; KV heads fewer than c are sent as replicas.
        held = max(cfg.kv_heads, c)
        b = 2 * (cfg.heads + held) * cfg.head_dim * torch.finfo(dtype).bits // 8
        group = blocks[me // c]
        steps = []
        for n in tokens:
            layout = make_hybrid_layout(
                seqlens=[n * c], cp=c, heads=c, head_group=group, ring_group=None, device=device
            )
            local = layout.local_tokens
            q = torch.randn(local, cfg.heads, cfg.head_dim, dtype=dtype, device=device)
            k = torch.randn(local, cfg.kv_heads, cfg.head_dim, dtype=dtype, device=device)
            steps.append((layout, q, k, torch.randn_like(k)))

        def exchange(
            layout: HybridLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> None:
            """Both exchanges forward, then both backward (q|k|v's gradients in one)."""
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            rq, rk, rv = heads_to_ring(q, k, v, layout)
            back = ring_to_heads(rq, layout)
            torch.autograd.backward(
                (back, rk, rv), (torch.ones_like(back), torch.zeros_like(rk), torch.zeros_like(rv))
            )

        # Rounds over all sizes (not all repeats of one size in a row): a burst of contention
        # on a shared machine then slows one round of every size instead of one size's median.
        times: list[list[float]] = [[] for _ in steps]
        for round_ in range(repeats + 1):
            for i, step in enumerate(steps):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                exchange(*step)
                sync()
                slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if round_ > 0:  # round 0 warms up
                    times[i].append(float(slowest.item()))
        points = [
            (b * layout.local_tokens // 2, statistics.median(t) / 4)
            for (layout, *_), t in zip(steps, times)
        ]
        out[c] = points
        log(f"  head exchange, group of {c}: {points[-1][1] * 1e3:.3f} ms per exchange for "
            f"{points[-1][0]} B/rank")  # fmt: skip
    return out


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


def measure(
    cfg: TinyConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_seconds: float,
    repeats: int,
    lengths: list[int],
    log: Callable[[str], None],
) -> dict:
    """Run every measurement on this rank (all ranks call it together under torchrun)."""
    deadline = time.monotonic() + max_seconds
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    distributed = dist.is_initialized() and dist.get_world_size() > 1

    def together() -> None:
        if distributed:
            dist.barrier()

    gen = torch.Generator(device="cpu").manual_seed(0)
    out: dict = {"attn_len": [], "attn_fwd": [], "attn_fwdbwd": []}
    for s in lengths:
        if time.monotonic() > deadline and len(out["attn_len"]) >= 3:
            log(f"  time budget spent; attention table stops at {out['attn_len'][-1]} tokens")
            break
        q = torch.randn(s, cfg.heads, cfg.head_dim, generator=gen, dtype=dtype).to(device)
        k = torch.randn(s, cfg.kv_heads, cfg.head_dim, generator=gen, dtype=dtype).to(device)
        v = torch.randn_like(k)
        layout = make_ring_layout(seqlens=[s], cp=1)
        q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)

        def fwd(q=q, k=k, v=v, layout=layout) -> None:
            with torch.no_grad():
                ring_attention(q, k, v, layout, causal=True, kernel="auto")

        def fwdbwd(q=q, k=k, v=v, layout=layout) -> None:
            ring_attention(q, k, v, layout, causal=True, kernel="auto").sum().backward()

        together()
        out["attn_len"].append(s)
        out["attn_fwd"].append(_median_seconds(fwd, repeats, sync))
        out["attn_fwdbwd"].append(_median_seconds(fwdbwd, repeats, sync))
        log(f"  attention {s:>6} tokens: fwd+bwd {out['attn_fwdbwd'][-1] * 1e3:8.3f} ms")

    torch.manual_seed(0)
    model = TinyDecoder(cfg).to(device=device, dtype=dtype)
    # Packs of equal short sequences, two lengths: separates work per token from the fixed cost
    # per sequence (kernels that loop over sequences) and per micro-batch.
    out["packs"] = []
    for seqlen, counts in ((64, (1, 2, 4, 8, 16, 32)), (256, (1, 2, 4, 8))):
        for n_seqs in counts:
            seqlens = [seqlen] * n_seqs
            tokens = torch.randint(0, cfg.vocab, (sum(seqlens),), generator=gen).to(device)
            labels = next_token_labels(tokens, seqlens)
            positions = torch.arange(seqlen, device=device).repeat(n_seqs)
            layout = make_ring_layout(seqlens=seqlens, cp=1)

            def step(tokens=tokens, labels=labels, positions=positions, layout=layout) -> None:
                model.loss_sum(tokens, labels, positions, layout, kernel="auto").backward()

            together()
            out["packs"].append((seqlen, n_seqs, _median_seconds(step, repeats, sync)))
            log(f"  model fwd+bwd {n_seqs:>3} x {seqlen}: {out['packs'][-1][2] * 1e3:8.3f} ms")

    # The whole model on one sequence of each length: calibrates the attention table in the
    # code path training uses (module overheads, the loss), not only the bare kernel.
    out.update(single_len=[], single_seconds=[])
    for s in out["attn_len"]:
        tokens = torch.randint(0, cfg.vocab, (s,), generator=gen).to(device)
        labels = next_token_labels(tokens, [s])
        positions = torch.arange(s, device=device)
        layout = make_ring_layout(seqlens=[s], cp=1)

        def single(tokens=tokens, labels=labels, positions=positions, layout=layout) -> None:
            model.loss_sum(tokens, labels, positions, layout, kernel="auto").backward()

        together()
        out["single_len"].append(s)
        out["single_seconds"].append(_median_seconds(single, repeats, sync))
        log(f"  model fwd+bwd, one sequence of {s:>6}: {out['single_seconds'][-1] * 1e3:8.3f} ms")

    if distributed:
        world = dist.get_world_size()
        me = dist.get_rank()
        out["links"] = {}
        sizes = _group_sizes(world)
        groups = {
            c: [dist.new_group(list(range(b, b + c))) for b in range(0, world, c)] for c in sizes
        }
        for c in sizes:
            group = groups[c][me // c]
            layout = make_ring_layout(seqlens=[2 * c], cp=c, group=group, rank=me)
            points = []
            for tokens in (64, 256, 1024, 4096, 16384):
                block = torch.zeros(tokens, cfg.kv_heads, cfg.head_dim, dtype=dtype, device=device)

                def step(block=block, layout=layout) -> None:
                    ring_exchange([block, block], layout=layout, tags=(1, 2)).wait()

                together()
                points.append(
                    (2 * block.numel() * block.element_size(), _median_seconds(step, repeats, sync))
                )
            out["links"][c] = points
            log(
                f"  ring step, group of {c}: {points[-1][1] * 1e3:.3f} ms for {points[-1][0]} bytes"
            )
        # The ring's fixed cost per step as training pays it (kernel calls, merges, autograd,
        # P2P set-up): the model on a tiny pack per group size; fitted into the link latency.
        out["ring_packs"] = []
        for c in sizes:
            group = groups[c][me // c]
            for n_seqs in (1, 4):
                seqlens = [2 * c * 4] * n_seqs
                tokens = torch.randint(0, cfg.vocab, (sum(seqlens),), generator=gen).to(device)
                labels = next_token_labels(tokens, seqlens)
                r = me % c
                layout = make_ring_layout(seqlens=seqlens, cp=c, group=group, rank=me)
                tok = zigzag_shard(tokens, seqlens=seqlens, cp=c, rank=r)
                lab = zigzag_shard(labels, seqlens=seqlens, cp=c, rank=r, pad_value=-100)
                pos = zigzag_positions(seqlens=seqlens, cp=c, rank=r).to(device)

                def ring_step(tok=tok, lab=lab, pos=pos, layout=layout) -> None:
                    model.loss_sum(tok, lab, pos, layout, kernel="auto").backward()

                together()
                out["ring_packs"].append((c, seqlens, _median_seconds(ring_step, repeats, sync)))
                log(
                    f"  model on {n_seqs} tiny sequence(s) at cp {c}: "
                    f"{out['ring_packs'][-1][2] * 1e3:.3f} ms"
                )
        out["all_to_all"] = measure_all_to_all(
            cfg, groups, dtype=dtype, device=device, repeats=repeats, sync=sync, log=log
        )
        statuses: list = [None] * world

        def wave_sync() -> None:
            dist.all_gather_object(statuses, None)

        together()
        out["wave_seconds"] = _median_seconds(wave_sync, repeats, sync)
    return out


def _model_shape(cfg: TinyConfig, *, dtype_bytes: int) -> dict:
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


def _calibrate_latency(
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
    from dyncp.cost_model.model import CostModel

    rows, rhs = [], []
    for c, seqlens, measured in packs:
        probe = {
            "schema_version": 1,
            "name": "probe",
            "description": "ring probe",
            "provenance": {"source": "-", "device": "-", "date": "-", "method": "-"},
            "model": _model_shape(cfg, dtype_bytes=4),
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
    a, b, k, attn_err = fit_attention(lengths, fwdbwd)
    k = min(k, 0.99 * float(fwdbwd.min()))  # the schema wants every entry above k
    ratio = float(np.median((fwdbwd - fwd) / fwd))
    # Packs: t = lin * tokens + layers * n * (kernel(s) + o) + C, kernel(s) = a s^2 + b s from
    # the bare-kernel fit; least squares for lin (per token), o (per sequence), C (per pack).
    packs = np.asarray(raw["packs"], dtype=float)
    s_len, n_seq, t_pack = packs[:, 0], packs[:, 1], packs[:, 2]
    rest = t_pack - cfg.layers * n_seq * (a * s_len**2 + b * s_len)
    basis = np.stack([s_len * n_seq, cfg.layers * n_seq, np.ones(len(packs))], 1)
    coef, _ = nnls(basis / t_pack[:, None], rest / t_pack)
    per_token, per_sequence, constant = (float(x) for x in coef)
    lin_err = float(np.max(np.abs(basis @ coef - rest) / t_pack))
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
            latency = _calibrate_latency(
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
        "model": _model_shape(cfg, dtype_bytes=torch.empty((), dtype=dtype).element_size()),
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


def run_context(device: torch.device) -> RunContext:
    """This process's run set-up: processes (the job's world), threads, device, cores."""
    return RunContext(
        processes=dist.get_world_size() if dist.is_initialized() else 1,
        threads_per_process=torch.get_num_threads(),
        device_type=device.type,
        device_name=torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (platform.processor() or platform.machine()),
        cpus=os.cpu_count() or 1,
    )


def _all_to_all_into(
    args: argparse.Namespace, *, device: torch.device, command: str, log: Callable[[str], None]
) -> None:
    """Measure the all-to-all alone and write its links into an existing profile (rank 0).

    Refuses a profile measured with another number of processes or threads, or of another
    model or dtype: its other numbers describe that run, and the all-to-all must be measured
    the same way to sit beside them.
    """
    profile = load_profile(args.all_to_all_into)
    here = run_context(device)
    run = profile.provenance.run
    if run is None or (run.processes, run.threads_per_process) != (
        here.processes,
        here.threads_per_process,
    ):
        measured = (
            "no run context"
            if run is None
            else (f"{run.processes} processes x {run.threads_per_process} threads")
        )
        raise ProfileError(
            f"profile {args.all_to_all_into} was measured with {measured}; this run has "
            f"{here.processes} processes x {here.threads_per_process} threads"
        )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    world, me = dist.get_world_size(), dist.get_rank()
    groups = {
        c: [dist.new_group(list(range(b, b + c))) for b in range(0, world, c)]
        for c in _group_sizes(world)
    }
    log(f"measuring the all-to-all alone for {args.all_to_all_into}")
    cfg, dtype = MODELS[args.model], getattr(torch, args.dtype)
    shape = _model_shape(cfg, dtype_bytes=torch.empty((), dtype=dtype).element_size())
    if profile.model.model_dump() != shape:
        raise ProfileError(
            f"profile {args.all_to_all_into} describes {profile.model.model_dump()}, not "
            f"--model {args.model} in {args.dtype} ({shape})"
        )
    points = measure_all_to_all(
        cfg, groups, dtype=dtype, device=device, repeats=args.repeats, sync=sync, log=log
    )
    if me != 0:
        return
    links, note = all_to_all_section(points, dtype)
    data = profile.model_dump(mode="json")
    data["communication"]["all_to_all_links"] = links
    prov = data["provenance"]
    prov["method"] += f"; all_to_all_links measured alone on {dt.date.today()}: {command}"
    prov["notes"] = [*prov["notes"], note]
    out = args.out or args.all_to_all_into
    out.write_text(Profile.model_validate(data).to_json())
    log(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m dyncp.profiling.profile", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, default=None, help="the profile to write")
    p.add_argument(
        "--all-to-all-into",
        type=Path,
        default=None,
        metavar="PROFILE",
        help="measure only the all-to-all (torchrun, >= 2 processes) and write its "
        "all_to_all_links into PROFILE, every other number kept (to --out, else PROFILE)",
    )
    p.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    p.add_argument("--max-length", type=int, default=4096, help="longest attention length")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--max-seconds", type=float, default=120.0, help="measurement time budget")
    p.add_argument(
        "--calibration-packs",
        type=int,
        default=8,
        help="real-length packs per CP size for the final refit (0: none)",
    )
    p.add_argument("--capacity", type=int, default=1024, help="tokens per rank of those packs")
    p.add_argument("--dataset", default="wikipedia", help="lengths those packs are drawn from")
    args = p.parse_args(argv)
    if args.out is None and args.all_to_all_into is None:
        p.error("--out is required (or --all-to-all-into PROFILE)")
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.all_to_all_into is not None and not distributed:
        p.error("--all-to-all-into measures between processes: run it under torchrun with >= 2")
    if distributed:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    torch.set_num_threads(1 if distributed and args.device == "cpu" else torch.get_num_threads())
    device = (
        torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
        if args.device == "cuda"
        else torch.device("cpu")
    )
    dtype = getattr(torch, args.dtype)
    lengths = [
        s
        for s in (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
        if s <= args.max_length
    ]

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    command = " ".join(
        ["python -m dyncp.profiling.profile", *(argv if argv is not None else sys.argv[1:])]
    )
    if distributed:
        command = (
            f"torchrun --nproc-per-node {dist.get_world_size()} -m dyncp.profiling.profile "
            + command.split(" ", 3)[-1]
        )
    if args.all_to_all_into is not None:
        try:
            _all_to_all_into(args, device=device, command=command, log=log)
        except ProfileError as exc:
            p.error(str(exc))
        finally:
            dist.destroy_process_group()
        return
    log(f"profiling {args.model} on {args.device} ({args.dtype}), budget {args.max_seconds:.0f} s")
    raw = measure(
        MODELS[args.model],
        device=device,
        dtype=dtype,
        max_seconds=args.max_seconds,
        repeats=args.repeats,
        lengths=lengths,
        log=log,
    )
    packs: list[Measurement] = []
    if args.calibration_packs > 0:
        log(f"  timing {args.calibration_packs} real-length packs per CP size for the refit")
        torch.manual_seed(1)
        packs = measure_packs(
            TinyDecoder(MODELS[args.model]).to(device=device, dtype=dtype),
            pool=load_lengths(resolve_dataset(args.dataset)),
            sizes=ring_sizes(dist.get_world_size() if distributed else 1),
            capacity=args.capacity,
            cases=args.calibration_packs,
            repeats=args.repeats,
            rng=np.random.default_rng(1),  # validation draws its packs from seed 0
            device=device,
        )
    if rank == 0:
        name = args.name or args.out.stem
        profile = build_profile(
            name,
            MODELS[args.model],
            raw,
            dtype=dtype,
            device=device,
            command=command,
        )
        if packs:
            world = dist.get_world_size() if distributed else 1
            fit = fit_profile(
                profile,
                packs,
                ranks_per_node=world,
                min_measurements=1,
                source=f"the profiler's {len(packs)} packs of real {args.dataset} lengths",
            )
            profile = Profile.model_validate(json.loads(fit.profile.to_json()) | {"name": name})
            log(
                f"  refit to the packs: mean error {fit.error_before:.1%} -> "
                f"{fit.error_after:.1%}, overlap {fit.overlap}"
            )
        args.out.write_text(profile.to_json())
        log(f"wrote {args.out}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
