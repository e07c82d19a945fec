"""The tiny decoder cut into pipeline chunks: what ``execute_pipeline`` calls on each process.

Virtual stage ``q`` (chunk ``c`` of stage ``s``, ``q = c * stages + s``) holds the blocks
``stage_layers(layers, pipeline)[q]`` after the ones of the virtual stages before it; the first
also holds the embedding, the last the final norm, the LM head and the loss. A chunk holds the
*same* modules as the whole model it is cut from (no copy), so the gradients it accumulates are
the whole model's, parameter by parameter: a test builds the model once with one seed on every
process, runs its own chunks, and compares each parameter with one process on the whole batch.

A user's model is cut the same way: any callables ``chunk(x, ctx)`` following the contract of
``dyncp.runtime.pipeline`` (``x`` None on the first, the scaled loss returned by the last).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from dyncp.plan import Pipeline, StepPlan, stage_layers
from dyncp.profiling import TinyConfig, TinyDecoder
from dyncp.runtime import (
    IGNORE,
    Activation,
    MicroBatchContext,
    PipelineGroups,
    PipelineLayout,
    execute_pipeline,
    next_token_labels,
)
from dyncp.runtime.pipeline_measure import gather_pipeline_reports, pipeline_measurement

__all__ = ["TinyChunk", "measured_steps", "tiny_chunks"]

#: The tokens of a micro-batch, packed in ``ctx.seq_ids`` order and unpadded.
Tokens = Callable[[MicroBatchContext], torch.Tensor]


class TinyChunk(nn.Module):
    """Blocks ``[first, first + count)`` of a TinyDecoder, with its embedding when ``embeds``
    and its norm, head and loss when ``heads``."""

    def __init__(
        self, model: TinyDecoder, first: int, count: int, *, embeds: bool, heads: bool,
        tokens: Tokens, kernel: str = "math",
    ) -> None:  # fmt: skip
        super().__init__()
        self.embed = model.embed if embeds else None
        self.blocks = nn.ModuleList(model.blocks[first : first + count])
        self.norm = model.norm if heads else None
        self.head = model.head if heads else None
        self.first, self.count = first, count
        self._tokens, self.kernel = tokens, kernel

    def forward(self, x: torch.Tensor | None, ctx: MicroBatchContext) -> torch.Tensor:
        packed = self._tokens(ctx) if (self.embed is not None or self.head is not None) else None
        if self.embed is not None:
            assert packed is not None
            x = self.embed(ctx.shard(packed))
        if x is None:
            raise ValueError("a chunk without the embedding needs the previous stage's output")
        positions = ctx.positions()
        for block in self.blocks:
            x = block(x, positions, ctx.layout, self.kernel)
        if self.head is None:
            return x
        assert packed is not None and self.norm is not None
        labels = ctx.shard(next_token_labels(packed, ctx.seqlens), pad_value=IGNORE)
        logits = self.head(self.norm(x))
        loss = nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
        return loss * ctx.loss_scale


def tiny_chunks(
    model: TinyDecoder, pipeline: Pipeline, stage: int, tokens: Tokens, *, kernel: str = "math"
) -> list[TinyChunk]:
    """Stage ``stage``'s ``pipeline.virtual`` chunks of ``model`` (module docstring);
    ``tokens(ctx)``: the micro-batch's packed tokens (read by the first and last chunks)."""
    layers = stage_layers(model.cfg.layers, pipeline)
    if not 0 <= stage < pipeline.stages:
        raise ValueError(f"stage {stage} is not one of 0..{pipeline.stages - 1}")
    last = pipeline.model_stages - 1
    chunks = []
    for c in range(pipeline.virtual):
        q = c * pipeline.stages + stage
        first = sum(layers[:q])
        chunks.append(
            TinyChunk(
                model,
                first,
                layers[q],
                embeds=q == 0,
                heads=q == last,
                tokens=tokens,
                kernel=kernel,
            )  # fmt: skip
        )
    return chunks


def measured_steps(
    rank: int, world: int, plans: list[str], columns: int, config: dict
) -> tuple[list, list] | None:
    """A ``run_gloo`` worker: run each plan (JSON) once on a PP 2 x ``columns`` grid with a fresh
    ``TinyDecoder(TinyConfig(**config))`` in fp32 (seeded tokens), and return, on grid rank 0,
    each step's ``PipelineStepMeasurement`` and its gathered reports (None elsewhere)."""
    cfg = TinyConfig(**config)
    groups = PipelineGroups(PipelineLayout(stages=2, columns=columns), timeout=120.0)
    torch.manual_seed(0)
    model = TinyDecoder(cfg)
    measured, gathered = [], []
    for step, plan_json in enumerate(plans):
        plan = StepPlan.from_json(plan_json)
        gen = torch.Generator().manual_seed(step)
        tokens = [torch.randint(0, cfg.vocab, (s,), generator=gen) for s in plan.lengths]
        chunks = tiny_chunks(
            model,
            plan.pipeline,
            groups.stage,
            lambda ctx, tokens=tokens: torch.cat([tokens[i] for i in ctx.seq_ids]),
        )
        model.zero_grad(set_to_none=True)
        dist.barrier(group=groups.control_group)
        report = execute_pipeline(plan, groups, chunks, activation=Activation(hidden=cfg.dim))
        reports = gather_pipeline_reports(report, groups)
        if reports is not None:
            bytes_per_token = cfg.dim * 4  # fp32 hand-offs
            measured.append(
                pipeline_measurement(plan, reports, activation_bytes_per_token=bytes_per_token)
            )
            gathered.append(reports)
    return (measured, gathered) if groups.position == 0 else None
