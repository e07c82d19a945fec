"""Gantt charts of pipelined steps: one row per process (stage, column), one bar per operation.

A pipelined plan's price (``dyncp.cost_model.pipeline_timing.price_pipeline``) is a timeline: when
each process starts and ends each forward and backward of the schedule. Drawn per policy on one
time axis, it shows where the step goes: forwards light and backwards dark, coloured by slot (the
micro-batch's place in the order), so the warm-up and cool-down bubbles, a slow slot that holds
every later stage, and an idle column all show at a glance. ``python -m dyncp.sim --pp P --plot
DIR`` writes ``pipeline-gantt.png``; docs/concepts/pipeline.md shows one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from dyncp.cost_model.pipeline_schedule import PipelineCost

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["draw_pipeline", "pipeline_gantt"]

#: Columns drawn per stage at most: a 512-column pipeline draws its first ones (every column
#: runs the same order, so the first few show the schedule; the caption says how many).
MAX_COLUMNS = 4


def draw_pipeline(ax: Axes, cost: PipelineCost, *, columns: int = MAX_COLUMNS) -> int:
    """Draw ``cost``'s timeline on ``ax``: rows ``stage s / column w`` for the first ``columns``
    columns, top to bottom by stage; returns the number of columns drawn."""
    from matplotlib import colormaps

    stages, _, world = cost.op_start.shape
    shown = min(columns, world)
    slots = 1 + max((op.slot for ops in cost.ops for op in ops), default=0)
    palette = colormaps["tab20"]
    labels = []
    for s in range(stages):
        for w in range(shown):
            row = s * shown + w
            labels.append(f"stage {s} / col {w}")
            for k, op in enumerate(cost.ops[s]):
                start, end = float(cost.op_start[s, k, w]), float(cost.op_end[s, k, w])
                if end <= start:
                    continue  # an idle column's operation
                colour = palette((2 * op.slot) % 20 + (1 if op.kind == "F" else 0))
                ax.barh(row, end - start, left=start, height=0.8, color=colour, edgecolor="white")
                if slots <= 16 and end - start > 0.02 * cost.step_seconds:
                    text = f"{op.kind}{op.slot}" + (f".{op.chunk}" if op.chunk else "")
                    ax.text((start + end) / 2, row, text, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlim(0, cost.step_seconds * 1.01)
    ax.grid(axis="x", alpha=0.3)
    return shown


def pipeline_gantt(costs: Mapping[str, PipelineCost], *, caption: str = "") -> Figure:
    """One panel per policy, on one time axis (module docstring)."""
    from matplotlib.figure import Figure

    names = list(costs)
    rows = sum(c.op_start.shape[0] * min(MAX_COLUMNS, c.op_start.shape[2]) for c in costs.values())
    fig = Figure(figsize=(12, 0.6 + 0.2 * rows + 0.5 * len(names)), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(names), 1, sharex=True))
    for ax, name in zip(axes, names):
        cost = costs[name]
        shown = draw_pipeline(ax, cost)
        world = cost.op_start.shape[2]
        of = f"first {shown} of {world} columns" if shown < world else f"{world} columns"
        ax.set_title(
            f"{name}: step {cost.step_seconds:.3f} s, bubble {cost.bubble_fraction:.1%} ({of})",
            fontsize=9,
            loc="left",
        )
    axes[-1].set_xlim(0, 1.01 * max(c.step_seconds for c in costs.values()))  # one time axis
    axes[-1].set_xlabel("predicted seconds (F: forward, light; B: backward, dark; colour: slot)")
    if caption:
        fig.suptitle(caption, fontsize=10)
    return fig
