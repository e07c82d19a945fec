"""The agreement's verdicts on the rows every rank gathers (one process, no collective).

Properties asserted: a plan held by a majority names the others; with no majority (two ranks,
or a tie) nobody is named and the message says so; ranks that hold the same plan but cannot run
their part are named with their reasons, alone, and every rank can fall back alike.
"""

from __future__ import annotations

import pytest

from dyncp.control.agreement import PlanMismatchError, PlanUnusable, _compare

WHERE = (0, 3)  # epoch, step


def rows(*digests: int, unusable: dict[int, int] | None = None) -> list[tuple[int, ...]]:
    flags = unusable or {}
    return [(*WHERE, flags.get(r, 0), d) for r, d in enumerate(digests)]


def test_the_minority_is_named_when_a_plan_has_a_majority() -> None:
    with pytest.raises(PlanMismatchError) as err:
        _compare([0, 1, 2, 3], rows(7, 7, 7, 9), "epoch 0 step 3")
    assert err.value.ranks == (3,)


@pytest.mark.parametrize("digests", [(7, 9), (7, 7, 9, 9), (5, 6, 7, 8)])
def test_no_majority_names_no_rank_and_says_so(digests: tuple[int, ...]) -> None:
    ranks = list(range(len(digests)))
    with pytest.raises(PlanMismatchError) as err:
        _compare(ranks, rows(*digests), "epoch 0 step 3")
    assert err.value.ranks == ()
    assert "no plan has a majority" in str(err.value) and "no rank can be named" in str(err.value)


def test_ranks_that_cannot_run_their_part_are_named_alone_with_their_reasons() -> None:
    with pytest.raises(PlanUnusable) as err:
        _compare([0, 1, 2, 3], rows(7, 7, 7, 7, unusable={0: 2, 1: 2}), "epoch 0 step 3")
    assert err.value.ranks == (0, 1) and err.value.reasons == (2, 2)
    assert "rank 0: its slice is malformed" in str(err.value)
    with pytest.raises(PlanUnusable) as err:  # world 2: the other rank is not blamed
        _compare([0, 1], rows(7, 7, unusable={0: 1}), "epoch 0 step 3")
    assert err.value.ranks == (0,) and "rank 0: its slice is missing" in str(err.value)


def test_agreeing_rows_pass() -> None:
    _compare([0, 1], rows(7, 7), "epoch 0 step 3")
