"""Plan JSON: its schema versions, and the hardened decoding of documents anyone may have written.

Plans travel through a Store other processes can write, so nothing about a document is trusted:
every field's type is checked, integers must lie in ``[0, 2**63)``, the document may nest at most
``MAX_JSON_DEPTH`` levels, and any text or value gives either checked Python values or a
``PlanError`` with rule ``"decode"``, never another exception. This module reads the parts of a
plan document (its topology, its waves as plain tuples, lists of integers);
``StepPlan.from_dict`` in ``dyncp.plan.contract`` builds the plan from them, so the codec needs
none of the plan's classes.

Versions: ``schema_version`` 4 (an optional ``pipeline`` object: stages and virtual stages,
``dyncp.plan.pipeline``); version 3 (the topology names its ``placement`` rule, ``"domain"``,
and its group sizes may be any menu the rule allows); version 2 (groups carry ``heads``, the
topology the allowed head sizes and the model's head counts) and version 1 (rings only,
``heads = 1``) are still read, under the same placement rule -- for their power-of-two sizes on
power-of-two nodes it is the rule they were written under.
"""

from __future__ import annotations

import json
from typing import Any

from dyncp.plan.errors import PlanError
from dyncp.plan.pipeline import Pipeline
from dyncp.plan.topology import PLACEMENT, Topology

__all__ = [
    "MAX_JSON_DEPTH",
    "READABLE_VERSIONS",
    "SCHEMA_VERSION",
    "GroupFields",
    "check_document",
    "decode_ints",
    "decode_pipeline",
    "decode_topology",
    "decode_waves",
    "kind",
    "loads",
    "require",
]

SCHEMA_VERSION = 4
#: Plan JSON versions ``from_dict`` reads: 1 (rings only, before head parallelism), 2 (head
#: splits, power-of-two menus), 3 (menus shaped by the machine, named placement rule) and 4
#: (pipeline stages).
READABLE_VERSIONS = (1, 2, 3, 4)
#: Deepest nesting a plan document may have (a valid plan nests 5 levels; stats a few more).
MAX_JSON_DEPTH = 32
_INT_LIMIT = 2**63

#: One decoded group: (start, size, heads, the sequence ids of each micro-batch).
GroupFields = tuple[int, int, int, tuple[tuple[int, ...], ...]]


def loads(text: str | bytes) -> Any:
    """Parse plan JSON; any text or bytes give a value or a PlanError (rule ``"decode"``)."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError, TypeError) as exc:
        # ValueError covers bad JSON, bad UTF-8 and integers longer than Python parses.
        raise PlanError("decode", f"plan is not valid JSON: {_short(exc)}") from None


def check_document(data: Any) -> int:
    """The schema version of a plan document: an object of a readable version, not too deep."""
    if not isinstance(data, dict):
        raise PlanError("decode", f"plan JSON must be an object, got {kind(data)}")
    version = data.get("schema_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise PlanError(
            "decode",
            f"plan schema_version {version!r} not supported (readable: "
            f"{', '.join(map(str, READABLE_VERSIONS))})",
        )
    if _depth(data) > MAX_JSON_DEPTH:
        raise PlanError("decode", f"plan JSON nests deeper than {MAX_JSON_DEPTH} levels")
    return version


def decode_topology(data: dict, version: int) -> Topology:
    """The document's topology; a topology ``Topology`` refuses is a PlanError too."""
    t = require(data, "topology", dict, "plan")
    if version >= 3 and t.get("placement") != PLACEMENT:
        raise PlanError(
            "decode",
            f"plan topology placement {t.get('placement')!r} not supported (readable: "
            f"{PLACEMENT!r})",
        )
    try:
        return Topology(
            _int(require(t, "world", int, "topology"), "topology.world"),
            _int(require(t, "ranks_per_node", int, "topology"), "topology.ranks_per_node"),
            _int(require(t, "capacity", int, "topology"), "topology.capacity"),
            tuple(
                _int(c, "topology.group_sizes[]")
                for c in _list(t.get("group_sizes", []), "topology.group_sizes")
            ),
            *_head_fields(t, version),
        )
    except PlanError:
        raise
    except ValueError as exc:
        raise PlanError("decode", str(exc)) from None


def decode_waves(data: dict, version: int) -> tuple[tuple[GroupFields, ...], ...]:
    """The document's waves, each a tuple of its groups' fields."""
    return tuple(
        tuple(_group(g, w, version) for g in _list(wave, f"waves[{w}]"))
        for w, wave in enumerate(_list(require(data, "waves", list, "plan"), "waves"))
    )


def decode_pipeline(data: dict, version: int) -> Pipeline | None:
    """The document's pipeline (version 4; absent or null: an unpipelined plan)."""
    p = data.get("pipeline")
    if p is None:
        return None
    if version < 4:
        raise PlanError("decode", f"plan field 'pipeline' needs schema_version 4, got {version}")
    if not isinstance(p, dict):
        raise PlanError("decode", f"plan field 'pipeline' must be an object, got {kind(p)}")
    unknown = sorted(set(p) - {"stages", "virtual"})
    if unknown:
        raise PlanError("decode", f"plan field 'pipeline' has unknown keys {unknown}")
    return Pipeline(
        _int(require(p, "stages", int, "pipeline"), "pipeline.stages"),
        _int(require(p, "virtual", int, "pipeline"), "pipeline.virtual"),
    )


def decode_ints(value: object, where: str) -> tuple[int, ...]:
    """A list of integers in ``[0, 2**63)`` (``where`` names it in errors)."""
    return tuple(_int(i, f"{where}[]") for i in _list(value, where))


def require(obj: dict, key: str, expected: type, where: str) -> Any:
    """``obj[key]``, which must be there and be an ``expected`` (a bool is no int)."""
    if key not in obj:
        raise PlanError("decode", f"plan JSON is missing field {key!r} (in {where})")
    value = obj[key]
    if not isinstance(value, expected) or isinstance(value, bool):
        raise PlanError(
            "decode", f"{where} field {key!r} must be {expected.__name__}, got {kind(value)}"
        )
    return value


def kind(value: object) -> str:
    """The JSON kind of a decoded value, as errors name it (``null``, ``int``, ``list``, ...)."""
    return "null" if value is None else type(value).__name__


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a plan may hold")


def _depth(value: object) -> int:
    """Nesting depth of a decoded JSON value (iterative: no recursion limit to hit)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            if level > MAX_JSON_DEPTH:
                return level
            todo.extend((v, level + 1) for v in item if isinstance(v, (dict, list)))
    return deepest


def _list(value: object, where: str) -> list:
    if not isinstance(value, list):
        raise PlanError("decode", f"plan field {where} must be a list, got {kind(value)}")
    return value


def _int(value: object, where: str) -> int:
    if type(value) is not int or not 0 <= value < _INT_LIMIT:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise PlanError(
            "decode", f"plan field {where} must be an integer in [0, 2**63), got {shown}"
        )
    return value


def _head_fields(t: dict, version: int) -> tuple[tuple[int, ...], int, int]:
    """Topology head fields: absent from version 1 plans (rings only)."""
    if version == 1:
        return (1,), 0, 0
    return (
        tuple(
            _int(u, "topology.head_sizes[]")
            for u in _list(require(t, "head_sizes", list, "topology"), "topology.head_sizes")
        ),
        _int(require(t, "query_heads", int, "topology"), "topology.query_heads"),
        _int(require(t, "kv_heads", int, "topology"), "topology.kv_heads"),
    )


def _group(g: object, w: int, version: int) -> GroupFields:
    where = f"waves[{w}][]"
    if not isinstance(g, dict):
        raise PlanError("decode", f"plan field {where} must be an object, got {kind(g)}")
    heads = 1 if version == 1 else _int(require(g, "heads", int, "group"), f"{where}.heads")
    return (
        _int(require(g, "start", int, "group"), f"{where}.start"),
        _int(require(g, "size", int, "group"), f"{where}.size"),
        heads,
        tuple(
            tuple(_int(i, f"{where}.microbatches[][]") for i in _list(mb, where))
            for mb in _list(require(g, "microbatches", list, "group"), f"{where}.microbatches")
        ),
    )
