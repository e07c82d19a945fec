"""Zigzag sharding and the zigzag step schedule, checked against independent reference code.

No processes are spawned here: the schedule of every (rank, source) pair of a ring is built from
lengths, cp and rank alone, so the tests can check that together the steps cover each allowed
(query, key) pair of real tokens exactly once, and that off-diagonal steps do equal work.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dyncp.ring_attention import (
    zigzag_positions,
    zigzag_shard,
    zigzag_token_index,
    zigzag_unshard,
)
from dyncp.ring_attention.steps import zigzag_steps

seqlens_st = st.lists(st.integers(1, 70), min_size=1, max_size=6)
cp_st = st.sampled_from([1, 2, 4, 8])
CPU = torch.device("cpu")


def reference_local(seqlens: list[int], cp: int, rank: int) -> list[tuple[int, int, bool]]:
    """(sequence, position, is_real) of every local token, straight from the plan contract."""
    tokens = []
    for b, length in enumerate(seqlens):
        if cp == 1:
            tokens += [(b, p, True) for p in range(length)]
            continue
        padded = -(-length // (2 * cp)) * 2 * cp
        m = padded // (2 * cp)
        chunks = [list(range(i * m, (i + 1) * m)) for i in range(2 * cp)]
        tokens += [(b, p, p < length) for p in chunks[rank] + chunks[2 * cp - 1 - rank]]
    return tokens


@settings(max_examples=60, deadline=None)
@given(seqlens=seqlens_st, cp=cp_st)
def test_index_and_positions_follow_the_contract(seqlens: list[int], cp: int) -> None:
    starts = [sum(seqlens[:b]) for b in range(len(seqlens))]
    counts = set()
    for rank in range(cp):
        ref = reference_local(seqlens, cp, rank)
        index = zigzag_token_index(seqlens=seqlens, cp=cp, rank=rank).tolist()
        positions = zigzag_positions(seqlens=seqlens, cp=cp, rank=rank).tolist()
        assert index == [starts[b] + p if real else -1 for b, p, real in ref]
        assert positions == [p for _, p, _ in ref]
        counts.add(len(index))
    assert len(counts) == 1  # every rank of a ring holds the same number of rows


@settings(max_examples=60, deadline=None)
@given(seqlens=seqlens_st, cp=cp_st)
def test_shard_then_unshard_is_identity(seqlens: list[int], cp: int) -> None:
    x = torch.randn(sum(seqlens), 3, 2, dtype=torch.float64)
    shards = [zigzag_shard(x, seqlens=seqlens, cp=cp, rank=r, pad_value=7.0) for r in range(cp)]
    assert torch.equal(zigzag_unshard(shards, seqlens=seqlens), x)
    for r, shard in enumerate(shards):
        pad = zigzag_token_index(seqlens=seqlens, cp=cp, rank=r) < 0
        assert bool((shard[pad] == 7.0).all())


def _pairs(seqlens: list[int], cp: int, *, causal: bool) -> Counter:
    """(sequence, query position, key position) of every pair all ring steps compute."""
    pairs: Counter = Counter()
    for r in range(cp):
        q_tokens = reference_local(seqlens, cp, r)
        steps = zigzag_steps(seqlens=seqlens, cp=cp, rank=r, causal=causal, device=CPU)
        for s, step in enumerate(steps):
            assert step.source == s
            k_tokens = reference_local(seqlens, cp, s)
            n = len(q_tokens)
            q_rows = list(range(n)) if step.q_rows is None else step.q_rows.tolist()
            k_rows = list(range(n)) if step.k_rows is None else step.k_rows.tolist()
            cq, ck = step.spec.cu_seqlens_q, step.spec.cu_seqlens_k
            for i in range(step.spec.num_seqs):
                qs, ks = q_rows[cq[i] : cq[i + 1]], k_rows[ck[i] : ck[i + 1]]
                shift = len(ks) - len(qs)
                for a, qr in enumerate(qs):
                    for b, kr in enumerate(ks):
                        if step.spec.causal and b > a + shift:
                            continue
                        (sq, pq, real_q), (sk, pk, real_k) = q_tokens[qr], k_tokens[kr]
                        assert sq == sk and real_q and real_k
                        pairs[(sq, pq, pk)] += 1
    return pairs


@settings(max_examples=40, deadline=None)
@given(seqlens=st.lists(st.integers(1, 40), min_size=1, max_size=4), cp=cp_st, causal=st.booleans())
def test_steps_cover_each_allowed_pair_exactly_once(
    seqlens: list[int], cp: int, causal: bool
) -> None:
    expected = Counter(
        (b, i, j)
        for b, length in enumerate(seqlens)
        for i in range(length)
        for j in range(length)
        if j <= i or not causal
    )
    assert _pairs(seqlens, cp, causal=causal) == expected


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_steps_do_equal_work_without_padding(cp: int) -> None:
    seqlens = [2 * cp * n for n in (1, 3, 5)]
    per_step = {}
    for r in range(cp):
        for s, step in enumerate(
            zigzag_steps(seqlens=seqlens, cp=cp, rank=r, causal=True, device=CPU)
        ):
            lq, lk = step.spec.seqlens_q, step.spec.seqlens_k
            per_step[(r, s)] = sum(
                a * (a + 1) // 2 if step.spec.causal else a * b for a, b in zip(lq, lk)
            )
    off_diagonal = {w for (r, s), w in per_step.items() if r != s}
    diagonal = {w for (r, s), w in per_step.items() if r == s}
    m = [n // (2 * cp) for n in seqlens]
    assert off_diagonal == {sum(2 * x * x for x in m)}
    assert diagonal == {sum(x * (2 * x + 1) for x in m)}


def test_sharding_errors_name_the_problem() -> None:
    x = torch.zeros(10, 2)
    with pytest.raises(ValueError, match=r"x must have sum\(seqlens\)=9 rows"):
        zigzag_shard(x, seqlens=[4, 5], cp=2, rank=0)
    with pytest.raises(ValueError, match=r"rank must be an index in \[0, cp=2\)"):
        zigzag_shard(x, seqlens=[4, 6], cp=2, rank=2)
    with pytest.raises(ValueError, match="cp must be an integer >= 1"):
        zigzag_positions(seqlens=[4], cp=0, rank=0)
    with pytest.raises(ValueError, match="lengths >= 1"):
        zigzag_token_index(seqlens=[4, 0], cp=1, rank=0)
    shards = [zigzag_shard(x, seqlens=[10], cp=2, rank=r) for r in range(2)]
    with pytest.raises(ValueError, match="shard of rank 1 has shape"):
        zigzag_unshard([shards[0], shards[1][:-1]], seqlens=[10])
    with pytest.raises(ValueError, match="one tensor per rank"):
        zigzag_unshard([], seqlens=[10])
