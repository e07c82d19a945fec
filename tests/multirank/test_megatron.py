"""dyncp's scheduler inside megatron-core's real dynamic-CP data path, on 8 gloo CPU ranks.

One spawn runs one global batch twice through megatron-core 0.16.1's own
``HybridCPDataLoaderWrapper`` (all-gather of lengths, the scheduler call, the all-to-all
re-routing) and ``hybrid_context_parallel_forward_backward`` (forward_step and backward_step per
sub-sample, a barrier per round): first with the release's ``BalancedCPScheduler``, then with
``DynCPScheduler`` installed by its one call, planning on every rank and then planning once on
the first rank and broadcasting. The model is tiny but needs its CP partners: every
token's output depends on the sum of its whole sequence's embeddings, all-reduced over the
sub-sample's hybrid group, so a partner running another sub-sample (or none) changes the loss or
hangs the collective (the process group's timeout then fails the run). Only the CUDA and
parallel_state stand-ins of ``dyncp.testing.megatron_cpu`` are not megatron-core's code.

Checked: every token processed exactly once (by token ids carried through the wrapper), CP
partners on the same sub-sample, the summed loss and the DP-reduced gradients equal to the
release's and to a one-process reference within fp64 rounding, and dyncp's schedule valid and
identical on every rank, with packs (several sub-samples per rank per round) and several CP sizes.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

pytest.importorskip(
    "megatron.core", reason="needs the megatron extra: pip install 'dyncp[megatron]'"
)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.nn.functional as dist_nn  # noqa: E402
from torch import nn  # noqa: E402

from dyncp.testing.distributed import run_gloo  # noqa: E402

pytestmark = pytest.mark.multirank

WORLD = 8
CAPACITY = 64  # megatron's max_seqlen_per_dp_cp_rank: sequences up to 512 tokens, CP 1 .. 8
VOCAB, DIM = 29, 6
#: The release's own scheduler, dyncp's planned on every rank, dyncp's planned once and broadcast.
SCHEDULERS = ("release", "dyncp", "dyncp-broadcast")


def batch_of(rank: int) -> list[list[int]]:
    """Rank ``rank``'s packed samples, as sub-sample lengths (long-tailed, CP 1 to 8)."""
    rng = np.random.default_rng(100 + rank)
    packs = []
    for _ in range(2):
        n = int(rng.integers(2, 4))
        packs.append([int(x) for x in np.clip(rng.lognormal(3.4, 0.9, n), 4, 400)])
    return packs


def uids_of(rank: int) -> list[list[np.ndarray]]:
    """Globally unique token ids of each sub-sample of ``batch_of(rank)``."""
    out, base = [], rank * 100_000
    for pack in batch_of(rank):
        subs = []
        for n in pack:
            subs.append(np.arange(base, base + n, dtype=np.int64))
            base += n
        out.append(subs)
    return out


class Tiny(nn.Module):
    """Embedding, a sequence-wide context (sum of the sequence's embeddings, all-reduced over the
    CP group), a linear head: partners' tokens change every output."""

    def __init__(self) -> None:
        super().__init__()
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM, dtype=torch.float64)
        self.head = nn.Linear(DIM, VOCAB, dtype=torch.float64)

    def set_input_tensor(self, _tensor) -> None:  # megatron's forward_step calls it
        pass

    def loss(self, tokens: torch.Tensor, total: int, group) -> torch.Tensor:
        h = self.emb(tokens)
        ctx = h.sum(0)
        if group is not None:
            ctx = dist_nn.all_reduce(ctx, group=group)
        logits = self.head(h + torch.tanh(ctx / total))
        return nn.functional.cross_entropy(logits, (tokens * 7 + 3) % VOCAB, reduction="sum")


def tokens_of(uids: torch.Tensor) -> torch.Tensor:
    return (uids * 13 + uids // 7) % VOCAB


def _step(rank: int, model: Tiny, scheduler: str, groups, tp_group) -> dict:
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import (
        hybrid_context_parallel_forward_backward,
    )
    from megatron.core.pipeline_parallel.schedules import check_first_val_step
    from megatron.core.process_groups_config import ProcessGroupCollection

    from dyncp.cost_model.model import CostModel
    from dyncp.cost_model.schema import load_profile
    from dyncp.integrations.megatron import DynCPScheduler

    config = ModelParallelConfig(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=CAPACITY)
    config.calculate_per_token_loss = True  # a TransformerConfig field forward_step reads
    packs = []
    for subs in uids_of(rank):
        uid = torch.from_numpy(np.concatenate(subs))
        cu = torch.tensor(np.cumsum([0] + [len(s) for s in subs]), dtype=torch.int32)
        packs.append({"tokens": tokens_of(uid), "uid": uid, "cu_seqlens": cu})
    pgs = ProcessGroupCollection()
    pgs.dp_cp, pgs.dp, pgs.tp = dist.group.WORLD, dist.group.WORLD, tp_group
    wrapper = HybridCPDataLoaderWrapper(iter([packs]), config, pg_collection=pgs)
    if scheduler.startswith("dyncp"):
        cost = CostModel(load_profile("h100-reference"), ranks_per_node=8)
        broadcast = scheduler == "dyncp-broadcast"
        DynCPScheduler.for_wrapper(wrapper, cost, broadcast=broadcast).install(wrapper)
    seen: list[np.ndarray] = []
    out_of_sync: list[str] = []

    def forward_step_func(data_iterator, model):
        sample = next(data_iterator)
        cp = int(sample["local_cp_size"])
        uid = sample["uid"]
        group = groups[cp] if cp > 1 else None
        if group is not None:  # the partners' sub-sample: its first token id and length
            mine = torch.tensor([int(uid[0]), len(uid)])
            got = [torch.zeros_like(mine) for _ in range(cp)]
            dist.all_gather(got, mine, group=group)
            if any(not torch.equal(g, mine) for g in got):
                out_of_sync.append(f"rank {rank}: {[g.tolist() for g in got]}")
        part = slice(rank % cp, None, cp)  # the group is an aligned block: index = rank % cp
        seen.append(uid[part].numpy().copy())
        loss = model.loss(sample["tokens"][part], len(uid), group)

        def loss_func(output):
            return output, torch.tensor(len(uid[part])), {"loss": output.detach().clone()}

        return loss, loss_func

    model.zero_grad(set_to_none=True)
    store: list = []
    hybrid_context_parallel_forward_backward(
        forward_step_func, wrapper, model, 1, None, None, store, config, False, None, False,
        contextlib.nullcontext, torch.zeros([], dtype=torch.int), check_first_val_step,
        model.model_type,
    )  # fmt: skip
    loss = (
        torch.stack([d["loss"] for d in store]).sum()
        if store
        else torch.zeros((), dtype=torch.float64)
    )
    dist.all_reduce(loss)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        grads[name] = g.clone()
    sched = wrapper.cp_balancing_scheduler
    rounds = None
    if scheduler == "dyncp":
        # The schedule every rank computed for itself, read back by planning the same lengths.
        lengths = [(i, int(n)) for i, n in enumerate(all_lengths())]
        rounds = sched.plan(lengths)
    return {
        "loss": loss.item(),
        "grads": grads,
        "seen": np.concatenate(seen) if seen else np.zeros(0, np.int64),
        "passes": len(store),
        "out_of_sync": out_of_sync,
        "rounds": rounds,
    }


def all_lengths() -> list[int]:
    return [n for r in range(WORLD) for pack in batch_of(r) for n in pack]


def _worker(rank: int, world: int) -> dict:
    from dyncp.testing.megatron_cpu import cpu_megatron, hybrid_groups, tp_groups

    groups = hybrid_groups(rank, world)
    tp = tp_groups(rank, world)
    model = Tiny()
    with cpu_megatron(tp):
        return {name: _step(rank, model, name, groups, tp) for name in SCHEDULERS}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_gloo(_worker, world=WORLD, timeout=180, pg_timeout=60)


def reference() -> tuple[float, dict[str, torch.Tensor]]:
    """The same global batch on one process: every sub-sample whole."""
    model = Tiny()
    total = torch.zeros((), dtype=torch.float64)
    for r in range(WORLD):
        for subs in uids_of(r):
            for uid in subs:
                total = total + model.loss(tokens_of(torch.from_numpy(uid)), len(uid), None)
    total.backward()
    return total.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_every_token_once_partners_in_sync(results: list[dict], scheduler: str) -> None:
    every = np.sort(np.concatenate([u for r in range(WORLD) for subs in uids_of(r) for u in subs]))
    seen = np.sort(np.concatenate([res[scheduler]["seen"] for res in results]))
    assert seen.shape == every.shape and np.array_equal(seen, every)
    assert [res[scheduler]["out_of_sync"] for res in results] == [[]] * WORLD


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_loss_and_grads_equal_one_process(results: list[dict], scheduler: str) -> None:
    ref_loss, ref_grads = reference()
    for res in results:
        got = res[scheduler]
        assert got["loss"] == pytest.approx(ref_loss, rel=1e-12, abs=0)
        assert got["loss"] == pytest.approx(res["release"]["loss"], rel=1e-12, abs=0)
        for name, ref in ref_grads.items():
            err = (got["grads"][name] - ref).abs().max().item()
            assert err <= 1e-10 * ref.abs().max().item(), (scheduler, name, err)


@pytest.mark.timeout(240)
def test_dyncp_schedule_is_one_schedule_with_packs_and_cp_sizes(results: list[dict]) -> None:
    from dyncp.planner.baselines.megatron_core import check_rounds

    rounds = results[0]["dyncp"]["rounds"]
    assert all(res["dyncp"]["rounds"] == rounds for res in results)
    n = len(all_lengths())
    check_rounds(rounds, range(n), WORLD)
    assert max(len(ids) for round_ in rounds for ids in round_) > 1  # packs: consecutive subs
    sizes = set()
    for round_ in rounds:
        for i in {i for ids in round_ for i in ids}:
            sizes.add(sum(i in ids for ids in round_))
    assert len(sizes) >= 3, sizes
    passes = sum(res["dyncp"]["passes"] for res in results)
    assert passes == sum(len(ids) for round_ in rounds for ids in round_)
