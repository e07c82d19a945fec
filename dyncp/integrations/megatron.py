"""megatron-core's dynamic-CP data path with dyncp's plans: ``DynCPScheduler``.

megatron-core 0.16.1 (``pip install dyncp[megatron]``) schedules a global batch for its hybrid
(dynamic) context parallelism in ``HybridCPDataLoaderWrapper``: it all-gathers the sub-sample
lengths, asks ``cp_balancing_scheduler.get_groups_and_subsamples(global_id_seqlens, config)`` for
``sample_id_groups[round][dp_cp_rank] -> [global ids]``, routes the samples there and
``hybrid_context_parallel_forward_backward`` runs them (one forward+backward per id, a barrier
after each round). That attribute is the seam: ``DynCPScheduler`` answers the same call with
dyncp's plan, and one call installs it::

    from dyncp.integrations.megatron import DynCPScheduler
    wrapper = HybridCPDataLoaderWrapper(data_iterator, config)
    DynCPScheduler.for_wrapper(wrapper, model).install(wrapper)

Why it is exact on every rank: every rank calls the scheduler with the same all-gathered lengths,
and the planner runs in deterministic mode (a number of work units, never a clock), so each rank
computes the same plan locally -- no broadcast needed. That search takes about a second at 64
ranks and several at 512 (``bench/megatron_core_bench.py``), so ``broadcast=`` (``for_wrapper(...,
broadcast=True)``) plans once instead, on the DP x CP group's first rank under a wall-clock
deadline, and broadcasts the schedule (an error, too, so no rank waits). Plans are priced with
``timing="barrier"``, as the release runs rounds; a group's packed micro-batches become
consecutive sub-samples of its round (``dyncp.planner.baselines.megatron_core``).

Refused up front, each with a one-line error: head splits (the format has no head-parallel
groups), a CP-size menu other than the powers of two (the release only builds power-of-two hybrid
groups), a sequence no group can hold within ``max_seqlen_per_dp_cp_rank``, a config whose
capacity differs from the scheduler's, and a megatron-core version other than
``SUPPORTED_VERSIONS`` (the seam is a private attribute; another version may call it differently).
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata
from typing import Any

from dyncp.cost_model.model import CostModel
from dyncp.plan import StepPlan
from dyncp.planner import Planner
from dyncp.planner.baselines.megatron_core import check_rounds, plan_from_rounds, rounds_from_plan

__all__ = ["SUPPORTED_VERSIONS", "DynCPScheduler", "check_megatron_version"]

#: megatron-core releases whose ``HybridCPDataLoaderWrapper`` this adapter is tested against.
SUPPORTED_VERSIONS = ("0.16.1",)
#: Deterministic planning units per step (``Planner(time_limit=..., deterministic=True)``).
DEFAULT_TIME_LIMIT = 0.05
#: Wall-clock seconds of the broadcasting rank's planner per step (``broadcast=``).
BROADCAST_TIME_LIMIT = 0.1


def check_megatron_version(version: str | None = None) -> str:
    """The installed megatron-core version; ImportError/RuntimeError (one line) when it is absent
    or not one of ``SUPPORTED_VERSIONS``."""
    if version is None:
        try:
            version = metadata.version("megatron-core")
        except metadata.PackageNotFoundError:
            raise ImportError(
                "dyncp.integrations.megatron needs megatron-core "
                f"{' or '.join(SUPPORTED_VERSIONS)}: pip install 'dyncp[megatron]'"
            ) from None
    if version not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"megatron-core {version} is installed; dyncp.integrations.megatron supports "
            f"{', '.join(SUPPORTED_VERSIONS)} "
            f"(pip install 'megatron-core=={SUPPORTED_VERSIONS[-1]}')"
        )
    return version


class DynCPScheduler:
    """A drop-in for megatron-core's ``BalancedCPScheduler``: dyncp's plan, the release's format.

    Args:
        model: the cost model plans are priced with (its ``ranks_per_node`` is the node size).
        world: DP x CP ranks (the wrapper's ``dp_cp_group.size()``).
        capacity: tokens per rank (megatron's ``config.max_seqlen_per_dp_cp_rank``).
        time_limit: deterministic planning units per step; with ``broadcast``, wall-clock
            seconds (default ``BROADCAST_TIME_LIMIT``).
        broadcast: a process group (the wrapper's DP x CP group): its first rank plans under a
            wall-clock deadline and broadcasts the schedule to the others, instead of every rank
            running the deterministic search (seconds at 512 ranks: bench/megatron_core_bench.py).
        options: further ``Planner`` options (``policy``, ``cpsat``, ``bound`` -- default
            ``"simple"`` --, ...); ``group_sizes`` must be powers of two and ``head_sizes``
            only (1,).
    """

    def __init__(
        self,
        model: CostModel,
        *,
        world: int,
        capacity: int,
        time_limit: float | None = None,
        broadcast: Any = None,
        **options: Any,
    ) -> None:
        heads = tuple(options.get("head_sizes", (1,)))
        if heads != (1,):
            raise ValueError(
                f"head_sizes={heads}: megatron-core's schedule has no head-parallel groups; "
                "only (1,) is allowed"
            )
        sizes = tuple(options.get("group_sizes", ()))
        odd = [c for c in sizes if c < 1 or c & (c - 1)]
        if odd:
            raise ValueError(
                f"group_sizes {odd} are not powers of two; megatron-core builds hybrid CP "
                "groups of power-of-two sizes only"
            )
        options.setdefault("policy", "dyncp")
        # Only the plan is used here; the tight (LP) bound is a report, a fifth of the planning
        # time at 512 ranks (bench/megatron_core_bench.py).
        options.setdefault("bound", "simple")
        if options["policy"] == "dyncp-hybrid":
            raise ValueError("policy dyncp-hybrid splits heads; megatron-core's format cannot")
        self.capacity = int(capacity)
        self.world = int(world)
        self.broadcast = broadcast
        if time_limit is None:
            time_limit = DEFAULT_TIME_LIMIT if broadcast is None else BROADCAST_TIME_LIMIT
        self.planner = Planner(
            model,
            world=self.world,
            ranks_per_node=model.ranks_per_node,
            capacity=self.capacity,
            time_limit=time_limit,
            deterministic=broadcast is None,
            timing="barrier",
            **options,
        )
        self.topology = self.planner.topology
        #: The last step's plan as dyncp planned it (for metrics; see ``last_release_plan``).
        self.last_plan: StepPlan | None = None
        self._last_rounds: tuple[list[list[list[int]]], list[int], list[int]] | None = None

    @property
    def last_release_plan(self) -> StepPlan | None:
        """The last step's schedule as the release runs it (a micro-batch per sub-sample), built
        when asked: metrics and benches read it, the data path never does."""
        if self._last_rounds is None:
            return None
        rounds, ids, lengths = self._last_rounds
        return plan_from_rounds(
            _as_positions(rounds, ids), lengths, self.topology, policy="dyncp-megatron"
        )

    @classmethod
    def for_wrapper(
        cls, wrapper: Any, model: CostModel, *, broadcast: bool = False, **options: Any
    ) -> DynCPScheduler:
        """A scheduler sized from a ``HybridCPDataLoaderWrapper`` (its DP x CP group, its config's
        ``max_seqlen_per_dp_cp_rank``); ``broadcast=True``: plan once on the group's first rank
        and broadcast over that group. Checks the installed megatron-core version."""
        check_megatron_version()
        return cls(
            model,
            world=wrapper.dp_cp_group.size(),
            capacity=wrapper.config.max_seqlen_per_dp_cp_rank,
            broadcast=wrapper.dp_cp_group if broadcast else None,
            **options,
        )

    def install(self, wrapper: Any) -> Any:
        """Make ``wrapper`` (a ``HybridCPDataLoaderWrapper``) schedule with this object; returns
        it. Refuses a wrapper whose DP x CP group or capacity differs from this scheduler's."""
        check_megatron_version()
        if not hasattr(wrapper, "cp_balancing_scheduler"):
            raise TypeError(
                f"{type(wrapper).__name__} has no cp_balancing_scheduler; pass a megatron-core "
                "HybridCPDataLoaderWrapper"
            )
        size = wrapper.dp_cp_group.size()
        if size != self.world:
            raise ValueError(f"wrapper's DP x CP group has {size} ranks, scheduler {self.world}")
        self._check_capacity(wrapper.config)
        wrapper.cp_balancing_scheduler = self
        return wrapper

    def _check_capacity(self, config: Any) -> None:
        got = getattr(config, "max_seqlen_per_dp_cp_rank", self.capacity)
        if got is not None and int(got) != self.capacity:
            raise ValueError(
                f"config.max_seqlen_per_dp_cp_rank={got} but the scheduler plans for "
                f"capacity={self.capacity}; build both from the same value"
            )

    def plan(self, global_id_seqlens: Sequence[tuple[int, int]]) -> list[list[list[int]]]:
        """``sample_id_groups`` for ``(global id, length)`` pairs (the release's second return)."""
        ids = [int(i) for i, _ in global_id_seqlens]
        lengths = [int(n) for _, n in global_id_seqlens]
        too_long = [
            (i, n) for i, n in zip(ids, lengths, strict=True) if self.topology.min_cp(n) is None
        ]
        if too_long:
            i, n = too_long[0]
            raise ValueError(
                f"sample {i} has {n} tokens; no group of {self.world} ranks holds it at "
                f"max_seqlen_per_dp_cp_rank={self.capacity} ({len(too_long)} such samples)"
            )
        if self.broadcast is None:
            rounds = self._rounds(lengths, ids)
        else:
            rounds = self._broadcast_rounds(lengths, ids)
        self._last_rounds = (rounds, ids, lengths)
        return rounds

    def _rounds(self, lengths: list[int], ids: list[int]) -> list[list[list[int]]]:
        plan = self.planner.plan(lengths)
        rounds = rounds_from_plan(plan, ids)
        check_rounds(rounds, ids, self.world)
        self.last_plan = plan
        return rounds

    def _broadcast_rounds(self, lengths: list[int], ids: list[int]) -> list[list[list[int]]]:
        """The group's first rank plans; every rank gets its schedule, or its error (one line,
        raised on every rank, so that no rank waits for a schedule that never comes)."""
        import torch.distributed as dist

        group = self.broadcast
        message: list[Any] = [None]
        if dist.get_rank(group) == 0:
            try:
                message[0] = self._rounds(lengths, ids)
            except ValueError as exc:
                message[0] = str(exc)
        dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
        if isinstance(message[0], str):
            raise ValueError(message[0])
        return message[0]

    def get_groups_and_subsamples(
        self, global_id_seqlens: Sequence[tuple[int, int]], config: Any
    ) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
        """The call ``HybridCPDataLoaderWrapper.__next__`` makes. Returns (per-rank lengths per
        round, sample ids per round and rank), as ``BalancedCPScheduler`` does."""
        self._check_capacity(config)
        rounds = self.plan(global_id_seqlens)
        length = {int(i): int(n) for i, n in global_id_seqlens}
        groups = [[[length[i] for i in ids] for ids in round_] for round_ in rounds]
        return groups, rounds


def _as_positions(rounds: list[list[list[int]]], ids: Sequence[int]) -> list[list[list[int]]]:
    """``rounds`` with global ids replaced by their positions in ``ids`` (the plan's seq ids)."""
    pos = {int(i): k for k, i in enumerate(ids)}
    return [[[pos[i] for i in r] for r in round_] for round_ in rounds]
