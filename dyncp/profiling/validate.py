"""Check a profile against reality: ``python -m dyncp.profiling.validate --profile P``.

    torchrun --nproc-per-node 2 -m dyncp.profiling.validate --profile cpu-gloo

Runs real micro-batches of the profile's model (forward + backward of the tiny decoder through
dyncp's ring attention) under CP sizes 1, 2, 4 (every size the world allows), packs of random
real-distribution lengths that fill ``--capacity`` tokens per rank, on every rank at once (rings
of the same size side by side, as in a training wave). Measured: the median over repeats of the
slowest rank's time. Predicted: ``CostModel.microbatch_seconds(cp, lengths)``. Prints the mean
absolute percentage error (MAPE) per CP size and overall.

A profile describes the run that measured it: the processes side by side, the threads each used,
the device. Before any number is compared, the profile's recorded set-up
(``provenance.run``) is compared with this run's; if they differ, validation refuses (exit
status 2, one line naming each differing field with both values), because the error it would
print measures the difference of set-ups, not the model. ``--allow-mismatch`` compares anyway,
under a warning naming both values.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile, ProfileError, RunContext
from dyncp.data.readers import load_lengths, resolve_dataset
from dyncp.profiling.decoder import TinyConfig, TinyDecoder
from dyncp.profiling.measure import run_context
from dyncp.profiling.packs import measure_packs, random_pack, ring_sizes

__all__ = ["main", "random_pack", "setup_differences"]


def setup_differences(profile: Profile, run: RunContext) -> list[str] | None:
    """What differs between the profile's measuring run and ``run`` (None: not recorded).

    The machine's core count is not compared (a profile may fairly be checked on a bigger
    machine); processes, threads per process and the device are.
    """
    recorded = profile.provenance.run
    if recorded is None:
        return None
    return [
        f"{name}: profile {getattr(recorded, name)!r}, this run {getattr(run, name)!r}"
        for name in ("processes", "threads_per_process", "device_type", "device_name")
        if getattr(recorded, name) != getattr(run, name)
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m dyncp.profiling.validate", description=__doc__.splitlines()[0]
    )
    p.add_argument("--profile", required=True)
    p.add_argument("--capacity", type=int, default=1024, help="tokens per rank per micro-batch")
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--cases", type=int, default=6, help="packs per CP size")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="compare even if this run's set-up differs from the profile's (warned)",
    )
    args = p.parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    try:
        model_cost = CostModel.load(args.profile, ranks_per_node=world)
    except ProfileError as exc:
        sys.exit(f"validate: {exc}")
    differences = setup_differences(model_cost.profile, run_context(torch.device("cpu")))
    warning = ""
    if differences is None:
        warning = (
            f"WARNING: profile {args.profile} does not record how it was measured "
            "(provenance.run); the comparison below may compare different set-ups"
        )
    elif differences:
        what = "; ".join(differences)
        if not args.allow_mismatch:
            if distributed:
                dist.destroy_process_group()
            if rank == 0:
                print(
                    f"validate: refusing: profile {args.profile} was measured under another "
                    f"set-up ({what}); rerun with the profile's set-up, or pass "
                    "--allow-mismatch to compare anyway",
                    file=sys.stderr,
                )
            sys.exit(2)
        warning = f"WARNING: SET-UP DIFFERS FROM THE PROFILE'S ({what}): errors below include it"
    if warning and rank == 0:
        print(warning, flush=True)
    shape = model_cost.profile.model
    cfg = TinyConfig(
        vocab=shape.vocab_size,
        dim=shape.hidden_size,
        heads=shape.num_heads,
        kv_heads=shape.num_kv_heads,
        layers=shape.num_layers,
        ffn=shape.ffn_hidden_size,
    )
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = TinyDecoder(cfg).to(dtype)
    pool = load_lengths(resolve_dataset(args.dataset))
    sizes = ring_sizes(world)
    measured = measure_packs(
        model,
        pool=pool,
        sizes=sizes,
        capacity=args.capacity,
        cases=args.cases,
        repeats=args.repeats,
        rng=np.random.default_rng(0),  # the profiler calibrates on seed 1: other packs
    )
    predict = model_cost.microbatch_seconds
    rows = [
        (m.cp, len(m.lengths), sum(m.lengths), m.seconds, predict(m.cp, m.lengths))
        for m in measured
    ]
    if rank == 0:
        print(
            f"profile {args.profile}, {world} processes, capacity {args.capacity}, "
            f"{args.cases} packs per CP size, median of {args.repeats}"
        )
        print(
            f"{'cp':>3}{'seqs':>6}{'tokens':>8}{'measured ms':>13}{'predicted ms':>14}{'error':>8}"
        )
        for cp, n, tok, m, pr in rows:
            print(f"{cp:>3}{n:>6}{tok:>8}{m * 1e3:>13.2f}{pr * 1e3:>14.2f}{(pr - m) / m:>8.1%}")
        errors = {}
        for cp in sizes:
            e = [abs(pr - m) / m for c, _, _, m, pr in rows if c == cp]
            errors[cp] = float(np.mean(e))
            print(f"MAPE cp={cp}: {errors[cp]:.1%}")
        overall = float(np.mean([abs(pr - m) / m for _, _, _, m, pr in rows]))
        print(f"MAPE overall: {overall:.1%}")
        if warning:
            print(warning)
        sys.stdout.flush()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
