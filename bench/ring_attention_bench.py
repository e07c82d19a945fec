"""Ring attention benchmark: ring-step overhead on CPU, kernel throughput on GPU.

CPU (always): a ring of ``cp`` gloo processes runs causal zigzag ring attention on a micro-batch;
one ring step is the ring's time divided by ``cp`` steps. The same processes also run the whole
micro-batch alone (cp = 1, same kernel, same threads, alternating with the ring runs so both see
the same load); that time divided by ``cp**2`` is the work of one step (the ring splits the
attention into cp ranks x cp steps of equal work). The ratio step / (single / cp^2) is the ring's
overhead factor: 1.0 means communication, gathers and merges cost nothing. Every process gets
``--threads`` threads; with more processes than cores the ratio also includes oversubscription,
and the script says so.

GPU (only with CUDA): cp = 1 forward+backward of one causal sequence of 4K..128K tokens through
``ring_attention`` (kernel auto: flash-attn if importable, else torch SDPA) against the raw kernel
it wraps (``flash_attn_varlen_func`` / ``F.scaled_dot_product_attention``), as TFLOP/s; the
difference is the ring's bookkeeping (float32 accumulator, copies). The time of one block merge
(paid cp - 1 times per forward when cp > 1) is printed next to it as a share of the raw kernel.

    python bench/ring_attention_bench.py                     # CPU: cp 2 (and 4 if >= 4 cores)
    python bench/ring_attention_bench.py --cp 2 4 --tokens 4096 8192
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dyncp.ring_attention import make_ring_layout, merge_block, ring_attention, zigzag_shard

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _inputs(seqlens: list[int], *, seed: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    total = sum(seqlens)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=dtype)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=dtype)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=dtype)
    return q.to(device), k.to(device), v.to(device)


def _time(fn, *, reps: int, warmup: int = 1, sync=lambda: None) -> float:
    """Fastest of ``reps`` runs of ``fn()``, in seconds."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed run: other load only ever adds time


def _fwd_bwd(q, k, v, layout, kernel):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, layout, causal=True, kernel=kernel)
    out.backward(torch.ones_like(out))


def _fwd(q, k, v, layout, kernel):
    with torch.no_grad():
        ring_attention(q, k, v, layout, causal=True, kernel=kernel)


# ---------------------------------------------------------------------------------------- CPU


def _ring_worker(rank: int, cp: int, store: str, seqlens, kernel, threads, reps, result) -> None:
    """Time the ring and, in the same processes and conditions, the single-process baseline.

    Ring and baseline runs alternate, every rank running its own copy of the baseline at the same
    time, so both see the same contention for cores and memory; the fastest of ``reps`` runs of
    each counts, and the slowest rank (a ring is as slow as its slowest rank).
    """
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=cp,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    try:
        layout = make_ring_layout(seqlens=seqlens, cp=cp, group=dist.group.WORLD)
        full = _inputs(seqlens, seed=0, dtype=torch.float32)
        local = [zigzag_shard(t, seqlens=seqlens, cp=cp, rank=rank) for t in full]
        single_layout = make_ring_layout(seqlens=seqlens, cp=1)
        times = []
        for fn in (_fwd, _fwd_bwd):
            ring, single = [], []
            for _ in range(reps + 1):  # the first round warms up and is dropped
                dist.barrier()
                ring.append(_time(lambda fn=fn: fn(*local, layout, kernel), reps=1, warmup=0))
                dist.barrier()
                single.append(
                    _time(lambda fn=fn: fn(*full, single_layout, kernel), reps=1, warmup=0)
                )
            t = torch.tensor([min(ring[1:]), min(single[1:])], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(t.tolist())
        if rank == 0:
            result.put(times)
    finally:
        dist.destroy_process_group()


def _ring_times(seqlens: list[int], cp: int, args: argparse.Namespace) -> list[list[float]]:
    """[ring seconds, single-process seconds] for forward and for forward+backward."""
    result = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        worker_args = (cp, f"{tmp}/store", seqlens, args.kernel, args.threads, args.reps, result)
        mp.start_processes(_ring_worker, args=worker_args, nprocs=cp, start_method="spawn")
        return result.get()


def cpu_bench(args: argparse.Namespace) -> None:
    cores = os.cpu_count() or 1
    print(
        f"CPU: {cores} cores, {args.threads} thread(s) per process, float32, {HEADS} heads / "
        f"{KV_HEADS} KV heads x {HEAD_DIM}, causal, kernel={args.kernel}"
    )
    print(
        f"{'micro-batch':>22} {'cp':>3} {'pass':>8} {'single ms':>10} {'step ms':>9} "
        f"{'same work ms':>13} {'ratio':>6}"
    )
    torch.set_num_threads(args.threads)
    for seqlens in [[n] for n in args.tokens] + [_packed(args.tokens[-1])]:
        name = f"1 x {seqlens[0]}" if len(seqlens) == 1 else f"{len(seqlens)} seqs, {sum(seqlens)}"
        for cp in args.cp:
            for label, (r, s) in zip(("fwd", "fwd+bwd"), _ring_times(seqlens, cp, args)):
                step, same = r / cp, s / cp**2
                print(
                    f"{name:>22} {cp:>3} {label:>8} {s * 1e3:>10.1f} {step * 1e3:>9.1f} "
                    f"{same * 1e3:>13.1f} {step / same:>6.2f}"
                )
    over = [cp for cp in args.cp if cp * args.threads > cores]
    if over:
        print(
            f"note: cp {over} run more threads than the {cores} cores; their ratios include "
            f"oversubscription, not only ring overhead"
        )


def _packed(total: int) -> list[int]:
    """A long-tailed packed micro-batch of about ``total`` tokens (deterministic)."""
    rng = random.Random(1)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(total - sum(lengths), 1 + int(rng.expovariate(8 / total))))
    return lengths


# ---------------------------------------------------------------------------------------- GPU


def gpu_bench(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        print("GPU part skipped: CUDA is not available")
        return
    from dyncp.ring_attention.flash_kernel import flash_attn_import_error

    flash_error = flash_attn_import_error()
    print(
        f"GPU: {torch.cuda.get_device_name()}, bfloat16, {GPU_SHAPE[0]} heads / {GPU_SHAPE[1]} KV "
        f"heads x {GPU_SHAPE[2]}, causal fwd+bwd, cp=1; flash-attn: {flash_error or 'available'}"
    )
    print(
        f"{'tokens':>8} {'ours TFLOP/s':>13} {'raw kernel':>31} {'TFLOP/s':>8} {'overhead':>9} "
        f"{'merge ms':>9} {'merge/step':>11}"
    )
    for n in args.gpu_tokens:
        ours, base, raw_name = _gpu_one(n, reps=args.reps, flash=flash_error is None)
        merge = _gpu_merge(n, reps=args.reps)
        flops = 3.5 * 2 * n * n * GPU_SHAPE[0] * GPU_SHAPE[2]  # causal fwd 2n^2hd, bwd 2.5x fwd
        print(
            f"{n:>8} {flops / ours / 1e12:>13.1f} {raw_name:>31} {flops / base / 1e12:>8.1f} "
            f"{ours / base - 1:>+9.1%} {merge * 1e3:>9.3f} {merge / base:>11.2%}"
        )
        torch.cuda.empty_cache()
    print(
        "overhead: ring_attention at cp=1 (accumulator, copies) vs the raw kernel; merge: one "
        "log-sum-exp merge of an n-token block (paid cp-1 times per forward at cp > 1), as a "
        "share of the raw fwd+bwd"
    )


GPU_SHAPE = (16, 4, 128)  # heads, KV heads, head dim


def _gpu_merge(n: int, *, reps: int) -> float:
    """Seconds of one merge_block of an ``n``-token bfloat16 block into a float32 accumulator."""
    heads, _, dim = GPU_SHAPE
    out = torch.randn(n, heads, dim, device="cuda")
    lse = torch.randn(n, heads, device="cuda")
    block_out = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16)
    block_lse = torch.randn(n, heads, device="cuda")
    return _time(
        lambda: merge_block(out, lse, block_out, block_lse), reps=reps, sync=torch.cuda.synchronize
    )


def _gpu_one(n: int, *, reps: int, flash: bool) -> tuple[float, float, str]:
    """Seconds of ring_attention (cp = 1) and of the raw kernel for one sequence of ``n``."""
    import torch.nn.functional as F

    heads, kv_heads, dim = GPU_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(n, heads, dim, **shape)
    k = torch.randn(n, kv_heads, dim, **shape)
    v = torch.randn(n, kv_heads, dim, **shape)
    layout = make_ring_layout(seqlens=[n], cp=1)
    sync = torch.cuda.synchronize
    ours = _time(lambda: _fwd_bwd(q, k, v, layout, "auto"), reps=reps, sync=sync)
    if flash:
        from flash_attn import flash_attn_varlen_func

        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")

        def raw() -> None:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            o = flash_attn_varlen_func(qq, kk, vv, cu, cu, n, n, causal=True)
            o.backward(torch.ones_like(o))

        return ours, _time(raw, reps=reps, sync=sync), "flash_attn_varlen_func"

    def raw_sdpa() -> None:
        qq, kk, vv = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        o.backward(torch.ones_like(o))

    return ours, _time(raw_sdpa, reps=reps, sync=sync), "F.scaled_dot_product_attention"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cores = os.cpu_count() or 1
    parser.add_argument("--cp", type=int, nargs="+", default=[c for c in (2, 4) if c <= cores])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--kernel", default="auto", choices=["auto", "sdpa", "math"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gpu-tokens", type=int, nargs="+",
                        default=[1 << p for p in range(12, 18)])  # fmt: skip
    parser.add_argument("--skip-cpu", action="store_true")
    args = parser.parse_args()
    if not args.skip_cpu:
        cpu_bench(args)
    gpu_bench(args)


if __name__ == "__main__":
    main()
