"""What a dataflow step's reports teach the cost model (``dyncp.runtime.measure``).

Under dataflow a group's early members wait inside its first collective for the last one; that
wait is not the micro-batch's cost and must not reach the calibration, nor be taken for the
switching overhead.
"""

from __future__ import annotations

import pytest

from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave
from dyncp.runtime.executor import MicroBatchTiming, RankReport
from dyncp.runtime.measure import step_measurements


def _plan() -> StepPlan:
    # Wave 0: rank 0 runs seq 0 alone, rank 1 runs seq 1 alone; wave 1: ranks 0-1 run seq 2.
    plan = StepPlan(
        topology=Topology(2, 2, 1000),
        lengths=(900, 200, 600),
        waves=(
            Wave((Group(0, 1, (MicroBatch((0,)),)), Group(1, 1, (MicroBatch((1,)),)))),
            Wave((Group(0, 2, (MicroBatch((2,)),)),)),
        ),
    )
    plan.validate()
    return plan


def test_a_members_wait_for_the_last_arrival_is_not_measured_as_work() -> None:
    # Rank 0 is busy 1.0 s in wave 0, rank 1 only 0.2 s: rank 1 enters the CP-2 micro-batch
    # 0.8 s early and its timing of it (1.3 s) includes that wait; rank 0's (0.5 s) does not.
    reports = [
        RankReport(
            timings=[
                MicroBatchTiming(0, 0, 1, (0,), (900,), 1.0),
                MicroBatchTiming(1, 0, 2, (2,), (600,), 0.5),
            ],
            wave_seconds=[1.01, 0.52],
        ),
        RankReport(
            timings=[
                MicroBatchTiming(0, 1, 1, (1,), (200,), 0.2),
                MicroBatchTiming(1, 0, 2, (2,), (600,), 1.3),
            ],
            wave_seconds=[0.21, 1.33],
        ),
    ]
    mbs, waves = step_measurements(_plan(), reports)
    assert [m.seconds for m in mbs] == pytest.approx([1.0, 0.2, 0.5])
    # Wave 1: the CP-2 group's work (0.5 s) plus its switching cost, taken at the member that
    # did not wait (0.52 - 0.5); rank 1's 0.03 includes nothing of its wait either.
    assert waves[1].busy_seconds == pytest.approx(0.5)
    assert waves[1].seconds == pytest.approx(0.52)
    # Wave 0: the slowest group's work plus the median switching cost of its two groups.
    assert waves[0].busy_seconds == pytest.approx(1.0)
    assert waves[0].seconds == pytest.approx(1.0 + 0.01)


def test_reports_of_another_plan_are_refused() -> None:
    reports = [RankReport(timings=[], wave_seconds=[0.1, 0.1]) for _ in range(2)]
    with pytest.raises(ValueError, match="no timing for it"):
        step_measurements(_plan(), reports)
