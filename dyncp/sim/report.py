"""Summaries of a replay: the JSON report and the table printed by ``python -m dyncp.sim``."""

from __future__ import annotations

from typing import Any

import numpy as np

from dyncp.sim.replay import PolicyRun

__all__ = ["summarise", "format_table"]


def _histogram(counter: dict[int, int]) -> dict[str, int]:
    return {str(cp): int(counter[cp]) for cp in sorted(counter)}


def summarise(runs: dict[str, PolicyRun], bounds: list[float]) -> dict[str, Any]:
    """The report's numbers; every field but the plan_seconds_* timings is deterministic."""
    policies: dict[str, Any] = {}
    for name, run in runs.items():
        plan_s = np.asarray(run.plan_seconds)
        policies[name] = {
            "mean_step_seconds": float(np.mean(run.step_seconds)),
            "mean_imbalance": float(np.mean(run.imbalance)),
            "mean_efficiency": float(np.mean(run.efficiency)),
            "mean_gap_to_lower_bound": float(np.mean(run.gap)),
            "max_gap_to_lower_bound": float(np.max(run.gap)),
            "mean_waves": float(np.mean(run.waves)),
            "plan_seconds_p50": float(np.percentile(plan_s, 50)),
            "plan_seconds_p99": float(np.percentile(plan_s, 99)),
            "cp_histogram": _histogram(run.cp_sequences),
            "cp_token_histogram": _histogram(run.cp_tokens),
            "step_seconds": [float(x) for x in run.step_seconds],
        }
    out: dict[str, Any] = {
        "policies": policies,
        "lower_bound_mean_step_seconds": float(np.mean(bounds)),
    }
    for base in ("static", "megatron"):
        if base in policies:
            ref = policies[base]["mean_step_seconds"]
            out[f"speedup_vs_{base}"] = {
                name: ref / p["mean_step_seconds"] for name, p in policies.items()
            }
    return out


def format_table(summary: dict[str, Any]) -> str:
    """A fixed-width table, one row per policy."""
    vs_static = summary.get("speedup_vs_static", {})
    head = (
        f"{'policy':<15}{'step s':>9}{'vs static':>10}{'imbalance':>10}{'gap to LB':>10}"
        f"{'plan p50':>10}{'plan p99':>10}  CP sizes (share of sequences)"
    )
    lines = [head, "-" * len(head)]
    for name, p in summary["policies"].items():
        hist = p["cp_histogram"]
        total = sum(hist.values()) or 1
        mix = " ".join(f"{cp}:{n / total:.1%}" for cp, n in hist.items())
        speed = f"{vs_static[name]:.3f}x" if name in vs_static else "-"
        lines.append(
            f"{name:<15}{p['mean_step_seconds']:>9.3f}{speed:>10}{p['mean_imbalance']:>10.3f}"
            f"{p['mean_gap_to_lower_bound']:>10.1%}{p['plan_seconds_p50'] * 1e3:>8.1f}ms"
            f"{p['plan_seconds_p99'] * 1e3:>8.1f}ms  {mix}"
        )
    lines.append(f"{'lower bound':<15}{summary['lower_bound_mean_step_seconds']:>9.3f}")
    return "\n".join(lines)
