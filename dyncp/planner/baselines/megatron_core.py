"""megatron-core's dynamic-CP schedule format, read as a StepPlan and written from one; torch-free.

megatron-core 0.16.1's ``HybridCPDataLoaderWrapper`` asks its scheduler for
``sample_id_groups[round][dp_cp_rank] -> [global sample ids]`` and
``hybrid_context_parallel_forward_backward`` runs it: each listed id is its own forward+backward
(a sub-sample), the ranks listing an id are its CP group, and a barrier over all DP x CP ranks
ends every round. This module is the one translation between that format and dyncp's plan
contract, shared by the adapter (``dyncp.integrations.megatron``: dyncp's plan in the release's
format) and the ``megatron-core`` baseline (the released ``BalancedCPScheduler``'s output priced
as the release runs it). Why one module: both sides must be priced the same way, or a comparison
of the two says nothing.

- ``plan_from_rounds``: one wave per round, one micro-batch per sub-sample (the release never
  packs), groups = the ranks holding an id. The plan is not validated: the release may exceed
  ``capacity``, which ``overflow`` reports instead of hiding.
- ``rounds_from_plan``: each wave a round; a group's micro-batches become consecutive
  sub-samples listed identically by every member; the last round is made to reach every rank,
  as the release's schedule requires (it runs the last sub-sample of the last round outside the
  no-sync context on every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave, padded_length

__all__ = [
    "Overflow",
    "Rounds",
    "check_rounds",
    "overflow",
    "plan_from_rounds",
    "rounds_from_plan",
]

#: ``rounds[round][rank]``: the global sample ids a DP x CP rank runs in that round, in order.
Rounds = list[list[list[int]]]


@dataclass(frozen=True, slots=True)
class Overflow:
    """Sub-samples whose tokens per rank exceed ``capacity`` (on a GPU: out of memory).

    ``count`` of ``total`` sub-samples; ``max_ratio``: the largest tokens-per-rank / capacity,
    over the rank-rounds; a rank-round holds several sub-samples one after another, so the peak
    is one sub-sample's (the release frees activations between forward+backward passes).
    ``rank_round_tokens_ratio``: the largest summed tokens a rank holds in one round / capacity,
    which is what a packed micro-batch of the same round would need.
    """

    count: int
    total: int
    max_ratio: float
    rank_round_tokens_ratio: float


def _blocks(round_: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """Each id of one round -> the ranks listing it, in rank order."""
    holders: dict[int, list[int]] = {}
    for rank, ids in enumerate(round_):
        for i in ids:
            holders.setdefault(int(i), []).append(rank)
    return holders


def check_rounds(rounds: Rounds, ids: Sequence[int], world: int, *, aligned: bool = True) -> None:
    """Raise ValueError (one line) unless ``rounds`` is a schedule megatron-core runs correctly:
    ``world`` ranks per round, every id of ``ids`` exactly once, each id's ranks a contiguous
    power-of-two block (aligned to its size when ``aligned``), the members of a block listing
    their ids in the same order, and an id on every rank in the last round."""
    if not rounds:
        raise ValueError("megatron-core schedule: no rounds (it needs at least one)")
    seen: dict[int, int] = {}
    for j, round_ in enumerate(rounds):
        if len(round_) != world:
            raise ValueError(
                f"megatron-core schedule: round {j} lists {len(round_)} ranks, not {world}"
            )
        for i, ranks in _blocks(round_).items():
            if i in seen:
                raise ValueError(f"megatron-core schedule: id {i} in rounds {seen[i]} and {j}")
            seen[i] = j
            c, s = len(ranks), ranks[0]
            if ranks != list(range(s, s + c)) or c & (c - 1) or (aligned and s % c):
                raise ValueError(
                    f"megatron-core schedule: id {i} in round {j} on ranks {ranks}, not an "
                    f"{'aligned ' if aligned else ''}power-of-two block"
                )
            lists = {tuple(round_[r]) for r in ranks}
            if len(lists) > 1:
                raise ValueError(
                    f"megatron-core schedule: ranks {ranks} of round {j} list different ids"
                )
    missing = sorted(set(int(i) for i in ids) - set(seen))
    extra = sorted(set(seen) - set(int(i) for i in ids))
    if missing or extra:
        raise ValueError(f"megatron-core schedule: ids missing {missing[:5]}, unknown {extra[:5]}")
    idle = [r for r, got in enumerate(rounds[-1]) if not got]
    if idle:
        raise ValueError(f"megatron-core schedule: ranks {idle[:8]} have no id in the last round")


def plan_from_rounds(
    rounds: Rounds,
    lengths: Sequence[int],
    topology: Topology,
    *,
    policy: str = "megatron-core",
) -> StepPlan:
    """The StepPlan the release runs for ``rounds`` (ids index ``lengths``): a wave per round, a
    group per block of ranks sharing ids, one micro-batch per sub-sample in the members' order.
    Not validated (an overflowing plan is still priced; see ``overflow``)."""
    waves = []
    for j, round_ in enumerate(rounds):
        groups: dict[tuple[int, int], list[int]] = {}
        for i, ranks in _blocks(round_).items():
            key = (ranks[0], len(ranks))
            if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
                raise ValueError(f"megatron-core schedule: id {i} on non-contiguous ranks {ranks}")
            groups.setdefault(key, []).append(i)
        wave = []
        for (start, size), members in sorted(groups.items()):
            held = set(members)
            order = [i for i in round_[start] if i in held]
            wave.append(Group(start, size, tuple(MicroBatch((i,)) for i in order)))
        if wave:
            waves.append(Wave(tuple(wave)))
        elif j == len(rounds) - 1:
            raise ValueError("megatron-core schedule: the last round is empty")
    return StepPlan(topology, tuple(int(x) for x in lengths), tuple(waves), policy=policy)


def overflow(plan: StepPlan) -> Overflow:
    """How often and by how much ``plan``'s sub-samples exceed the topology's capacity."""
    cap = plan.topology.capacity
    count = total = 0
    worst = packed = 0.0
    for wave in plan.waves:
        for g in wave.groups:
            per_rank = [
                padded_length(plan.lengths[i], g.size) / g.size
                for mb in g.microbatches
                for i in mb.seq_ids
            ]
            total += len(per_rank)
            count += sum(t > cap for t in per_rank)
            worst = max(worst, max(per_rank, default=0.0) / cap)
            packed = max(packed, sum(per_rank) / cap)
    return Overflow(count, total, worst, packed)


def rounds_from_plan(plan: StepPlan, ids: Sequence[int]) -> Rounds:
    """``plan`` in the release's format: ``ids[seq]`` is each sequence's global sample id.

    A wave leaving ranks idle is no problem in any round but the last, where every rank must run
    a sub-sample. So a wave that reaches every rank is moved last (under a barrier per round the
    order of rounds does not change the step); when none does, a group of the last wave whose
    aligned buddy block is idle doubles into it (more CP, less memory per rank) until every rank
    is reached. Raises ValueError (one line) when neither works.
    """
    world = plan.topology.world
    waves = [w for w in plan.waves if w.groups]

    def covered(wave: Wave) -> int:
        return sum(g.size for g in wave.groups)

    full = [k for k, w in enumerate(waves) if covered(w) == world]
    if full and full[-1] != len(waves) - 1:
        waves.append(waves.pop(full[-1]))
    elif not full:
        waves[-1] = _grow_into_idle(waves[-1], world)
    rounds: Rounds = []
    for wave in waves:
        round_: list[list[int]] = [[] for _ in range(world)]
        for g in wave.groups:
            listed = [int(ids[i]) for mb in g.microbatches for i in mb.seq_ids]
            for r in g.ranks:
                round_[r] = list(listed)
        rounds.append(round_)
    return rounds


def _grow_into_idle(wave: Wave, world: int) -> Wave:
    """``wave`` with groups doubled into idle aligned buddy blocks until every rank is busy."""
    groups = sorted(wave.groups, key=lambda g: g.start)
    while sum(g.size for g in groups) < world:
        busy = {r for g in groups for r in g.ranks}
        for k, g in enumerate(groups):
            size = 2 * g.size
            start = g.start - g.start % size
            if size > world:
                continue
            buddy = set(range(start, start + size)) - set(g.ranks)
            if not buddy & busy:
                groups[k] = Group(start, size, g.microbatches)
                break
        else:
            raise ValueError(
                "megatron-core needs a sub-sample on every rank in the last round, and the "
                f"plan's last round reaches {len(busy)} of {world} ranks with no idle block to "
                "grow into; give each global batch at least as many sequences as ranks"
            )
    return Wave(tuple(groups))
