"""The tolerant JSON comparison forgives last-bit float noise and nothing else."""

from __future__ import annotations

import pytest
from json_close import assert_json_close, json_differences


def test_last_digit_float_noise_is_forgiven() -> None:
    built = {"link": [{"latency": 3.32076116567818e-05, "n": 2}], "name": "h100"}
    bundled = {"link": ({"latency": 3.320761165678179e-05, "n": 2},), "name": "h100"}
    assert_json_close(built, bundled)


@pytest.mark.parametrize(
    ("got", "want", "where"),
    [
        ({"x": 1.0}, {"x": 1.0 + 1e-6}, "$.x"),
        ({"x": 1.0, "y": 2.0}, {"y": 2.0}, "$.x"),
        ({"n": 2}, {"n": 3}, "$.n"),
        ({"n": [1.0, 2.0]}, {"n": [1.0]}, "$.n"),
        ({"s": "a"}, {"s": "b"}, "$.s"),
        ({"b": True}, {"b": 1.0}, "$.b"),
        ({"v": None}, {"v": 0.0}, "$.v"),
        ({"v": 0.0}, {"v": 1e-300}, "$.v"),
    ],
)
def test_every_other_difference_is_named(got: object, want: object, where: str) -> None:
    diffs = json_differences(got, want)
    assert len(diffs) == 1 and diffs[0].startswith(where)
    with pytest.raises(AssertionError, match="1 difference"):
        assert_json_close(got, want)
