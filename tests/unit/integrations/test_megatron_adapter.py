"""``DynCPScheduler`` and the release runner in one process: what is refused up front (one line
each), the version pin, determinism, and the released scheduler's output read as a plan."""

from __future__ import annotations

import numpy as np
import pytest

from dyncp.cost_model.model import CostModel
from dyncp.integrations.megatron import SUPPORTED_VERSIONS, DynCPScheduler, check_megatron_version
from dyncp.planner.baselines.megatron_core import check_rounds, overflow, plan_from_rounds

MODEL = CostModel.load("h100-reference", 8)


class Config:
    max_seqlen_per_dp_cp_rank = 2048


def batch(world: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(6.5, 1.3, 5 * world), 8, 2048 * world).astype(int)
    return [(i, int(n)) for i, n in enumerate(lengths)]


def test_version_pin_names_the_installed_version() -> None:
    assert check_megatron_version(SUPPORTED_VERSIONS[0]) == SUPPORTED_VERSIONS[0]
    with pytest.raises(
        RuntimeError, match=r"^megatron-core 0\.15\.0 is installed; .* supports 0\.16\.1"
    ):
        check_megatron_version("0.15.0")  # fmt: skip


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"head_sizes": (1, 2)},
            "head_sizes=(1, 2): megatron-core's schedule has no head-parallel",
        ),
        ({"group_sizes": (1, 2, 3)}, "group_sizes [3] are not powers of two"),
        ({"policy": "dyncp-hybrid"}, "policy dyncp-hybrid splits heads"),
    ],
)
def test_what_the_format_cannot_express_is_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        DynCPScheduler(MODEL, world=8, capacity=2048, **options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_sample_no_group_holds_and_a_capacity_mismatch_are_refused() -> None:
    sched = DynCPScheduler(MODEL, world=8, capacity=2048)
    with pytest.raises(ValueError, match=r"^sample 1 has 20000 tokens; no group of 8 ranks holds"):
        sched.get_groups_and_subsamples([(0, 100), (1, 20000)], Config())
    other = type("C", (), {"max_seqlen_per_dp_cp_rank": 4096})()
    with pytest.raises(ValueError, match=r"max_seqlen_per_dp_cp_rank=4096 but .* capacity=2048"):
        sched.get_groups_and_subsamples([(0, 100)] * 8, other)


@pytest.mark.parametrize("world", [8, 16])
def test_schedules_are_valid_and_the_same_from_every_instance(world: int) -> None:
    for seed in range(2):
        pairs = batch(world, seed)
        a = DynCPScheduler(MODEL, world=world, capacity=2048)
        b = DynCPScheduler(MODEL, world=world, capacity=2048)
        groups, rounds = a.get_groups_and_subsamples(pairs, Config())
        assert b.get_groups_and_subsamples(pairs, Config()) == (groups, rounds)
        check_rounds(rounds, [i for i, _ in pairs], world)
        length = dict(pairs)
        assert groups == [[[length[i] for i in ids] for ids in r] for r in rounds]
        assert overflow(a.last_release_plan).count == 0  # dyncp's plans respect capacity


def test_the_released_scheduler_runs_and_reads_as_a_plan() -> None:
    pytest.importorskip("megatron.core", reason="needs the megatron extra")
    from dyncp.integrations.megatron_release import release_rounds

    pairs = batch(8, 3)
    lengths = [n for _, n in pairs]
    rounds = release_rounds(lengths, world=8, capacity=2048)
    check_rounds(rounds, range(len(lengths)), 8, aligned=False)  # every id once, in sync
    sched = DynCPScheduler(MODEL, world=8, capacity=2048)
    plan = plan_from_rounds(rounds, lengths, sched.topology)
    assert all(len(mb.seq_ids) == 1 for _, _, mb in plan.microbatches())  # it never packs
    assert sum(1 for _ in plan.microbatches()) == len(lengths)
