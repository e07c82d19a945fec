"""python -m dyncp.service: the plan service, standalone, next to a training job.

    python -m dyncp.service --host trainer-0 --port 29500 --prefix myjob \\
        --dataset lengths.parquet --world 64 --ranks-per-node 8 --capacity 8192 \\
        --global-batch-tokens 1048576 --seed 0 --lookahead 4

It connects to the job's TCPStore as a client and publishes the plans the job's samplers read
(every rank passes ``store=..., prefix=..., serve=False``). Batching options must be the job's:
a plan for another batch is rejected by the readers, which then fall back (and count it). Stops
on SIGINT/SIGTERM or after ``--duration`` seconds, and prints its counters.

Each step is planned for ``--budget-share`` of its predicted seconds, within [0.1 s,
``--budget-cap``] (``dyncp.planner.budget``; defaults 0.25 and 2 s); ``--time-limit`` plans every
step for a fixed number of seconds instead.

``--calibrate``: the service also refits the cost model from the measurements the trainers push
(``dyncp.runtime.measure.StoreMeasurements``), publishes each adopted version in the Store before
pricing plans with it (readers' fallbacks name the version they use), and with
``--save-profile`` writes the calibrated profile after each adopted refit.

Plans are signed with the job's secret when ``DYNCP_PLAN_SECRET`` (or ``DYNCP_PLAN_SECRET_FILE``)
is set, as on every rank, and bound to the run given by ``--run-id`` (default
``$DYNCP_RUN_ID``), which must be the ranks' ``run_id``; with a secret the run id is required
(a startup error without one), as it is on the ranks when none of them serves. ``--slices``
(default ``auto``, as the readers' ``slices``: from ``dyncp.plan.SLICES_FROM`` ranks unless the
plans are pipelined; ``on`` / ``off`` to force) publishes a slice header and one record per node
instead of the whole plan; the readers' choice must resolve alike. A startup
error (bad option, dataset, profile, unreachable store, or a port that accepts connections but
does not answer like a TCPStore within ``--connect-timeout``) is one line on stderr and exit
status 2 -- torch's own connection warnings are held back while connecting; SIGINT/SIGTERM
stop the connecting too (status 130). If the Store or the planning thread dies while serving,
one line says why and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from dyncp.control.model_channel import ServiceCalibration
from dyncp.control.signing import SECRET_ENV, SECRET_FILE_ENV, PlanSigner
from dyncp.cost_model import CostModel
from dyncp.cost_model.calibration.online import OnlineCalibrator
from dyncp.data import OVERLONG, BatchSchedule
from dyncp.data.readers import DatasetError, load_lengths, resolve_dataset
from dyncp.plan import Topology, use_slices
from dyncp.planner import POLICIES, Planner
from dyncp.planner.budget import DEFAULT_STEP_BUDGET, StepBudget
from dyncp.service.publisher import PlanService

#: How often the main thread checks that the planning thread is alive.
WATCH_SECONDS = 0.2
#: The longest --connect-timeout accepted (an hour; torch's timedelta overflows near 1e308).
MAX_CONNECT_SECONDS = 3600.0
#: The longest --time-limit / --duration accepted (a year of seconds: finite for every clock).
MAX_SECONDS = 3.2e7
#: Extra seconds the connecting thread gets beyond --connect-timeout before we give up on it.
CONNECT_GRACE = 1.0
_CONNECT_THREAD = "dyncp-store-connect"


class StartupError(Exception):
    """A problem found before serving; ``main`` prints it as one line."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived before serving began."""


def _count(minimum: int, maximum: int | None = None):  # noqa: ANN202 - an argparse type
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {text!r}")
        return value

    return parse


def _seconds(*, zero: bool, maximum: float = MAX_SECONDS):  # noqa: ANN202 - an argparse type
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value >= 0 if zero else value > 0) or not value <= maximum:
            bound = ">= 0" if zero else "> 0"
            raise argparse.ArgumentTypeError(
                f"expected seconds {bound} and at most {maximum:g}, got {text!r}"
            )
        return value

    return parse


class _OneLineParser(argparse.ArgumentParser):
    """Option errors as one line (``--help`` still shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"dyncp.service.cli: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _OneLineParser(prog="python -m dyncp.service", description=__doc__.splitlines()[0])
    p.add_argument("--host", required=True, help="host of the job's TCPStore")
    p.add_argument(
        "--port", type=_count(1, 65535), required=True, help="port of the job's TCPStore"
    )
    p.add_argument("--prefix", default="default", help="the samplers' prefix= (job namespace)")
    p.add_argument("--dataset", required=True, help="lengths file or bundled name (as the job)")
    p.add_argument("--column", default=None, help="column/key holding the lengths")
    p.add_argument("--world", type=_count(1), required=True)
    p.add_argument("--ranks-per-node", type=_count(1), default=8)
    p.add_argument(
        "--capacity", type=_count(1), required=True, help="tokens per rank per micro-batch"
    )
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--global-batch-tokens", type=_count(1))
    size.add_argument("--global-batch-size", type=_count(1))
    p.add_argument("--seed", type=_count(0), default=0)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--drop-last", action="store_true")
    p.add_argument("--overlong", choices=OVERLONG, default="error")
    p.add_argument("--profile", default="h100-reference", help="cost-model profile name or path")
    p.add_argument("--policy", choices=POLICIES, default="dyncp")
    p.add_argument(
        "--time-limit",
        type=_seconds(zero=False),
        default=None,
        help="fixed planner seconds per step (default: the budget below)",
    )
    p.add_argument(
        "--budget-share",
        type=float,
        default=DEFAULT_STEP_BUDGET.share,
        help="planning seconds per predicted step second (0, 1]",
    )
    p.add_argument(
        "--budget-cap",
        type=_seconds(zero=False),
        default=DEFAULT_STEP_BUDGET.cap,
        help="most planner seconds per step",
    )
    p.add_argument("--lookahead", type=_count(0), default=2)
    p.add_argument(
        "--duration", type=_seconds(zero=True), default=0.0, help="stop after N s (0: never)"
    )
    p.add_argument(
        "--connect-timeout", type=_seconds(zero=False, maximum=MAX_CONNECT_SECONDS), default=60.0
    )
    p.add_argument(
        "--run-id",
        default=os.environ.get("DYNCP_RUN_ID", ""),
        help="the ranks' run_id (default $DYNCP_RUN_ID): records are bound to it",
    )
    p.add_argument(
        "--slices",
        nargs="?",
        const="on",
        default="auto",
        choices=("auto", "on", "off"),
        help="publish a slice header and one record per node (the readers' slices; default "
        "auto: as the readers' default, from dyncp.plan.SLICES_FROM ranks unless pipelined)",
    )
    p.add_argument("--calibrate", action="store_true", help="refit the cost model online")
    p.add_argument("--refit-every", type=int, default=4, help="steps between refits")
    p.add_argument("--save-profile", default=None, help="write the calibrated profile here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="dyncp.service.cli: %(message)s")
    # The service's own line when its thread stops: main prints the one line that says so.
    logging.getLogger("dyncp.service.publisher").addFilter(
        lambda record: not record.getMessage().startswith("plan service stopped")
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        service = _start(args, stop)
    except StartupError as exc:
        print(f"dyncp.service.cli: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Interrupted:
        print("dyncp.service.cli: interrupted before serving", file=sys.stderr, flush=True)
        return 130
    end = None if not args.duration else time.monotonic() + args.duration
    status = 0
    with _python_stderr_only():
        while not stop.wait(WATCH_SECONDS):
            if not service.alive:
                why = service.failure or "the planning thread stopped"
                print(
                    f"dyncp.service.cli: error: stopped serving: {_one_line(why)}", file=sys.stderr
                )
                status = 1
                break
            if end is not None and time.monotonic() >= end:
                break
        service.stop()
    print(f"dyncp.service.cli: {service.counters}", flush=True)
    calibration = service.calibration
    if calibration is not None:
        cal = calibration.calibrator
        print(
            f"dyncp.service.cli: cost model v{cal.current.version} after {cal.refits} refits "
            f"({cal.buffer.seen} micro-batches measured, {cal.rejected} records rejected)",
            flush=True,
        )
    return status


def _one_line(what: object) -> str:
    """The first line of an error (torch's store errors append C++ stack frames)."""
    lines = [line.strip() for line in str(what).splitlines() if line.strip()]
    text = lines[0] if lines else type(what).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _start(args: argparse.Namespace, stop: threading.Event) -> PlanService:
    """Everything before serving; any problem is a StartupError that names it."""
    try:
        return _build(args, stop)
    except (DatasetError, ValueError, OSError) as exc:  # ProfileError is a ValueError
        raise StartupError(_one_line(exc)) from None
    except RuntimeError as exc:  # torch's store errors once connected (DistStoreError)
        raise StartupError(
            f"the job's TCPStore at {args.host}:{args.port} failed: {_one_line(exc)}"
        ) from None


@contextlib.contextmanager
def _held_stderr() -> Iterator[None]:
    """Hold back what C++ writes to file descriptor 2 (torch's connection retries log dozens of
    lines per attempt); the one-line error is printed after."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as sink:
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _python_stderr_only() -> Iterator[None]:
    """While serving: what Python writes to stderr (our one-line errors, logging) still goes
    there; what C++ writes to file descriptor 2 does not (a dead Store makes torch's client log
    a dozen lines of retries and stack frames, after which we print the one line that counts)."""
    sys.stderr.flush()
    saved = os.dup(2)
    python = open(saved, "w", buffering=1, closefd=False)  # noqa: SIM115 - closed below
    old = sys.stderr
    handlers = [
        h for h in logging.getLogger().handlers
        if isinstance(h, logging.StreamHandler) and h.stream is old
    ]  # fmt: skip
    try:
        with open(os.devnull, "wb") as sink:
            os.dup2(sink.fileno(), 2)
            sys.stderr = python
            for h in handlers:
                h.setStream(python)
            yield
    finally:
        python.flush()
        sys.stderr = old
        for h in handlers:
            h.setStream(old)
        os.dup2(saved, 2)
        os.close(saved)
        python.close()


def _connect(args: argparse.Namespace, stop: threading.Event) -> dist.TCPStore:
    """A client of the job's TCPStore, connected within --connect-timeout (plus a grace), or
    a StartupError; a signal stops the wait (Interrupted).

    The connection runs in a daemon thread: torch's constructor can block far past its timeout
    on a port that accepts and never answers, and ignores signals meanwhile.
    """
    result: dict[str, object] = {}

    def connect() -> None:
        try:
            timeout = timedelta(seconds=args.connect_timeout)
            result["store"] = dist.TCPStore(args.host, args.port, is_master=False, timeout=timeout)
        except Exception as exc:  # torch's store errors (DistNetworkError, DistStoreError, ...)
            result["error"] = exc

    where = f"the job's TCPStore at {args.host}:{args.port}"
    thread = threading.Thread(target=connect, name=_CONNECT_THREAD, daemon=True)
    end = time.monotonic() + args.connect_timeout + CONNECT_GRACE
    with _held_stderr():
        thread.start()
        while thread.is_alive() and time.monotonic() < end and not stop.is_set():
            thread.join(0.05)
    if "store" in result:
        return result["store"]  # type: ignore[return-value]
    if stop.is_set():
        raise Interrupted
    if "error" in result:
        raise StartupError(f"cannot reach {where}: {_one_line(result['error'])}")
    raise StartupError(
        f"cannot reach {where}: no answer within --connect-timeout {args.connect_timeout:g} s "
        "(something accepts connections on that port but does not answer like a TCPStore)"
    )


def _build(args: argparse.Namespace, stop: threading.Event) -> PlanService:
    signed = os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV)
    if signed and not args.run_id:
        raise StartupError(
            "plans are signed but no --run-id (or $DYNCP_RUN_ID) is given: records bound to no "
            "run are rejected by ranks bound to one, and an earlier run's would replay; give "
            "the ranks' run_id"
        )
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
    budget = None
    if args.time_limit is None:
        try:
            budget = StepBudget(share=args.budget_share, cap=args.budget_cap)
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
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
    store = _connect(args, stop)
    calibration = None
    if args.calibrate:
        calibrator = OnlineCalibrator(
            model.profile, ranks_per_node=args.ranks_per_node, refit_every=args.refit_every
        )
        calibration = ServiceCalibration(  # versions bound to the run, as the plans
            store,
            args.prefix,
            calibrator,
            save_path=args.save_profile,
            signer=PlanSigner.from_env(run=args.run_id),
        )
    service = PlanService(
        store,
        source=schedule,
        planner=planner,
        prefix=args.prefix,
        lookahead=args.lookahead,
        calibration=calibration,
        run_id=args.run_id,
        slices=use_slices(
            {"on": True, "off": False}.get(args.slices, "auto"),
            planner.topology,
            pipelined=planner.pipeline is not None,
        ),
        budget=budget,
    )
    service.start()
    print(
        f"dyncp.service.cli: {len(schedule.lengths)} samples, world {args.world}, prefix "
        f"{args.prefix!r}, store {args.host}:{args.port}, plans "
        f"{'signed' if service.signer.authenticated else 'UNSIGNED'}"
        f"{', as slices' if service.slices else ', whole'}",
        flush=True,
    )
    return service


if __name__ == "__main__":
    status = main()
    if any(t.name == _CONNECT_THREAD and t.is_alive() for t in threading.enumerate()):
        # A connection attempt still blocked in C++: interpreter shutdown could wait on it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
