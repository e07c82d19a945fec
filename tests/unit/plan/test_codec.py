"""Plan JSON (dyncp.plan.codec): round trips, total decoding of any input, old versions."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_builders import valid_plan

from dyncp.plan import (
    SCHEMA_VERSION,
    PlanError,
    StepPlan,
)

# ------------------------------------------------------------------------------------ JSON


def test_json_round_trip_preserves_everything() -> None:
    plan = valid_plan()
    text = plan.to_json()
    back = StepPlan.from_json(text)
    assert back == plan
    assert back.stats == plan.stats
    assert back.sample_ids == plan.sample_ids
    assert back.policy == "hand"
    assert back.topology == plan.topology
    back.validate()
    assert back.to_json() == text
    assert json.loads(text)["schema_version"] == SCHEMA_VERSION


def test_dict_round_trip_and_types() -> None:
    plan = valid_plan()
    data = plan.to_dict()
    back = StepPlan.from_dict(json.loads(json.dumps(data)))
    assert back == plan
    assert isinstance(back.lengths, tuple) and isinstance(back.waves, tuple)
    assert isinstance(back.waves[0].groups[0].microbatches[0].seq_ids, tuple)
    assert data["waves"][0][1] == {
        "start": 4,
        "size": 1,
        "heads": 1,
        "microbatches": [[1], [2, 3, 4]],
    }


def test_round_trip_without_sample_ids() -> None:
    plan = valid_plan()
    plan.sample_ids = None
    plan.stats = {}
    plan.policy = ""
    back = StepPlan.from_json(plan.to_json())
    assert back == plan
    assert back.sample_ids is None


def test_optional_fields_default() -> None:
    data = valid_plan().to_dict()
    for key in ("policy", "sample_ids", "stats"):
        del data[key]
    back = StepPlan.from_dict(data)
    assert back.policy == "" and back.sample_ids is None and back.stats == {}
    assert back.waves == valid_plan().waves


@pytest.mark.parametrize("version", [None, 0, 5, "1", True])
def test_bad_schema_version(version: object) -> None:
    data = valid_plan().to_dict()
    if version is None:
        del data["schema_version"]
    else:
        data["schema_version"] = version
    with pytest.raises(ValueError, match="schema_version"):
        StepPlan.from_dict(data)


@pytest.mark.parametrize("key", ["topology", "lengths", "waves"])
def test_missing_top_level_field(key: str) -> None:
    data = valid_plan().to_dict()
    del data[key]
    with pytest.raises(ValueError, match=f"missing field '{key}'"):
        StepPlan.from_json(json.dumps(data))


@pytest.mark.parametrize("key", ["start", "size", "microbatches"])
def test_missing_group_field(key: str) -> None:
    data = valid_plan().to_dict()
    del data["waves"][0][0][key]
    with pytest.raises(ValueError, match=f"missing field '{key}'"):
        StepPlan.from_dict(data)


@pytest.mark.parametrize("key", ["world", "capacity"])
def test_missing_topology_field(key: str) -> None:
    data = valid_plan().to_dict()
    del data["topology"][key]
    with pytest.raises(ValueError, match=key):
        StepPlan.from_dict(data)


def test_invalid_topology_in_json_names_field() -> None:
    data = valid_plan().to_dict()
    data["topology"]["capacity"] = 0
    with pytest.raises(ValueError, match=r"Topology\.capacity"):
        StepPlan.from_dict(data)


# ------------------------------------------------------------------------------ total decoding

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def _decode(text: str | bytes) -> StepPlan | None:
    """StepPlan, or None for a PlanError; any other exception fails the test."""
    try:
        plan = StepPlan.from_json(text)
    except PlanError as exc:
        assert exc.rule == "decode"
        return None
    with contextlib.suppress(PlanError):
        plan.validate()  # a decoded plan is checkable without crashing
    return plan


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) into a JSON value."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _replace(value: object, path: tuple, new: object) -> object:
    if not path:
        return new
    copy = json.loads(json.dumps(value))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = new
    return copy


@settings(max_examples=300, deadline=None)
@given(value=json_values)
def test_any_json_value_decodes_to_a_plan_or_a_plan_error(value: object) -> None:
    _decode(json.dumps(value))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200))
def test_any_bytes_decode_to_a_plan_or_a_plan_error(data: bytes) -> None:
    _decode(data)


PLAN_PATHS = _paths(valid_plan().to_dict())


@settings(max_examples=400, deadline=None)
@given(path=st.sampled_from(PLAN_PATHS), new=json_values)
def test_wrong_types_at_every_field_give_a_plan_error(path: tuple, new: object) -> None:
    _decode(json.dumps(_replace(valid_plan().to_dict(), path, new)))


def _at(value: object, path: tuple) -> object:
    for key in path:
        value = value[key]  # type: ignore[index]
    return value


@pytest.mark.parametrize("path", PLAN_PATHS[1:], ids=lambda p: "/".join(map(str, p)))
@pytest.mark.parametrize("new", ["x", None, 1.5, True, -1, 2**64, [], {}], ids=repr)
def test_each_field_rejects_each_wrong_kind(path: tuple, new: object) -> None:
    data = valid_plan().to_dict()
    plan = _decode(json.dumps(_replace(data, path, new)))
    free = (
        (path[0] == "stats" and (len(path) > 1 or new == {}))  # informational, any object
        or (path == ("policy",) and isinstance(new, str))
        or (path == ("sample_ids",) and new is None)
        or (new == [] and isinstance(_at(data, path), list))  # empty lists: validate() judges
    )
    assert (plan is not None) == free, (path, new)


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '"x"',
        "null",
        "1e999",
        "-1e999",
        "NaN",
        "Infinity",
        "1" * 5000,
        "[" * 100_000 + "]" * 100_000,
        '{"schema_version": 1, "topology": ' + "[" * 50 + "]" * 50 + "}",
        "{" * 50_000,
        b"\xff\xfe\x00garbage",
        "",
    ],
    ids=lambda t: repr(t[:20]),
)
def test_hostile_texts_are_plan_errors(text: str | bytes) -> None:
    with pytest.raises(PlanError, match=r"^\[decode\]"):
        StepPlan.from_json(text)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lengths", [10**30], "lengths"),
        ("lengths", [True], "lengths"),
        ("lengths", "abc", "lengths"),
        ("sample_ids", [1.0] * 8, "sample_ids"),
        ("policy", 3, "policy"),
        ("stats", [], "stats"),
        ("waves", {}, "waves"),
    ],
)
def test_field_errors_name_the_field(field: str, value: object, message: str) -> None:
    data = valid_plan().to_dict()
    data[field] = value
    with pytest.raises(PlanError, match=message):
        StepPlan.from_json(json.dumps(data))


def test_huge_number_literal_in_a_field_names_the_field() -> None:
    text = valid_plan().to_json().replace('"lengths": [4000,', '"lengths": [1e999,')
    assert "1e999" in text
    with pytest.raises(PlanError, match=r"lengths\[\] must be an integer"):
        StepPlan.from_json(text)


def test_deep_stats_are_refused() -> None:
    data = valid_plan().to_dict()
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    data["stats"] = {"x": deep}
    with pytest.raises(PlanError, match="nests deeper"):
        StepPlan.from_json(json.dumps(data))


def test_version_1_plans_still_read() -> None:
    data = valid_plan().to_dict()
    data["schema_version"] = 1
    for key in ("head_sizes", "query_heads", "kv_heads"):
        del data["topology"][key]
    for wave_groups in data["waves"]:
        for g in wave_groups:
            del g["heads"]
    back = StepPlan.from_dict(data)
    assert back.waves == valid_plan().waves and back.topology == valid_plan().topology
    assert all(g.heads == 1 for w in back.waves for g in w.groups)


@pytest.mark.parametrize("field", ["heads", "head_sizes"])
def test_version_2_needs_head_fields(field: str) -> None:
    data = valid_plan().to_dict()
    if field == "heads":
        del data["waves"][0][0]["heads"]
    else:
        del data["topology"]["head_sizes"]
    with pytest.raises(PlanError, match=f"missing field '{field}'"):
        StepPlan.from_dict(data)
