"""Per-rank plan slices: a rank reads what it runs, plus a small header that commits to the plan.

At 16,384 ranks a whole plan is megabytes of JSON, and every rank decoding, hashing and checking
all of it costs seconds per step. A rank needs only its own groups (the waves it runs in, their
micro-batches, the lengths and dataset rows of their sequences) and three numbers of the whole
batch (sequences, label tokens, waves). So the plan's maker cuts it into one record per *span*
of ``slice_span(topology)`` consecutive positions (a node: ``ranks_per_node``) and commits to all
of them in a Merkle tree:

    header    topology, waves, sequences, label tokens, the policy, and the tree's 12-byte root
              (signed at the step's key like a plan: ``dyncp.control.signing``)
    record k  proof (depth x 12 bytes: the siblings from leaf k up) + compact JSON of every
              group that has a member in span k, each once; depth = ceil(log2 spans)

Why spans and not one record per rank: a group's micro-batches are needed by each of its
members. One record per rank repeats a group of c ranks c times (all records were 3.6x / 4.8x
the plan's JSON at 4,096 / 16,384 ranks on dyncp-policy plans, where most sequences sit in
groups of 2-16) and stores a proof per rank (0.5x of the plan by itself). Aligned groups of at
most a node's size never cross a node, so in node-wide records only the groups larger than a
node repeat, once per node they span; proofs are one per node (``bench/control_plane_bench.py
--offline --policy dyncp``: 1.2x / 1.3x). A rank reads its node's record (a few kilobytes), and
because the record's key follows from the topology, it reads the header and the record in one
Store request (``multi_get``), not in two round trips through an index of separate group blobs.

A rank checks its record against the header's root (depth hashes), keeps the groups it is a
member of, and takes part in the per-step agreement with the root's first 8 bytes as its digest:
equal roots on every rank and a verified record on each mean every rank runs its part of the
same whole plan, without any rank reading it. The whole plan is validated once, by its maker,
before it is cut. Hashes: BLAKE2b with 12-byte digests (``HASH_BYTES``); leaves, inner nodes and
padding are domain-separated, and a leaf hashes its span's index, so a record cannot be replayed
at another span. A bad record makes every rank of its span unable to run the step (they say so in
the agreement and every rank falls back alike).
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
    "SLICES_FROM",
    "PlanSlice",
    "SliceHeader",
    "SliceUnavailable",
    "check_slice_header",
    "is_header",
    "open_slice",
    "own_slice",
    "record_index",
    "slice_plan",
    "slice_span",
    "use_slices",
]

SLICE_VERSION = 2  # 2: one record per span of positions (1: one per position)
#: 96-bit nodes: finding another slice with the same path is a second preimage (2**96 work);
#: the maker, who could look for collisions, is trusted (it signs the header).
HASH_BYTES = 12
_LEAF, _NODE, _EMPTY = b"dyncp-slice-leaf\0", b"dyncp-slice-node\0", b"dyncp-slice-empty"
_HEADER_TAG = b'{"dyncp_slices":'
#: Largest record a reader decodes (a node's record of a 131,072-sequence plan: ~10 KB at most).
MAX_SLICE_BYTES = 16 << 20


#: ``slices="auto"`` (the sampler's and ``dyncp.serve``'s default) reads and publishes slices from
#: this many ranks on: the smallest world measured by ``bench/slices_crossover_bench.py``, where a
#: reader of slices already spent less per step than a reader of the whole plan (0.70x at 2
#: ranks, 0.36x at 8, 0.05x at 64; see docs/guides/scale.md), so at every world measured.
SLICES_FROM = 2


def use_slices(choice: bool | str, topology: Topology, *, pipelined: bool) -> bool:
    """Whether a job of ``topology`` reads plans as slices: ``choice`` True or False, or
    ``"auto"``: from ``SLICES_FROM`` ranks, unless the plans are pipelined (slices do not carry
    stages; ``slice_plan``).

    Raises:
        ValueError: ``choice`` is not True, False or "auto".
    """
    if choice == "auto":
        return topology.world >= SLICES_FROM and not pipelined
    if choice is True or choice is False:
        return choice
    raise ValueError(f"slices must be True, False or 'auto', got {choice!r}")


def _h(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"".join(parts), digest_size=HASH_BYTES).digest()


def _depth(leaves: int) -> int:
    return max(0, (leaves - 1).bit_length())


def slice_span(topology: Topology) -> int:
    """Positions per record: a node's (``ranks_per_node``, at most the world; module docstring)."""
    return max(1, min(topology.ranks_per_node, topology.world))


def record_index(topology: Topology, position: int) -> int:
    """The record holding position ``position``'s groups (its span's index)."""
    return position // slice_span(topology)


def _spans(topology: Topology) -> int:
    return -(-topology.world // slice_span(topology))


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
    record: bytes  # its span's record as published (proof + content): what a resume re-checks

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


def _group_json(plan: StepPlan, w: int, g: Group) -> bytes:
    """``[wave, start, size, heads, [[[seq, length, row], ...] per micro-batch]]``, compact JSON
    (formatted directly: json.dumps of the nested lists took most of the cut)."""
    ids, lengths = plan.sample_ids, plan.lengths
    rows = range(len(lengths)) if ids is None else ids
    mbs = ",".join(
        "[" + ",".join(f"[{i},{lengths[i]},{rows[i]}]" for i in mb.seq_ids) + "]"
        for mb in g.microbatches
    )
    return f"[{w},{g.start},{g.size},{g.heads},[{mbs}]]".encode()


def slice_plan(plan: StepPlan) -> tuple[SliceHeader, list[bytes]]:
    """Cut a validated plan into its header and one record per span (proof + content).

    ``records[k]`` holds every group with a member in positions ``[k * span, (k + 1) * span)``
    (``span = slice_span(plan.topology)``), each group encoded once and shared by the records
    of the spans it covers. A pipelined plan is refused: slices do not carry its stages yet, and
    a slice that dropped them would run the plan unpipelined."""
    if plan.pipeline is not None:
        raise PlanError(
            "pipeline",
            f"plan slices do not carry pipeline stages; publish this {plan.pipeline.stages}-stage "
            f"plan whole",
        )
    span, spans = slice_span(plan.topology), _spans(plan.topology)
    parts: list[list[bytes]] = [[] for _ in range(spans)]
    for w, wave in enumerate(plan.waves):
        for g in wave.groups:
            text = _group_json(plan, w, g)
            for k in range(g.start // span, (g.start + g.size - 1) // span + 1):
                parts[k].append(text)
    contents = [b"[" + b",".join(part) + b"]" for part in parts]
    depth = _depth(spans)
    level = [_h(_LEAF, k.to_bytes(4, "little"), c) for k, c in enumerate(contents)]
    level += [_h(_EMPTY)] * ((1 << depth) - spans)
    levels = [level]
    while len(level) > 1:
        level = [_h(_NODE, level[i], level[i + 1]) for i in range(0, len(level), 2)]
        levels.append(level)
    records = []
    for k, content in enumerate(contents):
        proof, index = [], k
        for lv in levels[:-1]:
            proof.append(lv[index ^ 1])
            index //= 2
        records.append(b"".join(proof) + content)
    header = SliceHeader(
        topology=plan.topology,
        waves=len(plan.waves),
        sequences=len(plan.lengths),
        labels=int(np.sum(np.asarray(plan.lengths, dtype=np.int64))) - len(plan.lengths),
        root=levels[-1][0],
        policy=plan.policy,
    )
    return header, records


def open_slice(header: SliceHeader, record: bytes, position: int) -> PlanSlice:
    """Check position ``position``'s span record against the header's root; its part of it.

    Raises:
        PlanError: (rule ``"slice"``) the record is not the record of ``position``'s span of
            the plan the header commits to, or does not decode into groups of that span.
    """
    topology = header.topology
    if not 0 <= position < topology.world:
        raise PlanError(
            "slice", f"position {position} is not on the axis of {topology.world} ranks"
        )
    k = record_index(topology, position)
    depth = _depth(_spans(topology))
    if not depth * HASH_BYTES <= len(record) <= MAX_SLICE_BYTES:
        raise PlanError("slice", f"the slice of position {position} has {len(record)} bytes")
    content = record[depth * HASH_BYTES :]
    node, index = _h(_LEAF, k.to_bytes(4, "little"), content), k
    for level in range(depth):
        sibling = record[level * HASH_BYTES : (level + 1) * HASH_BYTES]
        node = _h(_NODE, node, sibling) if index % 2 == 0 else _h(_NODE, sibling, node)
        index //= 2
    if node != header.root:
        raise PlanError("slice", f"the slice of position {position} is not the header's plan's")
    return _decode(header, content, position, record)


def _decode(header: SliceHeader, content: bytes, position: int, record: bytes) -> PlanSlice:
    """This position's groups of a span record the maker committed to; still checked (every
    group in the span, at most one of this position's per wave), so that a bug is an error."""
    span = slice_span(header.topology)
    first = record_index(header.topology, position) * span
    try:
        data: Any = json.loads(content)
        lengths: dict[int, int] = {}
        samples: dict[int, int] = {}
        by_wave: dict[int, Group] = {}
        for w, start, size, heads, mbs in data:
            if not (0 <= w < header.waves and start < first + span and first < start + size):
                raise ValueError(f"a group at {start} (size {size}) of wave {w} is not the span's")
            if not start <= position < start + size:
                continue  # another member of the span's
            micro = []
            for mb in mbs:
                for i, length, row in mb:
                    lengths[int(i)], samples[int(i)] = int(length), int(row)
                micro.append(MicroBatch(tuple(int(i) for i, _, _ in mb)))
            group = Group(int(start), int(size), tuple(micro), int(heads))
            if w in by_wave:
                raise ValueError(f"two groups of position {position} in wave {w}")
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
    return open_slice(header, records[record_index(plan.topology, position)], position)


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
