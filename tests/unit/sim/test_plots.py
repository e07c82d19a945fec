"""Simulator pictures: --plot writes the Gantt charts and step-time plots; a clear message without
matplotlib."""

from __future__ import annotations

import functools
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.planner.planner import POLICIES, Planner
from dyncp.sim.__main__ import main

SMALL = ["--world", "8", "--ranks-per-node", "4", "--capacity", "512", "--max-length", "4096"]
PNG = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG, f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@functools.cache
def model() -> CostModel:
    return CostModel.load("h100-reference", 4)


def test_plot_writes_a_gantt_per_policy_and_the_step_time_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    assert main([*SMALL, "--steps", "3", "--plot", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    expected = {f"gantt-{p}.png" for p in POLICIES} | {"gantt.png", "step-seconds.png"}
    expected |= {"timeseries.png", "step-parts.png"}
    assert names == expected
    for name in expected:
        width, height = png_size(out / name)
        assert width >= 800 and height >= 300, (name, width, height)
    # The combined chart stacks one panel per policy.
    assert png_size(out / "gantt.png")[1] > 2 * png_size(out / "gantt-dyncp.png")[1]


def test_plot_step_and_policy_subset(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "one"
    args = [
        *SMALL,
        "--steps",
        "2",
        "--plot-step",
        "1",
        "--policies",
        "megatron",
        "--plot",
        str(out),
    ]
    assert main(args) == 0
    assert {p.name for p in out.iterdir()} == {
        "gantt-megatron.png",
        "step-seconds.png",
        "step-parts.png",
        "timeseries.png",
    }


def test_plot_step_out_of_range(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, "--steps", "2", "--plot-step", "2", "--plot", str(tmp_path)])
    assert exc.value.code == 2
    assert "--plot-step 2: choose a step in 0..1" in capsys.readouterr().err


def test_missing_matplotlib_gives_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    from dyncp.sim.plots import PlotsUnavailable, require_matplotlib

    with pytest.raises(PlotsUnavailable, match=r"pip install 'dyncp\[plots\]'"):
        require_matplotlib()
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, "--steps", "1", "--plot", str(tmp_path / "p")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--plot: plots need matplotlib" in err and "dyncp[plots]" in err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("timing", ["barrier", "dataflow"])
def test_gantt_draws_every_microbatch_and_the_idle_time(timing: str) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.collections import PatchCollection

    from dyncp.sim.plots import gantt_figure

    lengths = np.random.default_rng(2).integers(1, 3000, 40)
    plans = {}
    for policy in ("megatron", "dyncp"):
        planner = Planner(
            model(),
            world=8,
            ranks_per_node=4,
            capacity=512,
            policy=policy,
            max_length=4096,
            timing=timing,
        )
        plans[policy] = planner.plan(lengths)
    fig = gantt_figure(plans, model())  # each plan drawn under the timing it was made for
    axes = fig.axes
    assert len(axes) == 2
    slowest = max(evaluate_plan(p, model(), timing=timing).step_seconds for p in plans.values())
    for ax, plan in zip(axes, plans.values()):
        cost = evaluate_plan(plan, model(), timing=timing)
        idle, bars, outlines = [c for c in ax.collections if isinstance(c, PatchCollection)]
        # Barrier: one idle block per wave; dataflow: one behind the whole step.
        assert len(idle.get_paths()) == (len(plan.waves) if timing == "barrier" else 1)
        assert len(bars.get_paths()) == sum(1 for _ in plan.microbatches())
        assert len(outlines.get_paths()) == sum(len(w.groups) for w in plan.waves)
        # Shared time axis: the slowest policy fits; ranks on y, rank 0 at the top.
        assert ax.get_xlim()[1] >= slowest
        assert ax.get_ylim() == (8, 0)
        # Busy area drawn = the ranks' predicted busy seconds (idle is what is left).
        area = 0.0
        for path in bars.get_paths():
            (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            area += (x1 - x0) * (y1 - y0)
            assert x1 <= cost.step_seconds * (1 + 1e-9)  # every bar inside the step
        assert area == pytest.approx(float(cost.rank_busy_seconds.sum()), rel=1e-9)
        if timing == "dataflow":  # each group drawn where its span says
            spans = [s for wave in cost.group_spans for s in wave]
            boxes = [p.vertices for p in outlines.get_paths()]
            for (start, end), v in zip(spans, boxes):
                assert v[:, 0].min() == pytest.approx(start + model().wave_overhead, abs=1e-12)
                assert v[:, 0].max() == pytest.approx(end, rel=1e-9)
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "idle" in labels
        assert ("wave boundary" in labels) == (timing == "barrier")
        assert ax.get_title(loc="left").endswith(f"{timing} timing")
        sizes = sorted({g.size for w in plan.waves for g in w.groups})
        assert [f"CP {c}" for c in sizes] == labels[: len(sizes)]


def test_gantt_writes_the_head_split_on_split_groups() -> None:
    pytest.importorskip("matplotlib")
    from dyncp.sim.plots import gantt_figure

    lengths = np.random.default_rng(4).integers(1, 4000, 30)
    lengths[:3] = (3900, 3500, 3000)  # long enough for groups of 8, where splits pay
    planner = Planner(model(), world=8, ranks_per_node=4, capacity=512, policy="dyncp-hybrid",
                      max_length=4096, head_sizes=(1, 2, 4, 8))  # fmt: skip
    plan = planner.plan(lengths)
    fig = gantt_figure({"dyncp-hybrid": plan}, model())
    texts = {t.get_text() for t in fig.axes[0].texts}
    split = {g.layout_name for w in plan.waves for g in w.groups if g.heads > 1}
    assert split, "the plan has no split group to draw"
    # Groups wide enough to hold a label are labelled with their split (and only splits are).
    assert texts & split and not {t for t in texts if t.startswith("ring")}


def test_the_timeseries_plot_shows_measured_steps_without_a_metrics_port(tmp_path: Path) -> None:
    """The Grafana-free view: --plot with --measurement-noise draws the per-step series (and the
    synthetic measured steps) with no Prometheus or port involved."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    args = [*SMALL, "--steps", "4", "--policies", "static,dyncp", "--measurement-noise", "0.05"]
    assert main([*args, "--plot", str(out)]) == 0
    width, height = png_size(out / "timeseries.png")
    assert width > 1000 and height > 600


def test_step_parts_bars_stack_to_each_policys_whole_step() -> None:
    """One bar per policy; its segments are the plan's named parts and stack to its total."""
    pytest.importorskip("matplotlib")
    from dyncp.planner import Planner, PlannerConfig
    from dyncp.sim.step_parts_plot import step_parts_figure

    lengths = np.random.default_rng(0).integers(64, 12_000, 32)
    plans = {}
    for policy in ("static", "dyncp"):
        config = PlannerConfig(
            world=8,
            ranks_per_node=4,
            capacity=16_384,
            policy=policy,
            max_length=12_000,
            deterministic=True,
            cpsat=None,
            step_parts=True,
        )
        plans[policy] = Planner(model(), config).plan(lengths)
    ax = step_parts_figure(plans).axes[0]
    for k, plan in enumerate(plans.values()):
        heights = [
            r.get_height() for r in ax.patches if abs(r.get_x() + r.get_width() / 2 - k) < 0.1
        ]
        assert sum(heights) == pytest.approx(plan.stats["step_parts"]["total"], rel=1e-9)
        assert len(heights) >= 3  # attention, linear, launch at least
