"""StepBudget: a planning budget that follows the predicted step; the planner spends it anytime,
deterministically in deterministic mode; the plan service and OnlinePlanner plan with it."""

from __future__ import annotations

import numpy as np
import pytest
from planner_helpers import assert_exactly_once

from dyncp.cost_model import CostModel
from dyncp.plan import plan_digest
from dyncp.planner import Planner
from dyncp.planner.budget import DEFAULT_STEP_BUDGET, StepBudget
from dyncp.sampler import OnlinePlanner
from dyncp.service import PlanService, plan_batch

WORLD, PER_NODE, CAPACITY = 16, 8, 4096


def model() -> CostModel:
    return CostModel.load("h100-reference", PER_NODE)


def planner(**kw: object) -> Planner:
    return Planner(model(), world=WORLD, ranks_per_node=PER_NODE, capacity=CAPACITY, **kw)


def batch(seed: int, n: int = 96) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(1500), 1.4, n), 1, WORLD * CAPACITY).astype(np.int64)


def test_the_budget_is_a_share_of_the_step_within_floor_and_cap() -> None:
    b = StepBudget(share=0.25, cap=2.0, floor=0.1)
    assert b.seconds(0.0) == 0.1  # floor
    assert b.seconds(0.2) == 0.1  # 0.05 < floor
    assert b.seconds(2.0) == pytest.approx(0.5)
    assert b.seconds(100.0) == 2.0  # cap
    assert StepBudget() == DEFAULT_STEP_BUDGET
    assert DEFAULT_STEP_BUDGET.floor == 0.1  # never below the old fixed limit


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"share": 0.0}, "share must be in"),
        ({"share": 1.5}, "share must be in"),
        ({"floor": 0.0}, "floor must be > 0"),
        ({"cap": 0.05}, "cap .* must be >= floor"),
        ({"share": float("nan")}, "finite"),
        ({"cap": "2"}, "finite number"),
    ],
)
def test_bad_budgets_are_refused_with_what_is_allowed(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepBudget(**kw)


def test_bad_predictions_and_conflicting_options_are_refused() -> None:
    with pytest.raises(ValueError, match="predicted_step_seconds"):
        StepBudget().seconds(float("inf"))
    with pytest.raises(ValueError, match="not both"):
        planner(time_limit=0.5, budget=StepBudget())
    with pytest.raises(ValueError, match="StepBudget"):
        planner(budget=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="StepBudget"):
        planner().plan(batch(0), budget=1.0)  # type: ignore[arg-type]


def test_deterministic_mode_budgets_in_work_units_from_the_prediction() -> None:
    """The budget is the batch's closed-form bound times the share (no clock), CP-SAT runs with
    that many deterministic units, and planning twice gives the same plan."""
    budget = StepBudget(share=1.0, cap=0.3, floor=0.25)  # >= min_improve_seconds: CP-SAT runs
    lengths = batch(1)
    plans = [planner(deterministic=True, budget=budget).plan(lengths) for _ in range(2)]
    st = plans[0].stats
    assert st["budget"]["units"] == "deterministic"
    predicted = st["budget"]["predicted_step_seconds"]
    assert predicted == st["simple_lower_bound_seconds"]
    assert st["budget"]["seconds"] == budget.seconds(predicted)
    assert st["solver"]["status"] != "SKIPPED"
    assert plan_digest(plans[0]) == plan_digest(plans[1])
    assert plans[0].stats["budget"] == plans[1].stats["budget"]
    # A share of a short step stays at the floor: below min_improve_seconds CP-SAT is skipped.
    short = planner(deterministic=True, budget=StepBudget(share=0.01)).plan(lengths)
    assert short.stats["budget"]["seconds"] == 0.1
    assert short.stats["solver"]["status"] == "SKIPPED"


def test_a_tiny_budget_still_returns_a_valid_plan() -> None:
    tiny = StepBudget(share=1e-6, cap=1e-4, floor=1e-4)
    lengths = batch(2, 160)
    plan = planner(budget=tiny).plan(lengths)
    plan.validate()
    assert_exactly_once(plan, len(lengths))
    assert plan.stats["budget"]["seconds"] == 1e-4
    assert plan.stats["budget"]["units"] == "wall"


def test_a_per_call_budget_overrides_the_planner_limit() -> None:
    p = planner(deterministic=True, cpsat=None)
    lengths = batch(3)
    assert "budget" not in p.plan(lengths).stats  # a fixed time_limit: no budget
    got = p.plan(lengths, budget=StepBudget(share=0.5)).stats["budget"]
    assert got["share"] == 0.5 and got["floor"] == 0.1


class _Recording(Planner):
    """Records the ``budget`` each plan() call got."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.budgets: list[StepBudget | None] = []

    def plan(self, lengths, **options):
        self.budgets.append(options.get("budget"))
        return super().plan(lengths, **options)


def recording(world: int = WORLD) -> _Recording:
    per_node = min(world, PER_NODE)
    return _Recording(
        CostModel.load("h100-reference", per_node),
        world=world,
        ranks_per_node=per_node,
        capacity=CAPACITY,
        deterministic=True,
        cpsat=None,
    )


def test_plan_batch_passes_the_budget_and_sets_sample_ids() -> None:
    p = recording()
    lengths = batch(4, 32)
    plan = plan_batch(p, np.arange(32) + 100, lengths, budget=StepBudget(share=0.5))
    assert p.budgets == [StepBudget(share=0.5)]
    assert plan.sample_ids[0] == 100 and plan.stats["budget"]["share"] == 0.5


class _Source:
    def num_steps(self, epoch: int) -> int:
        return 1

    def batch(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        return np.arange(32), batch(5, 32)


def test_the_plan_service_plans_with_its_budget() -> None:
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.HashStore()
    p = recording()
    service = PlanService(store, source=_Source(), planner=p, prefix="budget", secret=b"k" * 32)
    assert service.budget == DEFAULT_STEP_BUDGET
    assert service.publish(0, 0)
    assert p.budgets == [DEFAULT_STEP_BUDGET]
    own = PlanService(
        store, source=_Source(), planner=p, prefix="own", secret=b"k" * 32, budget=None
    )
    own.publish(0, 0)
    assert p.budgets[-1] is None  # the planner's own time_limit
    with pytest.raises(ValueError, match="StepBudget"):
        PlanService(store, source=_Source(), planner=p, prefix="x", budget=2.0)  # type: ignore[arg-type]


def test_the_online_planner_plans_with_its_budget() -> None:
    p = recording(world=1)
    budget = StepBudget(share=0.5, cap=1.0)
    with OnlinePlanner(p, rank=0, budget=budget) as online:
        step = online.submit([7, 8, 9], [100, 200, 300]).result(timeout=60)
    assert p.budgets == [budget]
    assert step.plan.stats["budget"]["share"] == 0.5
    with OnlinePlanner(p, rank=0) as online:
        online.submit([1], [50]).result(timeout=60)
    assert p.budgets[-1] == DEFAULT_STEP_BUDGET
    with pytest.raises(ValueError, match="StepBudget"):
        OnlinePlanner(p, rank=0, budget=0.5)  # type: ignore[arg-type]
