"""The rounding bound (``dyncp.planner.bounds.rounding``): per rank the groups fit in one step, so
any dual-feasible rounding of their shares does too. Hand-checked where it binds, and never
above the exhaustive dataflow optimum on small batches where it raises the tight bound."""

from __future__ import annotations

import numpy as np
import pytest
from test_lp_bound import any_model
from test_lp_bound_exact import optimum

import dyncp.planner.bounds.lp_bound as lp_bound
from dyncp.plan import Topology
from dyncp.planner.bounds.rounding import rounding_bound

INF = np.inf


def three_on_two(low: float) -> float:
    """Two ranks, size 1 only, three sequences of 1 s alone that never share a micro-batch
    (each fills a rank's capacity), r 1 rank-second each."""
    ones = np.ones((1, 3))
    return rounding_bound(
        sizes=np.asarray([1]),
        alone=ones,
        r=ones,
        pad=np.full((1, 3), 64.0),
        fixed=np.zeros(1),
        world=2,
        capacity=64,
        low=low,
    )


def test_more_than_half_the_step_never_shares_a_rank() -> None:
    """Three 1 s sequences on two ranks: the busy time says 1.5 s; each takes more than half of
    any step below 2 s, so no two share a rank and three ranks would be needed: the bound
    climbs to 2 s (two on one rank, the optimum), within the bisection's precision, and never
    above."""
    value = three_on_two(1.5)
    assert 2.0 * (1 - 5e-3) <= value < 2.0
    assert three_on_two(2.0) == 2.0  # nothing above the optimum is shown impossible


def test_sequences_that_may_share_a_micro_batch_are_not_rounded() -> None:
    """Three sequences of 1 s alone whose r is 0.3 rank-seconds (the rest of their time alone
    is a cost a shared micro-batch pays once) and that fit one micro-batch together: its
    contract-2 floor is 0.9 s, so the three may share one, and their shares of the step are
    their r: no rounding counts them, and the bound stays where it was."""
    ones = np.ones((1, 3))
    value = rounding_bound(
        sizes=np.asarray([1]),
        alone=ones,
        r=0.3 * ones,
        pad=np.full((1, 3), 8.0),
        fixed=np.zeros(1),
        world=2,
        capacity=64,
        low=1.5,
    )
    assert value == 1.5


@pytest.mark.parametrize(
    ("topo", "lengths", "kind"),
    [
        (Topology(2, 4, 256), [165, 108, 197], "quadratic"),
        (Topology(2, 4, 64), [46, 46, 85, 95], "flexsp"),
        (Topology(2, 2, 64), [128, 58, 69], "flexsp"),
        (Topology(2, 4, 64), [1, 59, 37, 37], "reference"),
        (Topology(2, 4, 64), [41, 107, 49, 128, 62], "reference"),
    ],
)
def test_rounding_raises_the_tight_bound_below_the_optimum(
    topo: Topology, lengths: list[int], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small batches (found by a random search) where the rounding bound lifts the dataflow
    bound by 3-22% of the exhaustive dataflow optimum, and stays below it."""
    model = any_model(kind, topo.ranks_per_node)
    best = optimum(lengths, topo, model, "dataflow")
    with_rounding = lp_bound.lp_lower_bound(np.asarray(lengths), topo, model).seconds
    monkeypatch.setattr(lp_bound, "_rounded", lambda bound, *args: bound)
    without = lp_bound.lp_lower_bound(np.asarray(lengths), topo, model).seconds
    assert without + 0.03 * best < with_rounding <= best * (1 + 1e-9)
