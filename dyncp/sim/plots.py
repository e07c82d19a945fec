"""Pictures of plans: a Gantt chart of one step (ranks x time) and step-time distributions.

    python -m dyncp.sim --plot plots/     # plots/gantt-<policy>.png, gantt.png, step-seconds.png

matplotlib is an optional extra (``pip install 'dyncp[plots]'``); everything here uses the
object-oriented ``Figure`` API with the Agg canvas, never pyplot's global state.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dyncp.cost_model.evaluate import check_timing, evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.pipeline_timing import price_pipeline
from dyncp.plan import StepPlan
from dyncp.sim.pipeline_plots import pipeline_gantt
from dyncp.sim.replay import PolicyRun
from dyncp.sim.step_parts_plot import step_parts_figure
from dyncp.sim.timeseries import timeseries_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["PlotsUnavailable", "require_matplotlib", "draw_gantt", "gantt_figure", "write_plots"]

# One colour per CP size (indexed by log2): colour-blind-friendly, distinct from the idle grey.
CP_COLOURS = (
    "#4c9be8",  # 1
    "#55a868",  # 2
    "#e8a33d",  # 4
    "#c44e52",  # 8
    "#8172b2",  # 16
    "#2f4858",  # 32
    "#d867b2",  # 64
    "#8c613c",  # 128
)
IDLE_COLOUR = "#eeeeee"
WAVE_COLOUR = "#b00020"


class PlotsUnavailable(ImportError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Raise ``PlotsUnavailable`` with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as exc:
        raise PlotsUnavailable(
            f"plots need matplotlib, which is not installed ({exc}); install it with "
            f"pip install 'dyncp[plots]' (or pip install 'matplotlib>=3.7')"
        ) from None


def _colour(cp: int) -> str:
    return CP_COLOURS[min(cp.bit_length() - 1, len(CP_COLOURS) - 1)]


def draw_gantt(
    ax: Axes,
    plan: StepPlan,
    model: CostModel,
    *,
    title: str | None = None,
    xmax: float | None = None,
    timing: str | None = None,
) -> None:
    """Draw one step on ``ax``: a row per rank, time on x (up to ``xmax`` seconds).

    Each micro-batch is a bar over its group's ranks, coloured by CP size and outlined thinly;
    each group's block is outlined in black, with its head split written on it when it has one
    (``a2a4xring2``); the hatched grey behind them is idle time. ``timing`` (default: the one
    the plan was made for, ``stats["timing"]``, else dataflow) places the groups: under
    ``"dataflow"`` each group starts when its last rank is free (``PlanCost.group_spans``, the
    wave overhead first); under ``"barrier"`` every wave starts together, and dashed red
    vertical lines separate the waves (whose length includes the per-wave overhead).
    """
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Patch, Rectangle

    timing = check_timing(timing or plan.stats.get("timing", "dataflow"))
    cost = evaluate_plan(plan, model, timing=timing)
    barrier = timing == "barrier"
    world = plan.topology.world
    xmax = cost.step_seconds if xmax is None else xmax
    idle: list[Rectangle] = [] if barrier else [Rectangle((0.0, 0), cost.step_seconds, world)]
    bars: list[Rectangle] = []
    colours: list[str] = []
    outlines: list[Rectangle] = []
    t0 = 0.0
    for w, (wave, wave_seconds) in enumerate(zip(plan.waves, cost.wave_seconds)):
        if barrier:
            idle.append(Rectangle((t0, 0), wave_seconds, world))
        j = 0
        for g, group in enumerate(wave.groups):
            # Barrier: the wave's start; dataflow: the group's, after its overhead.
            first = t0 if barrier else cost.group_spans[w][g][0] + model.wave_overhead
            t = first
            for _ in group.microbatches:
                dt = cost.microbatch_seconds[w][j]
                j += 1
                bars.append(Rectangle((t, group.start), dt, group.size))
                colours.append(_colour(group.size))
                t += dt
            outlines.append(Rectangle((first, group.start), t - first, group.size))
            if group.heads > 1 and t - first > 0.04 * xmax:
                # A head split is written on its group: "a2a4xring2" (u ranks exchange heads).
                ax.text(
                    (first + t) / 2,
                    group.start + group.size / 2,
                    group.layout_name,
                    ha="center",
                    va="center",
                    fontsize=6,
                    rotation=90 if group.size > 4 * (t - first) / xmax * world else 0,
                    zorder=5,
                )
        t0 += wave_seconds
        if not barrier:
            continue
        if w < len(plan.waves) - 1:
            ax.axvline(t0, color=WAVE_COLOUR, linestyle="--", linewidth=1.6, zorder=4)
        if wave_seconds > 0.05 * xmax:
            ax.text(
                t0 - wave_seconds / 2,
                0.3,
                f"wave {w}",
                ha="center",
                va="top",
                fontsize=8,
                zorder=5,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1.5},
            )
    ax.add_collection(
        PatchCollection(
            idle, facecolor=IDLE_COLOUR, edgecolor="#bbbbbb", hatch="///", linewidth=0, zorder=1
        )
    )
    ax.add_collection(
        PatchCollection(bars, facecolor=colours, edgecolor="white", linewidth=0.3, zorder=2)
    )
    ax.add_collection(
        PatchCollection(outlines, facecolor="none", edgecolor="black", linewidth=0.6, zorder=3)
    )
    ax.set_xlim(0, xmax * 1.005)
    ax.set_ylim(world, 0)
    per_node = plan.topology.ranks_per_node
    for node in range(per_node, world, per_node):
        ax.axhline(node, color="#888888", linewidth=0.4, zorder=0)
    step = max(1, world // 16)
    ax.set_yticks(range(0, world + 1, step) if world > 1 else [0])
    ax.set_ylabel("rank")
    ax.set_xlabel("seconds (predicted)")
    sizes = sorted({g.size for wave in plan.waves for g in wave.groups})
    handles = [Patch(facecolor=_colour(c), edgecolor="white", label=f"CP {c}") for c in sizes]
    handles.append(Patch(facecolor=IDLE_COLOUR, edgecolor="#bbbbbb", hatch="///", label="idle"))
    from matplotlib.lines import Line2D

    if barrier:
        handles.append(
            Line2D([], [], color=WAVE_COLOUR, linestyle="--", linewidth=1.6, label="wave boundary")
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    if title is None:
        title = plan.policy or str(plan.stats.get("policy", ""))
    mean_busy = float(cost.rank_busy_seconds.mean())
    waves = f"{len(plan.waves)} wave" + ("s" if len(plan.waves) != 1 else "")
    ax.set_title(
        f"{title}: {cost.step_seconds:.3f} s, imbalance {cost.imbalance:.3f}, "
        f"ranks busy {mean_busy / cost.step_seconds:.0%} of the step, "
        f"{len(plan.lengths)} sequences, {waves}, {timing} timing",
        fontsize=10,
        loc="left",
    )


def gantt_figure(
    plans: Mapping[str, StepPlan],
    model: CostModel,
    *,
    caption: str = "",
    timing: str | None = None,
) -> Figure:
    """One Gantt panel per policy, stacked on a shared time axis, timed as ``timing`` (default:
    each plan's own, see ``draw_gantt``)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    n = len(plans)
    world = next(iter(plans.values())).topology.world
    height = 1.2 + n * max(2.2, min(4.5, world / 16))
    fig = Figure(figsize=(13, height), layout="constrained")
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    timings = {
        name: check_timing(timing or plan.stats.get("timing", "dataflow"))
        for name, plan in plans.items()
    }
    xmax = max(
        evaluate_plan(plan, model, timing=timings[name]).step_seconds
        for name, plan in plans.items()
    )
    for ax, (name, plan) in zip(axes, plans.items()):
        draw_gantt(ax, plan, model, title=name, xmax=xmax, timing=timings[name])
    for ax in axes[:-1]:
        ax.set_xlabel("")
    if caption:
        fig.suptitle(caption, fontsize=11)
    return fig


def _step_figure(runs: Mapping[str, PolicyRun], bounds: list[float], caption: str) -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    ax_s, ax_i = fig.subplots(1, 2, width_ratios=(3, 2))
    names = list(runs)
    series = [np.asarray(runs[n].step_seconds) for n in names] + [np.asarray(bounds)]
    labels = names + ["lower bound"]
    rng = np.random.default_rng(0)
    for ax, data, lab, unit in (
        (ax_s, series, labels, "step seconds (predicted)"),
        (ax_i, [np.asarray(runs[n].imbalance) for n in names], names, "imbalance (busiest / mean)"),
    ):
        ax.boxplot(data, showfliers=False, widths=0.5)
        ax.set_xticks(range(1, len(lab) + 1), lab)
        for k, values in enumerate(data, start=1):
            colour = "#888888" if lab[k - 1] == "lower bound" else "#4c72b0"
            x = k + rng.uniform(-0.12, 0.12, len(values))
            ax.scatter(x, values, s=10, alpha=0.7, color=colour, zorder=3)
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelrotation=15)
    ax_s.set_title(
        f"step time per policy, {len(bounds)} step" + ("s" if len(bounds) != 1 else ""),
        fontsize=10,
        loc="left",
    )
    ax_i.set_title("imbalance per policy", fontsize=10, loc="left")
    if caption:
        fig.suptitle(caption, fontsize=11)
    return fig


def write_plots(
    directory: Path,
    *,
    plans: Mapping[str, StepPlan],
    model: CostModel,
    runs: Mapping[str, PolicyRun],
    bounds: list[float],
    step: int = 0,
    caption: str = "",
    measured: Mapping[str, list[float]] | None = None,
) -> list[Path]:
    """Write ``gantt-<policy>.png`` (step ``step`` of each policy), ``gantt.png`` (all policies on
    one time axis), ``step-seconds.png``, ``step-parts.png`` (the parts of the step, stacked per
    policy, ``dyncp.sim.step_parts_plot``) and ``timeseries.png`` (the dashboard's per-step series,
    ``dyncp.sim.timeseries``; ``measured``: policy -> measured step seconds) into ``directory``;
    pipelined plans get ``pipeline-gantt.png`` (``dyncp.sim.pipeline_plots``) instead of the
    Gantt charts;
    returns the paths written.

    Raises:
        PlotsUnavailable: matplotlib is missing.
    """
    require_matplotlib()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    suffix = f" (step {step})" + (f" - {caption}" if caption else "")

    def save(fig: Any, name: str) -> None:
        path = directory / name
        fig.savefig(path, dpi=110)
        written.append(path)

    piped = {name: plan for name, plan in plans.items() if plan.pipeline is not None}
    if piped:  # pipelined plans: their timelines per process, priced as the schedule runs
        costs = {name: price_pipeline(plan, model) for name, plan in piped.items()}
        save(pipeline_gantt(costs, caption=f"one pipelined step{suffix}"), "pipeline-gantt.png")
    for name, plan in plans.items():
        if name in piped:
            continue
        save(gantt_figure({name: plan}, model, caption=f"{name}{suffix}"), f"gantt-{name}.png")
    if len(plans) > 1 and not piped:
        save(gantt_figure(plans, model, caption=f"one step, every policy{suffix}"), "gantt.png")
    save(_step_figure(runs, bounds, caption), "step-seconds.png")
    if any(isinstance(p.stats.get("step_parts"), dict) for p in plans.values()):
        save(step_parts_figure(plans, caption=f"one step{suffix}"), "step-parts.png")
    save(timeseries_figure(runs, bounds, measured=measured, caption=caption), "timeseries.png")
    return written
