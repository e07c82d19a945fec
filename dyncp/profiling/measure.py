"""The profiler's measurements: attention, the model, ring steps, head exchanges, waves.

What is measured, per transformer layer of the model shape (``--model``):

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

Every measurement is the median over repeats of the slowest rank's time; ``dyncp.profiling.fits``
turns them into a profile and ``python -m dyncp.profiling.profile`` runs both.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from dyncp.cost_model.schema import RunContext
from dyncp.profiling.decoder import TinyConfig, TinyDecoder
from dyncp.ring_attention import make_ring_layout, ring_attention, zigzag_positions, zigzag_shard
from dyncp.ring_attention.comm import ring_exchange
from dyncp.runtime import next_token_labels

__all__ = [
    "ALL_TO_ALL_TOKENS",
    "group_sizes",
    "measure",
    "measure_all_to_all",
    "median_seconds",
    "run_context",
]


def median_seconds(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
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


#: Tokens per rank of the timed all-to-alls (the head exchange of a layer's q, k and v).
ALL_TO_ALL_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)


def group_sizes(world: int) -> list[int]:
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
        out["attn_fwd"].append(median_seconds(fwd, repeats, sync))
        out["attn_fwdbwd"].append(median_seconds(fwdbwd, repeats, sync))
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
            out["packs"].append((seqlen, n_seqs, median_seconds(step, repeats, sync)))
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
        out["single_seconds"].append(median_seconds(single, repeats, sync))
        log(f"  model fwd+bwd, one sequence of {s:>6}: {out['single_seconds'][-1] * 1e3:8.3f} ms")

    if distributed:
        world = dist.get_world_size()
        me = dist.get_rank()
        out["links"] = {}
        sizes = group_sizes(world)
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
                    (2 * block.numel() * block.element_size(), median_seconds(step, repeats, sync))
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
                out["ring_packs"].append((c, seqlens, median_seconds(ring_step, repeats, sync)))
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
        out["wave_seconds"] = median_seconds(wave_sync, repeats, sync)
    return out


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
