"""dyncp's quickstart: a tiny Llama, 5 steps of real Wikipedia lengths, 2 CPU processes.

    torchrun --nproc-per-node 2 examples/quickstart.py

The README shows this file as it is, and a test runs it as written.
"""

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from dyncp.cost_model import CostModel
from dyncp.data import load_lengths, resolve_dataset
from dyncp.integrations.hf import causal_lm_loss, register_ring_attention
from dyncp.planner import Planner
from dyncp.runtime import GroupPool, execute, reduce_gradients, reduce_loss
from dyncp.sampler import DynamicCPSampler

STEPS, CAPACITY = 5, 512  # steps to run; tokens per rank per micro-batch
dist.init_process_group("gloo")  # "nccl" on GPUs (and a GPU profile such as h100-reference)
world, rank = dist.get_world_size(), dist.get_rank()
lengths = load_lengths(resolve_dataset("wikipedia"))[:4000].clip(max=1024)  # real lengths
torch.manual_seed(0)  # the same data and initial weights on every rank
dataset = [torch.randint(0, 256, (int(n),)) for n in lengths]  # yours: 1-D token tensors
config = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
model = AutoModelForCausalLM.from_config(config, attn_implementation=register_ring_attention())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
pool = GroupPool()  # every ring a plan can need, built once
profile = "cpu-gloo"  # a cost model measured on 2 CPU processes
planner = Planner(
    CostModel.load(profile, ranks_per_node=world),
    world=world,
    ranks_per_node=world,
    capacity=CAPACITY,
    deterministic=True,
)  # same plan on all
plans = {}
sampler = DynamicCPSampler(
    lengths,
    world_size=world,
    rank=rank,
    capacity=CAPACITY,
    planner=planner,
    global_batch_tokens=4 * world * CAPACITY,
    seed=0,
    on_step=lambda plan, info: plans.__setitem__(info.step, plan),
)
for mb in sampler:  # this rank's micro-batches; the last of each step marks it
    if not mb.meta.last_in_step:
        continue
    plan, losses = plans.pop(mb.meta.step), []

    def step_fn(ctx, losses=losses):  # one micro-batch on its ring: token loss * loss_scale
        loss = causal_lm_loss(model, ctx, torch.cat([dataset[i] for i in ctx.sample_ids]))
        loss.backward()
        losses.append(loss.detach())

    report = execute(plan, pool, step_fn, agree=False)  # the sampler agreed on the plan
    reduce_gradients(model, pool=pool)  # SUM over DP x CP: the gradient of the global batch
    optimizer.step()
    optimizer.zero_grad()
    loss = reduce_loss(losses)  # the global batch's mean token loss, on every rank
    if rank == 0:
        cp = sorted(set(plan.cp_of_sequences().values()))
        print(
            f"step {mb.meta.step}: loss {loss.item():.4f}, {len(plan.lengths)} documents, "
            f"CP sizes {cp}, {report.busy_seconds:.3f} s busy on rank 0, predicted step "
            f"{plan.stats['predicted_step_seconds']:.3f} s ({profile}, uncalibrated)"
        )
    if mb.meta.step + 1 == STEPS:
        break
sampler.close()
if rank == 0:
    print(f"ran {STEPS} steps of {type(model).__name__} on {world} processes under dynamic CP")
dist.destroy_process_group()
