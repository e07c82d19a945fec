"""python -m dyncp.serve: the plan service, standalone, next to a training job.

    python -m dyncp.serve --host trainer-0 --port 29500 --prefix myjob \\
        --dataset lengths.parquet --world 64 --ranks-per-node 8 --capacity 8192 \\
        --global-batch-tokens 1048576 --seed 0 --time-limit 2.0 --lookahead 4

It connects to the job's TCPStore as a client and publishes the plans the job's samplers read
(every rank passes ``store=..., prefix=..., serve=False``). Batching options must be the job's:
a plan for another batch is rejected by the readers, which then fall back (and count it). Stops
on SIGINT/SIGTERM or after ``--duration`` seconds, and prints its counters.

``--calibrate``: the service also refits the cost model from the measurements the trainers push
(``dyncp.runtime.measure.StoreMeasurements``), publishes each adopted version in the Store before
pricing plans with it (readers' fallbacks name the version they use), and with
``--save-profile`` writes the calibrated profile after each adopted refit.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta

import torch.distributed as dist

from dyncp.calibration import OnlineCalibrator
from dyncp.cost_model import CostModel
from dyncp.datasets import load_lengths, resolve_dataset
from dyncp.model_channel import ServiceCalibration
from dyncp.plan import Topology
from dyncp.planner import POLICIES, Planner
from dyncp.sampler import OVERLONG, BatchSchedule
from dyncp.service import PlanService


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dyncp.serve", description=__doc__.splitlines()[0])
    p.add_argument("--host", required=True, help="host of the job's TCPStore")
    p.add_argument("--port", type=int, required=True, help="port of the job's TCPStore")
    p.add_argument("--prefix", default="default", help="the samplers' prefix= (job namespace)")
    p.add_argument("--dataset", required=True, help="lengths file or bundled name (as the job)")
    p.add_argument("--column", default=None, help="column/key holding the lengths")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--capacity", type=int, required=True, help="tokens per rank per micro-batch")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--global-batch-tokens", type=int)
    size.add_argument("--global-batch-size", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--drop-last", action="store_true")
    p.add_argument("--overlong", choices=OVERLONG, default="error")
    p.add_argument("--profile", default="h100-reference", help="cost-model profile name or path")
    p.add_argument("--policy", choices=POLICIES, default="dyncp")
    p.add_argument("--time-limit", type=float, default=1.0, help="planner seconds per step")
    p.add_argument("--lookahead", type=int, default=2)
    p.add_argument("--duration", type=float, default=0.0, help="stop after N seconds (0: never)")
    p.add_argument("--connect-timeout", type=float, default=60.0)
    p.add_argument("--calibrate", action="store_true", help="refit the cost model online")
    p.add_argument("--refit-every", type=int, default=64, help="micro-batches between refits")
    p.add_argument("--save-profile", default=None, help="write the calibrated profile here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = CostModel.load(args.profile, ranks_per_node=args.ranks_per_node)
    topology = Topology(args.world, args.ranks_per_node, args.capacity)
    planner = Planner(
        model,
        world=args.world,
        ranks_per_node=args.ranks_per_node,
        capacity=args.capacity,
        policy=args.policy,
        max_length=topology.max_length(),
        time_limit=args.time_limit,
    )
    schedule = BatchSchedule(
        load_lengths(resolve_dataset(args.dataset), args.column),
        max_length=planner.topology.max_length(),
        overlong=args.overlong,
        seed=args.seed,
        shuffle=not args.no_shuffle,
        global_batch_tokens=args.global_batch_tokens,
        global_batch_size=args.global_batch_size,
        drop_last=args.drop_last,
    )
    store = dist.TCPStore(
        args.host, args.port, is_master=False, timeout=timedelta(seconds=args.connect_timeout)
    )
    calibration = None
    if args.calibrate:
        calibrator = OnlineCalibrator(
            model.profile, ranks_per_node=args.ranks_per_node, refit_every=args.refit_every
        )
        calibration = ServiceCalibration(
            store, args.prefix, calibrator, save_path=args.save_profile
        )
    service = PlanService(
        store,
        source=schedule,
        planner=planner,
        prefix=args.prefix,
        lookahead=args.lookahead,
        calibration=calibration,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"dyncp.serve: {len(schedule.lengths)} samples, world {args.world}, prefix "
        f"{args.prefix!r}, store {args.host}:{args.port}",
        flush=True,
    )
    service.start()
    stop.wait(args.duration or None)
    service.stop()
    print(f"dyncp.serve: {service.counters}", flush=True)
    if calibration is not None:
        cal = calibration.calibrator
        print(
            f"dyncp.serve: cost model v{cal.current.version} after {cal.refits} refits "
            f"({cal.buffer.seen} micro-batches measured, {cal.rejected} records rejected)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
