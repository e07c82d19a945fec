"""``PlanStats``: what produced a plan (policy, predictions, bounds, solver outcomes), typed.

A plan's ``stats`` used to be a bare dict written in many places; ``PlanStats`` names what the
planner writes as typed fields (``plan.stats.predicted_step_seconds``), each ``None`` until
written. It is a dict underneath, so what read and wrote the dict keeps working for one release
(``plan.stats["x"]``, ``.get``, ``in``, item assignment, iteration, ``dict(plan.stats)``), keys
nobody typed (a caller's own) are kept as they are, and a plan's JSON is the same byte for byte.
A field is a key: writing ``stats.policy`` writes ``stats["policy"]``, and an absent key reads
as ``None`` through its field (and raises ``KeyError`` through ``[]``, as a dict does).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

__all__ = ["PlanStats"]

T = TypeVar("T")


class _Field(Generic[T]):
    """A typed field of ``PlanStats``: the key of its name; ``None`` while absent."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Field[T]: ...
    @overload
    def __get__(self, obj: PlanStats, owner: type | None = None) -> T | None: ...
    def __get__(self, obj: PlanStats | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return obj.get(self.name)

    def __set__(self, obj: PlanStats, value: T | None) -> None:
        obj[self.name] = value

    def __delete__(self, obj: PlanStats) -> None:
        obj.pop(self.name, None)


class PlanStats(dict[str, Any]):
    """What produced a plan (module docstring). Wall-clock values live under ``timings``, apart
    from the values that depend only on the inputs (deterministic mode)."""

    __slots__ = ()

    #: The policy that built the plan; the timing its figures use (``dyncp.cost_model.evaluate``).
    policy = _Field[str]()
    timing = _Field[str]()
    #: The plan's predicted step seconds under the model and ``timing``; its imbalance and
    #: efficiency; its number of waves.
    predicted_step_seconds = _Field[float]()
    imbalance = _Field[float]()
    efficiency = _Field[float]()
    waves = _Field[int]()
    #: The constructed plan's seconds, before any improvement or baseline.
    greedy_step_seconds = _Field[float]()
    #: The bounds and the gaps to them (``None`` while a deferred bound is computed).
    lower_bound_seconds = _Field[float]()
    simple_lower_bound_seconds = _Field[float]()
    gap_to_lower_bound = _Field[float]()
    gap_to_simple_bound = _Field[float]()
    #: Which bound was computed and how (``kind``, ``status``, ``variables``, ``deferred``).
    bound = _Field[dict[str, Any]]()
    #: The CP-SAT improvement's and the layout search's outcomes (``status``, ...).
    solver = _Field[dict[str, Any]]()
    layout = _Field[dict[str, Any]]()
    #: The step budget the plan was made within (``dyncp.planner.budget``).
    budget = _Field[dict[str, Any]]()
    #: Each baseline candidate's seconds, and ``baseline:<name>`` when one was handed out.
    baseline_seconds = _Field[dict[str, float]]()
    chosen = _Field[str]()
    #: Which construction won on a menu that does not nest or with head splits.
    construction = _Field[str]()
    #: The cost-model version the plan was made with (``dyncp.planner.versioned``).
    model_version = _Field[int]()
    #: Pass alignment (``Planner(passes="aligned")``): passes, empty rank-passes and
    #: pass-timed seconds of the plan before and after (``AlignmentReport.as_dict``).
    alignment = _Field[dict[str, Any]]()
    #: A pipelined plan (``Planner(pipeline=...)``): slots, the pipelined step and its bubble,
    #: every candidate's price, the pipelined bound (``dyncp.planner.pipeline.PipelineStats``).
    pipeline = _Field[dict[str, Any]]()
    #: The whole step as named parts on its busiest rank, the common per-step parts (gradient
    #: reduction, optimizer) included (``dyncp.cost_model.step_parts.StepParts.as_dict``).
    step_parts = _Field[dict[str, float]]()
    #: Wall-clock values (seconds of each part of ``plan()``, candidates tried).
    timings = _Field[dict[str, Any]]()

    #: The typed fields, in the order above.
    FIELDS: tuple[str, ...] = ()


PlanStats.FIELDS = tuple(k for k, v in vars(PlanStats).items() if isinstance(v, _Field))
