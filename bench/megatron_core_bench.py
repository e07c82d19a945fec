"""dyncp against the dynamic CP Megatron-LM users run today, and the adapter's planning latency.

    python bench/megatron_core_bench.py [--steps 10] [--latency-steps 5]

Part 1 (predicted, ``h100-reference``, 64 ranks, 8 per node, max length 131072, global batch
2 x 64 x capacity tokens, seed 0): ``python -m dyncp.sim --policies megatron-core,megatron,dyncp``
on the shared datasets (``../shared/datasets``, when present) and the bundled samples, at
capacities 8192 and 16384. ``megatron-core`` is megatron-core 0.16.1's released
``BalancedCPScheduler`` run itself, priced as the release runs it (a micro-batch per sample, a
barrier per round); ``megatron`` is Megatron-LM's dev-branch packing-aware greedy; ``dyncp`` is
dyncp's planner under the simulator's dataflow timing, and ``dyncp (as megatron runs it)`` is the
same planner's plan as ``DynCPScheduler`` hands it to megatron-core: barrier timing, a
micro-batch per sub-sample. Ratios are the release's step over the others', measured in one run.
The release's capacity overflow: steps with a sub-sample over the capacity (its forward+backward
holds more tokens per rank than ``max_seqlen_per_dp_cp_rank``; out of memory on a GPU), and steps
where a rank's whole round holds more (what a packed micro-batch of that round would need).

Part 2 (wall clock, this machine): ``DynCPScheduler.get_groups_and_subsamples`` per step at 64
and 512 ranks (capacity 8192, Wikipedia batches of 2 x world x capacity tokens), median and max
over ``--latency-steps`` steps (and the median CPU seconds of the process, which a loaded machine
inflates less); with ``broadcast=`` (the first rank plans under its 0.1 s wall-clock deadline and
broadcasts; timed here on a one-rank gloo group, so the broadcast itself is not in the figure);
and the released ``BalancedCPScheduler`` on the same batches.
Every rank runs this call once per global batch, in the data loader.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.data.readers import load_lengths, resolve_dataset
from dyncp.integrations.megatron import DynCPScheduler
from dyncp.integrations.megatron_release import release_rounds
from dyncp.sim.__main__ import main as sim_main
from dyncp.sim.replay import admit, draw_batches

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"
DATASETS = {
    "wikipedia (shared, 1M)": SHARED / "wikipedia_flexsp.parquet",
    "wlbllm (shared, 99.5k)": SHARED / "wlbllm_distca.parquet",
    "wikipedia (bundled)": "wikipedia",
    "wlbllm (bundled)": "wlbllm",
}
CAPACITIES = (8192, 16384)
WORLD = 64


def predicted(steps: int) -> None:
    model = CostModel.load("h100-reference", 8)
    print(
        f"{'dataset':<24}{'cap':>6}{'dyncp s':>9}{'as mcore':>9}{'mcore s':>9}{'dev s':>8}"
        f"{'mcore/dyncp':>12}{'mcore/dev':>10}{'sub-sample over':>17}{'round over':>15}"
    )
    for name, source in DATASETS.items():
        if isinstance(source, Path) and not source.is_file():
            print(f"{name:<24} (missing: {source})")
            continue
        for cap in CAPACITIES:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "r.json"
                argv = ["--dataset", str(source), "--world", str(WORLD), "--capacity", str(cap)]
                argv += ["--max-length", "131072", "--steps", str(steps)]
                argv += ["--policies", "megatron-core,megatron,dyncp", "--json", str(out)]
                with (
                    contextlib.redirect_stdout(io.StringIO()),
                    contextlib.redirect_stderr(io.StringIO()),
                ):
                    sim_main(argv)
                report = json.loads(out.read_text())
            step = {k: v["mean_step_seconds"] for k, v in report["policies"].items()}
            as_mcore = _dyncp_as_megatron_runs_it(source, cap, steps, model)
            o = report["overflow"]["megatron-core"]
            sub = f"{o['steps_over']}/{o['steps']} {o['max_ratio']:.2f}x"
            rnd = f"{o['steps_packed_over']}/{o['steps']} {o['max_rank_round_ratio']:.1f}x"
            print(
                f"{name:<24}{cap:>6}{step['dyncp']:>9.3f}{as_mcore:>9.3f}"
                f"{step['megatron-core']:>9.3f}{step['megatron']:>8.3f}"
                f"{step['megatron-core'] / step['dyncp']:>11.3f}x"
                f"{step['megatron-core'] / step['megatron']:>9.3f}x{sub:>17}{rnd:>15}"
            )


def _batches(source, cap: int, steps: int, world: int) -> list[np.ndarray]:
    lengths, _ = admit(load_lengths(resolve_dataset(str(source)), None), 131072, "truncate")
    return list(
        draw_batches(lengths, steps=steps, seed=0, global_batch_tokens=2 * world * cap)
    )  # fmt: skip


def _dyncp_as_megatron_runs_it(source, cap: int, steps: int, model: CostModel) -> float:
    """Mean step of DynCPScheduler's schedules as megatron-core runs them (same batches)."""
    sched = DynCPScheduler(model, world=WORLD, capacity=cap)
    seconds = []
    for batch in _batches(source, cap, steps, WORLD):
        sched.plan([(i, int(n)) for i, n in enumerate(batch)])
        plan = sched.last_release_plan
        seconds.append(evaluate_plan(plan, model, timing="barrier").step_seconds)
    return float(np.mean(seconds))


def latency(steps: int) -> None:
    model = CostModel.load("h100-reference", 8)
    with tempfile.TemporaryDirectory() as tmp:  # the broadcast needs a group: one gloo rank
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            _latency(model, steps)
        finally:
            dist.destroy_process_group()


def _latency(model: CostModel, steps: int) -> None:
    print(
        f"\n{'ranks':>6}{'docs/step':>10}{'dyncp p50':>11}{'dyncp max':>11}{'dyncp cpu':>11}"
        f"{'bcast p50':>11}{'bcast max':>11}{'release p50':>13}"
    )
    for world in (64, 512):
        sched = DynCPScheduler(model, world=world, capacity=8192)
        bcast = DynCPScheduler(model, world=world, capacity=8192, broadcast=dist.group.WORLD)
        ours, theirs, docs, cpu, cast = [], [], [], [], []
        for batch in _batches("wikipedia", 8192, steps, world):
            pairs = [(i, int(n)) for i, n in enumerate(batch)]
            docs.append(len(pairs))
            start, cpu0 = time.perf_counter(), time.process_time()
            sched.get_groups_and_subsamples(pairs, None)
            ours.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu0)
            start = time.perf_counter()
            bcast.get_groups_and_subsamples(pairs, None)
            cast.append(time.perf_counter() - start)
            start = time.perf_counter()
            release_rounds(batch, world=world, capacity=8192)
            theirs.append(time.perf_counter() - start)
        print(
            f"{world:>6}{statistics.mean(docs):>10.0f}{statistics.median(ours) * 1e3:>9.0f}ms"
            f"{max(ours) * 1e3:>9.0f}ms{statistics.median(cpu) * 1e3:>9.0f}ms"
            f"{statistics.median(cast) * 1e3:>9.0f}ms{max(cast) * 1e3:>9.0f}ms"
            f"{statistics.median(theirs) * 1e3:>11.0f}ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--latency-steps", type=int, default=5)
    parser.add_argument("--latency-only", action="store_true", help="skip the predicted table")
    args = parser.parse_args()
    if not args.latency_only:
        predicted(args.steps)
    latency(args.latency_steps)


if __name__ == "__main__":
    main()
