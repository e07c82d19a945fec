"""Measure what a step pays outside its micro-batches: the ``step`` section of a profile.

    python -m dyncp.profiling.profile --whole-step --out profiles/mine.json    # with the rest
    torchrun --nproc-per-node 2 -m dyncp.profiling.step_costs --into cpu-gloo --out mine.json

What is timed, on the machine the profiler runs on (``dyncp.cost_model.step_parts`` prices it):

- the optimizer: ``torch.optim.AdamW.step()`` over the profiled model's parameters with
  gradients present (its moments allocated by a first, untimed step), the median over repeats of
  the slowest rank, divided by the parameter count: seconds per parameter of one unsharded
  update;
- the gradient all-reduce over all ranks (under torchrun): the median ``all_reduce`` of a buffer
  of the model's gradient bytes, and the median ``runtime.reduce_gradients`` (the runtime's
  reduction: one all-reduce per bucket of gradients), recorded in the provenance beside the price
  the profile's links give it, so a reader sees whether the links describe the data-parallel
  collective too (the calibration's fixed part absorbs what they miss), with the load average;
- the embedding and the LM head are part of the profiler's measured linear work (it times the
  whole model: ``dyncp.profiling.measure``), so they are written as 0, never counted twice.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from dyncp.cost_model.schema import Profile, load_profile
from dyncp.cost_model.step_parts import common_parts
from dyncp.profiling.decoder import MODELS, TinyDecoder
from dyncp.profiling.measure import median_seconds
from dyncp.runtime import reduce_gradients

__all__ = ["measure_step_costs", "with_step_costs"]


def measure_step_costs(
    model: torch.nn.Module, *, repeats: int = 5, sync: Callable[[], None] = lambda: None
) -> dict:
    """The measured ``step`` section for ``model`` and what the all-reduce took (``notes``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    if count == 0:
        raise ValueError("measure_step_costs needs a model with trainable parameters")
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optim = torch.optim.AdamW(params, lr=1e-6)
    update = median_seconds(optim.step, repeats, sync)
    elem = params[0].element_size()
    out = {
        "step": {
            "embedding_seconds_per_token": 0.0,
            "head_loss_seconds_per_token": 0.0,
            "parameters": count,
            "gradient_bytes_per_parameter": float(elem),
            "parameter_bytes_per_parameter": float(elem),
            "optimizer_seconds_per_parameter": update / count,
            "fixed_seconds": 0.0,
            "integration": "ddp",
        },
        "all_reduce_seconds": None,
        "reduce_gradients_seconds": None,
    }
    if dist.is_initialized() and dist.get_world_size() > 1:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        out["all_reduce_seconds"] = median_seconds(lambda: dist.all_reduce(flat), repeats, sync)
        out["reduce_gradients_seconds"] = median_seconds(
            lambda: reduce_gradients(model), repeats, sync
        )
    return out


def with_step_costs(profile: Profile, measured: dict, *, world: int, command: str) -> Profile:
    """``profile`` (version 2) with the measured ``step``, the method named in its provenance."""
    data = json.loads(profile.to_json())
    data["schema_version"] = 2
    data["step"] = measured["step"]
    candidate = Profile.model_validate(data)
    note = f"step: AdamW and gradient all-reduce measured by `{command}`"
    if measured["all_reduce_seconds"] is not None:
        priced = common_parts(candidate, world=world, ranks_per_node=world)[0]
        note += (
            f"; measured all-reduce of the gradients over {world} ranks "
            f"{measured['all_reduce_seconds']:.3g} s as one buffer, "
            f"{measured['reduce_gradients_seconds']:.3g} s as runtime.reduce_gradients runs it "
            f"(in buckets), priced by the links {priced:.3g} s"
        )
    if "load_average" in measured:
        note += f"; load average {measured['load_average']:.2f} when measured"
    if "date" in measured:
        note += f" on {measured['date']}"
    data["provenance"]["notes"] = [*data["provenance"]["notes"], note]
    return Profile.model_validate(data)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--into", required=True, help="the profile (name or path) to add the step to")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
    world = dist.get_world_size() if distributed else 1
    base = load_profile(args.into)
    torch.manual_seed(0)
    measured = measure_step_costs(TinyDecoder(MODELS[args.model]), repeats=args.repeats)
    launcher = f"torchrun --nproc-per-node {world}" if distributed else "python"
    command = f"{launcher} -m dyncp.profiling.step_costs " + " ".join(argv or sys.argv[1:])
    measured["load_average"] = os.getloadavg()[0]
    measured["date"] = datetime.date.today().isoformat()
    if not distributed or dist.get_rank() == 0:
        profile = with_step_costs(base, measured, world=world, command=command)
        args.out.write_text(profile.to_json())
        print(f"wrote {args.out}", file=sys.stderr)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
