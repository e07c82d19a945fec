"""The step plan: the contract between the planner, the cost model, the runtime and the simulator.

A plan says, for one global batch, which ranks run which sequences with which context-parallel (CP)
size, and in what order. Everything else in dyncp either produces a plan (planners), prices one
(the cost model) or executes one (the runtime), so the rules live here, once, in ``validate()``.

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

Placement (``dyncp.plan.menu``): a group of size c lies inside one NVLink domain of
``ranks_per_node`` ranks, on an aligned block counted from the domain's first rank, or spans whole
domains on a block aligned to c. With a power-of-two domain and world this is the aligned block
``[k*c, (k+1)*c)`` of earlier versions.

Plan JSON: ``schema_version`` 3 (the topology names its ``placement`` rule, ``"domain"``, and its
group sizes may be any menu the rule allows); version 2 (groups carry ``heads``, the topology the
allowed head sizes and the model's head counts) and version 1 (rings only, ``heads = 1``) are
still read, under the same placement rule -- for their power-of-two sizes on power-of-two nodes it
is the rule they were written under.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dyncp.plan.menu import (
    check_sizes,
    domain_size,
    is_placement,
    menu_sizes,
    placements,
    split_allowed,
)
from dyncp.plan.stats import PlanStats

__all__ = [
    "Topology",
    "MicroBatch",
    "Group",
    "Wave",
    "StepPlan",
    "PlanError",
    "padded_length",
    "plan_digest",
]

SCHEMA_VERSION = 3
#: Plan JSON versions ``from_dict`` reads: 1 (rings only, before head parallelism), 2 (head
#: splits, power-of-two menus) and 3 (menus shaped by the machine, named placement rule).
READABLE_VERSIONS = (1, 2, 3)
#: The placement rule of version 3 plans (the only one; see ``dyncp.plan.menu``).
PLACEMENT = "domain"


class PlanError(ValueError):
    """A plan breaks a rule of the contract.

    Attributes:
        rule: short name of the violated rule (e.g. ``"exactly-once"``, ``"capacity"``).
        ids: the offending sequence ids, ranks or group starts, as named in the message.
    """

    def __init__(self, rule: str, message: str, ids: Sequence[int] = ()) -> None:
        super().__init__(f"[{rule}] {message}")
        self.rule = rule
        self.ids = tuple(int(i) for i in ids)


def padded_length(length: int, cp: int) -> int:
    """Tokens a sequence occupies in a group of ``cp`` ranks: a multiple of 2*cp when cp > 1."""
    if cp == 1:
        return int(length)
    unit = 2 * cp
    return -(-int(length) // unit) * unit


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
    head = [SCHEMA_VERSION, t.world, t.ranks_per_node, t.capacity, len(t.group_sizes)]
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
    h = hashlib.blake2b(digest_size=8)
    try:
        for part in (head, plan.lengths, () if ids is None else ids, flat):
            h.update(np.asarray(part, dtype=np.int64).tobytes())
    except (OverflowError, TypeError, ValueError) as exc:
        raise PlanError("digest", f"the plan holds a value that is not an int64: {exc}") from None
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass(frozen=True, slots=True)
class Topology:
    """The ranks a plan schedules and what each can hold.

    Args:
        world: number of ranks on the DP x CP axis.
        ranks_per_node: ranks sharing one NVLink domain (a node, or a whole NVL72 rack);
            ``world`` is a multiple of it (whole domains) or at most it (one domain, partly
            used).
        capacity: tokens per rank one micro-batch may hold (after zigzag padding).
        group_sizes: the menu of allowed CP sizes: any sizes the placement rules of
            ``dyncp.plan.menu`` allow (inside one domain, or whole domains), e.g.
            ``menu_sizes("divisors", world=576, ranks_per_node=72)``. Default: every power of
            two dividing ``world`` that the rules allow (the sizes dyncp always used).
        head_sizes: allowed head-parallel degrees u of a group (u ranks exchange heads by
            all-to-all, ``size // u`` form the ring); 1 always included. A group of c may use u
            when u divides c and its head blocks stay inside a domain (``split_allowed``).
            Default ``(1,)``: rings only.
        query_heads, kv_heads: the model's attention heads; required (> 0) when a head size
            above 1 is allowed, since u must divide the query heads, and the KV heads must be
            divisible by u or divide it (KV heads fewer than u are replicated: rank j of a
            head group holds KV head ``j // (u // kv_heads)``). 0: not given.
        placement: the placement rule's name; ``"domain"``, the only one (``dyncp.plan.menu``).
    """

    world: int
    ranks_per_node: int
    capacity: int
    group_sizes: tuple[int, ...] = ()
    head_sizes: tuple[int, ...] = (1,)
    query_heads: int = 0
    kv_heads: int = 0
    placement: str = PLACEMENT

    def __post_init__(self) -> None:
        if self.placement != PLACEMENT:
            raise ValueError(
                f"Topology.placement {self.placement!r} unknown; the placement rule is "
                f"{PLACEMENT!r} (see dyncp.plan.menu)"
            )
        for name in ("world", "ranks_per_node", "capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive integer, got {value!r}")
        if self.world > self.ranks_per_node and self.world % self.ranks_per_node:
            raise ValueError(
                f"Topology.world={self.world} is not a whole number of nodes of "
                f"ranks_per_node={self.ranks_per_node}: give a multiple of {self.ranks_per_node} "
                "(or a single node's ranks, world <= ranks_per_node)"
            )
        if not self.group_sizes:
            sizes = menu_sizes(
                "powers-of-two", world=self.world, ranks_per_node=self.ranks_per_node
            )
        else:
            try:
                sizes = check_sizes(
                    self.group_sizes, world=self.world, ranks_per_node=self.ranks_per_node
                )
            except ValueError as exc:
                raise ValueError(f"Topology.group_sizes: {exc}") from None
        object.__setattr__(self, "group_sizes", sizes)
        self._check_heads()

    def _check_heads(self) -> None:
        for name in ("query_heads", "kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Topology.{name} must be an integer >= 0, got {value!r}")
        heads = tuple(sorted({1, *(int(u) for u in self.head_sizes)}))
        bad = [u for u in heads if u < 1 or u > self.max_group_size]
        if bad:
            raise ValueError(
                f"Topology.head_sizes {bad} not allowed: each must be in [1, largest group size "
                f"{self.max_group_size}]"
            )
        object.__setattr__(self, "head_sizes", heads)
        unused = [u for u in heads if not any(u in self.splits(c) for c in self.group_sizes)]
        if unused:
            raise ValueError(
                f"Topology.head_sizes {unused} split no allowed group: a group of c ranks may "
                "split u ways when u divides c and each head block of u ranks stays inside one "
                f"domain of {self.domain} ranks or spans whole domains (group sizes "
                f"{list(self.group_sizes)})"
            )
        if heads == (1,):
            return
        q, kv = self.query_heads, self.kv_heads
        if q < 1 or kv < 1:
            raise ValueError(
                f"Topology.head_sizes {list(heads)} split heads, so query_heads and kv_heads "
                f"must be given (> 0); got query_heads={q}, kv_heads={kv}"
            )
        if q % kv:
            raise ValueError(f"Topology.kv_heads={kv} must divide query_heads={q}")
        wrong = [u for u in heads if q % u or (kv % u and u % kv)]
        if wrong:
            raise ValueError(
                f"Topology.head_sizes {wrong} do not fit the heads: each u must divide "
                f"query_heads={q}, and kv_heads={kv} must be divisible by u or divide it"
            )

    @property
    def max_group_size(self) -> int:
        return self.group_sizes[-1]

    @property
    def domain(self) -> int:
        """Ranks of one NVLink domain on this axis (``min(ranks_per_node, world)``)."""
        return domain_size(self.world, self.ranks_per_node)

    def placements(self, size: int) -> tuple[int, ...]:
        """First ranks of the blocks a group of ``size`` may occupy (``dyncp.plan.menu``)."""
        return placements(size, world=self.world, ranks_per_node=self.ranks_per_node)

    def is_placement(self, start: int, size: int) -> bool:
        """Whether ``[start, start + size)`` is a block the rules allow for an allowed size."""
        return size in self.group_sizes and is_placement(
            start, size, world=self.world, ranks_per_node=self.ranks_per_node
        )

    def memory_tokens(self, lengths: Sequence[int], cp: int) -> int:
        """Tokens per rank of a micro-batch of ``lengths`` at CP size ``cp`` (padding included)."""
        total = sum(padded_length(s, cp) for s in lengths)
        return -(-total // cp)

    def fits(self, lengths: Sequence[int], cp: int) -> bool:
        return self.memory_tokens(lengths, cp) <= self.capacity

    def min_cp(self, length: int) -> int | None:
        """Smallest allowed CP size that can hold ``length`` alone, or None if none can."""
        for cp in self.group_sizes:
            if padded_length(length, cp) <= cp * self.capacity:
                return cp
        return None

    def max_length(self) -> int:
        """Longest sequence any allowed group can hold (0 if none holds even one token)."""
        return max(
            cp * self.capacity // (2 * cp) * 2 * cp if cp > 1 else self.capacity
            for cp in self.group_sizes
        )

    def splits(self, size: int) -> tuple[int, ...]:
        """Head-parallel degrees u a group of ``size`` ranks may use (u divides size)."""
        return tuple(
            u
            for u in self.head_sizes
            if split_allowed(size, u, world=self.world, ranks_per_node=self.ranks_per_node)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "world": self.world,
            "ranks_per_node": self.ranks_per_node,
            "capacity": self.capacity,
            "group_sizes": list(self.group_sizes),
            "head_sizes": list(self.head_sizes),
            "query_heads": self.query_heads,
            "kv_heads": self.kv_heads,
            "placement": self.placement,
        }


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
    """

    topology: Topology
    lengths: tuple[int, ...]
    waves: tuple[Wave, ...]
    policy: str = ""
    sample_ids: tuple[int, ...] | None = None
    stats: PlanStats = field(default_factory=PlanStats)

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
        }

    @classmethod
    def from_dict(cls, data: Any) -> StepPlan:
        """Decode a plan dict; any value gives a StepPlan or a PlanError (rule ``"decode"``).

        Plans travel through a Store other processes can write, so nothing about ``data`` is
        trusted: every field's type is checked, integers must lie in ``[0, 2**63)`` and the
        document may nest at most ``MAX_JSON_DEPTH`` levels. ``validate()`` is not called.
        """
        if not isinstance(data, dict):
            raise PlanError("decode", f"plan JSON must be an object, got {_kind(data)}")
        version = data.get("schema_version")
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise PlanError(
                "decode",
                f"plan schema_version {version!r} not supported (readable: "
                f"{', '.join(map(str, READABLE_VERSIONS))})",
            )
        if _depth(data) > MAX_JSON_DEPTH:
            raise PlanError("decode", f"plan JSON nests deeper than {MAX_JSON_DEPTH} levels")
        t = _field(data, "topology", dict, "plan")
        if version >= 3 and t.get("placement") != PLACEMENT:
            raise PlanError(
                "decode",
                f"plan topology placement {t.get('placement')!r} not supported (readable: "
                f"{PLACEMENT!r})",
            )
        try:
            topo = Topology(
                _int(_field(t, "world", int, "topology"), "topology.world"),
                _int(_field(t, "ranks_per_node", int, "topology"), "topology.ranks_per_node"),
                _int(_field(t, "capacity", int, "topology"), "topology.capacity"),
                tuple(
                    _int(c, "topology.group_sizes[]")
                    for c in _list(t.get("group_sizes", []), "topology.group_sizes")
                ),
                *_head_fields(t, version),
            )
        except PlanError:
            raise
        except ValueError as exc:
            raise PlanError("decode", str(exc)) from None
        waves = tuple(
            Wave(tuple(_group(g, w, version) for g in _list(wave, f"waves[{w}]")))
            for w, wave in enumerate(_list(_field(data, "waves", list, "plan"), "waves"))
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
            lengths=tuple(
                _int(s, "lengths[]")
                for s in _list(_field(data, "lengths", list, "plan"), "lengths")
            ),
            waves=waves,
            policy=policy,
            sample_ids=None
            if sample_ids is None
            else tuple(_int(i, "sample_ids[]") for i in _list(sample_ids, "sample_ids")),
            stats=PlanStats(stats),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> StepPlan:
        """Decode plan JSON; any text or bytes give a StepPlan or a PlanError (rule "decode")."""
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError, TypeError) as exc:
            # ValueError covers bad JSON, bad UTF-8 and integers longer than Python parses.
            raise PlanError("decode", f"plan is not valid JSON: {_short(exc)}") from None
        return cls.from_dict(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


# --------------------------------------------------------------------------------- decoding helpers

#: Deepest nesting a plan document may have (a valid plan nests 5 levels; stats a few more).
MAX_JSON_DEPTH = 32
_INT_LIMIT = 2**63


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a plan may hold")


def _depth(value: object) -> int:
    """Nesting depth of a decoded JSON value (iterative: no recursion limit to hit)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            if level > MAX_JSON_DEPTH:
                return level
            todo.extend((v, level + 1) for v in item if isinstance(v, (dict, list)))
    return deepest


def _field(obj: dict, key: str, kind: type, where: str) -> Any:
    if key not in obj:
        raise PlanError("decode", f"plan JSON is missing field {key!r} (in {where})")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise PlanError(
            "decode", f"{where} field {key!r} must be {kind.__name__}, got {_kind(value)}"
        )
    return value


def _list(value: object, where: str) -> list:
    if not isinstance(value, list):
        raise PlanError("decode", f"plan field {where} must be a list, got {_kind(value)}")
    return value


def _int(value: object, where: str) -> int:
    if type(value) is not int or not 0 <= value < _INT_LIMIT:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise PlanError(
            "decode", f"plan field {where} must be an integer in [0, 2**63), got {shown}"
        )
    return value


def _head_fields(t: dict, version: int) -> tuple[tuple[int, ...], int, int]:
    """Topology head fields: absent from version 1 plans (rings only)."""
    if version == 1:
        return (1,), 0, 0
    return (
        tuple(
            _int(u, "topology.head_sizes[]")
            for u in _list(_field(t, "head_sizes", list, "topology"), "topology.head_sizes")
        ),
        _int(_field(t, "query_heads", int, "topology"), "topology.query_heads"),
        _int(_field(t, "kv_heads", int, "topology"), "topology.kv_heads"),
    )


def _group(g: object, w: int, version: int) -> Group:
    where = f"waves[{w}][]"
    if not isinstance(g, dict):
        raise PlanError("decode", f"plan field {where} must be an object, got {_kind(g)}")
    heads = 1 if version == 1 else _int(_field(g, "heads", int, "group"), f"{where}.heads")
    return Group(
        _int(_field(g, "start", int, "group"), f"{where}.start"),
        _int(_field(g, "size", int, "group"), f"{where}.size"),
        tuple(
            MicroBatch(tuple(_int(i, f"{where}.microbatches[][]") for i in _list(mb, where)))
            for mb in _list(_field(g, "microbatches", list, "group"), f"{where}.microbatches")
        ),
        heads,
    )
