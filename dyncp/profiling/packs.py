"""Time real micro-batches: packs of real document lengths, run as a training wave runs them.

Shared by the profiler (its final calibration pass) and by validation, so that a profile is
fitted and checked on the same kind of measurement: every rank runs a ring of the same size side
by side (as in a wave), forward + backward of the profile's model through dyncp's ring attention;
a pack's time is the median over repeats of the slowest rank's time (the first round is a
warm-up). Repeats are taken in rounds over all packs, so a passing burst of other load on the
machine spoils one repeat of many packs rather than every repeat of a few.
Collective: every rank must call :func:`measure_packs` with the same arguments.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from dyncp.cost_model.calibration.fit import Measurement
from dyncp.plan import padding_multiple
from dyncp.profiling.decoder import TinyDecoder
from dyncp.ring_attention import make_ring_layout, zigzag_positions, zigzag_shard
from dyncp.runtime import next_token_labels

__all__ = ["measure_packs", "random_pack", "ring_sizes"]


def random_pack(pool: np.ndarray, cp: int, capacity: int, rng: np.random.Generator) -> list[int]:
    """Lengths drawn from ``pool`` until the next would overflow ``capacity`` tokens per rank."""
    out: list[int] = []
    tokens = 0
    unit = padding_multiple(cp)
    while True:
        s = int(min(rng.choice(pool), cp * capacity))
        padded = -(-s // unit) * unit
        if tokens + padded > cp * capacity:
            return out or [s]
        out.append(s)
        tokens += padded


def ring_sizes(world: int) -> list[int]:
    """CP sizes a world of ``world`` processes can run side by side (powers of two up to 8)."""
    return [c for c in (1, 2, 4, 8) if c <= world and world % c == 0]


def measure_packs(
    model: TinyDecoder,
    *,
    pool: np.ndarray,
    sizes: list[int],
    capacity: int,
    cases: int,
    repeats: int,
    rng: np.random.Generator,
    device: torch.device | None = None,
) -> list[Measurement]:
    """``cases`` random packs per CP size in ``sizes``, each timed ``repeats`` times.

    Returns the same measurements on every rank. Process groups for the rings are created here,
    in the same order on every rank.
    """
    distributed = dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    groups = {
        c: [dist.new_group(list(range(b, b + c))) for b in range(0, world, c)]
        for c in sizes
        if c > 1
    }
    vocab = model.cfg.vocab
    device = device or torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cases_by_size = []
    for cp in sizes:
        group = None if cp == 1 else groups[cp][rank // cp]
        for _ in range(cases):
            seqlens = random_pack(pool, cp, capacity, rng)
            tokens = torch.randint(0, vocab, (sum(seqlens),))
            labels = next_token_labels(tokens, seqlens)
            me = rank % cp
            layout = make_ring_layout(seqlens=seqlens, cp=cp, group=group, rank=rank)
            tok = zigzag_shard(tokens, seqlens=seqlens, cp=cp, rank=me).to(device)
            lab = zigzag_shard(labels, seqlens=seqlens, cp=cp, rank=me, pad_value=-100).to(device)
            pos = zigzag_positions(seqlens=seqlens, cp=cp, rank=me).to(device)
            cases_by_size.append((cp, seqlens, tok, lab, pos, layout))
    # Round robin: every round times every pack once, so a burst of foreign load on the machine
    # hits one repeat of many packs (the median drops it), not all repeats of a few packs.
    times: list[list[float]] = [[] for _ in cases_by_size]
    for r in range(repeats + 1):
        for j, (_, _, tok, lab, pos, layout) in enumerate(cases_by_size):
            if distributed:
                dist.barrier()
            t0 = time.perf_counter()
            model.loss_sum(tok, lab, pos, layout, kernel="auto").backward()
            sync()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            if distributed:
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r:  # the first round is a warm-up
                times[j].append(float(t.item()))
            model.zero_grad(set_to_none=True)
    out = [
        Measurement(cp, tuple(seqlens), statistics.median(t))
        for (cp, seqlens, *_), t in zip(cases_by_size, times)
    ]
    return out
