"""Summaries of a replay: the JSON report and the table printed by ``python -m dyncp.sim``."""

from __future__ import annotations

from typing import Any

import numpy as np

from dyncp.sim.replay import PolicyRun

__all__ = ["format_latency", "format_table", "summarise"]


def _histogram(counter: dict[int, int]) -> dict[str, int]:
    return {str(cp): int(counter[cp]) for cp in sorted(counter)}


def _layouts(counter: dict[str, int]) -> dict[str, int]:
    """Sequences per group layout, by CP size then head split (``ring8`` before ``a2a2xring4``)."""

    def key(name: str) -> tuple[int, int]:
        parts = [int("".join(ch for ch in part if ch.isdigit())) for part in name.split("x")]
        heads = parts[0] if name.startswith("a2a") else 1
        return (int(np.prod(parts)), heads)

    return {name: int(counter[name]) for name in sorted(counter, key=key)}


def _mean(values: list[float]) -> float | None:
    """The mean, or None where the plans have no such figure (pipelined plans: imbalance)."""
    arr = np.asarray(values, dtype=np.float64)
    return None if not arr.size or np.isnan(arr).all() else float(np.nanmean(arr))


def summarise(runs: dict[str, PolicyRun], bounds: list[float]) -> dict[str, Any]:
    """The report's numbers; every field but the plan_seconds_* timings is deterministic."""
    policies: dict[str, Any] = {}
    for name, run in runs.items():
        plan_s = np.asarray(run.plan_seconds)
        policies[name] = {
            "mean_step_seconds": float(np.mean(run.step_seconds)),
            "mean_imbalance": _mean(run.imbalance),
            "mean_efficiency": _mean(run.efficiency),
            "mean_gap_to_lower_bound": float(np.mean(run.gap)),
            "max_gap_to_lower_bound": float(np.max(run.gap)),
            "mean_waves": float(np.mean(run.waves)),
            "plan_seconds_p50": float(np.percentile(plan_s, 50)),
            "plan_seconds_p99": float(np.percentile(plan_s, 99)),
            "cp_histogram": _histogram(run.cp_sequences),
            "cp_token_histogram": _histogram(run.cp_tokens),
            "layout_histogram": _layouts(run.layouts),
            "step_seconds": [float(x) for x in run.step_seconds],
        }
        if run.step_parts:  # the whole step's parts, averaged over the steps
            keys = run.step_parts[0].keys()
            policies[name]["mean_step_parts"] = {
                k: float(np.mean([parts[k] for parts in run.step_parts])) for k in keys
            }
        if run.bubble:  # pipelined plans: their balance is the bubble, not an imbalance
            policies[name]["mean_bubble_fraction"] = float(np.mean(run.bubble))
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
            if all("mean_step_parts" in p for p in policies.values()):
                whole = policies[base]["mean_step_parts"]["total"]
                out[f"whole_step_speedup_vs_{base}"] = {
                    name: whole / p["mean_step_parts"]["total"] for name, p in policies.items()
                }
    return out


def format_latency(seconds: float) -> str:
    """A plan latency in at most 8 characters: ``12.3ms``, ``1.23s``, ``258s``, ``3.2h``."""
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f}ms"
    if seconds < 100.0:
        return f"{seconds:.2f}s"
    if seconds < 100_000.0:
        return f"{seconds:.0f}s"
    return f"{seconds / 3600:.1f}h"


def _cells(values: list[str], widths: list[int], left: int) -> str:
    """Values right-aligned to ``widths`` (the first ``left`` left-aligned), always separated
    by at least one space, so that a value wider than its column shifts the row instead of
    running into its neighbour."""
    out = []
    for i, (v, w) in enumerate(zip(values, widths)):
        out.append(f"{v:<{w}}" if i < left else f"{v:>{w}}")
    return " ".join(out)


_HEAD = ["policy", "step s", "vs static", "imbalance", "gap to LB", "plan p50", "plan p99"]
_WIDTHS = [14, 9, 9, 9, 9, 9, 9]


def _mix(hist: dict[str, int], total: int) -> str:
    """CP sizes' shares of the sequences; a share that would print as 0.0% is given as a count
    (the rare long documents are the ones that matter)."""
    return " ".join(
        f"{cp}:{n / total:.1%}" if n / total >= 0.0005 else f"{cp}:{n} seq"
        for cp, n in hist.items()
    )


def format_table(summary: dict[str, Any]) -> str:
    """A fixed-width table, one row per policy."""
    vs_static = summary.get("speedup_vs_static", {})
    piped = any("mean_bubble_fraction" in p for p in summary["policies"].values())
    names = [*_HEAD[:3], "bubble" if piped else "imbalance", *_HEAD[4:]]
    head = _cells(names, _WIDTHS, 1) + "  CP sizes (share of sequences, or their count)"
    lines = [head, "-" * len(head)]
    for name, p in summary["policies"].items():
        hist = p["cp_histogram"]
        total = sum(hist.values()) or 1
        mix = _mix(hist, total)
        speed = f"{vs_static[name]:.3f}x" if name in vs_static else "-"
        row = [
            name,
            f"{p['mean_step_seconds']:.3f}",
            speed,
            f"{p['mean_bubble_fraction']:.1%}" if piped else f"{p['mean_imbalance']:.3f}",
            f"{p['mean_gap_to_lower_bound']:.1%}",
            format_latency(p["plan_seconds_p50"]),
            format_latency(p["plan_seconds_p99"]),
        ]
        lines.append(_cells(row, _WIDTHS, 1) + f"  {mix}")
        layouts = p.get("layout_histogram", {})
        if any(not name.startswith("ring") for name in layouts):
            split = " ".join(
                f"{name}:{n / total:.1%}"
                for name, n in layouts.items()
                if not name.startswith("ring")
            )
            lines.append(" " * (sum(_WIDTHS) + len(_WIDTHS) - 1) + f"  head splits: {split}")
    bound = f"{summary['lower_bound_mean_step_seconds']:.3f}"
    lines.append(_cells(["lower bound", bound], _WIDTHS[:2], 1))
    whole = summary.get("whole_step_speedup_vs_static", {})
    common = [
        p["mean_step_parts"]["total"] - p["mean_step_parts"]["planned"]
        for p in summary["policies"].values()
        if "mean_step_parts" in p
    ]
    if whole and max(common, default=0.0) > 0:  # a profile with the whole step (version 2)
        figures = " ".join(f"{name} {x:.3f}x" for name, x in whole.items())
        lines.append(f"whole step vs static (reduction, optimizer included): {figures}")
    return "\n".join(lines)
