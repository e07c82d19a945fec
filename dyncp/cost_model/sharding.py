"""ShardingCost: the seconds of one forward+backward pass under FSDP2 full sharding, comm included.

Full sharding keeps each unit's (a transformer block's, the embedding's, the head's) parameters
sharded over all ranks and, in every pass, all-gathers a unit before its forward, again before
its backward (it is resharded after the forward), and reduce-scatters its gradients after its
backward. FSDP2 prefetches: the all-gather of the next unit runs while the current one computes
(forward and backward), and a unit's reduce-scatter runs while the next unit (in backward order)
computes. So a unit costs the larger of its compute and the communication that must hide behind
it, and only what does not hide is exposed. With units ``1..L`` in forward order, per-unit
forward compute ``f_i``, backward ``b_i``, all-gather ``a_i`` and reduce-scatter ``s_i``::

    forward  = a_1 + sum_{i=1..L} max(f_i, a_{i+1})                   (a_{L+1} = 0)
    backward = a_L + sum_{i=L..1} max(b_i, a_{i-1} + s_{i+1}) + s_1   (a_0 = s_{L+1} = 0)

that is, in backward order each unit's compute hides the previous (in that order) unit's
reduce-scatter and the next one's all-gather, which share the network (a rank's link carries one
collective at a time, so their seconds add); the first all-gather and the last reduce-scatter are
exposed. A pass that runs no micro-batch (an *empty pass*, ``dyncp.plan.passes``) computes
nothing and pays its collectives alone: ``sum_i (2 a_i + s_i)``.

When are gradients reduced? In every pass: accumulating unsharded gradients over the passes and
reducing once would hold every unit's full gradient (4 bytes a parameter in fp32) on every rank
for the whole step, the very buffer full sharding exists to remove; reduce-scattering each pass
keeps one unit's unsharded gradient at a time and accumulates the sharded ones (FSDP2's default).
Its price is one reduce-scatter per unit per pass, counted above.

A runner that accumulates unsharded gradients and reduces once (``reduce="once"``: the memory
allows a whole gradient) reduce-scatters only in the step's last pass: every other pass prices
``s_i = 0``, the last the formula above (``ShardingCost.scatters``).

``ShardingCost.for_model`` builds one from what a model is -- its units' parameter counts, its
dtypes (torch's names or bytes, read without torch) and the world -- with the collectives from a
profile; ``dyncp.integrations.fsdp_mode`` reads those from a ``fully_shard`` model.

Collectives are ``latency + bytes / bandwidth`` (``Collective``), bytes being the unit's whole
unsharded buffer (the size nccl-tests reports: an all-gather's output, a reduce-scatter's input).
``ShardingCost.from_profile`` takes them from a profile's measured communication (see there); a
caller with its own measurements gives ``Collective`` values directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from dyncp.cost_model.schema import Profile

__all__ = [
    "DTYPE_BYTES",
    "REDUCE",
    "Collective",
    "ShardingCost",
    "collective_from_profile",
    "dtype_bytes",
]

#: When gradients are reduce-scattered: in every pass, or once in the step's last pass.
REDUCE = ("every-pass", "once")
#: Bytes of an element of each floating dtype, by torch's name (``str(torch.bfloat16)`` without
#: its ``"torch."``), so that the cost model reads a model's dtypes without importing torch.
DTYPE_BYTES = {
    "float64": 8,
    "double": 8,
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_bytes(dtype: str | int) -> int:
    """Bytes of an element of ``dtype``: a name of ``DTYPE_BYTES`` (``"torch."`` allowed in
    front), or already bytes (an int >= 1).

    Raises:
        ValueError: an unknown name or a count below 1.
    """
    if isinstance(dtype, bool) or not isinstance(dtype, int | str):
        raise ValueError(f"dtype must be a dtype name or bytes, got {dtype!r}")
    if isinstance(dtype, int):
        if dtype < 1:
            raise ValueError(f"dtype bytes must be >= 1, got {dtype}")
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


#: Share of a pass's compute in its forward: a GEMM's backward runs two GEMMs of the forward's
#: size (input and weight gradients), so 1 / (1 + 2) (Narayanan et al., "Efficient Large-Scale
#: Language Model Training on GPU Clusters Using Megatron-LM", SC'21, sec. 5.1: 3x the
#: forward's FLOPs in forward + backward).
FORWARD_SHARE = 1.0 / 3.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """A collective over all ranks: ``latency_seconds + bytes / bandwidth_bytes_per_second``,
    ``bytes`` the unsharded buffer (an all-gather's output, a reduce-scatter's input)."""

    latency_seconds: float
    bandwidth_bytes_per_second: float

    def __post_init__(self) -> None:
        if not self.latency_seconds >= 0:
            raise ValueError(f"Collective.latency_seconds must be >= 0, got {self.latency_seconds}")
        if not self.bandwidth_bytes_per_second > 0:
            raise ValueError(
                "Collective.bandwidth_bytes_per_second must be > 0, got "
                f"{self.bandwidth_bytes_per_second}"
            )

    def seconds(self, nbytes: float) -> float:
        return self.latency_seconds + nbytes / self.bandwidth_bytes_per_second


#: A world of one rank communicates nothing.
_FREE = Collective(latency_seconds=0.0, bandwidth_bytes_per_second=float("inf"))


def collective_from_profile(profile: Profile, *, world: int, ranks_per_node: int) -> Collective:
    """An all-gather (or reduce-scatter) over ``world`` ranks, from ``profile``'s communication.

    - ``world == 1``: free (nothing moves).
    - ``world <= ranks_per_node`` and listed in ``communication.all_to_all_links``: that entry.
      In the reference profiles (``dyncp.cost_model.reference``) those are fits of
      ``latency + B / bandwidth`` over measured NCCL all_gathers of output size B on 2, 4 and 8
      H100s -- the very collective priced here.
    - otherwise a pipelined ring over ``world`` ranks in ``world / ranks_per_node`` nodes: each
      rank receives ``(world - 1) / world`` of the buffer over its slowest hop (the inter-node
      link across nodes, NVLink inside one), so bandwidth = link bandwidth x world / (world - 1);
      the first chunk crosses every hop of the ring once, so latency = the sum of the hops'
      latencies (``nodes - 1`` inter-node hops, the rest intra-node). Ring all-gather cost
      ``(p - 1) alpha + (p - 1) / p n beta``: Thakur, Rabenseifner and Gropp, "Optimization of
      Collective Communication Operations in MPICH" (IJHPCA 2005), with the hops' latencies
      summed as the pipelined ring pays them.

    Reduce-scatter is priced as this all-gather of the same buffer: both move ``(world - 1) /
    world`` of it through every rank, and the measured NCCL reduce_scatter on 8 H100s is within
    7% of the all_gather from 128 MiB to 8 GiB (reference/h100-distca/nccl_perf.csv).
    """
    if world < 1 or ranks_per_node < 1:
        raise ValueError(f"world and ranks_per_node must be >= 1, got {world}, {ranks_per_node}")
    if world == 1:
        return _FREE
    comm = profile.communication
    listed = {link.group_size: link for link in comm.all_to_all_links}
    if world <= ranks_per_node and world in listed:
        link = listed[world]
        return Collective(
            latency_seconds=link.latency_seconds,
            bandwidth_bytes_per_second=link.bandwidth_bytes_per_second,
        )
    nodes = -(-world // ranks_per_node)
    slowest = comm.inter_node if nodes > 1 else comm.intra_node
    latency = (nodes - 1) * comm.inter_node.latency_seconds
    latency += (world - nodes) * comm.intra_node.latency_seconds
    return Collective(
        latency_seconds=latency,
        bandwidth_bytes_per_second=slowest.bandwidth_bytes_per_second * world / (world - 1),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingCost:
    """What full sharding adds to a pass (module docstring for the formula).

    Args:
        unit_params: parameters of each FSDP unit, in forward order (e.g. the embedding, each
            block, the final norm and head).
        unit_compute: share of a pass's compute each unit runs (same length, sums to 1; default
            proportional to ``unit_params``, i.e. to the GEMM work per token).
        param_bytes: bytes of a gathered parameter (2: bf16 ``param_dtype``).
        grad_bytes: bytes of a reduce-scattered gradient (4: fp32 ``reduce_dtype``).
        gather, scatter: the all-gather and reduce-scatter over all ranks.
        forward_share: share of a unit's compute in its forward (default ``FORWARD_SHARE``).
        reduce: ``"every-pass"`` (default: a reduce-scatter per unit in every pass) or
            ``"once"`` (in the step's last pass only; module docstring).

    Raises:
        ValueError: an empty, negative or inconsistent field (the message names it).
    """

    unit_params: tuple[int, ...]
    unit_compute: tuple[float, ...] = ()
    param_bytes: int = 2
    grad_bytes: int = 4
    gather: Collective
    scatter: Collective
    forward_share: float = FORWARD_SHARE
    reduce: str = "every-pass"

    def __post_init__(self) -> None:
        if self.reduce not in REDUCE:
            raise ValueError(
                f"ShardingCost.reduce must be one of {', '.join(REDUCE)}, got {self.reduce!r}"
            )
        units = tuple(int(n) for n in self.unit_params)
        if not units or min(units) < 0:
            raise ValueError(f"ShardingCost.unit_params must be >= 0 each, got {units}")
        object.__setattr__(self, "unit_params", units)
        shares = tuple(float(x) for x in self.unit_compute)
        if not shares:
            total = sum(units)
            shares = tuple(n / total if total else 1.0 / len(units) for n in units)
        if len(shares) != len(units) or min(shares) < 0 or abs(sum(shares) - 1.0) > 1e-9:
            raise ValueError(
                f"ShardingCost.unit_compute must give one share >= 0 per unit "
                f"({len(units)}) summing to 1, got {shares}"
            )
        object.__setattr__(self, "unit_compute", shares)
        for name in ("param_bytes", "grad_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ShardingCost.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.forward_share < 1:
            raise ValueError(
                f"ShardingCost.forward_share must be in (0, 1), got {self.forward_share}"
            )
        for name in ("gather", "scatter"):
            if not isinstance(getattr(self, name), Collective):
                raise ValueError(f"ShardingCost.{name} must be a Collective")

    @classmethod
    def from_profile(
        cls,
        profile: Profile,
        *,
        world: int,
        ranks_per_node: int,
        unit_params: tuple[int, ...],
        **options: object,
    ) -> ShardingCost:
        """Collectives from ``profile`` over ``world`` ranks (``collective_from_profile``)."""
        link = collective_from_profile(profile, world=world, ranks_per_node=ranks_per_node)
        return cls(unit_params=unit_params, gather=link, scatter=link, **options)  # type: ignore[arg-type]

    @classmethod
    def for_model(
        cls,
        unit_params: tuple[int, ...],
        *,
        param_dtype: str | int,
        reduce_dtype: str | int,
        profile: Profile,
        world: int,
        ranks_per_node: int,
        unit_compute: tuple[float, ...] = (),
        reduce: str = "every-pass",
    ) -> ShardingCost:
        """The cost of a model's units under full sharding over ``world`` ranks.

        Args:
            unit_params: each FSDP unit's parameters, in forward order (a ``fully_shard``
                root first: it is gathered first and reduced last).
            param_dtype, reduce_dtype: what the units are gathered in and their gradients
                reduced in (FSDP2's ``MixedPrecisionPolicy``), as names or bytes.
            profile, world, ranks_per_node: the collectives (``collective_from_profile``).
            unit_compute, reduce: as the class's fields.
        """
        return cls.from_profile(
            profile,
            world=world,
            ranks_per_node=ranks_per_node,
            unit_params=tuple(unit_params),
            unit_compute=tuple(unit_compute),
            param_bytes=dtype_bytes(param_dtype),
            grad_bytes=dtype_bytes(reduce_dtype),
            reduce=reduce,
        )

    def scatters(self, index: int, passes: int) -> bool:
        """Whether pass ``index`` of a step of ``passes`` reduce-scatters (``reduce``)."""
        return self.reduce == "every-pass" or index == passes - 1

    @property
    def gather_seconds(self) -> tuple[float, ...]:
        """Each unit's all-gather."""
        return tuple(self.gather.seconds(n * self.param_bytes) for n in self.unit_params)

    @property
    def scatter_seconds(self) -> tuple[float, ...]:
        """Each unit's gradient reduce-scatter."""
        return tuple(self.scatter.seconds(n * self.grad_bytes) for n in self.unit_params)

    def pass_seconds(self, compute: float, *, scatter: bool = True) -> float:
        """One pass whose busiest rank computes for ``compute`` seconds (0: an empty pass);
        ``scatter=False``: a pass that reduces no gradient (``reduce="once"``, not the last)."""
        if compute < 0:
            raise ValueError(f"compute must be >= 0 seconds, got {compute}")
        a = self.gather_seconds
        s = self.scatter_seconds if scatter else (0.0,) * len(a)
        f = [compute * self.forward_share * x for x in self.unit_compute]
        b = [compute * (1.0 - self.forward_share) * x for x in self.unit_compute]
        n = len(a)
        # Forward: unit i computes while unit i + 1 is gathered; the first gather is exposed.
        forward = a[0] + sum(max(f[i], a[i + 1] if i + 1 < n else 0.0) for i in range(n))
        # Backward, last unit first: unit i computes while unit i - 1 is gathered and unit
        # i + 1's gradients are reduce-scattered (one link: their seconds add); the first
        # gather and the last reduce-scatter are exposed.
        backward = a[-1] + s[0]
        for i in reversed(range(n)):
            hidden = (a[i - 1] if i > 0 else 0.0) + (s[i + 1] if i + 1 < n else 0.0)
            backward += max(b[i], hidden)
        return forward + backward

    @property
    def empty_pass_seconds(self) -> float:
        """An empty pass: its collectives alone, ``sum_i (2 a_i + s_i)``."""
        return self.pass_seconds(0.0)

    def exposed_seconds(self, compute: float) -> float:
        """What the collectives add to a pass computing ``compute`` seconds."""
        return self.pass_seconds(compute) - compute
