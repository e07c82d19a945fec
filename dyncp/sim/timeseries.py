"""The dashboard's main panels as pictures, for a user without Grafana: one PNG of per-step series.

``python -m dyncp.sim --plot DIR`` writes ``timeseries.png`` beside the Gantt charts: per step and
policy, the imbalance (a pipelined plan's bubble), the share of sequences that run on a ring
(CP > 1), the planner's wall-clock latency, and the predicted step seconds with the lower bound
(and the synthetic "measured" steps
of ``--measurement-noise``). These are the series the Grafana dashboard draws from the same
replay's Prometheus metrics (``dashboards/grafana/dyncp.json``: "Step imbalance over time",
"CP-size mix", "Plan latency quantiles", "Step seconds, predicted vs measured"), drawn straight
from the replay, so nothing but matplotlib is needed to look at a run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from dyncp.sim.replay import PolicyRun

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["timeseries_figure"]


def timeseries_figure(
    runs: Mapping[str, PolicyRun],
    bounds: list[float],
    *,
    measured: Mapping[str, list[float]] | None = None,
    caption: str = "",
) -> Figure:
    """Four panels over the steps, one line per policy (module docstring); ``measured``: policy
    -> measured step seconds, drawn dashed beside the predictions."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter

    fig = Figure(figsize=(12, 7), layout="constrained")
    (ax_i, ax_c), (ax_p, ax_s) = fig.subplots(2, 2, sharex=True)
    steps = np.arange(len(bounds))
    for k, (name, run) in enumerate(runs.items()):
        colour = f"C{k}"
        balance = 100 * np.asarray(run.bubble) if run.bubble else run.imbalance
        ax_i.plot(steps, balance, marker=".", color=colour, label=name)
        ax_c.plot(steps, 100 * np.asarray(run.multi_cp_share), marker=".", color=colour)
        ax_p.plot(steps, 1e3 * np.asarray(run.plan_seconds), marker=".", color=colour)
        ax_s.plot(steps, run.step_seconds, marker=".", color=colour)
        if measured and measured.get(name):
            ax_s.plot(steps, measured[name], ls="--", color=colour, alpha=0.7)
    ax_s.plot(steps, bounds, color="#555555", lw=2, ls=":", label="lower bound")
    piped = any(run.bubble for run in runs.values())
    balance = "pipeline bubble, % of process-seconds" if piped else "imbalance (busiest / mean)"
    titles = (
        (ax_i, f"{balance}, predicted", None),
        (ax_c, "sequences on a ring (CP > 1), % of the step's", None),
        (ax_p, "plan latency, ms (wall clock)", "log"),
        (ax_s, "step seconds: predicted (solid), measured (dashed)", None),
    )
    for ax, title, scale in titles:
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        if scale:
            ax.set_yscale(scale)
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    for ax in (ax_p, ax_s):
        ax.set_xlabel("step")
    ax_i.legend(fontsize=8, loc="upper right")
    ax_s.legend(fontsize=8, loc="upper right")
    if caption:
        fig.suptitle(caption, fontsize=11)
    return fig
