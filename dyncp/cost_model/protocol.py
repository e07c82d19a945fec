"""The cost-model protocol: everything the planner, the lower bound and the simulator call.

``CostModel`` (built from a profile JSON) implements it; a published or home-grown model that a
profile cannot express implements these members and plugs in the same way. All times are seconds
of one rank; ``lengths`` are 1-D integer arrays; ``cp`` is a CP (group) size.

Who calls what:

- simulator and plan pricing (``dyncp.cost_model.evaluate``): ``packs_seconds``,
  ``wave_overhead``, ``name``;
- planners: ``microbatch_seconds``, ``alone_seconds``, ``marginal_seconds``,
  ``microbatch_overhead``, ``ranks_per_node``;
- lower bounds (``dyncp.planner.bounds.closed_form``, ``dyncp.planner.bounds.lp_bound``):
  ``alone_seconds``, ``work_rank_seconds``, ``fixed_seconds``, ``bound_rank_seconds``,
  ``microbatch_seconds``, ``microbatch_overhead``, ``wave_overhead``.

Contract (the bounds are proven from it, so an implementation must keep it):

1. ``microbatch_seconds(c, S)`` never decreases when a sequence is added to ``S``;
2. ``microbatch_seconds(c, S) >= fixed_seconds(c) + sum(bound_rank_seconds(c, S)) / c``;
3. ``alone_seconds(c, [s]) == microbatch_seconds(c, [s])``;
4. ``bound_rank_seconds(c, s) >= work_rank_seconds(c, s) >= 0`` is not required, but
   ``work_rank_seconds(c, s) <= bound_rank_seconds(c, s)`` lets the older closed-form bound use
   the cheaper of the two; ``fixed_seconds(c) >= fixed_seconds(1) >= microbatch_overhead``;
5. ``packs_seconds(c, lengths, starts)[j] == microbatch_seconds(c, pack j)``.

Head splits (hybrid head x context parallelism, ``dyncp.plan.Group.heads``): a group of c ranks
may run as u x r (u ranks exchange heads by all-to-all, rings of r = c / u ranks). Every pricing
member above (all but the attributes and ``name``) then takes the keyword ``heads=u``, and the
contract holds for every (c, u) with ``heads=u`` passed to each side; contract 2, for instance,
reads ``microbatch_seconds(c, S, heads=u) >= fixed_seconds(c, heads=u) +
sum(bound_rank_seconds(c, S, heads=u)) / c``. The keyword is optional for a plug-in model:
callers pass it only when u > 1, so a model that prices rings only keeps the signatures below
(a topology whose ``head_sizes`` is ``(1,)`` never passes it). ``CostModel`` accepts it
everywhere (``heads=1`` is today's ring, bit for bit) and raises ValueError, naming the values,
for a split its profile cannot price.

Memory is not the cost model's business: it is the plan contract's (``dyncp.plan``); a head
split keeps the zigzag shard of c ranks, so its memory is that of the ring of c.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["CostModelProtocol"]


@runtime_checkable
class CostModelProtocol(Protocol):
    """What dyncp calls on a cost model (see the module docstring for who calls what)."""

    ranks_per_node: int
    microbatch_overhead: float  # seconds every micro-batch pays (the per-pass constant)
    wave_overhead: float  # seconds every wave pays (synchronisation when groups change)

    @property
    def name(self) -> str: ...

    def microbatch_seconds(self, cp: int, lengths: Sequence[int] | np.ndarray) -> float:
        """Seconds of one forward+backward of ``lengths`` packed at CP size ``cp``."""
        ...

    def packs_seconds(self, cp: int, lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """microbatch_seconds of many packs at once (``starts``: each pack's first index)."""
        ...

    def alone_seconds(self, cp: int, lengths: np.ndarray) -> np.ndarray:
        """Seconds of each sequence as its own micro-batch."""
        ...

    def marginal_seconds(self, cp: int, lengths: np.ndarray) -> np.ndarray:
        """Additive estimate of what each sequence adds to a micro-batch (for balancing)."""
        ...

    def work_rank_seconds(self, cp: int, lengths: np.ndarray) -> np.ndarray:
        """Compute-only rank-seconds of each sequence at ``cp`` (cp x per-rank seconds)."""
        ...

    def fixed_seconds(self, cp: int) -> float:
        """Seconds any micro-batch at ``cp`` pays whatever it holds (contract 2)."""
        ...

    def bound_rank_seconds(self, cp: int, lengths: np.ndarray) -> np.ndarray:
        """Additive lower bound of each sequence's rank-seconds at ``cp`` (contract 2)."""
        ...
