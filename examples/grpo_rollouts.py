"""Train on GRPO-style rollouts whose lengths exist only once they are generated.

    torchrun --nproc-per-node 2 examples/grpo_rollouts.py --steps 8            # overlapped
    torchrun --nproc-per-node 2 examples/grpo_rollouts.py --steps 8 --serial   # for comparison

A toy generator (``dyncp.testing.rollouts.RolloutLengths``: prompt groups with correlated,
long-tailed response lengths capped at a maximum response; scaled down here so that a CPU trains
it) produces each step's rollouts. The loop is a one-step off-policy pipeline: the rollouts of
step k+1 exist while step k trains, so ``OnlinePlanner.submit`` hands them to the planning thread
*before* step k trains and ``result`` finds the plan made (``--serial`` submits each batch when
its step starts: planning is then on the critical path). Every rank generates the same batch (the
trainer ranks all receive the rollouts); rank 0 plans with an anytime planner and broadcasts the
plan over a gloo group; the tiny decoder trains on it with ``runtime.execute``.

Rank 0 prints per step the root's planning time, the time the step waited for its plan, the
training time, and the cost model's predicted step time for the dyncp plan and for static CP
(the smallest CP size that holds the longest possible rollout, for every sequence).
"""

from __future__ import annotations

import argparse
import datetime
import time

import numpy as np
import torch
import torch.distributed as dist

from dyncp.cost_model import CostModel
from dyncp.planner import Planner
from dyncp.runtime import GroupPool, execute, job_timeout, reduce_gradients, reduce_loss
from dyncp.sampler import OnlinePlanner
from dyncp.testing import TinyConfig, TinyDecoder, microbatch_loss
from dyncp.testing.rollouts import RolloutLengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4, help="rollouts per prompt")
    p.add_argument("--median-response", type=int, default=160)
    p.add_argument("--max-response", type=int, default=900)
    p.add_argument("--capacity", type=int, default=512, help="tokens per rank per micro-batch")
    p.add_argument("--time-limit", type=float, default=0.1, help="planner deadline, seconds")
    p.add_argument("--profile", default=None, help="default: cpu-gloo (2) / cpu-gloo-4proc (4)")
    p.add_argument("--serial", action="store_true", help="plan after the previous step trains")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    profile = args.profile or ("cpu-gloo-4proc" if world == 4 else "cpu-gloo")
    pool = GroupPool()
    cost = CostModel.load(profile, ranks_per_node=world)
    planner = Planner(
        cost,
        world=world,
        ranks_per_node=world,
        capacity=args.capacity,
        time_limit=args.time_limit,
        cpsat=None,
    )
    rollouts = RolloutLengths(
        prompts=args.prompts,
        group_size=args.group_size,
        prompt_tokens=(16, 64),
        median_response=args.median_response,
        max_response=args.max_response,
    )
    static = Planner(
        cost,
        world=world,
        ranks_per_node=world,
        capacity=args.capacity,
        policy="static",
        max_length=rollouts.max_length,
    )
    torch.manual_seed(args.seed)
    cfg = TinyConfig(vocab=256, dim=64, heads=4, kv_heads=2, layers=2, ffn=128)
    model = TinyDecoder(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(args.seed)  # the same rollouts on every rank

    def generate() -> tuple[np.ndarray, np.ndarray, dict[int, torch.Tensor]]:
        ids, lengths = rollouts.draw(rng)
        gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
        tokens = {
            int(i): torch.randint(0, cfg.vocab, (int(n),), generator=gen)
            for i, n in zip(ids, lengths)
        }
        return ids, lengths, tokens

    span = datetime.timedelta(seconds=job_timeout())  # the job's timeout, not torch's 30 minutes
    group = dist.new_group(backend="gloo", timeout=span)  # used by the planning thread only
    rows = []
    with OnlinePlanner(planner, rank=rank, group=group) as online:
        batch = generate()
        pending = None if args.serial else online.submit(batch[0], batch[1])
        for step in range(args.steps):
            ids, lengths, tokens = batch
            following = generate() if step + 1 < args.steps else None
            start = time.perf_counter()
            if args.serial:  # planning on the critical path
                pending = online.submit(ids, lengths)
            elif following is not None:  # plan k+1 while k trains
                upcoming = online.submit(following[0], following[1])
            planned = pending.result(timeout=120)
            waited = time.perf_counter() - start
            losses: list[torch.Tensor] = []

            def step_fn(ctx, tokens=tokens, losses=losses) -> None:
                packed = torch.cat([tokens[i] for i in ctx.sample_ids])
                loss = microbatch_loss(model, ctx, packed, kernel="auto")
                loss.backward()
                losses.append(loss.detach())

            execute(planned.plan, pool, step_fn)
            reduce_gradients(model, pool=pool)  # SUM over the DP x CP axis; names a failed rank
            optim.step()
            optim.zero_grad(set_to_none=True)
            trained = time.perf_counter() - start - waited
            loss = reduce_loss(losses)
            if rank == 0:
                predicted = planned.plan.stats["predicted_step_seconds"]
                base = static.plan(lengths).stats["predicted_step_seconds"]
                rows.append((planned.plan_seconds, waited, trained, predicted, base))
                print(
                    f"step {step}: loss {loss.item():.4f}  {len(ids)} rollouts "
                    f"{int(lengths.sum())} tokens (longest {int(lengths.max())})  plan "
                    f"{planned.plan_seconds * 1e3:.1f} ms  waited {waited * 1e3:.1f} ms  train "
                    f"{trained:.3f} s  predicted {predicted:.3f} s vs static CP {base:.3f} s"
                )
            if following is not None:
                batch = following
                pending = None if args.serial else upcoming
    if rank == 0 and rows:
        plan_s, wait_s, train_s, pred, base = (np.array(c) for c in zip(*rows))
        later = slice(1, None) if len(rows) > 1 else slice(None)  # step 0 is never overlapped
        print(
            f"{'serial' if args.serial else 'overlapped'} planning over steps 1..: plan "
            f"{plan_s[later].mean() * 1e3:.1f} ms, exposed wait "
            f"{wait_s[later].mean() * 1e3:.1f} ms "
            f"({wait_s[later].sum() / plan_s[later].sum():.0%} of planning) per step of "
            f"{(train_s[later] + wait_s[later]).mean():.3f} s; predicted gain over static CP "
            f"{base.sum() / pred.sum():.3f}x"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
