"""Per-rank plan slices: a rank reads what it runs, plus a small header that commits to the plan.

At 16,384 ranks a whole plan is megabytes of JSON, and every rank decoding, hashing and checking
all of it costs seconds per step. A rank needs only its own groups (the waves it runs in, their
micro-batches, the lengths and dataset rows of their sequences) and three numbers of the whole
batch (sequences, label tokens, waves). So the plan's maker cuts it into one slice per rank and
commits to all of them in a Merkle tree:

    header   topology, waves, sequences, label tokens, the policy, and the tree's 12-byte root
             (signed at the step's key like a plan: ``dyncp.control.signing``)
    slice p  proof (depth x 12 bytes: the siblings from leaf p up) + compact JSON of what
             position p runs; depth = ceil(log2 world)

A rank checks its slice against the header's root (depth hashes) and takes part in the per-step
agreement with the root's first 8 bytes as its digest: equal roots on every rank and a verified
slice on each mean every rank runs its part of the same whole plan, without any rank reading it.
The whole plan is validated once, by its maker, before it is cut. Hashes: BLAKE2b with 12-byte
digests (``HASH_BYTES``); leaves, inner nodes and padding are domain-separated, and a leaf
hashes its position, so a slice cannot be replayed at another position.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dyncp.plan.codec import SCHEMA_VERSION
from dyncp.plan.contract import Group, MicroBatch, StepPlan, Wave
from dyncp.plan.errors import PlanError
from dyncp.plan.topology import Topology

__all__ = [
    "HASH_BYTES",
    "PlanSlice",
    "SliceHeader",
    "SliceUnavailable",
    "check_slice_header",
    "is_header",
    "open_slice",
    "own_slice",
    "slice_plan",
]

SLICE_VERSION = 1
#: 96-bit nodes: finding another slice with the same path is a second preimage (2**96 work);
#: the maker, who could look for collisions, is trusted (it signs the header). Shorter proofs
#: keep all slices together within 2x the plan's JSON at 16,384 ranks.
HASH_BYTES = 12
_LEAF, _NODE, _EMPTY = b"dyncp-slice-leaf\0", b"dyncp-slice-node\0", b"dyncp-slice-empty"
_HEADER_TAG = b'{"dyncp_slices":'
#: Largest slice a reader decodes (a rank of a 131,072-sequence plan holds ~13 KB at most).
MAX_SLICE_BYTES = 16 << 20


def _h(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"".join(parts), digest_size=HASH_BYTES).digest()


def _depth(world: int) -> int:
    return max(0, (world - 1).bit_length())


def is_header(body: bytes) -> bool:
    """Whether a record body at a step key is a slice header (not plan JSON or a fallback)."""
    return body.startswith(_HEADER_TAG)


@dataclass(frozen=True, slots=True)
class SliceHeader:
    """What every rank reads of a sliced plan: the batch's totals and the slices' root."""

    topology: Topology
    waves: int
    sequences: int
    labels: int  # label tokens of the global batch (sum of length - 1)
    root: bytes
    policy: str = ""

    @property
    def digest(self) -> int:
        """The plan's 64-bit signed digest for the per-step agreement (the root's first bytes)."""
        return int.from_bytes(self.root[:8], "little", signed=True)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "dyncp_slices": SLICE_VERSION,
                "labels": self.labels,
                "policy": self.policy,
                "root": self.root.hex(),
                "sequences": self.sequences,
                "topology": self.topology.to_dict(),
                "waves": self.waves,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> SliceHeader:
        """Decode a header; any bytes give a SliceHeader or a PlanError (rule ``"decode"``)."""
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise PlanError("decode", f"slice header is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("dyncp_slices") != SLICE_VERSION:
            raise PlanError("decode", f"slice header version not supported ({SLICE_VERSION})")
        root = data.get("root")
        if not isinstance(root, str) or len(root) != 2 * HASH_BYTES:
            raise PlanError("decode", f"slice header root must be {2 * HASH_BYTES} hex digits")
        try:
            root_bytes = bytes.fromhex(root)
        except ValueError:
            raise PlanError("decode", "slice header root must be hex digits") from None
        # The topology decodes exactly as a plan's does (an empty plan around it).
        empty = {"schema_version": SCHEMA_VERSION, "topology": data.get("topology")}
        empty.update(lengths=[], waves=[])
        topology = StepPlan.from_dict(empty).topology
        policy = data.get("policy", "")
        numbers = [data.get(k) for k in ("waves", "sequences", "labels")]
        if not all(type(v) is int and 0 <= v < 2**63 for v in numbers) or not isinstance(
            policy, str
        ):
            raise PlanError("decode", "slice header waves/sequences/labels must be integers >= 0")
        return cls(topology, *numbers, root_bytes, policy)


@dataclass(frozen=True, slots=True)
class PlanSlice:
    """What one rank runs of a plan, checked against its header.

    It reads like the parts of a :class:`~dyncp.plan.StepPlan` the runtime and the sampler use
    for one rank: ``waves`` holds every wave with only this rank's group (or none), ``lengths``
    and ``sample_ids`` map the sequence ids of those groups to their lengths and dataset rows.
    """

    header: SliceHeader
    position: int
    waves: tuple[Wave, ...]
    lengths: Mapping[int, int]
    sample_ids: Mapping[int, int]
    record: bytes  # as published (proof + content): what a resumed sampler re-checks

    @property
    def topology(self) -> Topology:
        return self.header.topology

    @property
    def digest(self) -> int:
        return self.header.digest

    def to_json(self) -> str:
        """The slice as text (for a sampler's mid-step state)."""
        return json.dumps(
            {
                "header": self.header.to_json().decode(),
                "position": self.position,
                "record": base64.b64encode(self.record).decode(),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> PlanSlice:
        data = json.loads(text)
        header = SliceHeader.from_json(data["header"].encode())
        return open_slice(header, base64.b64decode(data["record"]), int(data["position"]))


def _content(plan: StepPlan, groups: list[tuple[int, Group]]) -> bytes:
    """``[[wave, start, size, heads, [[[seq, length, row], ...] per micro-batch]], ...]``."""
    ids, lengths = plan.sample_ids, plan.lengths
    return json.dumps(
        [
            [
                w,
                g.start,
                g.size,
                g.heads,
                [
                    [[i, lengths[i], i if ids is None else ids[i]] for i in mb.seq_ids]
                    for mb in g.microbatches
                ],
            ]
            for w, g in groups
        ],
        separators=(",", ":"),
    ).encode()


def slice_plan(plan: StepPlan) -> tuple[SliceHeader, list[bytes]]:
    """Cut a validated plan into its header and one record per position (proof + content).

    A pipelined plan is refused: slices do not carry its stages yet, and a slice that dropped
    them would run the plan unpipelined."""
    if plan.pipeline is not None:
        raise PlanError(
            "pipeline",
            f"plan slices do not carry pipeline stages; publish this {plan.pipeline.stages}-stage "
            f"plan whole",
        )
    world = plan.topology.world
    mine: list[list[tuple[int, Group]]] = [[] for _ in range(world)]
    for w, wave in enumerate(plan.waves):
        for g in wave.groups:
            for p in g.ranks:
                mine[p].append((w, g))
    contents = [_content(plan, groups) for groups in mine]
    depth = _depth(world)
    level = [_h(_LEAF, p.to_bytes(4, "little"), c) for p, c in enumerate(contents)]
    level += [_h(_EMPTY)] * ((1 << depth) - world)
    levels = [level]
    while len(level) > 1:
        level = [_h(_NODE, level[i], level[i + 1]) for i in range(0, len(level), 2)]
        levels.append(level)
    records = []
    for p, content in enumerate(contents):
        proof, index = [], p
        for lv in levels[:-1]:
            proof.append(lv[index ^ 1])
            index //= 2
        records.append(b"".join(proof) + content)
    header = SliceHeader(
        topology=plan.topology,
        waves=len(plan.waves),
        sequences=len(plan.lengths),
        labels=sum(int(s) - 1 for s in plan.lengths),
        root=levels[-1][0],
        policy=plan.policy,
    )
    return header, records


def open_slice(header: SliceHeader, record: bytes, position: int) -> PlanSlice:
    """Check a record against the header's root and decode it.

    Raises:
        PlanError: (rule ``"slice"``) the record is not position ``position``'s slice of the
            plan the header commits to, or does not decode into groups of that position.
    """
    world = header.topology.world
    if not 0 <= position < world:
        raise PlanError("slice", f"position {position} is not on the axis of {world} ranks")
    depth = _depth(world)
    if not depth * HASH_BYTES <= len(record) <= MAX_SLICE_BYTES:
        raise PlanError("slice", f"the slice of position {position} has {len(record)} bytes")
    content = record[depth * HASH_BYTES :]
    node, index = _h(_LEAF, position.to_bytes(4, "little"), content), position
    for k in range(depth):
        sibling = record[k * HASH_BYTES : (k + 1) * HASH_BYTES]
        node = _h(_NODE, node, sibling) if index % 2 == 0 else _h(_NODE, sibling, node)
        index //= 2
    if node != header.root:
        raise PlanError("slice", f"the slice of position {position} is not the header's plan's")
    return _decode(header, content, position, record)


def _decode(header: SliceHeader, content: bytes, position: int, record: bytes) -> PlanSlice:
    """Decode content the maker committed to; still checked, so that a bug is an error."""
    try:
        data: Any = json.loads(content)
        lengths: dict[int, int] = {}
        samples: dict[int, int] = {}
        by_wave: dict[int, Group] = {}
        for w, start, size, heads, mbs in data:
            micro = []
            for mb in mbs:
                for i, length, row in mb:
                    lengths[int(i)], samples[int(i)] = int(length), int(row)
                micro.append(MicroBatch(tuple(int(i) for i, _, _ in mb)))
            group = Group(int(start), int(size), tuple(micro), int(heads))
            if not (0 <= w < header.waves and start <= position < start + size) or w in by_wave:
                raise ValueError(f"group {group} in wave {w}")
            by_wave[int(w)] = group
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise PlanError("slice", f"the slice of position {position} is malformed: {exc}") from None
    if any(not 0 <= i < header.sequences for i in lengths):
        raise PlanError("slice", f"the slice of position {position} names unknown sequences")
    waves = tuple(Wave((by_wave[w],) if w in by_wave else ()) for w in range(header.waves))
    return PlanSlice(header, position, waves, lengths, samples, record)


def own_slice(plan: StepPlan, position: int) -> PlanSlice:
    """Position ``position``'s slice of a whole plan this rank holds (the fallback path)."""
    header, records = slice_plan(plan)
    return open_slice(header, records[position], position)


class SliceUnavailable(PlanError):
    """This rank's slice of the step's (signed) header is missing or does not verify.

    Attributes:
        digest: the header's digest (every rank that holds the header compares it; this rank
            also says it cannot run its part, and every rank falls back alike).
        missing: the slice was absent (else: malformed, not the header's, or not this batch's).
    """

    def __init__(self, message: str, digest: int, *, missing: bool = False) -> None:
        super().__init__("slice", message)
        self.digest = digest
        self.missing = missing


def check_slice_header(header: SliceHeader, *, topology: Topology, lengths: np.ndarray) -> None:
    """Raise ValueError unless a slice header is for exactly this batch on ``topology``."""
    if header.topology != topology:
        raise ValueError(f"slice header is for topology {header.topology}, this job has {topology}")
    labels = int(np.sum(np.asarray(lengths, dtype=np.int64) - 1))
    if header.sequences != len(lengths) or header.labels != labels:
        raise ValueError("slice header sequences or label tokens differ from this step's batch")
