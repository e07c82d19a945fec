"""The CP'd diagonal linear recurrence against one process running each sequence in order.

float64 outputs and gradients (of ``a`` and ``x``) must agree within 1e-10 relative, in-process at
cp=1 and on 4 spawned gloo ranks as one cp=4 ring and two cp=2 rings, with lengths that leave
chunks partly or wholly padded; both exchanges (chunk states, all-to-all to channels).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dyncp.ring_attention import make_ring_layout, zigzag_shard, zigzag_token_index
from dyncp.ssm import channel_parallel_scan, diagonal_scan
from dyncp.testing.distributed import run_gloo

TOL = 1e-10


def reference_scan(a: torch.Tensor, x: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
    """h_t = a_t h_{t-1} + x_t token by token within each sequence (autograd-friendly)."""
    outs, start = [], 0
    for length in seqlens:
        h = torch.zeros(a.shape[1], dtype=a.dtype)
        for t in range(start, start + length):
            h = a[t] * h + x[t]
            outs.append(h)
        start += length
    return torch.stack(outs)


def make_case(seed: int, seqlens: list[int], channels: int = 8) -> dict:
    gen = torch.Generator().manual_seed(seed)
    total = sum(seqlens)
    # Decays in (0.5, 1): long memory, so states really cross chunk and rank boundaries.
    a = 0.5 + 0.5 * torch.rand(total, channels, generator=gen, dtype=torch.float64)
    x = torch.randn(total, channels, generator=gen, dtype=torch.float64)
    dy = torch.randn(total, channels, generator=gen, dtype=torch.float64)
    leaves = [a.clone().requires_grad_(), x.clone().requires_grad_()]
    y = reference_scan(*leaves, seqlens)
    da, dx = torch.autograd.grad(y, leaves, dy)
    return dict(seqlens=seqlens, a=a, x=x, dy=dy, y=y.detach(), da=da, dx=dx)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-300)).item()


def _run(case: dict, *, cp: int, group, scan=diagonal_scan) -> float:
    seqlens = case["seqlens"]
    layout = make_ring_layout(seqlens=seqlens, cp=cp, group=group)
    r = layout.rank
    a = zigzag_shard(case["a"], seqlens=seqlens, cp=cp, rank=r).requires_grad_()
    x = zigzag_shard(case["x"], seqlens=seqlens, cp=cp, rank=r).requires_grad_()
    y = scan(a, x, layout)
    dy = zigzag_shard(case["dy"], seqlens=seqlens, cp=cp, rank=r)
    da, dx = torch.autograd.grad(y, [a, x], dy)
    index = zigzag_token_index(seqlens=seqlens, cp=cp, rank=r)
    real = index >= 0
    err = max(_rel(y[real], case["y"][index[real]]), _rel(da[real], case["da"][index[real]]),
              _rel(dx[real], case["dx"][index[real]]))  # fmt: skip
    pad = torch.cat([y[~real], da[~real], dx[~real]]).abs()
    return max(err, pad.max().item() if pad.numel() else 0.0)


SEQLENS = [[64], [37, 1, 16, 9], [3, 100], [8, 15, 17]]


def _worker(rank: int, world: int, cases: list[dict]) -> list[float]:
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    whole = dist.new_group(list(range(world)))
    errs = []
    for case in cases:
        for scan in (diagonal_scan, channel_parallel_scan):
            errs.append(_run(case, cp=4, group=whole, scan=scan))
            errs.append(_run(case, cp=2, group=halves[rank // 2], scan=scan))
    return errs


@pytest.mark.timeout(120)
def test_state_passing_and_channel_parallel_scans_match_one_process() -> None:
    cases = [make_case(i, s) for i, s in enumerate(SEQLENS)]
    results = run_gloo(_worker, world=4, args=(cases,), timeout=100)
    worst = max(max(r) for r in results)
    assert worst < TOL, f"CP scan differs from one process by {worst} (relative)"


def test_scan_cp1_matches_reference() -> None:
    for i, seqlens in enumerate(SEQLENS):
        assert _run(make_case(50 + i, seqlens), cp=1, group=None) < TOL


def test_states_cross_sequences_never() -> None:
    # Two sequences: the second's first state is its own x, whatever came before.
    a = torch.full((6, 2), 0.9, dtype=torch.float64)
    x = torch.arange(12, dtype=torch.float64).view(6, 2)
    y = diagonal_scan(a, x, make_ring_layout(seqlens=[3, 3], cp=1))
    assert torch.equal(y[3], x[3])


def test_scan_errors() -> None:
    layout = make_ring_layout(seqlens=[4], cp=1)
    a = torch.rand(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="local_tokens=4"):
        diagonal_scan(a[:3], a[:3], layout)
    with pytest.raises(ValueError, match="share shape, dtype and device"):
        diagonal_scan(a, a.float(), layout)
    # cp=1 needs no exchange: the channel-parallel scan is the plain one.
    assert torch.equal(channel_parallel_scan(a, a, layout), diagonal_scan(a, a, layout))
