"""The step plan: the contract between the planner, the cost model, the runtime and the simulator.

A plan says, for one global batch, which ranks run which sequences with which context-parallel (CP)
size, and in what order. Everything else in dyncp either produces a plan (planners), prices one
(the cost model) or executes one (the runtime), so the rules live here, once, in ``validate()``.
The machine's side of the rules (allowed sizes, placement, memory) is ``dyncp.plan.topology``, the
padding rule ``dyncp.plan.padding``, the hardened JSON decoding ``dyncp.plan.codec``.

Vocabulary (see DESIGN.md)::

    rank        one position on the data-parallel x context-parallel axis, 0 .. world-1
    group       a block of ranks [start, start + size) the placement rules allow (see
                ``dyncp.plan.menu``); size = CP size; split into
                heads (u ranks exchanging heads by all-to-all) x ring (size / u ranks in a ring)
    micro-batch the packed sequences one group runs in one forward+backward
    wave        groups that run concurrently; groups within a wave are disjoint, and group
                membership changes only between waves (each rank runs its groups in wave
                order; the runtime has no barrier between waves: a group starts when its
                members are free)
    step plan   waves covering the global batch: every sequence exactly once

Memory: each sequence is zigzag-split into 2c chunks over a group of c ranks, so it is padded to a
multiple of 2c (c > 1; a size-1 group needs no padding). A micro-batch fits when its padded tokens
divided by c are at most ``capacity`` tokens per rank. The head split does not change this: every
rank of a group holds the same zigzag shard whatever u is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dyncp.plan.codec import (
    SCHEMA_VERSION,
    check_document,
    decode_ints,
    decode_pipeline,
    decode_topology,
    decode_waves,
    loads,
    require,
)
from dyncp.plan.codec import kind as _kind
from dyncp.plan.errors import PlanError
from dyncp.plan.pipeline import Pipeline
from dyncp.plan.stats import PlanStats
from dyncp.plan.topology import Topology

__all__ = [
    "MicroBatch",
    "Group",
    "Wave",
    "StepPlan",
    "plan_digest",
]


#: The version the digest hashes first: the schema version digests were defined under. Plan JSON's
#: version 4 added only ``pipeline``, which the digest appends when set, so a plan without one
#: keeps its digest across the two versions.
DIGEST_VERSION = 3


def plan_digest(plan: StepPlan) -> int:
    """64-bit signed digest of what a plan executes (topology, batch, waves; not stats).

    Every rank computes it every step, so it hashes the plan's integers as int64 arrays rather
    than its JSON (7x faster on a 32,768-sequence plan); each list is preceded by its length, so
    two different plans never hash the same bytes.

    Raises:
        PlanError: an integer of the plan does not fit in int64.
    """
    t = plan.topology
    ids = plan.sample_ids
    head = [DIGEST_VERSION, t.world, t.ranks_per_node, t.capacity, len(t.group_sizes)]
    head += [*t.group_sizes, len(t.head_sizes), *t.head_sizes, t.query_heads, t.kv_heads]
    head += [len(plan.lengths), -1 if ids is None else len(ids), len(plan.waves)]
    flat: list[int] = []
    for wave in plan.waves:
        flat.append(len(wave.groups))
        for g in wave.groups:
            flat += (g.start, g.size, g.heads, len(g.microbatches))
            for mb in g.microbatches:
                flat.append(len(mb.seq_ids))
                flat += mb.seq_ids
    if plan.pipeline is not None:  # appended only when set: an unpipelined plan hashes as before
        flat += (-2, plan.pipeline.stages, plan.pipeline.virtual)
    h = hashlib.blake2b(digest_size=8)
    try:
        for part in (head, plan.lengths, () if ids is None else ids, flat):
            h.update(np.asarray(part, dtype=np.int64).tobytes())
    except (OverflowError, TypeError, ValueError) as exc:
        raise PlanError("digest", f"the plan holds a value that is not an int64: {exc}") from None
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Sequence ids (indices into ``StepPlan.lengths``) packed into one forward+backward."""

    seq_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Group:
    """Ranks ``[start, start + size)`` running ``microbatches`` one after another at CP = size.

    ``heads`` = u splits the group into u x r (``ring`` = size // u): position
    ``start + i*u + j`` is ring index i and head index j; the u contiguous ranks of ring index i
    exchange heads by all-to-all, the r ranks of head index j (stride u) form a ring. u = 1 is a
    plain ring, u = size all-to-all only. Every rank holds the same tokens whatever u is (the
    zigzag at CP = size), so memory does not depend on the split.
    """

    start: int
    size: int
    microbatches: tuple[MicroBatch, ...]
    heads: int = 1

    @property
    def ranks(self) -> range:
        return range(self.start, self.start + self.size)

    @property
    def ring(self) -> int:
        """Ranks in each ring of the group (size // heads)."""
        return self.size // self.heads

    @property
    def layout_name(self) -> str:
        """``"ring8"``, ``"a2a8"`` or ``"a2a2xring4"``: the split as reports and Gantts show it."""
        if self.heads == 1:
            return f"ring{self.size}"
        if self.heads == self.size:
            return f"a2a{self.size}"
        return f"a2a{self.heads}xring{self.ring}"


@dataclass(frozen=True, slots=True)
class Wave:
    """Disjoint groups running concurrently; each rank's next wave starts when its group here is
    done (no barrier across the wave)."""

    groups: tuple[Group, ...]


@dataclass(slots=True)
class StepPlan:
    """One global batch: its sequence lengths, the topology and the waves that cover it.

    ``stats`` carries what produced the plan (policy, solver status, timings, predicted seconds,
    lower bound), a ``PlanStats`` (``dyncp.plan.stats``; a dict given is taken as one); it is
    informational and not part of the rules.
    ``sample_ids`` optionally maps each sequence id to the caller's sample index (dataset row).
    ``pipeline``: the plan runs over pipeline stages (``dyncp.plan.pipeline``); its waves are then
    slots, each group holding exactly one micro-batch, in the order every column runs them.
    """

    topology: Topology
    lengths: tuple[int, ...]
    waves: tuple[Wave, ...]
    policy: str = ""
    sample_ids: tuple[int, ...] | None = None
    stats: PlanStats = field(default_factory=PlanStats)
    pipeline: Pipeline | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "stats" and type(value) is not PlanStats:
            value = PlanStats(value)
        object.__setattr__(self, name, value)

    # ----------------------------------------------------------------------------- traversal
    def microbatches(self) -> Iterator[tuple[int, Group, MicroBatch]]:
        """Yield (wave index, group, micro-batch) in execution order."""
        for w, wave in enumerate(self.waves):
            for group in wave.groups:
                for mb in group.microbatches:
                    yield w, group, mb

    def cp_of_sequences(self) -> dict[int, int]:
        """CP size each sequence runs at."""
        return {i: g.size for _, g, mb in self.microbatches() for i in mb.seq_ids}

    # ----------------------------------------------------------------------------- rules
    def validate(self) -> None:
        """Check every invariant of the contract; raise PlanError naming the first broken rule."""
        n = len(self.lengths)
        bad_len = [i for i, s in enumerate(self.lengths) if int(s) < 1]
        if bad_len:
            raise PlanError("lengths", f"sequence lengths must be >= 1; ids {bad_len}", bad_len)
        if self.sample_ids is not None and len(self.sample_ids) != n:
            raise PlanError(
                "sample-ids", f"{len(self.sample_ids)} sample ids for {n} sequences", ()
            )
        if not self.waves and n:
            raise PlanError("exactly-once", f"no waves but {n} sequences", range(n))
        seen: dict[int, int] = {}
        dup: list[int] = []
        unknown: list[int] = []
        for w, wave in enumerate(self.waves):
            if not wave.groups:
                raise PlanError("empty-wave", f"wave {w} has no groups", (w,))
            used: dict[int, int] = {}
            for group in wave.groups:
                self._check_group(w, group, used)
                for m, mb in enumerate(group.microbatches):
                    self._check_microbatch(w, group, m, mb)
                    for i in mb.seq_ids:
                        if not 0 <= i < n:
                            unknown.append(i)
                        elif i in seen:
                            dup.append(i)
                        else:
                            seen[i] = group.size
        if unknown:
            raise PlanError(
                "exactly-once",
                f"unknown sequence ids {sorted(unknown)} (valid: 0..{n - 1})",
                sorted(unknown),
            )
        if dup:
            raise PlanError(
                "exactly-once", f"sequences scheduled twice: {sorted(dup)}", sorted(dup)
            )
        missing = [] if len(seen) == n else [i for i in range(n) if i not in seen]
        if missing:
            raise PlanError("exactly-once", f"sequences never scheduled: {missing}", missing)
        if self.pipeline is not None:
            self._check_pipeline(self.pipeline)

    def _check_pipeline(self, pipeline: Pipeline) -> None:
        """A pipelined plan's waves are slots: one micro-batch per group, a count the schedule
        allows (``dyncp.plan.pipeline``)."""
        if not isinstance(pipeline, Pipeline):
            raise PlanError(
                "pipeline",
                f"plan pipeline must be a Pipeline or None, got {type(pipeline).__name__}",
            )
        for w, wave in enumerate(self.waves):
            for group in wave.groups:
                if len(group.microbatches) != 1:
                    raise PlanError(
                        "pipeline-slot",
                        f"slot {w}: group at rank {group.start} holds {len(group.microbatches)} "
                        f"micro-batches; in a pipelined plan every group of a slot holds exactly "
                        f"one (a column outside every group is idle in that slot)",
                        (group.start,),
                    )
        pipeline.check_slots(len(self.waves))

    def _check_group(self, w: int, group: Group, used: dict[int, int]) -> None:
        topo = self.topology
        if group.size not in topo.group_sizes:
            raise PlanError(
                "group-size",
                f"wave {w}: group at rank {group.start} has size {group.size}; "
                f"allowed sizes are {list(topo.group_sizes)}",
                (group.start,),
            )
        if not topo.is_placement(group.start, group.size):
            starts = topo.placements(group.size)
            shown = ", ".join(map(str, starts[:8])) + (", ..." if len(starts) > 8 else "")
            raise PlanError(
                "group-alignment",
                f"wave {w}: group of size {group.size} starts at rank {group.start}; groups of "
                f"{group.size} may start at ranks {shown} (inside one domain of {topo.domain} "
                f"ranks, or on whole domains; world {topo.world})",
                (group.start,),
            )
        clash = [r for r in group.ranks if r in used]
        if clash:
            raise PlanError(
                "wave-disjoint",
                f"wave {w}: ranks {clash} are in both the group at {used[clash[0]]} and the group "
                f"at {group.start}",
                clash,
            )
        if group.heads not in topo.splits(group.size):
            raise PlanError(
                "head-split",
                f"wave {w}: group at rank {group.start} (size {group.size}) splits heads "
                f"{group.heads} ways; allowed head sizes dividing {group.size} are "
                f"{list(topo.splits(group.size))}",
                (group.start,),
            )
        for r in group.ranks:
            used[r] = group.start
        if not group.microbatches:
            raise PlanError(
                "empty-group",
                f"wave {w}: group at rank {group.start} has no micro-batches",
                (group.start,),
            )

    def _check_microbatch(self, w: int, group: Group, m: int, mb: MicroBatch) -> None:
        topo = self.topology
        where = f"wave {w}, group at rank {group.start} (cp={group.size}), micro-batch {m}"
        if not mb.seq_ids:
            raise PlanError("empty-microbatch", f"{where} is empty", ())
        valid = [i for i in mb.seq_ids if 0 <= i < len(self.lengths)]
        lengths = [self.lengths[i] for i in valid]
        if topo.memory_tokens(lengths, group.size) <= topo.capacity:
            # Within capacity, each sequence alone fits this group, whose size is allowed
            # (_check_group), so none needs a larger one: the min-cp check below cannot fail.
            return
        too_small = [
            i
            for i, s in zip(valid, lengths)
            if (need := topo.min_cp(s)) is None or need > group.size
        ]
        if too_small:
            needs = {i: topo.min_cp(self.lengths[i]) for i in too_small}
            raise PlanError(
                "min-cp",
                f"{where}: sequences {too_small} need CP sizes {needs} (None: no allowed size "
                f"holds them at capacity {topo.capacity})",
                too_small,
            )
        tokens = topo.memory_tokens(lengths, group.size)
        if tokens > topo.capacity:
            raise PlanError(
                "capacity",
                f"{where}: {tokens} padded tokens per rank exceed capacity {topo.capacity} "
                f"(sequences {list(mb.seq_ids)})",
                mb.seq_ids,
            )

    # ----------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "topology": self.topology.to_dict(),
            "policy": self.policy,
            "lengths": [int(s) for s in self.lengths],
            "sample_ids": None if self.sample_ids is None else [int(i) for i in self.sample_ids],
            "waves": [
                [
                    {
                        "start": g.start,
                        "size": g.size,
                        "heads": g.heads,
                        "microbatches": [[int(i) for i in mb.seq_ids] for mb in g.microbatches],
                    }
                    for g in wave.groups
                ]
                for wave in self.waves
            ],
            "stats": self.stats,
            **({} if self.pipeline is None else {"pipeline": self.pipeline.to_dict()}),
        }

    @classmethod
    def from_dict(cls, data: Any) -> StepPlan:
        """Decode a plan dict; any value gives a StepPlan or a PlanError (rule ``"decode"``).

        Plans travel through a Store other processes can write, so nothing about ``data`` is
        trusted: every field's type is checked, integers must lie in ``[0, 2**63)`` and the
        document may nest at most ``MAX_JSON_DEPTH`` levels (``dyncp.plan.codec``).
        ``validate()`` is not called.
        """
        version = check_document(data)
        topo = decode_topology(data, version)
        waves = tuple(
            Wave(
                tuple(
                    Group(start, size, tuple(MicroBatch(ids) for ids in mbs), heads)
                    for start, size, heads, mbs in wave
                )
            )
            for wave in decode_waves(data, version)
        )
        sample_ids = data.get("sample_ids")
        policy = data.get("policy", "")
        if not isinstance(policy, str):
            raise PlanError("decode", f"plan field 'policy' must be a string, got {_kind(policy)}")
        stats = data.get("stats", {})
        if not isinstance(stats, dict):
            raise PlanError("decode", f"plan field 'stats' must be an object, got {_kind(stats)}")
        return cls(
            topology=topo,
            lengths=decode_ints(require(data, "lengths", list, "plan"), "lengths"),
            waves=waves,
            policy=policy,
            sample_ids=None if sample_ids is None else decode_ints(sample_ids, "sample_ids"),
            stats=PlanStats(stats),
            pipeline=decode_pipeline(data, version),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> StepPlan:
        """Decode plan JSON; any text or bytes give a StepPlan or a PlanError (rule "decode")."""
        return cls.from_dict(loads(text))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)
