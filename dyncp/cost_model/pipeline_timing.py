"""Price a pipelined plan: every (stage, column) runs its schedule's operations, timed as a DAG.

A pipelined plan (``dyncp.plan.pipeline``) has ``P`` stages of ``W`` columns each; slot ``j``'s
group runs one micro-batch on the same columns of every stage, and virtual stage
``q = chunk * P + s`` holds ``stage_layers(num_layers, pipeline)[q]`` layers. Two steps:

1. :func:`stage_costs` cuts each micro-batch's cost-model seconds ``T`` into a forward and a
   backward per virtual stage, and prices the activation transfers between virtual stages.
2. :func:`price_pipeline` runs the schedule (``dyncp.cost_model.pipeline_schedule``): an
   operation starts when the previous operation of its (stage, column) is done and its input
   has arrived (data dependency done + transfer), and the members of a group start a
   micro-batch's operation together (each layer's ring collective needs all of them: start =
   max over the group's columns). A column idle in a slot does nothing there: its operations
   take no time and wait for nothing.

How a micro-batch's ``T`` (``model.microbatch_seconds(cp, lengths, heads=u)``) is cut, with
``L = lin * priced_tokens / cp`` (the profile's ``linear_seconds_per_token``: all non-attention
work *including the LM head*) and ``C = model.microbatch_overhead``:

- ``H = head_fraction * L``: the LM head (plus its loss), on the last virtual stage only.
  ``head_fraction = 2 h vocab / (layers * F_layer + 2 h vocab)`` with ``F_layer`` a decoder
  layer's forward GEMM FLOPs per token from the profile's ``model`` shape: ``2 h (n_q d + 2 n_kv
  d) + 2 n_q d h`` (QKV and output projections) ``+ 3 * 2 h f`` (a gated MLP's three GEMMs; a
  plain MLP has two, so for such a model the layer is overstated by a third of its MLP and the
  head's share understated accordingly). Assumption: the head's GEMM runs at the same seconds
  per FLOP as the layers' linear work (large bf16 GEMMs alike). The embedding lookup is priced
  at 0 (a gather, no GEMM).
- ``LL = L - H``: the layers' linear work, split over virtual stages by their layer share.
- ``N = T - C - L``: attention, ring transfers and (layer mixes) window/SSM terms, per layer, split
  by layer share too (every layer of a profile is priced alike, so a stage of ``n`` layers pays
  ``n / layers`` of it).
- ``C``: every virtual stage's forward+backward pays the micro-batch constant once (it is a
  per-pass cost: launches, the schedule's bookkeeping), so a pipelined micro-batch pays it
  ``P x V`` times in all.

Forward/backward split (each a stated assumption): linear work and the head backward = 2 x
forward (dgrad + wgrad GEMMs; the FLOPs accounting of Narayanan et al., SC'21); ``N`` by the
profile's attention ``backward_forward_ratio`` (``fwd_fraction`` of ``full_attention``; the
ring's exposed transfer and window/SSM terms are assumed to follow attention's split, since the
ring overlaps attention compute step by step); ``C`` 1 : 2 like the linear work (the backward
launches about twice the kernels). A cost model without these parts (a plug-in with
``packs_seconds`` and ``microbatch_overhead`` but no ``lin``, ``priced``, ``fwd_fraction`` or
``profile``) is cut uniformly: all of ``T - C`` by layer share, 1 : 2, no separate head;
``num_layers`` must then be given.

Activation transfers: between consecutive virtual stages a column moves its local tokens'
hidden states, ``padded tokens / cp x hidden_size x dtype_bytes`` (plan padding; the profile's
``model``), forward, and the same bytes (their gradient) backward, ``latency + bytes /
bandwidth`` on ``communication.intra_node`` when both processes share a node and on
``communication.inter_node`` otherwise. Process of (stage s, column w) is ``s * W + w`` (pipeline
outermost, Megatron-Core's default rank order), node = process // ranks_per_node. Assumptions:
each column pair has its own link share (one NIC per GPU, as on DGX H100), a transfer overlaps
compute (non-blocking p2p) and only delays its consumer. ``wave_overhead`` is not charged (the
slots of a pipelined plan are not waves of communicators switching; a group's communicator is
built once).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dyncp.cost_model.pipeline_schedule import PipelineCost, ScheduleGraph, StageCosts, schedule
from dyncp.plan import StepPlan, padded_lengths
from dyncp.plan.pipeline import Pipeline, stage_layers

__all__ = [
    "LINEAR_FORWARD",
    "CostSplit",
    "PipelineCost",
    "StageCosts",
    "cost_split",
    "hop_same_node",
    "p2p_links",
    "price_pipeline",
    "stage_costs",
]

#: Forward share of linear work, the head and the micro-batch constant (backward = 2 x forward).
LINEAR_FORWARD = 1.0 / 3.0


@dataclass(frozen=True, slots=True)
class CostSplit:
    """How a model's micro-batch seconds are cut (module docstring).

    ``parts``: the model has ``lin``/``priced``/``fwd_fraction`` (every CostModel of dyncp);
    ``False``: the uniform cut of a plug-in (all of ``T - C`` by layer share, 1 : 2, no head).
    """

    num_layers: int
    head_fraction: float  # H / L
    other_forward: float  # forward share of N = T - C - L
    parts: bool


def cost_split(model: object, *, num_layers: int | None = None) -> CostSplit:
    """The cut of ``model``'s micro-batch seconds (module docstring)."""
    profile = getattr(model, "profile", None)
    parts = all(hasattr(model, a) for a in ("lin", "priced", "fwd_fraction")) and profile
    layers = num_layers if num_layers is not None else getattr(model, "layers", None)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(
            f"the model's layer count is unknown or invalid ({layers!r}): pass num_layers >= 1"
        )
    if not parts:
        return CostSplit(layers, 0.0, LINEAR_FORWARD, False)
    shape = profile.model
    h, d = shape.hidden_size, shape.head_dim
    layer = 2 * h * (shape.num_heads * d + 2 * shape.num_kv_heads * d) + 2 * shape.num_heads * d * h
    layer += 3 * 2 * h * shape.ffn_hidden_size
    head = 2.0 * h * shape.vocab_size
    return CostSplit(layers, head / (layers * layer + head), float(model.fwd_fraction), True)


@dataclass(frozen=True, slots=True)
class _Items:
    """Every group of every slot (plan order) with what its micro-batch costs."""

    slot: np.ndarray
    start: np.ndarray
    size: np.ndarray
    seconds: np.ndarray  # the cost model's T
    priced: np.ndarray  # priced tokens (the profile's padding), summed
    padded: np.ndarray  # the plan's padded tokens, summed


def _items(plan: StepPlan, model: object, parts: bool) -> _Items:
    """One vectorised pricing call per group layout (CP size, head split), as evaluate_plan."""
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    rows = [
        (j, g.start, g.size, g.heads, g.microbatches[0].seq_ids)
        for j, wave in enumerate(plan.waves)
        for g in wave.groups
    ]
    n = len(rows)
    columns = list(zip(*rows)) if rows else [()] * 5
    slot, start, size, heads = (np.asarray(c, dtype=np.int64) for c in columns[:4])
    packs = columns[4]
    counts = np.fromiter(map(len, packs), dtype=np.int64, count=n)
    ids = np.fromiter(itertools.chain.from_iterable(packs), dtype=np.int64, count=counts.sum())
    firsts = np.cumsum(counts) - counts
    flat = lengths[ids]
    seconds, priced, padded = np.zeros(n), np.zeros(n), np.zeros(n)
    layout = size * (1 << 20) + heads
    for key in np.unique(layout).tolist():
        cp, u = divmod(key, 1 << 20)
        sel = np.flatnonzero(layout == key)
        pick = np.repeat(firsts[sel], counts[sel]) + (
            np.arange(counts[sel].sum())
            - np.repeat(np.cumsum(counts[sel]) - counts[sel], counts[sel])
        )
        sub, starts = flat[pick], np.concatenate([[0], np.cumsum(counts[sel])[:-1]])
        split = {"heads": u} if u > 1 else {}
        seconds[sel] = model.packs_seconds(cp, sub, starts, **split)
        padded[sel] = np.add.reduceat(padded_lengths(sub, cp).astype(np.float64), starts)
        if parts:
            priced[sel] = np.add.reduceat(model.priced(cp, sub).astype(np.float64), starts)
    return _Items(slot, start, size, seconds, priced, padded)


def p2p_links(
    model: object, p2p: Sequence[tuple[float, float]] | None = None
) -> tuple[tuple[float, float], tuple[float, float]]:
    """``((latency, bandwidth) intra-node, (latency, bandwidth) inter-node)`` of a stage-to-stage
    transfer: ``p2p`` when given, else the profile's ``communication.intra_node`` and
    ``communication.inter_node``."""
    if p2p is not None:
        if len(p2p) != 2:
            raise ValueError("p2p must be ((intra latency, bandwidth), (inter latency, bandwidth))")
        return (tuple(p2p[0]), tuple(p2p[1]))  # type: ignore[return-value]
    comm = getattr(getattr(model, "profile", None), "communication", None)
    if comm is None:
        raise ValueError(
            "the model has no profile.communication to price activation transfers; pass p2p"
        )
    intra, inter = comm.intra_node, comm.inter_node
    return (
        (intra.latency_seconds, intra.bandwidth_bytes_per_second),
        (inter.latency_seconds, inter.bandwidth_bytes_per_second),
    )


def hop_same_node(world: int, ranks_per_node: int, pipeline: Pipeline) -> np.ndarray:
    """``same[q, w]``: column ``w``'s processes of virtual stages ``q - 1`` and ``q`` share a
    node (process of stage s, column w: ``s * world + w``; row 0, no hop: True)."""
    col = np.arange(world)
    same = np.ones((pipeline.model_stages, world), dtype=bool)
    p = pipeline.stages
    for q in range(1, pipeline.model_stages):
        a, b = (q - 1) % p, q % p
        same[q] = (a * world + col) // ranks_per_node == (b * world + col) // ranks_per_node
    return same


def stage_costs(
    plan: StepPlan,
    model: object,
    *,
    num_layers: int | None = None,
    activation_bytes_per_token: float | None = None,
    p2p: Sequence[tuple[float, float]] | None = None,
) -> StageCosts:
    """Every operation's seconds and every transfer of pipelined ``plan`` under ``model``.

    ``num_layers``, ``activation_bytes_per_token`` (default hidden_size x dtype_bytes of the
    profile's model) and ``p2p`` (``((latency, bandwidth) intra-node, (..) inter-node)``, default
    the profile's ``communication`` links) are needed only for a model without a profile.
    """
    pipeline = plan.pipeline
    if pipeline is None:
        raise ValueError("stage_costs prices pipelined plans; this plan has pipeline=None")
    split = cost_split(model, num_layers=num_layers)
    per_stage = np.asarray(stage_layers(split.num_layers, pipeline), dtype=np.float64)
    share = per_stage / split.num_layers
    if activation_bytes_per_token is None:
        shape = getattr(getattr(model, "profile", None), "model", None)
        if shape is None:
            raise ValueError("the model has no profile.model: pass activation_bytes_per_token")
        activation_bytes_per_token = float(shape.hidden_size * shape.dtype_bytes)
    links = p2p_links(model, p2p)
    topo = plan.topology
    m, w, nq = len(plan.waves), topo.world, pipeline.model_stages
    pipeline.check_slots(m)
    it = _items(plan, model, split.parts)
    c = float(model.microbatch_overhead)
    if split.parts:
        lin = float(model.lin) * it.priced / it.size
        head = split.head_fraction * lin
        other = it.seconds - c - lin
        bad = np.flatnonzero(other < -1e-9 * np.maximum(it.seconds, 1.0))
        if bad.size:
            x = int(bad[0])
            raise ValueError(
                f"slot {int(it.slot[x])}: the model prices a micro-batch below its linear work "
                f"plus constant ({it.seconds[x]} < {lin[x]} + {c}); its parts cannot be cut"
            )
        other = np.maximum(other, 0.0)
    else:
        lin = head = np.zeros(len(it.seconds))
        other = it.seconds - c
    layered = lin - head
    f = LINEAR_FORWARD
    # Per item (a sentinel last: an idle column), the layer-proportional and the fixed seconds.
    pad = [0.0]
    share_f = np.append(f * layered + split.other_forward * other, pad)
    share_b = np.append((1 - f) * layered + (1 - split.other_forward) * other, pad)
    fixed = np.append(np.full(len(it.seconds), c), pad)
    head = np.append(head, pad)
    owner = np.full(m * w, len(it.seconds), dtype=np.int64)
    cover = np.repeat(it.slot * w + it.start, it.size) + (
        np.arange(it.size.sum()) - np.repeat(np.cumsum(it.size) - it.size, it.size)
    )
    owner[cover] = np.repeat(np.arange(len(it.seconds)), it.size)
    owner = owner.reshape(m, w)
    last = np.zeros(nq)
    last[-1] = 1.0
    fwd = share_f[owner][..., None] * share + f * (
        fixed[owner][..., None] + head[owner][..., None] * last
    )
    bwd = share_b[owner][..., None] * share + (1 - f) * (
        fixed[owner][..., None] + head[owner][..., None] * last
    )
    busy = owner < len(it.seconds)
    local = np.append(it.padded / it.size, pad)[owner]
    # Links between virtual stage q-1 and q, per column: intra-node when both processes share one.
    transfer = np.zeros((m, w, nq))
    same_node = hop_same_node(w, topo.ranks_per_node, pipeline)
    for q in range(1, nq):
        same = same_node[q]
        lat = np.where(same, links[0][0], links[1][0])
        bw = np.where(same, links[0][1], links[1][1])
        transfer[:, :, q] = np.where(busy, lat + local * activation_bytes_per_token / bw, 0.0)
    first = ~busy
    first.reshape(-1)[it.slot * w + it.start] = True  # each group's first column
    segments = tuple(np.flatnonzero(first[j]) for j in range(m))
    return StageCosts(pipeline, fwd, bwd, transfer, busy, segments)


def price_pipeline(
    plan: StepPlan,
    model: object,
    *,
    costs: StageCosts | None = None,
    graph: ScheduleGraph | None = None,
) -> PipelineCost:
    """The step of pipelined ``plan`` under ``model`` (module docstring); ``costs`` replaces the
    cost model's operation seconds (``stage_costs``; then ``model`` is not called); ``graph``
    (``pipeline_schedule.schedule_graph``) saves building the schedule again when many plans of
    one slot count are priced."""
    if costs is None:
        costs = stage_costs(plan, model)
    elif costs.pipeline != plan.pipeline:
        raise ValueError(f"costs are for {costs.pipeline}, the plan runs {plan.pipeline}")
    elif (costs.slots, costs.columns) != (len(plan.waves), plan.topology.world):
        raise ValueError(
            f"costs are for {costs.slots} slots x {costs.columns} columns, the plan has "
            f"{len(plan.waves)} x {plan.topology.world}"
        )
    return schedule(costs, graph=graph)
