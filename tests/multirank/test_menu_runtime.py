"""Ring attention, head splits, windows and the runtime on group sizes beyond powers of two.

Two spawns over gloo on CPU, one of 6 ranks (one domain of 6: sizes 2, 3, 5, 6) and one of 12
(one domain of 12: sizes 3, 4, 5, 6, 12), each running several cases on a ``GroupPool`` built
from the menu. Every rank compares, in float64 against per-sequence full attention on one
process (within 1e-10):

* ring attention (zigzag at c) for c in {3, 5, 6, 12}, causal and not, packs whose lengths are
  not multiples of 2c, MHA/GQA/MQA;
* head x ring splits 6 = 2 x 3 and 3 x 2, 12 = 4 x 3 and 3 x 4;
* sliding windows at c in {3, 5, 6, 12};

and trains the tiny decoder through ``execute`` on a plan mixing those sizes (and a 2 x 3 /
4 x 3 head split): the loss and the gradients summed over the ranks equal the whole batch on one
process (loss within 1e-12 relative, each gradient within 1e-9 of its largest entry).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave
from dyncp.plan.menu import placements
from dyncp.ring_attention import make_hybrid_layout
from dyncp.runtime import GroupPool, execute, reduce_gradients, reduce_loss
from dyncp.testing import microbatch_loss
from dyncp.testing.distributed import run_gloo
from tests.multirank.test_hybrid_attention import _case as hybrid_case
from tests.multirank.test_hybrid_attention import _run_case as run_hybrid
from tests.multirank.test_ring_attention import _run_case as run_ring
from tests.multirank.test_ring_attention import make_case as ring_case
from tests.multirank.test_runtime import CFG, make_model, reference, tokens_for
from tests.multirank.test_window import _run as run_window
from tests.multirank.test_window import make_case as window_case

TOL = 1e-10
SPAWN_TIMEOUT = {6: 150, 12: 240}  # seconds on 2 shared cores
SIZES = {6: (1, 2, 3, 5, 6), 12: (1, 3, 4, 5, 6, 12)}
HEADS = {6: (1, 2, 3), 12: (1, 2, 3, 4)}
RINGS = {6: (3, 5, 6), 12: (5, 12)}
SPLITS = {6: ((2, 3), (3, 2)), 12: ((4, 3), (3, 4))}


def _cases(world: int) -> dict:
    rng = random.Random(world)
    ring = [
        dict(c=c, **ring_case(rng, dtype="float64", kernel=kernel, causal=causal))
        for c in RINGS[world]
        for kernel, causal in (("math", True), ("sdpa", False))
    ]
    hybrid = [
        hybrid_case(rng, u=u, r=r, heads=heads, causal=causal)
        for u, r in SPLITS[world]
        for heads, causal in (((12, 12), True), ((12, 1), False), ((12, u if u > 2 else 6), True))
    ]
    windows = [
        dict(c=c, **window_case(world + c, seqlens=[5 * c + 3, 2 * c, 1], window=w))
        for c in RINGS[world]
        for w in (2, 2 * c + 1)
    ]
    return dict(ring=ring, hybrid=hybrid, windows=windows)


def _plan(world: int) -> StepPlan:
    """A step mixing the menu's sizes, head splits and single ranks."""
    rng = random.Random(100 + world)
    mb = MicroBatch
    topo = Topology(world, world, 256, SIZES[world], head_sizes=(1, 2, 4) if world == 12 else
                    (1, 2), query_heads=CFG.heads, kv_heads=CFG.kv_heads)  # fmt: skip
    if world == 6:
        waves = [
            [Group(0, 6, (mb((0,)), mb((1, 2))), heads=2)],  # a2a2 x ring3
            [Group(0, 3, (mb((3,)),)), Group(3, 3, (mb((4, 5)),))],
            [Group(0, 5, (mb((6, 7)),)), Group(5, 1, (mb((8,)),))],
            [Group(0, 2, (mb((9,)),)), Group(2, 2, (mb((10,)),)), Group(4, 2, (mb((11,)),))],
        ]
    else:
        waves = [
            [Group(0, 12, (mb((0, 1)),), heads=4)],  # a2a4 x ring3, KV heads replicated
            [Group(0, 5, (mb((2,)),)), Group(5, 5, (mb((3, 4)),)), Group(10, 1, (mb((5,)),))],
            [
                Group(0, 6, (mb((6,)),), heads=2),
                Group(6, 3, (mb((7,)),)),
                Group(9, 3, (mb((8, 9)),)),
            ],  # fmt: skip
            [Group(0, 4, (mb((10,)),)), Group(4, 4, (mb((11,)),)), Group(8, 4, (mb((12,)),))],
            [Group(0, 12, (mb((13,)),))],
        ]
    n = sum(len(m.seq_ids) for w in waves for g in w for m in g.microbatches)
    lengths = tuple(rng.choice([rng.randint(1, 11), rng.randint(20, 120)]) for _ in range(n))
    plan = StepPlan(topo, lengths, tuple(Wave(tuple(w)) for w in waves), policy="hand")
    plan.validate()
    return plan


def _mine(pool: GroupPool, rank: int, c: int) -> int | None:
    """The start of this rank's block of size c (None when the rank is in none)."""
    starts = placements(c, world=pool.world, ranks_per_node=pool.ranks_per_node)
    return next((s for s in starts if s <= rank < s + c), None)


def _split_families(world: int) -> list[int]:
    """Build the pool as on NCCL: ``split_group`` stood in for by gloo groups made the same way
    (every rank creates every group of the family), recording each call's family size."""
    calls: list[int] = []

    def split(*, split_ranks: list[list[int]], **kwargs):
        calls.append(len(split_ranks))
        groups = [dist.new_group(ranks=r, **kwargs) for r in split_ranks]
        return next((g for g, r in zip(groups, split_ranks) if dist.get_rank() in r), None)

    backend, split_group = dist.get_backend, getattr(dist, "split_group", None)
    dist.get_backend, dist.split_group = (lambda *a: "nccl"), split
    try:
        pool = GroupPool(group_sizes=SIZES[world], ranks_per_node=world, head_sizes=HEADS[world])
    finally:
        dist.get_backend, dist.split_group = backend, split_group
    assert pool.creation_calls == len(calls) and sum(calls) == pool.created
    return calls


def _worker(rank: int, world: int, cases: dict, plan_json: str, seed: int) -> dict:
    pool = GroupPool(group_sizes=SIZES[world], ranks_per_node=world, head_sizes=HEADS[world])
    errors: dict[str, float] = {}
    for k, case in enumerate(cases["ring"]):
        c = case["c"]
        start = _mine(pool, rank, c)
        if start is not None:
            found = run_ring(case, cp=c, index=rank - start, group=pool.group(start, c))
            assert found["finite"] and found["padding_grads_zero"], (c, found)
            errors[f"ring{c}#{k}"] = max(found["errors"].values())
    for k, case in enumerate(cases["hybrid"]):
        u, c = case["u"], case["u"] * case["r"]
        start = _mine(pool, rank, c)
        if start is not None:
            head, ring = pool.hybrid_groups(start, c, u)
            layout = make_hybrid_layout(
                seqlens=case["seqlens"], cp=c, heads=u, head_group=head, ring_group=ring
            )
            found = run_hybrid(case, layout)
            assert found["padding_zero"], (u, c)
            errors[f"a2a{u}xring{case['r']}#{k}"] = max(found["errors"].values())
    for k, case in enumerate(cases["windows"]):
        c = case["c"]
        start = _mine(pool, rank, c)
        if start is not None:
            errors[f"window{c}#{k}"] = run_window(case, cp=c, group=pool.group(start, c))
    plan = StepPlan.from_json(plan_json)
    model = make_model()
    tokens = tokens_for(list(plan.lengths), seed)
    losses = []

    def step_fn(ctx) -> None:
        loss = microbatch_loss(model, ctx, torch.cat([tokens[i] for i in ctx.seq_ids]))
        loss.backward()
        losses.append(loss.detach())

    report = execute(plan, pool, step_fn)
    try:  # a size straddling domains of 3 is refused before any group is created
        GroupPool(group_sizes=(1, 4), ranks_per_node=3)
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    return dict(
        families=_split_families(world) if world == 6 else None,
        refused=refused,
        off_block=pool.has_block(1, 3) or pool.has_block(1, 5) or not pool.has_block(0, 5),
        errors=errors,
        loss=reduce_loss(losses, dtype=torch.float64).item(),
        grads=reduce_gradients(model),
        ran=len(report.microbatches),
        created=pool.created,
        calls=pool.creation_calls,
        expected=pool.count.total,
    )


def _check(world: int) -> None:
    cases, plan, seed = _cases(world), _plan(world), 11
    results = run_gloo(
        _worker,
        world=world,
        args=(cases, plan.to_json(), seed),
        timeout=SPAWN_TIMEOUT[world],
        pg_timeout=60,
    )
    names = {n.split("#")[0] for res in results for n in res["errors"]}
    expected = {f"ring{c}" for c in RINGS[world]} | {f"window{c}" for c in RINGS[world]}
    expected |= {f"a2a{u}xring{r}" for u, r in SPLITS[world]}
    assert names == expected
    for rank, res in enumerate(results):
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= TOL, (rank, worst)
        assert res["created"] == res["expected"] == res["calls"]  # gloo: one call per group
        assert "[4] not allowed" in res["refused"] and not res["off_block"]
    ref_loss, ref_grads = reference(plan, seed)
    for rank, res in enumerate(results):
        assert res["loss"] == pytest.approx(ref_loss, rel=1e-12, abs=0)
        for name, ref in ref_grads.items():
            err = (res["grads"][name] - ref).abs().max().item()
            assert err <= 1e-9 * max(1.0, ref.abs().max().item()), (rank, name, err)
    if world == 6:  # one call per family: blocks of 2, 3, 5, 6 (the head blocks), rings of 6
        assert results[0]["families"] == [3, 2, 1, 1, 2, 3], results[0]["families"]
    ran = sum(res["ran"] for res in results)
    assert ran == sum(len(g.microbatches) * g.size for w in plan.waves for g in w.groups)


@pytest.mark.timeout(SPAWN_TIMEOUT[6] + 60)
def test_sizes_3_5_6_on_six_ranks_are_exact() -> None:
    _check(6)


@pytest.mark.timeout(SPAWN_TIMEOUT[12] + 60)
def test_sizes_5_12_and_splits_of_12_on_twelve_ranks_are_exact() -> None:
    _check(12)
