"""megatron-core's schedule format <-> StepPlan (``dyncp.planner.baselines.megatron_core``).

The release runs whatever ``sample_id_groups`` it gets; a schedule that breaks one of its
invariants deadlocks partners or drops samples on a GPU job, so ``check_rounds`` must see each
broken rule, and the translation must keep every sequence exactly once.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from dyncp.cost_model.model import CostModel
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave
from dyncp.planner import Planner
from dyncp.planner.baselines.megatron_core import (
    check_rounds,
    overflow,
    plan_from_rounds,
    rounds_from_plan,
)

TOPO = Topology(world=4, ranks_per_node=4, capacity=100)
#: Round 0: id 0 on ranks 0-1 (CP 2), ids 1, 2 packed on rank 2, id 3 on rank 3; round 1: id 4 on
#: all four ranks.
GOOD = [[[0], [0], [1, 2], [3]], [[4], [4], [4], [4]]]
LENGTHS = [150, 30, 40, 100, 390]


def test_a_valid_schedule_passes_and_reads_as_its_plan() -> None:
    check_rounds(GOOD, range(5), 4)
    plan = plan_from_rounds(GOOD, LENGTHS, TOPO)
    shown = [
        [(g.start, g.size, [mb.seq_ids for mb in g.microbatches]) for g in w.groups]
        for w in plan.waves
    ]
    assert shown == [
        [(0, 2, [(0,)]), (2, 1, [(1,), (2,)]), (3, 1, [(3,)])],
        [(0, 4, [(4,)])],
    ]  # fmt: skip
    plan.validate()


@pytest.mark.parametrize(
    ("edit", "ids", "message"),
    [
        (lambda r: r[0][3].append(0), 5, "id 0 in round 0 on ranks [0, 1, 3]"),  # not a block
        (lambda r: r.__setitem__(1, [[4], [4], [5], []]), 6, "ranks [3] have no id in the last"),
        (lambda r: [ids.append(1) for ids in r[1]], 5, "id 1 in rounds 0 and 1"),
        (lambda r: r[0].__setitem__(3, []), 5, "ids missing [3]"),
        (lambda r: r[0][0].append(9) or r[0][1].insert(0, 9), 10, "list different ids"),
        (lambda r: r[0].pop(), 5, "round 0 lists 3 ranks, not 4"),
    ],
)
def test_each_broken_rule_is_one_line_naming_it(edit, ids: int, message: str) -> None:
    rounds = copy.deepcopy(GOOD)
    edit(rounds)
    known = [i for i in range(ids) if i < 6 or i == 9]
    with pytest.raises(ValueError, match=r"megatron-core schedule: ") as err:
        check_rounds(rounds, known, 4)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_unaligned_block_is_refused_when_alignment_is_asked() -> None:
    rounds = [[[0], [1], [1], [2]]]
    check_rounds(rounds, range(3), 4, aligned=False)
    with pytest.raises(ValueError, match=r"id 1 in round 0 on ranks \[1, 2\], not an aligned"):
        check_rounds(rounds, range(3), 4)


def test_overflow_counts_sub_samples_and_rank_rounds() -> None:
    plan = plan_from_rounds(GOOD, LENGTHS, TOPO)
    over = overflow(plan)
    # id 3: 100 tokens at CP 1 = capacity (not over); id 0: 152/2 = 76; id 4: 392/4 = 98.
    assert (over.count, over.total) == (0, 5)
    assert over.max_ratio == pytest.approx(1.0)
    big = plan_from_rounds([[[0], [1], [2], [3]]], [250, 10, 10, 10], TOPO)
    over = overflow(big)
    assert (over.count, over.max_ratio) == (1, pytest.approx(2.5))
    packed = overflow(plan_from_rounds([[[0, 1], [2], [3], [4]]], [60, 70, 1, 1, 1], TOPO))
    assert packed.count == 0 and packed.rank_round_tokens_ratio == pytest.approx(1.3)


def test_a_full_wave_is_moved_last() -> None:
    full = Wave((Group(0, 4, (MicroBatch((0,)),)),))
    part = Wave((Group(0, 2, (MicroBatch((1, 2)),)),))
    plan = StepPlan(TOPO, (300, 10, 10), (full, part))
    rounds = rounds_from_plan(plan, [7, 8, 9])
    assert rounds == [[[8, 9], [8, 9], [], []], [[7]] * 4]
    check_rounds(rounds, [7, 8, 9], 4)


def test_an_idle_last_round_grows_into_idle_buddies_or_is_refused() -> None:
    part = Wave((Group(0, 1, (MicroBatch((0,)),)), Group(2, 2, (MicroBatch((1,)),))))
    rounds = rounds_from_plan(StepPlan(TOPO, (10, 10), (part,)), [0, 1])
    assert rounds == [[[0], [0], [1], [1]]]  # rank 0's group doubled into idle rank 1
    stuck = Wave((Group(0, 1, (MicroBatch((0,)),)), Group(1, 1, (MicroBatch((1,)),))))
    with pytest.raises(ValueError, match="reaches 2 of 4 ranks"):
        rounds_from_plan(StepPlan(TOPO, (10, 10), (stuck,)), [0, 1])


@pytest.mark.parametrize("world", [8, 16])
def test_dyncp_plans_translate_to_valid_schedules(world: int) -> None:
    model = CostModel.load("h100-reference", 8)
    planner = Planner(model, world=world, ranks_per_node=8, capacity=2048, deterministic=True,
                      time_limit=0.02, timing="barrier")  # fmt: skip
    rng = np.random.default_rng(world)
    for _ in range(3):
        lengths = [int(x) for x in np.clip(rng.lognormal(6.5, 1.3, 4 * world), 8, 2048 * world)]
        plan = planner.plan(lengths)
        ids = list(range(100, 100 + len(lengths)))
        rounds = rounds_from_plan(plan, ids)
        check_rounds(rounds, ids, world)
        back = plan_from_rounds(
            [[[i - 100 for i in r] for r in rnd] for rnd in rounds], lengths, plan.topology
        )
        assert sorted(i for _, _, mb in back.microbatches() for i in mb.seq_ids) == list(
            range(len(lengths))
        )
