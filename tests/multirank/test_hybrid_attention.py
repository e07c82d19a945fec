"""Hybrid head x context parallel attention (all-to-all over u ranks around a ring of r).

In-process: the token reordering after the head exchange is exactly the ring zigzag at r with
padding to 2c (hypothesis over lengths and splits); layout and pool argument errors.

Spawned once, 8 gloo ranks run every case: for (u, r) in (2,1), (4,1), (8,1), (2,2), (2,4),
(4,2), MHA, GQA and MQA heads (KV heads fewer than u replicated), causal and not, packs whose
lengths are not multiples of 2c (padding rows hold large garbage). Every rank compares its
outputs and dq/dk/dv on real tokens with per-sequence full attention in float64 (within 1e-10),
and checks that padding rows get output 0 and gradient 0. The same processes check the errors
that need process groups (window, head counts, groups the pool did not build).

In the same processes the runtime trains the tiny decoder (4 query heads, 2 KV heads) through
``execute`` on a plan mixing plain rings, all-to-all-only groups (KV heads replicated at u = 4),
hybrid groups and single ranks in one step: the loss and the gradients summed over the ranks
equal the whole batch on one process (fp64: loss within 1e-12, each gradient within 1e-9 of its
largest entry); a plan whose split the pool did not build is refused on every rank before any
ring collective.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dyncp.plan import Group, MicroBatch, PlanError, StepPlan, Topology, Wave
from dyncp.ring_attention import (
    HybridLayout,
    make_hybrid_layout,
    make_ring_layout,
    ring_attention,
    zigzag_positions,
    zigzag_shard,
    zigzag_token_index,
)
from dyncp.ring_attention.hybrid import hybrid_token_order
from dyncp.ring_attention.layout import pad_to
from dyncp.runtime import GroupPool, execute, reduce_gradients, reduce_loss
from dyncp.testing import microbatch_loss
from dyncp.testing.distributed import run_gloo
from tests.multirank.test_ring_attention import reference_attention
from tests.multirank.test_runtime import CFG, make_model, reference, tokens_for

TOL = 1e-10
WORLD = 8
SPLITS = [(2, 1), (4, 1), (8, 1), (2, 2), (2, 4), (4, 2)]
HEADS = [(8, 8), (8, 2), (8, 1)]  # MHA; GQA (replicated for u >= 4); MQA (replicated)
SPAWN_TIMEOUT = 300  # seconds for the one 8-rank run on 2 cores


# ------------------------------------------------------------------------------ in-process


def _ring_zigzag(seqlens: list[int], c: int, u: int, i: int) -> list[tuple[int, int]]:
    """(sequence, position) of ring position i's shard at r = c/u ranks, padded to 2c."""
    r, out = c // u, []
    for b, length in enumerate(seqlens):
        m = pad_to(length, 2 * c) // (2 * r)
        out += [(b, p) for p in range(i * m, (i + 1) * m)]
        out += [(b, p) for p in range((2 * r - 1 - i) * m, (2 * r - i) * m)]
    return out


@settings(max_examples=80, deadline=None)
@given(
    seqlens=st.lists(st.integers(1, 90), min_size=1, max_size=5),
    split=st.sampled_from([*SPLITS, (4, 4), (8, 2), (2, 8)]),
)
def test_reordered_head_group_shards_are_the_ring_zigzag(seqlens, split) -> None:
    u, r = split
    c = u * r
    order = hybrid_token_order(seqlens=seqlens, cp=c, heads=u)
    assert sorted(order.tolist()) == list(range(order.numel()))  # a permutation
    for i in range(r):
        # What the all-to-all gathers on ring position i: the shards of positions i*u + j'.
        gathered = []
        for j in range(u):
            pos = zigzag_positions(seqlens=seqlens, cp=c, rank=i * u + j).tolist()
            seq = [b for b, s in enumerate(seqlens) for _ in range(pad_to(s, 2 * c) // c)]
            gathered += list(zip(seq, pos))
        assert [gathered[k] for k in order.tolist()] == _ring_zigzag(seqlens, c, u, i)


def test_layout_and_ring_padding_errors() -> None:
    ring = make_ring_layout(seqlens=[5, 3], cp=1, pad_multiple=8)
    assert ring.cu_seqlens_local == (0, 8, 16) and ring.unit == 8
    assert make_ring_layout(seqlens=[5], cp=1).pad_multiple is None  # today's layout unchanged
    with pytest.raises(ValueError, match="pad_multiple must be a positive multiple of 4"):
        make_ring_layout(seqlens=[5], cp=2, group=None, pad_multiple=6)
    order = hybrid_token_order(seqlens=[5, 3], cp=4, heads=4)
    good = HybridLayout(
        cp=4, heads=4, rank=1, head_index=1, head_group=None, head_ranks=(0, 1, 2, 3),
        ring=ring, seqlens=(5, 3), cu_seqlens_local=(0, 2, 4),
        to_ring=order, from_ring=torch.argsort(order),
    )  # fmt: skip
    assert good.local_tokens == 4 and good.ring_cp == 1
    for change, message in (
        (dict(heads=1), "heads must be an integer >= 2 dividing cp"),
        (dict(heads=8), "heads must be an integer >= 2 dividing cp"),
        (dict(heads=2, head_ranks=(0, 1)), "ring of cp // heads = 2 ranks"),
        (dict(rank=2), r"rank=2 must be ring.rank \* heads \+ head_index"),
        (dict(head_ranks=(0, 1, 1, 3)), "4 distinct ranks"),
        (dict(cu_seqlens_local=(0, 2, 5)), r"cu_seqlens_local=\(0, 2, 5\) does not match"),
        (dict(to_ring=order[1:]), "heads \\* local_tokens = 16 rows"),
        (dict(seqlens=(5, 2)), "differ from its ring's"),
    ):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(good, **change)
    with pytest.raises(ValueError, match="heads must be >= 2 and divide cp=4"):
        make_hybrid_layout(seqlens=[5], cp=4, heads=1, head_group=None, ring_group=None)
    with pytest.raises(ValueError, match="heads must be >= 2 and divide cp=4"):
        make_hybrid_layout(seqlens=[5], cp=4, heads=3, head_group=None, ring_group=None)


# ------------------------------------------------------------------------------ spawned


def _case(rng: random.Random, *, u: int, r: int, heads: tuple[int, int], causal: bool) -> dict:
    c = u * r
    n = rng.randint(1, 4)
    seqlens = [rng.choice([rng.randint(1, 2 * c - 1), rng.randint(1, 70)]) for _ in range(n)]
    if all(s % (2 * c) == 0 for s in seqlens):
        seqlens.append(2 * c + 1)  # padding exercised in every case
    h, hkv = heads
    d = rng.choice([4, 8])
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    total = sum(seqlens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v, dout = (
        randn(total, h, d),
        randn(total, hkv, d),
        randn(total, hkv, d),
        randn(total, h, d),
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = reference_attention(*leaves, seqlens=seqlens, causal=causal)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    return dict(
        u=u, r=r, seqlens=seqlens, causal=causal, kernel=rng.choice(["math", "sdpa"]),
        q=q, k=k, v=v, dout=dout, out=out.detach(), dq=dq, dk=dk, dv=dv,
    )  # fmt: skip


def make_cases(seed: int = 15) -> list[dict]:
    rng = random.Random(seed)
    return [
        _case(rng, u=u, r=r, heads=heads, causal=causal)
        for u, r in SPLITS
        for heads in HEADS
        for causal in (True, False)
    ]


def _run_case(case: dict, layout: HybridLayout) -> dict:
    seqlens, c = case["seqlens"], layout.cp
    real = zigzag_token_index(seqlens=seqlens, cp=c, rank=layout.rank) >= 0
    garbage = torch.Generator().manual_seed(1000 + dist.get_rank())

    def local(t: torch.Tensor) -> torch.Tensor:
        x = zigzag_shard(t, seqlens=seqlens, cp=c, rank=layout.rank)
        noise = torch.randn(x.shape, generator=garbage, dtype=x.dtype) * 10
        return torch.where(real[:, None, None], x, noise).requires_grad_()

    q, k, v = local(case["q"]), local(case["k"]), local(case["v"])
    out = ring_attention(q, k, v, layout, causal=case["causal"], kernel=case["kernel"])
    out.backward(local(case["dout"]).detach())
    errors = {}
    tensors = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, got in tensors.items():
        want = zigzag_shard(case[name], seqlens=seqlens, cp=c, rank=layout.rank)
        assert got.shape == want.shape and got.dtype == torch.float64, (name, got.shape)
        diff = (got[real] - want[real]).abs()
        errors[name] = float(diff.max()) if diff.numel() else 0.0
    return dict(
        errors=errors,
        padding_zero=all(bool((t[~real] == 0).all()) for t in tensors.values()),
        padding_rows=int((~real).sum()),
    )


def _expect_error(found: dict, name: str, fn) -> None:
    try:
        fn()
    except ValueError as exc:
        found[name] = str(exc)
    else:
        found[name] = "no error"


def _negatives(pool: GroupPool, rank: int) -> dict:
    """Errors that need process groups; every rank runs the same calls (no collective hangs)."""
    found: dict[str, str] = {}
    head, ring = pool.hybrid_groups(0, 8, 4)
    layout = make_hybrid_layout(seqlens=[9, 4], cp=8, heads=4, head_group=head, ring_group=ring)
    n = layout.local_tokens

    def attend(h: int, hkv: int, lay=layout, **kw) -> None:
        ring_attention(torch.zeros(n, h, 4), torch.zeros(n, hkv, 4), torch.zeros(n, hkv, 4), lay,
                       **kw)  # fmt: skip

    _expect_error(found, "window", lambda: attend(8, 2, window=4))
    _expect_error(found, "q_heads", lambda: attend(6, 2))
    _expect_error(found, "kv_heads", lambda: attend(12, 3))
    other = dataclasses.replace(
        layout, head_index=(layout.head_index + 1) % 4, rank=layout.ring.rank * 4
        + (layout.head_index + 1) % 4,
    )  # fmt: skip
    _expect_error(found, "wrong_head_index", lambda: attend(8, 2, lay=other))
    _expect_error(found, "not_built", lambda: pool.hybrid_groups(0, 8, 16))
    _expect_error(found, "misaligned", lambda: pool.hybrid_groups(2, 4, 2))
    _expect_error(found, "not_member", lambda: pool.hybrid_groups(4 if rank < 4 else 0, 4, 2))
    a2a_head, _ = pool.hybrid_groups(rank // 4 * 4, 4, 4)
    _expect_error(
        found,
        "superfluous_ring",
        lambda: make_hybrid_layout(
            seqlens=[3], cp=4, heads=4, head_group=a2a_head, ring_group=a2a_head
        ),
    )
    _expect_error(found, "bad_head_size", lambda: GroupPool(head_sizes=(3,)))
    _expect_error(found, "big_head_size", lambda: GroupPool(group_sizes=(1, 2), head_sizes=(4,)))
    return found


def mixed_plan() -> StepPlan:
    """Plain rings, all-to-all only, hybrid and single-rank groups in one step on 8 ranks."""
    lengths = (37, 150, 9, 64, 23, 1, 2, 88, 45, 17, 5, 130, 70, 3, 11, 29)
    topo = Topology(WORLD, 4, 256, head_sizes=(1, 2, 4), query_heads=CFG.heads,
                    kv_heads=CFG.kv_heads)  # fmt: skip
    mb = MicroBatch
    waves = (
        Wave((Group(0, 8, (mb((1,)), mb((11, 5))), heads=2),)),  # a2a2 x ring4
        Wave(
            (
                Group(0, 4, (mb((7, 2)),), heads=4),  # all-to-all only, KV heads replicated
                Group(4, 2, (mb((3,)),)),  # ring2
                Group(6, 2, (mb((0, 6)), mb((12,))), heads=2),  # all-to-all only
            )
        ),
        Wave(
            (
                Group(0, 4, (mb((8, 4)),), heads=2),  # a2a2 x ring2
                Group(4, 4, (mb((9, 13)),)),  # ring4
            )
        ),
        Wave((Group(0, 8, (mb((10, 14)),), heads=4),)),  # a2a4 x ring2
        Wave((Group(0, 1, (mb((15,)),)),)),  # one rank
    )
    return StepPlan(topo, lengths, waves, policy="hand")


def _train(rank: int, pool: GroupPool, plan_json: str, seed: int) -> dict:
    plan = StepPlan.from_json(plan_json)
    model = make_model()
    tokens = tokens_for(list(plan.lengths), seed)
    losses, seen = [], []

    def step_fn(ctx) -> None:
        seen.append((ctx.heads, type(ctx.layout).__name__, ctx.layout.rank == ctx.rank_in_group))
        loss = microbatch_loss(model, ctx, torch.cat([tokens[i] for i in ctx.seq_ids]))
        loss.backward()
        losses.append(loss.detach())

    report = execute(plan, pool, step_fn)
    grads = reduce_gradients(model)
    loss = reduce_loss(losses, dtype=torch.float64)
    return dict(loss=loss.item(), grads=grads, seen=seen,
                timed_heads=[t.heads for t in report.timings])  # fmt: skip


def _refused(pool_heads: tuple[int, ...], plan_json: str) -> str:
    pool = GroupPool(head_sizes=pool_heads)
    try:
        execute(StepPlan.from_json(plan_json), pool, lambda ctx: None)
    except PlanError as exc:
        return f"{exc.rule}: {exc}"
    return "no error"


def _worker(rank: int, world: int, cases: list[dict], plan_json: str, seed: int) -> dict:
    pool = GroupPool(head_sizes=(1, 2, 4, 8))
    records = []
    # One split at a time; the c-blocks of the world run different cases at once.
    for u, r in SPLITS:
        c = u * r
        block, index = divmod(rank, c)
        ids = [i for i, case in enumerate(cases) if (case["u"], case["r"]) == (u, r)]
        head, ring = pool.hybrid_groups(block * c, c, u)
        for cid in ids[block :: world // c]:
            case = cases[cid]
            layout = make_hybrid_layout(
                seqlens=case["seqlens"], cp=c, heads=u, head_group=head, ring_group=ring
            )
            assert layout.rank == index and layout.ring.cp == r
            records.append(dict(case=cid, **_run_case(case, layout)))
    negatives = _negatives(pool, rank)
    trained = _train(rank, pool, plan_json, seed)
    negatives["pool_without_split"] = _refused((1, 2), plan_json)
    dist.barrier()
    return dict(records=records, negatives=negatives, created=pool.created, trained=trained)


TRAIN_SEED = 7


@pytest.fixture(scope="module")
def spawned() -> tuple[list[dict], list[dict]]:
    cases = make_cases()
    args = (cases, mixed_plan().to_json(), TRAIN_SEED)
    results = run_gloo(_worker, world=WORLD, args=args, timeout=SPAWN_TIMEOUT, pg_timeout=60)
    return cases, results


@pytest.mark.timeout(SPAWN_TIMEOUT + 60)
def test_every_split_matches_full_attention(spawned) -> None:
    cases, results = spawned
    runs: dict[int, int] = {}
    worst: dict[tuple[int, int], float] = {}
    for rank, res in enumerate(results):
        for rec in res["records"]:
            case = cases[rec["case"]]
            where = f"rank {rank} case {rec['case']} u={case['u']} r={case['r']}"
            assert rec["padding_zero"], f"padding rows got output or gradient at {where}"
            for name, err in rec["errors"].items():
                assert err <= TOL, f"{name} error {err:.3g} > {TOL:g} at {where}"
            split = (case["u"], case["r"])
            worst[split] = max(worst.get(split, 0.0), *rec["errors"].values())
            runs[rec["case"]] = runs.get(rec["case"], 0) + 1
    # every case ran on all c ranks of one group, and padding was exercised
    assert runs == {i: case["u"] * case["r"] for i, case in enumerate(cases)}
    assert all(sum(rec["padding_rows"] for res in results for rec in res["records"]
                   if rec["case"] == i) > 0 for i in range(len(cases)))  # fmt: skip
    print("max abs error per (u, r):", {k: f"{v:.1e}" for k, v in sorted(worst.items())})


@pytest.mark.timeout(SPAWN_TIMEOUT + 60)
def test_errors_that_need_process_groups(spawned) -> None:
    _, results = spawned
    for rank, res in enumerate(results):
        neg = res["negatives"]
        assert "window=... runs on a plain ring" in neg["window"], neg["window"]
        assert "query heads divisible by 4" in neg["q_heads"] and "got 6 query" in neg["q_heads"]
        assert "got 12 query and 3 KV heads" in neg["kv_heads"], neg["kv_heads"]
        assert f"this process (global rank {rank})" in neg["wrong_head_index"]
        assert "heads=16" in neg["not_built"] and "[0, 1, 2, 3, 4, 5, 6, 7]" in neg["not_built"]
        assert "ranks [2, 3, 4, 5]" in neg["misaligned"], neg["misaligned"]
        assert f"rank {rank}) is not in the group of ranks" in neg["not_member"]
        assert "pass ring_group=None" in neg["superfluous_ring"]
        assert "head sizes [3] not allowed" in neg["bad_head_size"]
        assert "head sizes [4] not allowed" in neg["big_head_size"]
        # 7 block groups + ring sub-groups: (c=4,u=2) 2 blocks x 2, (8,2) 2, (8,4) 4
        assert res["created"] == 7 + 4 + 2 + 4


@pytest.mark.timeout(SPAWN_TIMEOUT + 60)
def test_runtime_mixing_rings_all_to_all_and_hybrid_equals_one_process(spawned) -> None:
    _, results = spawned
    plan = mixed_plan()
    layouts = {g.layout_name for w in plan.waves for g in w.groups}
    assert layouts == {"ring1", "ring2", "ring4", "a2a2", "a2a4", "a2a2xring2", "a2a2xring4",
                       "a2a4xring2"}  # fmt: skip
    ref_loss, ref_grads = reference(plan, TRAIN_SEED)
    worst = 0.0
    for rank, res in enumerate(results):
        trained = res["trained"]
        assert trained["loss"] == pytest.approx(ref_loss, rel=1e-12, abs=0)
        for name, ref in ref_grads.items():
            err = (trained["grads"][name] - ref).abs().max().item() / ref.abs().max().item()
            assert err <= 1e-9, (rank, name, err)  # relative to the largest gradient entry
            worst = max(worst, err)
        # heads == 1 runs today's RingLayout; heads > 1 a HybridLayout at the same position
        for heads, kind, same_rank in trained["seen"]:
            assert kind == ("RingLayout" if heads == 1 else "HybridLayout") and same_rank
        assert trained["timed_heads"] == [h for h, _, _ in trained["seen"]]
        assert "group-pool" in res["negatives"]["pool_without_split"]
        assert "split heads 4 x ring 1" in res["negatives"]["pool_without_split"]
        assert "head sizes [1, 2]" in res["negatives"]["pool_without_split"]
    runs = sum(len(res["trained"]["seen"]) for res in results)
    assert runs == sum(len(g.microbatches) * g.size for w in plan.waves for g in w.groups)
    print(f"runtime: max relative gradient error {worst:.1e} over {runs} micro-batch runs")
