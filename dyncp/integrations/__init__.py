"""Integrations of dyncp with model libraries; each lives in its own module behind an extra.

``dyncp.integrations.hf``: Hugging Face ``transformers`` causal LMs (``pip install dyncp[hf]``).
``dyncp.integrations.fsdp``: step plans on FSDP2 (``fully_shard``) models, ``FSDPRunner``
(gather once, compute locally, reduce once; 1-D, HSDP and DP x TP meshes).
``dyncp.integrations.fsdp_layout``: where each FSDP2 parameter's gradient goes in its unit's
reduce-scatter (1-D, HSDP and DP x TP meshes), and the FSDP2 root check.
``dyncp.integrations.fsdp_sharded``: the same with FSDP2's own per-block full sharding in lockstep
passes, ``ShardedFSDPRunner`` (1-D, HSDP and DP x TP meshes).
``dyncp.integrations.fsdp_mode``: which of the two a per-rank memory budget allows,
``choose_fsdp_mode``.
``dyncp.integrations.ddp``: step plans on ``DistributedDataParallel`` models, ``DDPRunner``.
``dyncp.integrations.trainer``: ``transformers.Trainer`` with dyncp steps, ``DynCPTrainer``
(``pip install dyncp[trainer]``).
``dyncp.integrations.local``: a one-rank plan on a process without torch.distributed,
``execute_local``.
``dyncp.integrations.trl``: TRL's ``SFTTrainer`` with dyncp steps, ``DynCPSFTTrainer``
(``pip install dyncp[trl]``).
Importing this package imports no model library; importing a submodule needs its extra.
"""

__all__: list[str] = []
