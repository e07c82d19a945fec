"""The ``megatron-core`` policy: the released ``BalancedCPScheduler``, priced as it runs.

This is the dynamic CP that Megatron-LM and NeMo users run today (megatron-core 0.16.1, the
newest release in the package registry). The scheduler itself runs in a child process
(``python -m dyncp.integrations.megatron_release``; the module says why): the simulator stays
torch-free and the schedule is the release's own, not a re-implementation. Its
``sample_id_groups`` are read as a plan by ``dyncp.planner.baselines.megatron_core`` and priced
as ``hybrid_context_parallel_forward_backward`` runs them: one micro-batch per sub-sample (the
release never packs), a barrier over all ranks after every round (``timing="barrier"``, whatever
the simulator's ``--timing``). The release has no per-rank token limit when it joins groups, so
its plans may exceed ``capacity``; they are priced anyway and the excess is reported in
``stats["overflow"]`` (``Overflow``), not hidden.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.step_parts import step_parts
from dyncp.plan import StepPlan, Topology
from dyncp.planner.baselines.megatron_core import Overflow, overflow, plan_from_rounds
from dyncp.planner.bounds.closed_form import lower_bound

__all__ = ["RELEASE_POLICY", "ReleasePlanner", "overflow_summary"]

RELEASE_POLICY = "megatron-core"
_CHILD = "dyncp.integrations.megatron_release"


class ReleasePlanner:
    """``plan(lengths)`` as the simulator's planners answer it, from the released scheduler.

    ``plan.stats``: the release's predicted step (barrier timing), imbalance, efficiency, rounds
    (``waves``), the closed-form lower bound and the gap to it, the scheduler's own wall time
    (``timings.plan_seconds``, measured in the child) and ``overflow``; with ``step_parts``, the
    whole step's parts as the release runs it (barrier timing), as ``Planner(step_parts=True)``
    gives the other policies, so whole-step speedups over the release can be read.
    """

    def __init__(self, model: CostModel, *, topology: Topology, step_parts: bool = False) -> None:
        self.model = model
        self.topology = topology
        self.step_parts = step_parts
        self._proc: subprocess.Popen[str] | None = None
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (the child's lifetime)
        #: Each planned batch's ``Overflow``, in order.
        self.overflows: list[Overflow] = []

    def _child(self) -> subprocess.Popen[str]:
        if self._proc is None:
            cmd = [sys.executable, "-m", _CHILD, "--world", str(self.topology.world)]
            cmd += ["--capacity", str(self.topology.capacity)]
            env = dict(os.environ, PYTHONWARNINGS="ignore")
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                text=True, env=env,
            )  # fmt: skip
        return self._proc

    def rounds(self, lengths: Sequence[int]) -> tuple[list[list[list[int]]], float]:
        """The release's ``sample_id_groups`` for ``lengths`` and its wall time in seconds."""
        proc = self._child()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps({"lengths": [int(x) for x in lengths]}) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass  # the child's answer (or its stderr) says why
        line = proc.stdout.readline()
        if not line:
            self._stderr.seek(0)
            tail = [s for s in self._stderr.read().splitlines() if s.strip()][-1:]
            raise RuntimeError(f"policy {RELEASE_POLICY}: {_CHILD} exited: {' '.join(tail)}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"policy {RELEASE_POLICY}: {answer['error']}")
        return answer["rounds"], float(answer["seconds"])

    def plan(self, lengths: Sequence[int]) -> StepPlan:
        rounds, seconds = self.rounds(lengths)
        plan = plan_from_rounds(rounds, lengths, self.topology, policy=RELEASE_POLICY)
        cost = evaluate_plan(plan, self.model, timing="barrier")
        bound = (
            lower_bound(np.asarray(plan.lengths), self.topology, self.model)
            if len(lengths)
            else 0.0
        )
        over = overflow(plan)
        self.overflows.append(over)
        plan.stats = {
            "policy": RELEASE_POLICY,
            "timing": "barrier",
            "predicted_step_seconds": cost.step_seconds,
            "imbalance": cost.imbalance,
            "efficiency": cost.efficiency,
            "waves": len(plan.waves),
            "lower_bound_seconds": bound,
            "simple_lower_bound_seconds": bound,
            "gap_to_lower_bound": cost.step_seconds / bound - 1.0 if bound > 0 else 0.0,
            "timings": {"plan_seconds": seconds},
            "overflow": asdict(over),
        }
        if self.step_parts:
            parts = step_parts(plan, self.model, timing="barrier", priced=cost)
            plan.stats["step_parts"] = parts.as_dict()
        return plan

    def wait_bound(self, plan: StepPlan, timeout: float | None = None) -> StepPlan:
        return plan  # the bound is computed with the plan

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            self._proc.wait(timeout=30)
            self._proc = None
        self._stderr.close()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


def overflow_summary(overflows: Sequence[Overflow]) -> dict[str, float | int]:
    """How often and by how much the release exceeded ``capacity`` over a run: steps with a
    sub-sample over it (one forward+backward holding more tokens per rank than allowed), the
    sub-samples over it, the largest ratio; and the same for a rank's whole round (the tokens a
    packed micro-batch of that round would hold)."""
    return {
        "steps": len(overflows),
        "steps_over": sum(o.count > 0 for o in overflows),
        "sub_samples_over": sum(o.count for o in overflows),
        "sub_samples": sum(o.total for o in overflows),
        "max_ratio": max((o.max_ratio for o in overflows), default=0.0),
        "steps_packed_over": sum(o.rank_round_tokens_ratio > 1 for o in overflows),
        "max_rank_round_ratio": max((o.rank_round_tokens_ratio for o in overflows), default=0.0),
    }
