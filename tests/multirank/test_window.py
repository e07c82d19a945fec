"""Sliding-window ring attention against windowed attention of each sequence on one process.

The schedule (which steps and transfers a window needs) is checked in-process; the ring runs on
4 spawned gloo ranks in float64, as one cp=4 ring and as two cp=2 rings, for windows smaller than,
equal to and larger than a shard, and compares outputs and gradients within 1e-10.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist

from dyncp.ring_attention import (
    make_ring_layout,
    ring_attention,
    window_plan,
    zigzag_shard,
    zigzag_token_index,
)
from dyncp.testing.distributed import run_gloo

TOL = 1e-10


def windowed_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seqlens: list[int], window: int
) -> torch.Tensor:
    """Causal attention where query i sees keys i - window < j <= i, per packed sequence."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for length in seqlens:
        sl = slice(start, start + length)
        kk = k[sl].repeat_interleave(group, dim=1)
        vv = v[sl].repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[sl], kk) * scale
        i = torch.arange(length)
        diff = i[:, None] - i[None, :]
        s = s.masked_fill((diff < 0) | (diff >= window), -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv))
        start += length
    return torch.cat(outs)


def make_case(seed: int, *, seqlens: list[int], window: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads = random.Random(seed).choice([(4, 2), (2, 2), (4, 1)])
    dim = 8
    total = sum(seqlens)
    q = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(total, kv_heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(total, kv_heads, dim, generator=gen, dtype=torch.float64)
    dout = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = windowed_reference(*leaves, seqlens=seqlens, window=window)
    grads = torch.autograd.grad(out, leaves, dout)
    return dict(seqlens=seqlens, window=window, q=q, k=k, v=v, dout=dout,
                out=out.detach(), grads=grads)  # fmt: skip


def _run(case: dict, *, cp: int, group) -> float:
    """Largest absolute error of this rank's real rows (output and q/k/v gradients)."""
    seqlens = case["seqlens"]
    layout = make_ring_layout(seqlens=seqlens, cp=cp, group=group)
    r = layout.rank
    leaves = [zigzag_shard(case[n], seqlens=seqlens, cp=cp, rank=r).requires_grad_()
              for n in ("q", "k", "v")]  # fmt: skip
    out = ring_attention(*leaves, layout, window=case["window"], kernel="math")
    dout = zigzag_shard(case["dout"], seqlens=seqlens, cp=cp, rank=r)
    grads = torch.autograd.grad(out, leaves, dout)
    index = zigzag_token_index(seqlens=seqlens, cp=cp, rank=r)
    real = index >= 0
    err = (out[real] - case["out"][index[real]]).abs().max().item()
    for got, want in zip(grads, case["grads"]):
        err = max(err, (got[real] - want[index[real]]).abs().max().item())
        err = max(err, got[~real].abs().max().item() if (~real).any() else 0.0)
    return err


# m = shard half (chunk) size; windows below, at and above one chunk and one shard (2m).
CASES = [
    ([64, 40, 7], 3),  # window far below a chunk (m = 8 at cp=4)
    ([64, 40, 7], 8),  # window equal to a chunk of the longest sequence at cp=4
    ([64, 40, 7], 16),  # window equal to a shard (2 chunks) at cp=4
    ([64, 40, 7], 33),  # larger than a shard at cp=4, equal to a shard at cp=2 plus one
    ([64, 1, 30], 200),  # larger than every sequence: plain causal attention
    ([96], 1),  # a query sees only itself
]


def _worker(rank: int, world: int, cases: list[dict]) -> list[float]:
    torch.set_default_dtype(torch.float64)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    whole = dist.new_group(list(range(world)))
    errs = []
    for case in cases:
        errs.append(_run(case, cp=4, group=whole))
        errs.append(_run(case, cp=2, group=pairs[rank // 2]))
    return errs


@pytest.mark.timeout(120)
def test_windowed_ring_matches_per_sequence_reference_cp4_and_cp2() -> None:
    cases = [make_case(i, seqlens=s, window=w) for i, (s, w) in enumerate(CASES)]
    results = run_gloo(_worker, world=4, args=(cases,), timeout=100)
    worst = max(max(r) for r in results)
    assert worst < TOL, f"windowed ring differs from the reference by {worst}"


def test_cp1_window_matches_reference() -> None:
    for i, (seqlens, window) in enumerate(CASES):
        case = make_case(100 + i, seqlens=seqlens, window=window)
        assert _run(case, cp=1, group=None) < TOL


def test_small_window_needs_only_the_two_neighbours() -> None:
    # cp=8, one sequence of 1024 tokens: chunks of 64. A window within one chunk reaches the
    # neighbouring chunk only: rank r needs ranks r-1 and r+1 (2 transfers instead of 7).
    plan = window_plan(seqlens=[1024], cp=8, window=64)
    assert (plan.forward_hops, plan.backward_hops) == (1, 1)
    assert plan.transfers == 2
    assert all((r - s) % 8 in (0, 1, 7) for r, s in plan.needed)
    # Every step that is not needed has no visible key: the steps of the plain causal ring
    # (s <= r diagonal-or-earlier plus s > r second chunk) minus the window's.
    assert plan.skipped_steps == 64 - len(plan.needed) and plan.skipped_steps > 40


def test_large_window_is_the_whole_ring() -> None:
    plan = window_plan(seqlens=[1024], cp=8, window=4096)
    assert plan.transfers == 7
    assert len(plan.needed) == 64  # zigzag causal: every rank needs every block


def test_window_grows_the_hops_step_by_step() -> None:
    # 1024 tokens at cp=4: chunks of 128. Window 1 sees only the token itself (no transfer);
    # up to 129 the neighbouring chunks suffice; from 130 chunk distance 2 is reached as well.
    hops = [window_plan(seqlens=[1024], cp=4, window=w).transfers for w in (1, 2, 129, 130)]
    assert hops == [0, 2, 2, 3]


def test_window_errors() -> None:
    q = torch.randn(8, 2, 4, dtype=torch.float64)
    layout = make_ring_layout(seqlens=[8], cp=1)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        ring_attention(q, q, q, layout, window=0)
    with pytest.raises(ValueError, match="causal=True"):
        ring_attention(q, q, q, layout, window=4, causal=False)
    with pytest.raises(ValueError, match="kernel must be 'auto' or 'math'"):
        ring_attention(q, q, q, layout, window=4, kernel="sdpa")
