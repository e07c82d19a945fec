"""Profile this hardware into a cost-model profile: ``python -m dyncp.profiling.profile``.

    python -m dyncp.profiling.profile --out profiles/mine.json                 # one process
    torchrun --nproc-per-node 2 -m dyncp.profiling.profile \\
        --out dyncp/cost_model/profiles/cpu-gloo.json

The command line of the profiler: it measures (``dyncp.profiling.measure``, which says what is
timed and how), fits (``dyncp.profiling.fits``) and, last, times packs of real document lengths
filling ``--capacity`` tokens per rank at every CP size (``--calibration-packs`` per size, as
``dyncp.profiling.validate`` runs them but other packs): the profile built from the pieces is the
prior of a robust refit to these (``dyncp.cost_model.calibration.fit_profile``), so the
coefficients describe whole micro-batches as training runs them. ``--all-to-all-into PROFILE``
measures only the head exchange and writes it into an existing profile, every other number
kept.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dyncp.cost_model.calibration.fit import Measurement, fit_profile
from dyncp.cost_model.fitting import fit_linear, fit_link
from dyncp.cost_model.schema import Profile, ProfileError, load_profile
from dyncp.data.readers import load_lengths, resolve_dataset
from dyncp.profiling.decoder import MODELS, TinyDecoder
from dyncp.profiling.fits import all_to_all_section, build_profile, fit_link_robust, model_section
from dyncp.profiling.measure import group_sizes, measure, measure_all_to_all, run_context
from dyncp.profiling.packs import measure_packs, ring_sizes
from dyncp.profiling.step_costs import measure_step_costs, with_step_costs

# The profiler's pieces live in decoder, measure and fits (the fits in dyncp.cost_model.fitting;
# fit_attention is dyncp.cost_model.fitting.fit_quadratic); imported here, the names of 0.1 keep
# this path for one release.
__all__ = [
    "MODELS",
    "all_to_all_section",
    "build_profile",
    "fit_linear",
    "fit_link",
    "fit_link_robust",
    "main",
    "measure",
    "measure_all_to_all",
    "run_context",
]


def _all_to_all_into(
    args: argparse.Namespace, *, device: torch.device, command: str, log: Callable[[str], None]
) -> None:
    """Measure the all-to-all alone and write its links into an existing profile (rank 0).

    Refuses a profile measured with another number of processes or threads, or of another
    model or dtype: its other numbers describe that run, and the all-to-all must be measured
    the same way to sit beside them.
    """
    profile = load_profile(args.all_to_all_into)
    here = run_context(device)
    run = profile.provenance.run
    if run is None or (run.processes, run.threads_per_process) != (
        here.processes,
        here.threads_per_process,
    ):
        measured = (
            "no run context"
            if run is None
            else (f"{run.processes} processes x {run.threads_per_process} threads")
        )
        raise ProfileError(
            f"profile {args.all_to_all_into} was measured with {measured}; this run has "
            f"{here.processes} processes x {here.threads_per_process} threads"
        )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    world, me = dist.get_world_size(), dist.get_rank()
    groups = {
        c: [dist.new_group(list(range(b, b + c))) for b in range(0, world, c)]
        for c in group_sizes(world)
    }
    log(f"measuring the all-to-all alone for {args.all_to_all_into}")
    cfg, dtype = MODELS[args.model], getattr(torch, args.dtype)
    shape = model_section(cfg, dtype_bytes=torch.empty((), dtype=dtype).element_size())
    if profile.model.model_dump() != shape:
        raise ProfileError(
            f"profile {args.all_to_all_into} describes {profile.model.model_dump()}, not "
            f"--model {args.model} in {args.dtype} ({shape})"
        )
    points = measure_all_to_all(
        cfg, groups, dtype=dtype, device=device, repeats=args.repeats, sync=sync, log=log
    )
    if me != 0:
        return
    links, note = all_to_all_section(points, dtype)
    data = profile.model_dump(mode="json")
    data["communication"]["all_to_all_links"] = links
    prov = data["provenance"]
    prov["method"] += f"; all_to_all_links measured alone on {dt.date.today()}: {command}"
    prov["notes"] = [*prov["notes"], note]
    out = args.out or args.all_to_all_into
    out.write_text(Profile.model_validate(data).to_json())
    log(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m dyncp.profiling.profile", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, default=None, help="the profile to write")
    p.add_argument(
        "--all-to-all-into",
        type=Path,
        default=None,
        metavar="PROFILE",
        help="measure only the all-to-all (torchrun, >= 2 processes) and write its "
        "all_to_all_links into PROFILE, every other number kept (to --out, else PROFILE)",
    )
    p.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument(
        "--whole-step",
        action="store_true",
        help="also measure the optimizer and the gradient all-reduce (schema version 2 step)",
    )
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    p.add_argument("--max-length", type=int, default=4096, help="longest attention length")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--max-seconds", type=float, default=120.0, help="measurement time budget")
    p.add_argument(
        "--calibration-packs",
        type=int,
        default=8,
        help="real-length packs per CP size for the final refit (0: none)",
    )
    p.add_argument("--capacity", type=int, default=1024, help="tokens per rank of those packs")
    p.add_argument("--dataset", default="wikipedia", help="lengths those packs are drawn from")
    args = p.parse_args(argv)
    if args.out is None and args.all_to_all_into is None:
        p.error("--out is required (or --all-to-all-into PROFILE)")
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.all_to_all_into is not None and not distributed:
        p.error("--all-to-all-into measures between processes: run it under torchrun with >= 2")
    if distributed:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    torch.set_num_threads(1 if distributed and args.device == "cpu" else torch.get_num_threads())
    device = (
        torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
        if args.device == "cuda"
        else torch.device("cpu")
    )
    dtype = getattr(torch, args.dtype)
    lengths = [
        s
        for s in (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
        if s <= args.max_length
    ]

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    command = " ".join(
        ["python -m dyncp.profiling.profile", *(argv if argv is not None else sys.argv[1:])]
    )
    if distributed:
        command = (
            f"torchrun --nproc-per-node {dist.get_world_size()} -m dyncp.profiling.profile "
            + command.split(" ", 3)[-1]
        )
    if args.all_to_all_into is not None:
        try:
            _all_to_all_into(args, device=device, command=command, log=log)
        except ProfileError as exc:
            p.error(str(exc))
        finally:
            dist.destroy_process_group()
        return
    log(f"profiling {args.model} on {args.device} ({args.dtype}), budget {args.max_seconds:.0f} s")
    raw = measure(
        MODELS[args.model],
        device=device,
        dtype=dtype,
        max_seconds=args.max_seconds,
        repeats=args.repeats,
        lengths=lengths,
        log=log,
    )
    packs: list[Measurement] = []
    if args.calibration_packs > 0:
        log(f"  timing {args.calibration_packs} real-length packs per CP size for the refit")
        torch.manual_seed(1)
        packs = measure_packs(
            TinyDecoder(MODELS[args.model]).to(device=device, dtype=dtype),
            pool=load_lengths(resolve_dataset(args.dataset)),
            sizes=ring_sizes(dist.get_world_size() if distributed else 1),
            capacity=args.capacity,
            cases=args.calibration_packs,
            repeats=args.repeats,
            rng=np.random.default_rng(1),  # validation draws its packs from seed 0
            device=device,
        )
    step = None
    if args.whole_step:  # every rank: the all-reduce is a collective
        log("  timing the optimizer step and the gradient all-reduce")
        torch.manual_seed(1)
        model = TinyDecoder(MODELS[args.model]).to(device=device, dtype=dtype)
        step = measure_step_costs(model, repeats=args.repeats)
    if rank == 0:
        name = args.name or args.out.stem
        profile = build_profile(
            name,
            MODELS[args.model],
            raw,
            dtype=dtype,
            device=device,
            command=command,
        )
        if packs:
            world = dist.get_world_size() if distributed else 1
            fit = fit_profile(
                profile,
                packs,
                ranks_per_node=world,
                min_measurements=1,
                source=f"the profiler's {len(packs)} packs of real {args.dataset} lengths",
            )
            profile = Profile.model_validate(json.loads(fit.profile.to_json()) | {"name": name})
            log(
                f"  refit to the packs: mean error {fit.error_before:.1%} -> "
                f"{fit.error_after:.1%}, overlap {fit.overlap}"
            )
        if step is not None:
            world = dist.get_world_size() if distributed else 1
            profile = with_step_costs(profile, step, world=world, command=command)
        args.out.write_text(profile.to_json())
        log(f"wrote {args.out}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
