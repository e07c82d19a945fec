"""Hugging Face causal LMs under dynamic CP: dyncp's ring attention as a transformers attention.

    from dyncp.integrations.hf import causal_lm_loss, register_ring_attention

    name = register_ring_attention()                       # "dyncp_ring", once per process
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    # (or model.set_attn_implementation(name) on a model loaded with from_pretrained)

    def step_fn(ctx):                                      # runtime.execute calls this
        packed = torch.cat([tokens[i] for i in ctx.seq_ids])   # the micro-batch, unpadded
        causal_lm_loss(model, ctx, packed).backward()

The model stays the model the user asked for: its embeddings, norms, MLPs, its own RoPE (fed
with position ids that restart at 0 in every sequence and are sharded like the tokens) and its own
projections. Only the attention core is replaced, through transformers' attention-function
registry (``AttentionInterface``): every layer calls :func:`ring_attention_forward`, which runs
``dyncp.ring_attention.ring_attention`` over the micro-batch's ring with the layout passed down the
forward call (``ring_layout=ctx.layout``; there is no "current layout" stored anywhere).

Inputs are packed THD with batch dim 1: one row holding this rank's zigzag shards of every
sequence of the micro-batch, padding included (``ctx.shard``). No attention mask is built (the
layout says which token belongs to which sequence), so a micro-batch costs no ``T x T`` mask.

The loss, and why it is not the model's ``labels=`` loss: a transformers causal LM shifts its
labels inside the loss (token t is scored against label t + 1 of the same row). On a zigzag shard
the next row is usually not the next token of the sequence (the shard holds chunks r and 2c-1-r),
so shifting after sharding would score tokens against the wrong labels and drop one label per
chunk boundary. :func:`causal_lm_loss` shifts *before* sharding instead
(``next_token_labels``: each sequence's next tokens, -100 at its last token) and shards the
shifted labels with the tokens (padding -100); then every label token of the global batch lives
on exactly one rank of exactly one ring and is counted once. The token losses are summed with
``cross_entropy(..., reduction="sum")`` in the logits' dtype (bf16/fp16 upcast to fp32, as
transformers does) and multiplied by ``ctx.loss_scale``, so the gradients summed over the DP x
CP ranks are those of the global batch's mean token loss. The model's own loss function
(``ForCausalLMLoss``) with ``shift_labels`` would be equivalent in real training but casts the
logits to fp32 unconditionally, which would make an fp64 check of exactness impossible.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dyncp.plan import PlanError, StepPlan
from dyncp.plan.slice import PlanSlice
from dyncp.ring_attention import HybridLayout, RingLayout, ring_attention
from dyncp.runtime import IGNORE, next_token_labels

if TYPE_CHECKING:
    from dyncp.runtime import MicroBatchContext

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dyncp.integrations.hf needs transformers: pip install 'dyncp[hf]'") from exc

__all__ = [
    "ATTN_IMPLEMENTATION",
    "causal_lm_loss",
    "plan_check",
    "register_ring_attention",
    "ring_attention_forward",
    "ring_attention_mask",
    "shard_inputs",
    "windowed_layers",
]

#: The name under which :func:`register_ring_attention` registers ring attention.
ATTN_IMPLEMENTATION = "dyncp_ring"


def register_ring_attention(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register :func:`ring_attention_forward` in transformers' attention registry.

    Registration is global to the process (every model whose config names ``name`` uses it) and
    idempotent. Call it on every rank before building or switching the model. The name is also
    registered as a mask implementation (:func:`ring_attention_mask`): transformers drops the
    mask of an attention it has no mask function for, so without it a padding mask passed to the
    model would be silently ignored instead of refused.

    Returns:
        ``name``, to pass as ``attn_implementation``.

    Raises:
        ValueError: ``name`` is empty or is one of transformers' own implementations.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    taken = AttentionInterface._global_mapping.get(name)
    masked = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name)
    if (
        name == "eager"
        or (taken is not None and taken is not ring_attention_forward)
        or (masked is not None and masked is not ring_attention_mask)
    ):
        raise ValueError(
            f"attention implementation {name!r} is already registered as "
            f"{taken if taken is not None else masked!r}; choose another name "
            f"(default {ATTN_IMPLEMENTATION!r})"
        )
    AttentionInterface.register(name, ring_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ring_attention_mask)
    return name


def ring_attention_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """The mask transformers builds for ring attention: none, because the layout says which
    token belongs to which sequence and the kernels apply causality themselves.

    Transformers calls this once per forward, before the first layer (so before any ring
    communicates), with the user's 2-D padding mask as ``attention_mask`` (bool). A mask with a
    padded position would mean some tokens are not to be attended to; ring attention would
    attend to them, training a different model, so it is refused. An all-ones mask (what a
    tokenizer returns for an unpadded row) says nothing and is accepted.

    Raises:
        ValueError: ``attention_mask`` masks out a position.
    """
    if attention_mask is not None and not bool(attention_mask.all()):
        padded = int((~attention_mask.bool()).sum())
        raise ValueError(
            f"dyncp ring attention takes no padding mask: attention_mask of shape "
            f"{tuple(attention_mask.shape)} masks out {padded} position(s). Pack the "
            f"micro-batch's sequences without padding (causal_lm_loss and shard_inputs pad "
            f"through the layout) and pass attention_mask=None (an all-ones mask is accepted)"
        )
    return None


def ring_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    ring_layout: RingLayout | None = None,
    ring_kernel: str = "auto",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention core of one transformers layer, computed by ring attention.

    Args:
        module: the calling attention module (``is_causal`` is read from it, default True).
        query: ``(1, H, T, D)``; key, value: ``(1, Hkv, T, D)``, ``H % Hkv == 0`` (GQA), with
            RoPE already applied by the model; ``T`` is the layout's local token count. Under
            autocast (the Trainer's ``bf16=True``) the model's RoPE leaves query and key in
            float32 and value in bfloat16; ring attention casts them to the autocast dtype, as
            torch's SDPA does, so the layer runs as it would with ``attn_implementation="sdpa"``.
        attention_mask: must be None (the layout replaces the mask; none is built for this
            implementation).
        scaling: the model's softmax scale (``head_dim ** -0.5`` unless the config says else).
        dropout: must be 0 (ring attention has no attention dropout).
        ring_layout: the micro-batch's layout on this rank, passed to the model's forward as
            ``ring_layout=ctx.layout``; transformers hands forward kwargs down to every layer.
        ring_kernel: the block kernel (``"auto"``, ``"flash"``, ``"sdpa"``, ``"math"``).
        **kwargs: the rest of transformers' attention kwargs. A layer's ``sliding_window``
            (each query sees itself and the ``sliding_window - 1`` tokens before it, as in
            transformers' masks) runs ring attention's windowed path, which skips the ring steps
            outside the window and needs the ``"auto"`` or ``"math"`` kernel. ``softcap`` and
            ``s_aux`` (attention sinks) must be None: ring attention does not compute them, and
            silently dropping them would train a different model.

    Returns:
        ``(out, None)``: ``out`` is ``(1, T, H, D)`` as transformers expects; no weights.

    Raises:
        ValueError: no layout, a batch dim other than 1, a mask, dropout, or a feature ring
            attention does not compute (naming it).
    """
    if ring_layout is None:
        raise ValueError(
            "the dyncp ring attention implementation needs the micro-batch's layout: call the "
            "model with ring_layout=ctx.layout (see dyncp.integrations.hf.causal_lm_loss)"
        )
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"dyncp ring attention takes packed inputs with batch dim 1 (one row holding every "
            f"sequence of the micro-batch), got query of shape {tuple(query.shape)}"
        )
    if attention_mask is not None:
        raise ValueError(
            "dyncp ring attention takes no attention_mask: sequence boundaries come from the "
            "layout; pass position_ids restarting per sequence and no mask"
        )
    if dropout:
        raise ValueError(f"dyncp ring attention has no attention dropout; got dropout={dropout}")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"dyncp ring attention computes (causal, optionally windowed) softmax attention; "
                f"this layer asks for {name}={kwargs[name]!r}, which it does not support"
            )
    window = kwargs.get("sliding_window")
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    out = ring_attention(
        q,
        k,
        v,
        ring_layout,
        causal=bool(getattr(module, "is_causal", True)),
        softmax_scale=scaling,
        kernel=ring_kernel,
        window=None if window is None else int(window),
    )
    return out.unsqueeze(0), None


def windowed_layers(model: nn.Module) -> list[str]:
    """Names of ``model``'s attention modules that attend within a sliding window.

    Read from the modules (``sliding_window`` set, as transformers' attention modules do for a
    ``"sliding_attention"`` layer), since that is what each layer passes to the attention.
    """
    return [
        name
        for name, module in model.named_modules()
        if getattr(module, "sliding_window", None) is not None
    ]


def plan_check(model: nn.Module) -> Callable[[StepPlan | PlanSlice], None]:
    """A check of each step's plan against ``model``, for ``execute(..., plan_check=...)``.

    Ring attention's windowed path runs on plain rings only, so a model with sliding-window
    layers cannot run a group that splits its heads (``Group.heads`` > 1). ``execute`` calls the
    check on every rank after the plan is agreed and validated and before any ring collective,
    so such a plan makes every rank raise the same PlanError instead of failing in its first
    windowed layer after the layers before it have communicated. (Given a PlanSlice it sees this
    rank's groups only: the ranks of a split group refuse it, the others learn as from any
    failed group.)
    """
    windowed = windowed_layers(model)

    def check(plan: StepPlan | PlanSlice) -> None:
        if not windowed:
            return
        split = [(w, g) for w, wave in enumerate(plan.waves) for g in wave.groups if g.heads > 1]
        if split:
            w, g = split[0]
            raise PlanError(
                "head-split-window",
                f"{len(split)} group(s) split heads, first in wave {w}: ranks "
                f"{g.start}..{g.start + g.size - 1} as heads {g.heads} x ring {g.ring}; the model "
                f"has {len(windowed)} sliding-window layer(s) ({windowed[0]}, ...), which run on "
                f"plain rings only: plan with head_sizes=(1,)",
                tuple(g.start for _, g in split),
            )

    return check


def shard_inputs(
    ctx: MicroBatchContext, tokens: torch.Tensor, labels: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """This rank's model inputs for one micro-batch: ids, positions and shifted labels, ``(1, T)``.

    Args:
        ctx: the micro-batch's context (from ``runtime.execute``).
        tokens: the micro-batch's sequences packed in ``ctx.seq_ids`` order, unpadded (int64).
        labels: the label of each token for the *next-token* objective, already shifted (the
            label at row i is what row i must predict; -100 where nothing is predicted). Default
            ``next_token_labels(tokens, ctx.seqlens)``: the next token inside each sequence.

    Returns:
        ``input_ids``, ``position_ids`` (restarting at 0 in every sequence, zigzag-sharded like
        the tokens) and ``labels`` (-100 on padding), each with batch dim 1.

    Raises:
        ValueError: tokens or labels whose length is not the micro-batch's token count.
    """
    total = sum(ctx.seqlens)
    if tokens.dim() != 1 or tokens.shape[0] != total:
        raise ValueError(
            f"tokens must be the micro-batch's {total} tokens packed in one dimension "
            f"(seqlens {ctx.seqlens}), got shape {tuple(tokens.shape)}"
        )
    if labels is None:
        labels = next_token_labels(tokens, ctx.seqlens)
    elif labels.shape != tokens.shape:
        raise ValueError(
            f"labels must have the tokens' shape {tuple(tokens.shape)}, got {tuple(labels.shape)}"
        )
    return {
        "input_ids": ctx.shard(tokens)[None],
        "position_ids": ctx.positions().to(tokens.device)[None],
        "labels": ctx.shard(labels, pad_value=IGNORE)[None],
    }


def causal_lm_loss(
    model: nn.Module,
    ctx: MicroBatchContext,
    tokens: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    kernel: str = "auto",
) -> torch.Tensor:
    """Summed next-token loss of one micro-batch on this rank, times ``ctx.loss_scale``.

    Backward it inside ``step_fn``; after ``execute``, all-reduce (SUM) the gradients over the
    DP x CP ranks. See the module docstring for why the labels are shifted before sharding.

    Args:
        model: a transformers causal LM whose attention implementation is the registered ring
            (or a DistributedDataParallel wrapping of one: its ``.module`` has the config).
        ctx: the micro-batch's context.
        tokens: the micro-batch's sequences packed in ``ctx.seq_ids`` order, unpadded.
        labels: pre-shifted labels (see :func:`shard_inputs`); with custom labels, pass
            ``execute(..., labels_per_sequence=...)`` their count per sequence so the loss scale
            counts the same tokens.
        kernel: ring attention's block kernel.

    Raises:
        ValueError: the model does not use a ring attention registered by this module.
    """
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", 0)
    impl = getattr(config, "_attn_implementation", None)
    if AttentionInterface._global_mapping.get(impl) is not ring_attention_forward:
        raise ValueError(
            f"the model's attention implementation is {impl!r}; build it with "
            f"attn_implementation=register_ring_attention() (or set_attn_implementation)"
        )
    if isinstance(ctx.layout, HybridLayout) and windowed_layers(model):
        # Every rank of the group raises here, before its first all-to-all (execute refuses
        # such a plan before any collective when given plan_check(model)).
        raise ValueError(
            f"this micro-batch's group splits heads ({ctx.layout.heads} x ring "
            f"{ctx.layout.ring.cp}) but the model has sliding-window layers "
            f"({', '.join(windowed_layers(model)[:2])}), which run on plain rings only; plan "
            f"with head_sizes=(1,) and pass execute(..., plan_check=plan_check(model))"
        )
    inputs = shard_inputs(ctx, tokens, labels)
    out = model(
        input_ids=inputs["input_ids"],
        position_ids=inputs["position_ids"],
        use_cache=False,
        ring_layout=ctx.layout,
        ring_kernel=kernel,
    )
    logits = out.logits[0]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    loss = nn.functional.cross_entropy(
        logits, inputs["labels"][0].to(logits.device), ignore_index=IGNORE, reduction="sum"
    )
    return loss * ctx.loss_scale
