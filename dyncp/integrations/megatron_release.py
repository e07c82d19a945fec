"""megatron-core's released dynamic-CP scheduler, run offline: the ``megatron-core`` baseline.

``release_rounds(lengths, world=..., capacity=...)`` runs megatron-core's own
``BalancedCPScheduler`` (``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``, imported from
the installed package, never re-implemented) on one global batch and returns its
``sample_id_groups``, the schedule ``hybrid_context_parallel_forward_backward`` would run. The
scheduler reads nothing of its process group but the size, so a batch is scheduled here without
torch.distributed, exactly as every rank of a job would schedule it.

Why a child process for the simulator: ``python -m dyncp.sim`` and the planner are torch-free
(they run on a laptop), and megatron-core imports torch. The simulator's ``megatron-core``
policy (``dyncp.planner.baselines.megatron_core_planner``) starts
``python -m dyncp.integrations.megatron_release --world W --capacity C`` once and exchanges one
JSON line per batch with it: ``{"lengths": [...]}`` in, ``{"rounds": ..., "seconds": ...}`` out
(``seconds``: the scheduler's wall time), or ``{"error": "one line"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

__all__ = ["release_rounds", "release_scheduler"]


class _Ranks:
    """What ``BalancedCPScheduler`` reads of its DP x CP process group: the size."""

    def __init__(self, world: int) -> None:
        self._world = world

    def size(self) -> int:
        return self._world


def release_scheduler(*, world: int, capacity: int):
    """megatron-core's ``BalancedCPScheduler`` for ``world`` ranks and ``capacity`` tokens per rank
    (its ``max_seqlen_per_dp_cp_rank``); ImportError (one line) when megatron-core is absent."""
    try:
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError:
        raise ImportError(
            "the megatron-core policy runs megatron-core's own BalancedCPScheduler: "
            "pip install 'dyncp[megatron]'"
        ) from None
    return BalancedCPScheduler(max_seq_len_per_rank=int(capacity), dp_cp_group=_Ranks(world))


def release_rounds(lengths: Sequence[int], *, world: int, capacity: int) -> list[list[list[int]]]:
    """The release's ``sample_id_groups`` for one global batch (ids = positions in ``lengths``)."""
    scheduler = release_scheduler(world=world, capacity=capacity)
    _, rounds = scheduler.get_groups_and_subsamples(
        [(i, int(n)) for i, n in enumerate(lengths)], None
    )
    return [[[int(i) for i in ids] for ids in round_] for round_ in rounds]


def main(argv: Sequence[str] | None = None) -> int:
    """The simulator's child process: one JSON batch per input line, one answer per line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--capacity", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        release_scheduler(world=args.world, capacity=args.capacity)
    except ImportError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 2
    for line in sys.stdin:
        lengths = json.loads(line)["lengths"]
        start = time.perf_counter()
        try:
            rounds = release_rounds(lengths, world=args.world, capacity=args.capacity)
        except Exception as exc:  # the release's own assertion: reported, not a dead pipe
            answer = {"error": f"BalancedCPScheduler failed: {type(exc).__name__}: {exc}"}
        else:
            answer = {"rounds": rounds, "seconds": time.perf_counter() - start}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
