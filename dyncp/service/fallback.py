"""Planning one step's batch on the spot: the deterministic fallback planner, and the plan checks.

A reader whose step has no usable published plan by its deadline plans the step itself, and so
does every other reader: the fallback must be a pure function of the batch (no CP-SAT, no wall
clock) for every rank to compute the same plan. The same two helpers plan and check a batch for
the service and the samplers (``plan_batch``, ``check_plan``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dyncp.plan import StepPlan, Topology
from dyncp.planner.budget import DEFAULT_STEP_BUDGET, StepBudget
from dyncp.planner.planner import HYBRID_POLICY, Planner

__all__ = ["check_plan", "fallback_planner", "plan_batch"]


def fallback_planner(planner: Planner) -> Planner:
    """The deterministic greedy planner on ``planner``'s topology and cost model.

    A pure function of the batch (no CP-SAT, no wall clock), so every rank computes the same plan.
    It chooses head splits when ``planner`` does (policy ``dyncp-hybrid``) and optimises the
    same timing (``planner.timing``). It is built from ``planner.config`` (one
    ``dataclasses.replace``, not a copy of each argument), so a new option reaches it. Of
    ``planner``'s other options it keeps those that cannot change a deterministic plan without
    CP-SAT; those that could (a user improver, the baselines, ``max_length``) are the defaults,
    whatever ``planner`` was given. Its bound is the closed-form one (``bound="simple"``): every
    rank plans a fallback synchronously inside its step, and the tight LP bound, a report
    nothing in the step reads, costs seconds at 16,384 ranks.

    Every rank plans it inside its step, so it plans within the step budget (``planner``'s
    budget, else ``DEFAULT_STEP_BUDGET``: a share of the step the batch's closed-form bound
    predicts), counted without a clock: ``construction="auto"`` runs the deterministic search
    only where its estimated seconds (a count of sequences) fit that budget, else the quick
    construction (``dyncp.planner.construction.quick``), which is what it runs at scale (the
    search took 177 s at 4,096 ranks).
    """
    config = dataclasses.replace(
        planner.config,
        policy=HYBRID_POLICY if planner.policy == HYBRID_POLICY else "dyncp",
        deterministic=True,
        cpsat=None,
        improver=None,
        max_length=None,
        baselines=True,
        bound="simple",
        defer_bound="auto",
        time_limit=None,
        budget=planner.config.budget or DEFAULT_STEP_BUDGET,
        construction="auto",
    )
    return Planner(planner.model, config)


def plan_batch(
    planner: Planner,
    sample_ids: np.ndarray,
    lengths: np.ndarray,
    *,
    budget: StepBudget | None = None,
) -> StepPlan:
    """A validated plan of one global batch, its ``sample_ids`` set to the dataset indices;
    with ``budget``, planned with that share of its predicted step (``Planner.plan``)."""
    plan = planner.plan(lengths) if budget is None else planner.plan(lengths, budget=budget)
    plan.sample_ids = tuple(int(i) for i in sample_ids)
    return plan


def check_plan(
    plan: StepPlan, *, topology: Topology, sample_ids: np.ndarray, lengths: np.ndarray
) -> None:
    """Raise ValueError unless ``plan`` is a valid plan of exactly this batch on ``topology``."""
    if plan.topology != topology:
        raise ValueError(f"plan is for topology {plan.topology}, this job has {topology}")
    if plan.lengths != tuple(int(s) for s in lengths):
        raise ValueError("plan lengths differ from this step's batch")
    if plan.sample_ids != tuple(int(i) for i in sample_ids):
        raise ValueError("plan sample_ids differ from this step's batch")
    plan.validate()
