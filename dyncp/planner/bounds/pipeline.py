"""Lower bound on the pipelined step of any valid pipelined plan of a batch (``price_pipeline``).

For a batch (lengths), a topology (W columns per stage) and a pipeline (P stages, V virtual),
whatever the slots, groups, packing and head splits, ``price_pipeline(plan).step_seconds`` is at
least::

    LB = max_i min_(c,u) max( chain_i(c, u),  max_s  work_s(i at c, u) / W + fill_s + drain_s )

(at least ``max(max_s work_s / W + fill_s + drain_s, max_i min chain_i)``, the parts reported).

Notation (``dyncp.cost_model.pipeline_timing``): a micro-batch S at layout (c, u) costs the
model's ``T``; ``C`` the micro-batch constant; ``L = lin * priced(c, S) / c`` its linear work;
``H = h L`` the head (``h = head_fraction``); ``N = T - C - L``; ``a_q`` virtual stage q's share
of the layers, ``A_s`` the sum of ``a_q`` over stage s's chunks; ``f = 1/3`` and ``phi``
(attention's forward share) the forward shares. Stage s's forward+backward of S costs each of
the c columns ``A_s (T - C - H) + V C + [s = P-1] H``; its forward through q ``a_q (f (L - H) +
phi N) + f C (+ f H on the last virtual stage)``, its backward the same with ``1 - f``,
``1 - phi``; a hop of S between virtual stages ``latency + padded(c, S) / c x bytes / bandwidth``
on the link of that column's two processes.

Proof, term by term.

``work_s``: the busy seconds of stage s summed over its W columns are ``sum over micro-batches
c x stage cost = sum A_s c T + (V - A_s) c C + ([s = P-1] - A_s) c H``. The cost-model contract 2
(``dyncp.cost_model.protocol``) gives ``c T >= c fixed(c, u) + sum_i bound_rank(c, s_i, u)``,
and ``c H = h lin sum_i priced(c, s_i)`` exactly, so with ``A_s, V - A_s >= 0``::

    work_s >= A_s n min_(c,u) c fixed(c, u)
              + (V - A_s) C max(n, sum_i min_c pad(c, s_i) / cap)
              + sum_i min_(c,u) [A_s bound_rank(c, s_i, u) + ([s = P-1] - A_s) h lin priced(c, s_i)]

where n >= ``pipeline.slot_multiple()`` is a count of micro-batches (every slot of a plan has a
group, and the slot count is a multiple of it), ``sum c >= n`` and ``sum c >= sum_i padded /
capacity`` (a micro-batch at c holds at most c x capacity padded tokens), and the minima run over
the layouts that can hold s_i (the plan's own choice is one of them). The busiest column of
stage s is busy at least ``work_s / W``, and it is busy (work_s > 0 holds for every batch).

``fill_s`` and ``drain_s``: a column's operations on one stage run one after another. On stage
s, column w's first operation that computes is the forward of its first busy slot j0 through
virtual stage s (chunk 0): in ``stage_order`` every other operation of a slot j >= j0 comes
later (forwards by slot group, chunk, slot; a backward after the forward of its own index).
That forward waits for the forward of j0 through virtual stages 0..s-1 and the s hops, each
starting after its input arrived on the same column. Symmetrically its last computing operation
is the backward of its last busy slot j* through chunk 0, which the backwards of j* through
s-1..0 (and s hops) follow before the step ends. So the step is at least ``fill + busy_s(w) +
drain`` for the busiest column w, where fill and drain are the cheapest such chains of any
micro-batch: per virtual stage q < s (never the last, so no head), a micro-batch containing s_i
at (c, u) costs at least ``a_q (f (1 - h) lin priced(c, s_i) / c + phi N_lo) + f C`` forward,
where ``N >= N_lo = max(0, fixed(c, u) - C + (g(c, s_i) + sum_(k ok at c) min(g(c, s_k), 0) -
min(g(c, s_i), 0)) / c)`` with ``g = bound_rank - lin priced`` (contract 2 minus the exact L:
the other sequences of S add at least their negative parts); its hops at least ``latency +
padded(c, s_i) / c x bytes / bandwidth`` on the cheaper link any column has for that hop.

``chain_i``: the micro-batch holding s_i runs forward through all P V virtual stages and back,
each operation after its predecessor and each hop in between: at least ``T + (P V - 1) C + 2 x
hops >= alone(c, s_i, u) + (P V - 1) C + 2 x hops(s_i)`` (contracts 1 and 3: a micro-batch costs
at least any of its sequences alone).

Coupling: a plan runs each sequence s_i at one layout (c, u), so the chain of s_i at that layout
and every stage's work with s_i's own term (and padded tokens) at that layout hold at once, the
other sequences at their minima; the plan's choice is one of the layouts, hence the minimum over
layouts of the maximum, for every sequence (``closed_form``'s argument, here per stage).

Assumes nothing about the plan beyond the contract and nothing about the cost model beyond its
protocol contract (and, for the linear and head parts, the linear form ``lin x priced tokens /
c`` that ``stage_costs`` cuts; a plug-in model without those parts has ``L = H = 0``). Not
counted (each would only raise the step): waits on a slower group member, schedule bubbles
beyond fill and drain, and the wave overhead (``price_pipeline`` does not charge it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dyncp.cost_model.pipeline_timing import LINEAR_FORWARD, cost_split, hop_same_node, p2p_links
from dyncp.plan import Pipeline, Topology, padded_lengths
from dyncp.plan.pipeline import stage_layers
from dyncp.planner.batch import Batch

__all__ = ["PipelineBound", "pipeline_lower_bound"]


@dataclass(frozen=True, slots=True)
class PipelineBound:
    """``seconds``: the bound (module docstring), at least max(max over stages of ``work[s] +
    fill[s] + drain[s]``, ``chain``), the parts without the per-sequence coupling."""

    seconds: float
    work: tuple[float, ...]  # per stage: its least busy seconds per column (work_s / W)
    fill: tuple[float, ...]  # per stage: the cheapest forward through the stages before it
    drain: tuple[float, ...]  # per stage: the cheapest backward through them
    chain: float  # the costliest sequence's micro-batch through every virtual stage and back


def pipeline_lower_bound(
    lengths: Batch | Sequence[int] | np.ndarray,
    topology: Topology,
    pipeline: Pipeline,
    model: object,
    *,
    num_layers: int | None = None,
    activation_bytes_per_token: float | None = None,
    p2p: Sequence[tuple[float, float]] | None = None,
) -> PipelineBound:
    """Seconds no valid pipelined plan of ``lengths`` on ``topology`` x ``pipeline`` can beat
    under ``price_pipeline`` with ``model`` (module docstring). The keywords are
    ``stage_costs``'s, for a model without a profile."""
    batch = Batch.of(lengths, topology)
    x = batch.lengths
    p, v, w = pipeline.stages, pipeline.virtual, topology.world
    nq = pipeline.model_stages
    if len(x) == 0:
        return PipelineBound(0.0, (0.0,) * p, (0.0,) * p, (0.0,) * p, 0.0)
    split = cost_split(model, num_layers=num_layers)
    a = np.asarray(stage_layers(split.num_layers, pipeline), dtype=np.float64) / split.num_layers
    stage_share = a.reshape(v, p).sum(axis=0)  # A_s
    if activation_bytes_per_token is None:
        shape = getattr(getattr(model, "profile", None), "model", None)
        if shape is None:
            raise ValueError("the model has no profile.model: pass activation_bytes_per_token")
        activation_bytes_per_token = float(shape.hidden_size * shape.dtype_bytes)
    links = np.asarray(p2p_links(model, p2p), dtype=np.float64)  # rows: intra, inter
    same = hop_same_node(w, topology.ranks_per_node, pipeline)
    c0 = float(model.microbatch_overhead)
    lin = float(model.lin) if split.parts else 0.0
    hf = split.head_fraction

    # Every layout (c, u) the topology allows and the model prices; per layout and sequence:
    # fits, priced and padded tokens, bound_rank, alone; per layout: fixed.
    layouts = [(c, u) for c in topology.group_sizes for u in topology.splits(c)]
    rows = []
    for c, u in layouts:
        kw = {"heads": u} if u > 1 else {}
        ok = batch.min_cp <= c
        try:
            fixed = float(model.fixed_seconds(c, **kw))
            br = np.full(len(x), np.inf)
            al = np.full(len(x), np.inf)
            if ok.any():
                br[ok] = model.bound_rank_seconds(c, x[ok], **kw)
                al[ok] = model.alone_seconds(c, x[ok], **kw)
        except ValueError:
            continue  # a split the profile cannot price: no plan can use it either
        pr = model.priced(c, x).astype(np.float64) if split.parts else np.zeros(len(x))
        pad = padded_lengths(x, c).astype(np.float64)
        rows.append((c, ok, fixed, br, al, pr, pad))
    cs = np.asarray([r[0] for r in rows], dtype=np.float64)[:, None]
    ok = np.asarray([r[1] for r in rows])
    fixed = np.asarray([r[2] for r in rows])[:, None]
    br, al, pr, pad = (np.asarray([r[k] for r in rows]) for k in (3, 4, 5, 6))
    inf = np.inf

    # Hops: per layout and sequence, the cheapest link any column has for each hop q.
    local = pad / cs * activation_bytes_per_token
    hop = np.zeros((nq,) + local.shape)
    for q in range(1, nq):
        kinds = sorted({0 if s else 1 for s in same[q].tolist()})
        hop[q] = np.min([links[k, 0] + local / links[k, 1] for k in kinds], axis=0)

    # work_s / W, and (``coupled``) the same with sequence i at layout k: the per-sequence term
    # and the padded tokens of i at k instead of their minima.
    n = pipeline.slot_multiple()
    cap = float(topology.capacity)
    least_pad = np.where(ok, pad, inf).min(axis=0)
    tokens = least_pad.sum() / cap
    tokens_at = tokens + (pad - least_pad) / cap  # (K, n): i at k
    fixed_part = n * float((cs[:, 0] * fixed[:, 0]).min())
    work, coupled = [], []
    for s in range(p):
        last = 1.0 if s == p - 1 else 0.0
        per_seq = np.where(ok, stage_share[s] * br + (last - stage_share[s]) * hf * lin * pr, inf)
        least = per_seq.min(axis=0)
        constant = (v - stage_share[s]) * c0
        total = stage_share[s] * fixed_part + constant * max(n, tokens) + least.sum()
        work.append(max(float(total), 0.0) / w)
        at = total + (per_seq - least) + constant * (np.maximum(n, tokens_at) - max(n, tokens))
        coupled.append(np.maximum(at, 0.0) / w)

    # fill_s, drain_s: the cheapest forward / backward chain through virtual stages 0..s-1.
    g = br - lin * pr
    neg = np.where(ok, np.minimum(g, 0.0), 0.0).sum(axis=1, keepdims=True)
    n_lo = np.maximum(0.0, fixed - c0 + (g + neg - np.minimum(g, 0.0)) / cs)
    n_lo = np.where(ok, n_lo, 0.0)
    layered = (1.0 - hf) * lin * pr / cs
    f, phi = LINEAR_FORWARD, split.other_forward
    fill, drain = [0.0], [0.0]
    for s in range(1, p):
        share = a[:s].sum()
        hops = hop[1 : s + 1].sum(axis=0)
        fwd = share * (f * layered + phi * n_lo) + s * f * c0 + hops
        bwd = share * ((1 - f) * layered + (1 - phi) * n_lo) + s * (1 - f) * c0 + hops
        fill.append(float(np.where(ok, fwd, inf).min()))
        drain.append(float(np.where(ok, bwd, inf).min()))

    # chain_i: the sequence's micro-batch through everything and back.
    through = np.where(ok, al + (nq - 1) * c0 + 2.0 * hop[1:].sum(axis=0), inf)
    chain = float(through.min(axis=0).max())

    # The plan runs sequence i at one layout k: every part holds for that k at once.
    edges = np.asarray(fill) + np.asarray(drain)
    at_k = np.max([cw + e for cw, e in zip(coupled, edges.tolist())], axis=0)
    per_sequence = np.where(ok, np.maximum(through, at_k), inf).min(axis=0)
    stages = [wk + fl + dr for wk, fl, dr in zip(work, fill, drain)]
    seconds = max(float(per_sequence.max()), max(stages), chain)
    return PipelineBound(seconds, tuple(work), tuple(fill), tuple(drain), chain)
