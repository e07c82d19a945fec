"""The simulator's command line: its options, their types, and errors that fit on one line.

Every bad value is reported as one line naming the flag and what it allows (``python -m
dyncp.sim: error: argument --capacity: expected a positive integer, got 0``), not after
argparse's usage block, which is 14 lines at this many options and hides the one that matters;
the usage is printed for ``--help`` and for an option the parser does not know, where it is the
answer.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import NoReturn

from dyncp.cost_model.evaluate import TIMINGS
from dyncp.cost_model.schema import bundled_profiles
from dyncp.data.readers import BUNDLED, DEFAULT_DATASET
from dyncp.plan.menu import MENU_KINDS
from dyncp.planner.planner import ALL_POLICIES, HYBRID_POLICY
from dyncp.sim.replay import OVERLONG_ACTIONS

__all__ = ["DEFAULT_MAX_LENGTH", "OneLineParser", "build_parser"]

#: ``--max-length`` when none is given (the option's default is None, so that an error can say
#: whether the user chose the value).
DEFAULT_MAX_LENGTH = 131072


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (module docstring); exit status 2."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments"):
            self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _deadline(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 3600], got {text!r}")
    return value


def _head_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 1,2,4,8, got {text!r}"
        ) from None
    if not sizes or any(u < 1 for u in sizes):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 1,2,4,8, got {text!r}"
        )
    return tuple(sorted({1, *sizes}))


def _group_sizes(text: str) -> str | tuple[int, ...]:
    """A menu kind (``dyncp.plan.menu.MENU_KINDS``) or comma-separated sizes."""
    if text in MENU_KINDS:
        return text
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(c < 1 for c in sizes):
        raise argparse.ArgumentTypeError(
            f"expected {' or '.join(MENU_KINDS)} or comma-separated positive sizes such as "
            f"1,2,3,6,12, got {text!r}"
        )
    return tuple(sorted(set(sizes)))


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m dyncp.sim",
        description="Replay a length distribution and compare CP scheduling policies.",
    )
    p.add_argument(
        "--dataset",
        default=DEFAULT_DATASET,
        help=f"bundled sample ({', '.join(BUNDLED)}) or a file: .parquet .csv .jsonl .txt .npy "
        f"(default: {DEFAULT_DATASET})",
    )
    p.add_argument("--column", default=None, help="length column for parquet/csv/jsonl")
    p.add_argument("--world", type=_positive, default=64, help="DP x CP ranks (default 64)")
    p.add_argument("--ranks-per-node", type=_positive, default=8, help="(default 8)")
    p.add_argument(
        "--capacity",
        type=_positive,
        default=8192,
        help="tokens per rank per micro-batch, after zigzag padding (default 8192)",
    )
    batch = p.add_mutually_exclusive_group()
    batch.add_argument(
        "--global-batch-tokens",
        type=_positive,
        default=None,
        help="tokens per global batch (default: 2 x world x capacity)",
    )
    batch.add_argument("--global-batch-size", type=_positive, default=None, help="documents/step")
    p.add_argument(
        "--max-length",
        type=_positive,
        default=None,
        help=f"longest admitted document; sets the static policy's CP size (default "
        f"{DEFAULT_MAX_LENGTH})",
    )
    p.add_argument(
        "--overlong",
        choices=OVERLONG_ACTIONS,
        default="truncate",
        help="what to do with longer documents (reported either way; default truncate)",
    )
    p.add_argument(
        "--profile",
        default="h100-reference",
        help=f"bundled profile ({', '.join(bundled_profiles())}) or a profile JSON path",
    )
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated subset of megatron-core,{','.join(ALL_POLICIES)} (default: all "
        f"but megatron-core; {HYBRID_POLICY} only with --head-sizes). megatron-core: the released "
        "megatron-core 0.16.1 BalancedCPScheduler, what Megatron-LM users run today (needs "
        "dyncp[megatron]); megatron: Megatron-LM's dev-branch packing-aware greedy",
    )
    p.add_argument(
        "--head-sizes",
        type=_head_sizes,
        default=(1,),
        metavar="U,U,...",
        help="head-parallel degrees a group may use (u ranks exchange heads by all-to-all, the "
        "rest form the ring), e.g. 1,2,4,8; the dyncp-hybrid policy chooses among them "
        "(default 1: rings only)",
    )
    p.add_argument(
        "--group-sizes",
        type=_group_sizes,
        default="powers-of-two",
        metavar="MENU",
        help="the menu of CP sizes: powers-of-two (default: those dividing the world that fit "
        "the placement rules), divisors (divisors of --ranks-per-node, the NVLink domain, and "
        "whole-domain multiples), or a list such as 1,2,3,4,6,8,12 (see dyncp.plan.menu)",
    )
    p.add_argument(
        "--time-limit",
        type=_deadline,
        default=None,
        metavar="SECONDS",
        help="plan under a wall-clock deadline of SECONDS per step, as a training job's anytime "
        "planner does; plans then depend on the machine and its load (default: deterministic "
        "planners, the same plans on any machine)",
    )
    p.add_argument(
        "--timing",
        choices=TIMINGS,
        default="dataflow",
        help="how a step is timed, planned for and reported: dataflow (default; no barrier "
        "between waves, how dyncp's runtime runs a plan) or barrier (every wave ends together, "
        "the price before dataflow execution; kept for one release, for comparison)",
    )
    pipe = p.add_argument_group("pipeline parallelism")
    pipe.add_argument(
        "--pp",
        type=_positive,
        default=None,
        metavar="P",
        help="pipeline stages: every policy's plans are pipelined over P stages (1F1B; the "
        "world is each stage's DP x CP ranks), priced with the schedule's bubbles, and "
        "reported with the pipelined lower bound (default: no pipeline)",
    )
    pipe.add_argument(
        "--vpp",
        type=_positive,
        default=1,
        metavar="V",
        help="virtual stages per rank with --pp: interleaved 1F1B when V > 1 (default 1)",
    )
    p.add_argument("--steps", type=_positive, default=20, help="global batches to replay")
    p.add_argument("--seed", type=_seed, default=0, help="(an integer >= 0; default 0)")
    p.add_argument("--json", type=Path, default=None, help="write the full report here")
    obs = p.add_argument_group("metrics and plots")
    obs.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on this port while replaying (0: a free port, printed)",
    )
    obs.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address to serve on (default 127.0.0.1)",
    )
    obs.add_argument(
        "--hold",
        type=_seconds,
        nargs="?",
        const=math.inf,
        default=None,
        metavar="SECONDS",
        help="keep serving metrics after the replay: SECONDS, or until interrupted if omitted",
    )
    obs.add_argument(
        "--step-delay",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="pause after each step so that a dashboard sees the replay unfold (default 0)",
    )
    obs.add_argument(
        "--measurement-noise",
        type=_seconds,
        default=0.0,
        metavar="SIGMA",
        help="also feed synthetic 'measured' steps: each micro-batch's predicted time times "
        "exp(N(0, SIGMA)), to try the measured-vs-predicted panels without a GPU (default 0: "
        "no measured series)",
    )
    obs.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="DIR",
        help="write PNGs: gantt-<policy>.png, gantt.png, step-seconds.png (needs matplotlib)",
    )
    obs.add_argument(
        "--plot-step",
        type=int,
        default=0,
        metavar="K",
        help="step the Gantt charts show (default 0)",
    )
    return p
