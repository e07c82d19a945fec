"""Profile schema: the measured (or stated) numbers a CostModel is built from.

A profile is JSON validated by pydantic. Unknown fields are refused and every error names the
field's path, so a typo in a hand-edited profile fails loudly instead of silently using a default.
All times are seconds, sizes are bytes, and attention/communication figures are *per layer*
(multiplied by ``model.num_layers``).

Two attention forms share one schema:

- ``table``: measured forward+backward seconds of one causal sequence at CP size 1, by length,
  interpolated in log-log space (the form the profiler and the H100 reference produce);
- ``quadratic``: ``alpha * s**2 + beta * s`` seconds, coefficients given directly, so published
  analytic cost models plug in without measurements.

At CP size c a ring (``communication.kind = "ring"``, the default) runs c steps over p/c local
tokens, so attention costs a rank ``alpha * s^2 / c + beta * s`` (``beta`` is a per-step,
per-query-token cost); an all-to-all group (``"all_to_all"``: heads are exchanged, every rank runs
the whole sequence for 1/c of the heads) costs ``A(s) / c``. ``linear_seconds_per_token`` is
divided by c either way.

Communication per group size: ``communication.links`` optionally lists one (latency, bandwidth)
per group size, so a measured table (a bandwidth per SP size, the cliff wherever it really is)
replaces the two-link ``intra_node`` / ``inter_node`` default. A ring overlaps its transfers with
compute when ``overlap`` is true; an all-to-all is always added without overlap.

Head exchange of hybrid groups (a ring profile's group of c = u x r ranks whose u-rank head
groups exchange heads by all-to-all): ``communication.all_to_all_links`` optionally lists, per
head-group size u, the (latency, bandwidth) of an all-to-all over u ranks in which each rank holds
B bytes: ``latency + B / bandwidth``. A size not listed takes the next larger listed one (never an
optimistic guess); with no list at all it is derived from the ring link of u ranks,
``link(u)``, with bandwidth x u / (u - 1): each rank keeps 1/u of its bytes and sends the other
(u - 1)/u over a link as fast as its ring step's, all ranks at once (a full-bisection switch,
NVSwitch inside a node). A profile without the field loads and prices exactly as before, and
``to_json`` leaves the field out while it is empty.

Kernel-aware attention (both optional, both left out by ``to_json`` while unset, so a profile
without them loads and prices exactly as before under the same ``schema_version``):
``attention.tiles`` quantises each attention call to the kernel's tiles (block sizes read from
the kernel's source, ``dyncp.cost_model.kernels``), and ``attention.ring_sequence_step_seconds``
is a fixed cost per (sequence x ring step) at CP > 1 -- the per-chunk correction and launch
kernels of a ring implementation -- that CP 1 never pays.

Padding: ``padding.multiple_per_rank`` (default 2: zigzag, a multiple of 2c) sets how each
sequence is padded when the model *prices* a micro-batch at c > 1; 0 prices unpadded tokens, as
published analytic models do. Memory is the plan contract's rule (``dyncp.plan.padded_length``)
whatever the profile says.

Published forms as profiles (each bundled, each checked against its formula in the tests):

- Megatron's ``sum(L^2) / cp`` (the workload its dynamic-CP packing balances):
  ``dyncp/cost_model/profiles/published-megatron.json``;
- FlexSP-style ``sum(a1 L^2 + a2 L) / s + beta + [s > 1] V sum(L) / (s bw[s])``: attention
  ``quadratic`` with ``alpha = a1 / layers``, ``beta = 0``; ``linear_seconds_per_token = a2``;
  ``overheads.microbatch_seconds = beta``; ``communication.kind = "all_to_all"`` with
  ``kv_bytes_per_token = V / layers`` and ``links`` holding ``bw[s]`` (latency 0);
  ``padding.multiple_per_rank = 0``: ``dyncp/cost_model/profiles/published-flexsp.json``;
- WLB-LLM's ``(W_a sum(L^2) + W_l sum(L)) / cp`` (attention quadratic in each document, linear
  work in tokens, split evenly by per-document CP sharding):
  ``dyncp/cost_model/profiles/published-wlbllm.json``.

The whole step (``schema_version: 2`` only; a version-1 profile has none and prices exactly as
before): ``step`` lists what a training step pays besides its micro-batches' attention, linear
work and rings -- the embedding and the LM head with its loss per token (priced in every
micro-batch, divided by c like the linear work), the gradient reduction by parameter bytes over
a link, and the optimizer's update by parameter count -- so that a predicted speedup is a
whole-step one (``dyncp.cost_model.step_parts``).

What the planner, the bound and the simulator call on a cost model is listed in
``dyncp.cost_model.protocol``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "Profile",
    "ProfileError",
    "RunContext",
    "StepCosts",
    "load_profile",
    "bundled_profiles",
    "PROFILES_DIR",
]

# The bundled profiles are package data (pyproject.toml), so a wheel carries them.
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


class ProfileError(ValueError):
    """A profile file is missing, unreadable or breaks the schema (the message names the field)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Assumption(_Strict):
    """A number the profile uses that was not measured, with where it comes from."""

    name: str
    value: float | str
    source: str


class RunContext(_Strict):
    """How a measured profile's run was set up: what a validation or a user's run must match.

    Times measured with 4 processes sharing 2 cores, or with 8 threads instead of 1, describe
    another machine; ``dyncp.profiling.validate`` compares these fields before it compares
    numbers.
    """

    processes: int = Field(gt=0, description="processes that ran side by side (ranks)")
    threads_per_process: int = Field(gt=0, description="torch intra-op threads per process")
    device_type: str = Field(description="cpu or cuda")
    device_name: str = Field(description="CPU model or GPU name")
    cpus: int = Field(gt=0, description="CPU cores the machine had")


class Provenance(_Strict):
    """Where the numbers come from: required, so a profile cannot pretend to be measured."""

    source: str = Field(description="what was measured or derived, and by whom")
    device: str
    date: str
    method: str = Field(description="command or procedure that produced the file")
    assumptions: list[Assumption] = []
    notes: list[str] = []
    run: RunContext | None = Field(
        default=None, description="the measuring run's set-up (measured profiles only)"
    )


class ModelShape(_Strict):
    """The transformer the profile describes (informational except ``num_layers``)."""

    name: str
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    dtype_bytes: int = Field(gt=0)


class HeadScale(_Strict):
    """Attention of 1/``heads`` of the heads costs ``scale`` x A / ``heads`` (measured by
    calibration; a head count not listed is priced at scale 1, the plain 1/u assumption)."""

    heads: int = Field(ge=2)
    scale: float = Field(gt=0)


def _check_head_scales(scales: list[HeadScale]) -> None:
    sizes = [h.heads for h in scales]
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError("attention.head_scales must be sorted by strictly increasing heads")


class AttentionTiles(_Strict):
    """The attention kernel's tiles (``dyncp.cost_model.kernels``: read from its source, never
    fitted). When present, every attention call prices a chunk of n tokens at the causal length
    its padded tiles cover (``kernels.tile_length``), forward and backward each with its own
    blocks; absent, chunks are priced at their length (profiles without the field price exactly
    as before)."""

    kernel: str = Field(description="kernel name, e.g. fa3-sm90 (dyncp.cost_model.kernels)")
    forward_block_q: int = Field(ge=1)
    forward_block_kv: int = Field(ge=1)
    backward_block_q: int = Field(ge=1)
    backward_block_kv: int = Field(ge=1)
    pads: bool = Field(default=True, description="a partial tile costs a whole one")
    source: str = Field(description="file and line of the kernel source the blocks are read from")


_RING_SEQUENCE = (
    "fixed cost per sequence per ring step at CP > 1 (correction and launch kernels per chunk), "
    "fwd+bwd; CP 1 and all-to-all groups never pay it"
)


class AttentionTable(_Strict):
    """Measured causal attention forward+backward seconds per layer for one sequence, cp = 1."""

    form: Literal["table"]
    lengths: list[int] = Field(min_length=2)
    seconds: list[float] = Field(min_length=2)
    step_overhead_seconds: float = Field(
        ge=0, description="fixed kernel cost of one ring step (one varlen call), fwd+bwd"
    )
    backward_forward_ratio: float = Field(gt=0)
    sequence_overhead_seconds: float = Field(
        ge=0, default=0.0, description="fixed cost per sequence per ring step, fwd+bwd"
    )
    head_scales: list[HeadScale] = Field(
        default=[], description="per head-split size u: measured attention cost of 1/u of heads"
    )
    ring_sequence_step_seconds: float = Field(ge=0, default=0.0, description=_RING_SEQUENCE)
    tiles: AttentionTiles | None = None

    @model_validator(mode="after")
    def _check(self) -> AttentionTable:
        _check_head_scales(self.head_scales)
        if len(self.lengths) != len(self.seconds):
            raise ValueError(
                f"attention.lengths has {len(self.lengths)} entries but attention.seconds has "
                f"{len(self.seconds)}"
            )
        if any(b <= a for a, b in zip(self.lengths, self.lengths[1:])) or self.lengths[0] < 1:
            raise ValueError("attention.lengths must be positive and strictly increasing")
        fixed = self.step_overhead_seconds + self.sequence_overhead_seconds
        if any(t <= fixed for t in self.seconds):
            raise ValueError(
                "attention.seconds must all exceed attention.step_overhead_seconds + "
                f"sequence_overhead_seconds ({fixed}); the overheads are part of each measurement"
            )
        return self


class AttentionQuadratic(_Strict):
    """Attention seconds per layer for one sequence of s tokens at cp = 1: alpha*s^2 + beta*s."""

    form: Literal["quadratic"]
    alpha: float = Field(ge=0)
    beta: float = Field(ge=0)
    step_overhead_seconds: float = Field(ge=0, default=0.0)
    backward_forward_ratio: float = Field(gt=0, default=2.5)
    sequence_overhead_seconds: float = Field(ge=0, default=0.0)
    head_scales: list[HeadScale] = Field(default=[])
    ring_sequence_step_seconds: float = Field(ge=0, default=0.0, description=_RING_SEQUENCE)
    tiles: AttentionTiles | None = None

    @model_validator(mode="after")
    def _check(self) -> AttentionQuadratic:
        _check_head_scales(self.head_scales)
        return self


class Link(_Strict):
    """One ring step's transfer: ``latency + bytes / bandwidth``."""

    latency_seconds: float = Field(ge=0)
    bandwidth_bytes_per_second: float = Field(gt=0)


class GroupLink(Link):
    """The link of groups of exactly ``group_size`` ranks."""

    group_size: int = Field(ge=2)


class Communication(_Strict):
    """CP traffic. Ring: each step moves the KV block, the backward also moves dK/dV.
    All-to-all: per layer, ``kv_bytes_per_token`` x tokens / c bytes per rank, never overlapped."""

    kv_bytes_per_token: float = Field(
        ge=0, description="bytes of K and V per token per layer (2 * kv_heads * head_dim * dtype)"
    )
    backward_bytes_factor: float = Field(ge=0, default=2.0)
    overlap: bool = Field(
        default=True, description="transfer of the next block overlaps the current compute"
    )
    intra_node: Link
    inter_node: Link
    kind: Literal["ring", "all_to_all"] = Field(
        default="ring", description="ring attention (KV blocks) or all-to-all of heads (Ulysses)"
    )
    links: list[GroupLink] = Field(
        default=[],
        description="per group size; when given, used instead of intra_node / inter_node",
    )
    all_to_all_links: list[GroupLink] = Field(
        default=[],
        description="per head-group size u: an all-to-all over u ranks in which each rank holds "
        "B bytes takes latency + B / bandwidth (see CostModel.all_to_all_link)",
    )

    @model_validator(mode="after")
    def _check_links(self) -> Communication:
        for field in ("links", "all_to_all_links"):
            sizes = [link.group_size for link in getattr(self, field)]
            if any(b <= a for a, b in zip(sizes, sizes[1:])):
                raise ValueError(
                    f"communication.{field} must be sorted by strictly increasing group_size"
                )
        if self.all_to_all_links and self.kind != "ring":
            raise ValueError(
                "communication.all_to_all_links prices the head exchange of a ring profile's "
                "hybrid groups; a kind 'all_to_all' profile lists its exchange in links"
            )
        return self


#: How the data-parallel gradients are reduced (``dyncp.cost_model.step_parts`` prices each).
INTEGRATIONS = ("ddp", "fsdp2-once", "fsdp2-full")


class StepCosts(_Strict):
    """What one training step pays outside its micro-batches' attention, linear work and rings.

    Each number is measured (``dyncp.profiling``) or a stated assumption named in the
    provenance; ``dyncp.cost_model.step_parts`` turns them into a step's named parts. The
    data-parallel collectives use the profile's measured links
    (``dyncp.cost_model.sharding.collective_from_profile``).
    """

    embedding_seconds_per_token: float = Field(ge=0, default=0.0, description="fwd+bwd")
    head_loss_seconds_per_token: float = Field(
        ge=0, default=0.0, description="LM head and loss, fwd+bwd"
    )
    parameters: int = Field(ge=0, description="parameters of one model replica")
    gradient_bytes_per_parameter: float = Field(gt=0, default=4.0)
    parameter_bytes_per_parameter: float = Field(gt=0, default=2.0)
    optimizer_seconds_per_parameter: float = Field(
        ge=0, description="the optimizer's update of one parameter on one rank (unsharded)"
    )
    fixed_seconds: float = Field(
        ge=0, default=0.0, description="other work every step pays once (measured or calibrated)"
    )
    integration: Literal["ddp", "fsdp2-once", "fsdp2-full"] = Field(
        default="ddp", description="how gradients are reduced unless a caller says otherwise"
    )


class Padding(_Strict):
    """How a sequence is padded when a micro-batch is priced at CP size c > 1."""

    multiple_per_rank: int = Field(
        default=2, ge=0, description="pad to a multiple of this x c tokens (2: zigzag); 0: none"
    )


class Overheads(_Strict):
    microbatch_seconds: float = Field(ge=0, description="fixed cost of one forward+backward")
    wave_seconds: float = Field(ge=0, description="synchronisation when group membership changes")


class WindowGroup(_Strict):
    """``layers`` sliding-window attention layers whose queries each see ``window`` keys."""

    window: int = Field(ge=1, description="keys each query sees, itself included")
    layers: int = Field(ge=1)


class LayerMix(_Strict):
    """Which mixers the layers run, when not every layer is full causal attention.

    Optional: a profile without it prices ``model.num_layers`` full-attention layers, as before.
    With it, ``attention`` prices only ``full_attention_layers`` layers; sliding-window layers
    reuse the same attention table at the window's length, and SSM layers cost a time per token
    plus the chunk-state all-gather of ``dyncp.ssm`` (see ``dyncp.cost_model.layer_mix``).
    Parallel mixers (attention and SSM in one layer, as in Falcon-H1) count in both.
    """

    full_attention_layers: int = Field(ge=0)
    window: list[WindowGroup] = []
    ssm_layers: int = Field(default=0, ge=0)
    ssm_seconds_per_token: float = Field(
        default=0.0, ge=0, description="one SSM mixer's scan, fwd+bwd, per token"
    )
    ssm_chunk_state_bytes: float = Field(
        default=0.0, ge=0, description="bytes of one chunk's (decay, state) summary per layer"
    )
    ssm_all_to_all_bytes_per_token: float = Field(
        default=0.0,
        ge=0,
        description="bytes a token's SSM inputs and outputs move to and from channel "
        "parallelism per layer, forward (0: only state passing is offered)",
    )


class Profile(_Strict):
    """A complete cost-model profile."""

    schema_version: Literal[1, 2]
    name: str
    description: str
    provenance: Provenance
    model: ModelShape
    linear_seconds_per_token: float = Field(
        ge=0, description="all non-attention work (GEMMs, norms, MLP, head), fwd+bwd, whole model"
    )
    attention: Annotated[AttentionTable | AttentionQuadratic, Field(discriminator="form")]
    communication: Communication
    overheads: Overheads
    padding: Padding = Padding()
    layer_mix: LayerMix | None = None
    step: StepCosts | None = None

    @model_validator(mode="after")
    def _check_mix(self) -> Profile:
        if self.step is not None and self.schema_version < 2:
            raise ValueError("step needs schema_version 2 (version 1 profiles have no step)")
        mix = self.layer_mix
        if mix is None:
            return self
        attention = mix.full_attention_layers + sum(g.layers for g in mix.window)
        if attention > self.model.num_layers or mix.ssm_layers > self.model.num_layers:
            raise ValueError(
                f"layer_mix: {attention} attention and {mix.ssm_layers} SSM layers, but "
                f"model.num_layers is {self.model.num_layers}"
            )
        if attention + mix.ssm_layers == 0:
            raise ValueError("layer_mix: no layer has a mixer (attention, window or ssm)")
        if self.communication.kind != "ring":
            raise ValueError("layer_mix is priced for ring attention: communication.kind 'ring'")
        if self.attention.ring_sequence_step_seconds:
            raise ValueError(
                "attention.ring_sequence_step_seconds is priced for profiles without a "
                "layer_mix; set it to 0 or drop the layer_mix"
            )
        return self

    @classmethod
    def from_json(cls, text: str, origin: str = "<string>") -> Profile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile {origin} is not valid JSON: {exc}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                for err in exc.errors()
            )
            raise ProfileError(f"profile {origin} is invalid: {problems}") from None

    def to_json(self) -> str:
        data = self.model_dump(mode="json")
        if data.get("layer_mix") is None:
            data.pop("layer_mix", None)  # profiles without a mix keep their exact form
        if data.get("step") is None:
            data.pop("step", None)  # nor version-1 profiles without the whole step
        if not data["attention"].get("head_scales"):
            data["attention"].pop("head_scales", None)  # nor without measured head scales
        for key, empty in (("ring_sequence_step_seconds", 0.0), ("tiles", None)):
            if data["attention"].get(key) == empty:
                data["attention"].pop(key, None)  # nor without the kernel-aware terms
        if not data["communication"].get("all_to_all_links"):
            data["communication"].pop("all_to_all_links", None)  # nor without a head exchange
        return json.dumps(data, indent=2) + "\n"


def bundled_profiles() -> dict[str, Path]:
    """Profiles shipped with dyncp, by name."""
    return {p.stem: p for p in sorted(PROFILES_DIR.glob("*.json"))}


def load_profile(name_or_path: str | Path) -> Profile:
    """Load a bundled profile by name (e.g. ``h100-reference``) or a profile JSON by path."""
    path = Path(name_or_path)
    bundled = bundled_profiles()
    if not path.exists():
        if str(name_or_path) in bundled:
            path = bundled[str(name_or_path)]
        else:
            raise ProfileError(
                f"profile {str(name_or_path)!r} is neither a file nor a bundled profile "
                f"(bundled: {', '.join(bundled) or 'none'})"
            )
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from None
    return Profile.from_json(text, origin=str(path))
