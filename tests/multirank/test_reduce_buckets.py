"""reduce_gradients sends the gradients in buckets: the sums of one call per tensor, in few
calls (the cost model prices the reduction as one buffer)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dyncp.runtime import reduce_gradients
from dyncp.testing.distributed import run_gloo


def _model(rank: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(4, 3), nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)  # frozen: left out
    model[2].to(torch.float64)  # another dtype: its own bucket
    gen = torch.Generator().manual_seed(rank + 1)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    model[3].bias.grad = None  # no gradient on this rank: zeros go
    return model


def _worker(rank: int, world: int, bucket_bytes: int) -> dict:
    model = _model(rank)
    expected = {}
    for name, p in model.named_parameters():  # one call per tensor: the reference sums
        if p.requires_grad:
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            expected[name] = g
    calls = []
    plain = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return plain(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        grads = reduce_gradients(model, bucket_bytes=bucket_bytes)
    finally:
        dist.all_reduce = plain
    same = all(torch.equal(grads[n], expected[n]) for n in expected) and set(grads) == set(expected)
    return {"same": same, "calls": calls, "frozen": model[1].bias.grad is None}


@pytest.mark.timeout(120)
def test_buckets_sum_as_one_call_per_tensor_in_few_calls() -> None:
    for rank in run_gloo(_worker, world=2, args=(2**20,), timeout=90):
        assert rank["same"] and rank["frozen"]
        # float32 layers 0-1 (bias 1 frozen), float64 layer 2, float32 layer 3: three buckets
        assert rank["calls"] == [8 * 16 + 16 + 16 * 4, 4 * 3 + 3, 3 * 2 + 2]
    # 64 bytes: a tensor over it goes alone, the last two (6 + 2 float32: 32 bytes) together
    small = run_gloo(_worker, world=2, args=(64,), timeout=90)[0]
    assert small["same"] and small["calls"] == [128, 16, 64, 12, 3, 8]


def test_a_bucket_must_hold_something() -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        reduce_gradients(nn.Linear(2, 2), bucket_bytes=0)
