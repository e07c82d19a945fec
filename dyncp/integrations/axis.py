"""The one check every trainer integration makes: its process group is the pool's DP x CP axis.

dyncp's gradients are exact only when they are summed over exactly the ranks the plan spreads the
global batch over (``ctx.loss_scale`` counts every label token of the global batch once). A
sharding or data-parallel group on other ranks would sum a different set of partial gradients.
"""

from __future__ import annotations

import torch.distributed as dist

from dyncp.runtime import GroupPool

__all__ = ["check_same_ranks"]


def check_same_ranks(group: dist.ProcessGroup | None, pool: GroupPool, *, what: str) -> None:
    """Raise unless ``group`` (None: the default group) holds exactly the pool's axis ranks.

    Raises:
        ValueError: naming ``what`` and both rank lists.
    """
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    if sorted(ranks) != sorted(pool.ranks):
        raise ValueError(
            f"{what} spans ranks {sorted(ranks)}, the pool's DP x CP axis ranks "
            f"{sorted(pool.ranks)}; gradients must be summed over exactly the plan's ranks"
        )
