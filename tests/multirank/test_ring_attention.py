"""Ring attention against full attention computed per sequence on one process.

In-process tests cover the pieces (merge, kernels, kernel choice, layout and input errors, cp=1).
The ring itself runs in spawned processes over gloo on CPU: one pool per world size (2, 4, 8)
runs many random packed micro-batches, switching the same processes between ring sizes, and every
rank compares its outputs and gradients with a float64 reference on its real tokens:
float64 within 1e-10, float32 within 1e-5. Each pool also checks that wrong layouts fail.
GPU tests (kernels against the math reference) run only when CUDA is available.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dyncp.ring_attention import (
    BlockSpec,
    KernelFallbackWarning,
    MathKernel,
    SdpaKernel,
    make_ring_layout,
    merge_block,
    ring_attention,
    select_kernel,
    zigzag_shard,
    zigzag_token_index,
)
from dyncp.testing.distributed import start_ranks

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
DTYPES = {"float64": torch.float64, "float32": torch.float32}
HANG_SECONDS = 30  # gloo timeout inside the workers: a lost message fails instead of blocking

# ------------------------------------------------------------------------------ reference


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    seqlens: list[int],
    causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain softmax attention of each packed sequence alone (autograd-friendly)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for length in seqlens:
        sl = slice(start, start + length)
        kk = k[sl].repeat_interleave(group, dim=1)
        vv = v[sl].repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[sl], kk) * scale
        if causal:
            future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
            s = s.masked_fill(future, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv))
        start += length
    return torch.cat(outs)


def make_case(
    rng: random.Random, *, dtype: str, kernel: str, causal: bool, seqlens: list[int] | None = None
) -> dict:
    """A random packed micro-batch with its float64 reference output and gradients."""
    if seqlens is None:
        n = rng.randint(1, 5)
        seqlens = [rng.choice([rng.randint(1, 300), rng.randint(1, 40)]) for _ in range(n)]
    heads, kv_heads = rng.choice([(4, 4), (4, 2), (4, 1), (2, 2)])
    head_dim = rng.choice([8, 16])
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    total = sum(seqlens)

    def randn(*shape: int) -> torch.Tensor:
        # Rounded to the case dtype so the reference sees exactly the ring's inputs.
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DTYPES[dtype]).double()

    q = randn(total, heads, head_dim)
    k, v = randn(total, kv_heads, head_dim), randn(total, kv_heads, head_dim)
    dout = randn(total, heads, head_dim)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = reference_attention(*leaves, seqlens=seqlens, causal=causal)
    grads = torch.autograd.grad(out, leaves, dout)
    return dict(
        seqlens=seqlens, causal=causal, dtype=dtype, kernel=kernel,
        q=q, k=k, v=v, dout=dout, out=out.detach(), dq=grads[0], dk=grads[1], dv=grads[2],
    )  # fmt: skip


# Edge cases first: one token; lengths below 2*cp, around it and not divisible by it; the longest.
EDGE_SEQLENS = [[1], [1, 2, 3, 5, 7, 9, 15, 17], [300, 1, 299, 16], [8, 16, 32]]


def make_cases(count: int, seed: int) -> list[dict]:
    """Alternating float64/float32, math/sdpa kernels, two in three causal."""
    rng = random.Random(seed)
    return [
        make_case(
            rng,
            dtype=("float64", "float32")[i % 2],
            kernel=("math", "sdpa")[(i // 2) % 2],
            causal=(i // 4) % 3 != 2,
            seqlens=EDGE_SEQLENS[i] if i < len(EDGE_SEQLENS) else None,
        )
        for i in range(count)
    ]


# ------------------------------------------------------------------------------ in-process


def _rand(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_merge_of_two_key_halves_is_full_attention(dtype: torch.dtype) -> None:
    q, k, v = _rand(7, 2, 8, dtype=dtype), _rand(10, 2, 8, dtype=dtype, seed=1), _rand(10, 2, 8)
    v = v.to(dtype)
    kernel = MathKernel()
    full, full_lse = kernel.forward(
        q, k, v, spec=BlockSpec((0, 7), (0, 10), False), softmax_scale=0.3
    )
    out = torch.zeros_like(full)
    lse = torch.full((7, 2), -math.inf, dtype=full.dtype)
    for lo, hi in ((0, 4), (4, 10)):
        o, s = kernel.forward(
            q, k[lo:hi], v[lo:hi], spec=BlockSpec((0, 7), (0, hi - lo), False), softmax_scale=0.3
        )
        out, lse = merge_block(out, lse, o, s.t())
    assert (out - full).abs().max() <= TOL[dtype]
    assert (lse - full_lse.t()).abs().max() <= TOL[dtype]
    # A block that saw no key (lse -inf) leaves the accumulator unchanged.
    same_out, same_lse = merge_block(
        out, lse, torch.zeros_like(out), torch.full_like(lse, -math.inf)
    )
    assert torch.equal(same_out, out) and torch.equal(same_lse, lse)


KERNEL_SPECS = [
    # (q lengths, k lengths, causal): varlen, non-square, empty and single-token sequences
    ([5, 1, 37, 64], [5, 1, 37, 64], True),
    ([5, 1, 37, 64], [9, 3, 20, 64], False),
    ([3, 0, 8], [5, 4, 8], True),  # bottom-right causal; a sequence without queries
    ([4, 6], [0, 6], False),  # a sequence without keys: output 0, lse -inf
]


@pytest.mark.parametrize("kernel", [MathKernel(), SdpaKernel(), MathKernel(max_score_elements=50)])
@pytest.mark.parametrize("lens_q,lens_k,causal", KERNEL_SPECS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_kernel_matches_dense_reference(kernel, lens_q, lens_k, causal, dtype) -> None:
    spec = BlockSpec(tuple(_cum(lens_q)), tuple(_cum(lens_k)), causal)
    tq, tk = sum(lens_q), sum(lens_k)
    q = _rand(tq, 4, 8, dtype=dtype, seed=1).requires_grad_()
    k = _rand(tk, 2, 8, dtype=dtype, seed=2).requires_grad_()
    v = _rand(tk, 2, 8, dtype=dtype, seed=3).requires_grad_()
    out, lse = kernel.forward(q, k, v, spec=spec, softmax_scale=0.4)
    ref_out, ref_lse = _dense_reference(q, k, v, lens_q, lens_k, causal, 0.4)
    tol = TOL[dtype]
    assert (out - ref_out).abs().max() <= tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - ref_lse[finite]).abs().max() <= tol
    dout = _rand(tq, 4, 8, dtype=dtype, seed=4)
    grads = kernel.backward(dout, q, k, v, out.to(dtype), lse, spec=spec, softmax_scale=0.4)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout, allow_unused=True)
    for got, want in zip(grads, ref_grads):
        want = torch.zeros_like(got) if want is None else want
        assert (got - want).abs().max() <= tol


def _cum(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _dense_reference(q, k, v, lens_q, lens_k, causal, scale):
    """Per-sequence softmax with bottom-right causality; rows without keys give 0 and -inf."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(
        zip(_cum(lens_q), _cum(lens_q)[1:]), zip(_cum(lens_k), _cum(lens_k)[1:])
    ):
        kk = k[k0:k1].repeat_interleave(group, dim=1)
        vv = v[k0:k1].repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1], kk) * scale
        lq, lk = q1 - q0, k1 - k0
        if causal:
            j = torch.arange(lk)[None, :]
            i = torch.arange(lq)[:, None]
            s = s.masked_fill(j > i + lk - lq, -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0)[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", p, vv))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def test_select_kernel_by_name_auto_and_errors() -> None:
    cpu = torch.device("cpu")
    pick = dict(device=cpu, head_dim=8, v_head_dim=8)
    assert select_kernel("auto", dtype=torch.float64, **pick).name == "sdpa"
    assert select_kernel("math", dtype=torch.float32, **pick).name == "math"
    mine = MathKernel()
    assert select_kernel(mine, dtype=torch.float32, **pick) is mine
    with pytest.raises(ValueError, match="flash kernel runs on cuda only"):
        select_kernel("flash", dtype=torch.bfloat16, **pick)
    with pytest.raises(ValueError, match="unknown block kernel 'fast'.*allowed"):
        select_kernel("fast", dtype=torch.float32, **pick)
    with pytest.raises(ValueError, match="equal q/k and v head dims"):
        select_kernel("sdpa", dtype=torch.float32, device=cpu, head_dim=8, v_head_dim=4)
    # auto never falls back silently: a smaller kernel comes with a warning naming why.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = select_kernel("auto", dtype=torch.float32, device=cpu, head_dim=8, v_head_dim=4)
    assert chosen.name == "math"
    assert any(
        issubclass(w.category, KernelFallbackWarning) and "'sdpa' is unavailable" in str(w.message)
        for w in caught
    )


def test_layout_helper_and_its_errors() -> None:
    layout = make_ring_layout(seqlens=[5, 3], cp=1)
    assert layout.local_tokens == 8 and layout.cu_seqlens_local == (0, 5, 8)
    assert layout.group is None and layout.rank == 0
    with pytest.raises(ValueError, match="seqlens must be a non-empty list of lengths >= 1"):
        make_ring_layout(seqlens=[5, 0], cp=1)
    with pytest.raises(ValueError, match="cp must be an integer >= 1"):
        make_ring_layout(seqlens=[5], cp=0)
    with pytest.raises(ValueError, match="needs the ring's process group"):
        make_ring_layout(seqlens=[5], cp=2)
    with pytest.raises(ValueError, match="pass group=None"):
        make_ring_layout(seqlens=[5], cp=1, group=object())
    with pytest.raises(ValueError, match=r"cu_seqlens_local=\(0, 4, 8\) does not match"):
        dataclasses.replace(layout, cu_seqlens_local=(0, 4, 8))


def test_cp1_is_local_attention_and_inputs_are_checked() -> None:
    seqlens = [5, 1, 37, 120]
    total = sum(seqlens)
    layout = make_ring_layout(seqlens=seqlens, cp=1)
    for dtype in (torch.float64, torch.float32):
        q = _rand(total, 4, 16, dtype=dtype, seed=1).requires_grad_()
        k = _rand(total, 2, 16, dtype=dtype, seed=2).requires_grad_()
        v = _rand(total, 2, 16, dtype=dtype, seed=3).requires_grad_()
        for causal in (True, False):
            out = ring_attention(q, k, v, layout, causal=causal, kernel="math")
            ref = reference_attention(q, k, v, seqlens=seqlens, causal=causal)
            dout = _rand(total, 4, 16, dtype=dtype, seed=4)
            got = torch.autograd.grad(out, (q, k, v), dout)
            want = torch.autograd.grad(ref, (q, k, v), dout)
            assert out.dtype == dtype and all(g.dtype == dtype for g in got)
            assert (out - ref).abs().max() <= TOL[dtype]
            assert max((a - b).abs().max() for a, b in zip(got, want)) <= TOL[dtype]
    q, k, v = _rand(total, 4, 16), _rand(total, 2, 16), _rand(total, 2, 16)
    with pytest.raises(ValueError, match="q has 162 tokens but the layout's cu_seqlens_local ends"):
        ring_attention(q[1:], k, v, layout)
    with pytest.raises(ValueError, match="share dtype and device"):
        ring_attention(q, k.float(), v, layout)
    with pytest.raises(ValueError, match="k and v need the same number of heads"):
        ring_attention(q, _rand(total, 3, 16), _rand(total, 3, 16), layout)
    with pytest.raises(ValueError, match="same head_dim"):
        ring_attention(q, _rand(total, 2, 8), v, layout)
    with pytest.raises(ValueError, match=r"\(tokens, heads, head_dim\)"):
        ring_attention(q[:, 0], k, v, layout)
    with pytest.raises(ValueError, match="softmax_scale must be a positive"):
        ring_attention(q, k, v, layout, softmax_scale=-1.0)


# ------------------------------------------------------------------------------ spawned rings


def _groups(world: int) -> dict[int, list]:
    """Every aligned group of sizes 2, 4, .. world, created in the same order on every rank."""
    groups, size = {}, 2
    while size <= world:
        groups[size] = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
        size *= 2
    return groups


def _run_case(
    case: dict, *, cp: int, index: int, group, layout_seqlens: list[int] | None = None
) -> dict:
    """Run one case on this rank and return its max errors on real tokens (and sanity flags)."""
    dtype, seqlens = DTYPES[case["dtype"]], case["seqlens"]
    layout = make_ring_layout(seqlens=layout_seqlens or seqlens, cp=cp, group=group)
    real = zigzag_token_index(seqlens=seqlens, cp=cp, rank=index) >= 0
    garbage = torch.Generator().manual_seed(1000 + dist.get_rank())

    def local(t: torch.Tensor) -> torch.Tensor:
        # Padding rows hold large garbage: it must reach neither outputs nor gradients.
        x = zigzag_shard(t, seqlens=seqlens, cp=cp, rank=index).to(dtype)
        noise = torch.randn(x.shape, generator=garbage, dtype=torch.float64).to(dtype) * 10
        return torch.where(real[:, None, None], x, noise).requires_grad_()

    q, k, v = local(case["q"]), local(case["k"]), local(case["v"])
    out = ring_attention(q, k, v, layout, causal=case["causal"], kernel=case["kernel"])
    out.backward(local(case["dout"]).detach())
    errors = {}
    for name, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        want = zigzag_shard(case[name], seqlens=seqlens, cp=cp, rank=index)
        diff = (got.detach()[real].double() - want[real]).abs()
        errors[name] = float(diff.max()) if diff.numel() else 0.0
    tensors = (out, q.grad, k.grad, v.grad)
    return dict(
        errors=errors,
        finite=all(bool(torch.isfinite(t).all()) for t in tensors),
        dtypes_kept=all(t.dtype == dtype for t in tensors),
        padding_grads_zero=all(bool((t[~real] == 0).all()) for t in tensors[1:]),
    )


def _negative_checks(world: int, groups: dict, cases: list[dict]) -> dict:
    """Wrong layouts must give a mismatch or a ValueError, never a silent pass."""
    rank, found = dist.get_rank(), {}
    group = groups[world][0]
    # 1. Lengths in the wrong order: same token count, wrong sequence boundaries.
    case = cases[2]
    wrong = _run_case(case, cp=world, index=rank, group=group, layout_seqlens=case["seqlens"][::-1])
    found["reordered_max_error"] = max(wrong["errors"].values())
    # 2. A layout claiming another rank's place in the ring (fails on every rank, before any I/O).
    layout = make_ring_layout(seqlens=case["seqlens"], cp=world, group=group)
    bad = dataclasses.replace(layout, rank=(layout.rank + 1) % world)
    n = layout.local_tokens
    try:
        ring_attention(torch.zeros(n, 2, 8), torch.zeros(n, 2, 8), torch.zeros(n, 2, 8), bad)
    except ValueError as exc:
        found["wrong_rank"] = str(exc)
    # 3. A group of the wrong size for cp, and (world >= 4) a group without this rank.
    try:
        make_ring_layout(seqlens=[4], cp=2 * world, group=group)
    except ValueError as exc:
        found["wrong_size"] = str(exc)
    if world >= 4 and rank < 2:
        try:
            make_ring_layout(seqlens=[4], cp=2, group=groups[2][1])
        except ValueError as exc:
            found["not_member"] = str(exc)
    return found


def _worker(rank: int, world: int, tmp: str, plan: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=HANG_SECONDS),
    )
    try:
        cases = torch.load(f"{tmp}/../cases.pt", weights_only=False)
        groups = _groups(world)
        records = []
        # No barrier between phases: each ring's traffic stays in its own group.
        for phase, (cp, assignment) in enumerate(plan):
            block, index = divmod(rank, cp)
            group = None if cp == 1 else groups[cp][block]
            for cid in assignment[block]:
                result = _run_case(cases[cid], cp=cp, index=index, group=group)
                records.append(dict(phase=phase, cp=cp, case=cid, dtype=cases[cid]["dtype"]))
                records[-1].update(result)
        negatives = _negative_checks(world, groups, cases)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(dict(records=records, negatives=negatives)))


def _spawn(world: int, tmp: Path, plan: list) -> list[dict]:
    """Run ``plan`` on ``world`` spawned gloo ranks; fail (not hang) if they do not finish."""
    ctx = start_ranks(_worker, nprocs=world, args=(world, str(tmp), plan))
    deadline = time.monotonic() + 4 * HANG_SECONDS
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"ring workers (world {world}) did not finish in {4 * HANG_SECONDS} s")
    return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


NUM_CASES = 24


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ring")
    torch.save(make_cases(NUM_CASES, seed=20240611), root / "cases.pt")
    return root


def _check(results: list[dict], world: int) -> dict:
    """Assert every record within tolerance and the negative checks; return the max errors."""
    worst: dict[str, float] = {"float64": 0.0, "float32": 0.0}
    for rank, res in enumerate(results):
        for rec in res["records"]:
            tol = TOL[DTYPES[rec["dtype"]]]
            where = f"rank {rank} phase {rec['phase']} cp={rec['cp']} case {rec['case']}"
            assert rec["finite"], f"non-finite outputs or gradients at {where}"
            assert rec["dtypes_kept"], f"output or gradient dtype changed at {where}"
            assert rec["padding_grads_zero"], f"padding rows got gradient at {where}"
            for name, err in rec["errors"].items():
                assert err <= tol, f"{name} error {err:.3g} > {tol:g} at {where}"
                worst[rec["dtype"]] = max(worst[rec["dtype"]], err)
        neg = res["negatives"]
        assert "this process is global rank" in neg["wrong_rank"]
        assert f"group has {world} ranks" in neg["wrong_size"]
        if world >= 4 and rank < 2:
            assert "does not contain this rank" in neg["not_member"]
    assert max(r["negatives"]["reordered_max_error"] for r in results) > 1e-3
    f64, f32 = worst["float64"], worst["float32"]
    print(f"world {world}: max abs error float64 {f64:.2e}, float32 {f32:.2e}")
    return worst


def _ids(start: int, count: int) -> list[int]:
    return [(start + i) % NUM_CASES for i in range(count)]


@pytest.mark.timeout(150)
def test_ring_world_2(case_dir: Path) -> None:
    tmp = case_dir / "w2"
    tmp.mkdir()
    plan = [(2, [_ids(0, NUM_CASES)]), (1, [_ids(0, 4), _ids(4, 4)])]
    _check(_spawn(2, tmp, plan), 2)


@pytest.mark.timeout(150)
def test_ring_world_4_switches_cp4_two_cp2_rings_cp4(case_dir: Path) -> None:
    tmp = case_dir / "w4"
    tmp.mkdir()
    plan = [
        (4, [_ids(0, 12)]),
        (2, [_ids(12, 6), _ids(18, 6)]),  # two rings at once, different micro-batches
        (4, [_ids(12, 12)]),
    ]
    _check(_spawn(4, tmp, plan), 4)


@pytest.mark.timeout(150)
def test_ring_world_8(case_dir: Path) -> None:
    tmp = case_dir / "w8"
    tmp.mkdir()
    plan = [(8, [_ids(0, 6)]), (4, [_ids(6, 3), _ids(9, 3)])]
    _check(_spawn(8, tmp, plan), 8)


# ------------------------------------------------------------------------------ GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["sdpa", "flash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_kernels_match_math(name: str, dtype: torch.dtype) -> None:
    from dyncp.ring_attention import make_kernel

    kernel = make_kernel(name)
    dev = torch.device("cuda")
    reason = kernel.unsupported(device=dev, dtype=dtype, head_dim=64, v_head_dim=64)
    if reason:
        pytest.skip(reason)
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    for lens_q, lens_k, causal in KERNEL_SPECS[:2]:
        spec = BlockSpec(tuple(_cum(lens_q)), tuple(_cum(lens_k)), causal).on(dev)
        q = _rand(sum(lens_q), 8, 64, dtype=torch.float32, seed=1).to(dev, dtype)
        k = _rand(sum(lens_k), 2, 64, dtype=torch.float32, seed=2).to(dev, dtype)
        v = _rand(sum(lens_k), 2, 64, dtype=torch.float32, seed=3).to(dev, dtype)
        out, lse = kernel.forward(q, k, v, spec=spec, softmax_scale=0.125)
        ref, ref_lse = MathKernel().forward(q, k, v, spec=spec, softmax_scale=0.125)
        assert (out.float() - ref).abs().max() <= tol
        assert (lse - ref_lse).abs().max() <= tol
        dout = torch.randn_like(q)
        got = kernel.backward(dout, q, k, v, ref.to(dtype), ref_lse, spec=spec, softmax_scale=0.125)
        want = MathKernel().backward(
            dout, q, k, v, ref.to(dtype), ref_lse, spec=spec, softmax_scale=0.125
        )
        for a, b in zip(got, want):
            assert (a.float() - b).abs().max() <= tol * 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cp1_ring_matches_reference() -> None:
    seqlens = [1, 100, 1000, 37]
    dev, total = torch.device("cuda"), sum(seqlens)
    layout = make_ring_layout(seqlens=seqlens, cp=1)
    q = _rand(total, 8, 64, dtype=torch.float32, seed=1).to(dev).requires_grad_()
    k = _rand(total, 2, 64, dtype=torch.float32, seed=2).to(dev).requires_grad_()
    v = _rand(total, 2, 64, dtype=torch.float32, seed=3).to(dev).requires_grad_()
    out = ring_attention(q, k, v, layout, kernel="auto")
    ref = reference_attention(q.double(), k.double(), v.double(), seqlens=seqlens, causal=True)
    assert (out.double() - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("kernel", ["math", "sdpa"])
def test_cp1_strided_and_bfloat16_inputs(kernel: str) -> None:
    """q/k/v sliced out of a packed qkv tensor; bfloat16 keeps its dtype with float32 merging."""
    seqlens = [3, 50, 17]
    total = sum(seqlens)
    layout = make_ring_layout(seqlens=seqlens, cp=1)
    for dtype, tol in ((torch.float64, TOL[torch.float64]), (torch.bfloat16, 3e-2)):
        qkv = _rand(total, 3, 4, 16, seed=5).to(dtype).requires_grad_()
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        assert not q.is_contiguous()
        out = ring_attention(q, k, v, layout, kernel=kernel)
        (grad,) = torch.autograd.grad(out, qkv, torch.ones_like(out))
        ref_in = qkv.detach().double().requires_grad_()
        ref = reference_attention(
            ref_in[:, 0], ref_in[:, 1], ref_in[:, 2], seqlens=seqlens, causal=True
        )
        (ref_grad,) = torch.autograd.grad(ref, ref_in, torch.ones_like(ref))
        assert out.dtype == dtype and grad.dtype == dtype
        assert (out.double() - ref).abs().max() <= tol
        assert (grad.double() - ref_grad).abs().max() <= tol * 4
