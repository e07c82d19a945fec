"""The parts of one step as a stacked bar per policy (``step-parts.png`` of ``--plot``).

Each bar is one policy's plan of the same step, cut into the named parts of
``dyncp.cost_model.step_parts`` (``plan.stats["step_parts"]``): what the policies change
(attention, linear work, exposed communication, launches, synchronisation) at the bottom, what
every policy pays alike (gradient reduction, optimizer, fixed) on top, so a reader sees at once
how much of the whole step a better plan can remove.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from dyncp.plan import StepPlan

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PARTS", "step_parts_figure"]

#: The parts in stacking order, with their colours.
PARTS = (
    ("attention", "#4c72b0"),
    ("linear", "#55a868"),
    ("communication", "#c44e52"),
    ("launch", "#8172b2"),
    ("embedding_head", "#ccb974"),
    ("synchronisation", "#64b5cd"),
    ("gradient_reduction", "#dd8452"),
    ("optimizer", "#937860"),
    ("fixed", "#8c8c8c"),
)


def step_parts_figure(plans: Mapping[str, StepPlan], caption: str = "") -> Figure:
    """One stacked bar per plan that carries ``stats["step_parts"]``; a ValueError when none
    does (plans of a cost model without a profile)."""
    from matplotlib.figure import Figure

    names = [n for n, p in plans.items() if isinstance(p.stats.get("step_parts"), dict)]
    if not names:
        raise ValueError("no plan carries stats['step_parts'] (a cost model without a profile)")
    fig = Figure(figsize=(max(5.0, 1.3 * len(names) + 3.0), 4.5), layout="constrained")
    ax = fig.subplots()
    bottom = [0.0] * len(names)
    for part, colour in PARTS:
        values = [float(plans[n].stats["step_parts"][part]) for n in names]
        if not any(values):
            continue  # a part no plan pays (a version-1 profile's common parts) is left out
        ax.bar(names, values, bottom=bottom, color=colour, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    for k, total in enumerate(bottom):
        ax.annotate(f"{total:.3g} s", (k, total), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds of one step (predicted, busiest rank)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelrotation=15)
    ax.set_title("the parts of one step, per policy", fontsize=10, loc="left")
    if caption:
        fig.suptitle(caption, fontsize=11)
    return fig
