"""CostModel: predicted seconds of one micro-batch at a given CP size, from a Profile.

``CostModel(profile, ranks_per_node)`` (or ``CostModel.load(name, ranks_per_node)``) is what
planners, the simulator and calibration build. The formulas live where their idea does:

- ``full_attention``: :class:`FullAttentionModel`, layers that are all full attention (ring and
  all-to-all groups), with the hybrid head splits of ``head_split`` mixed in;
- ``layer_mix``: :class:`LayerMixCostModel`, the window and SSM terms of a profile with
  ``layer_mix`` on top of the full-attention ones.

Both derive from :class:`FullAttentionModel`; this module picks between them. A profile of full
attention gives a ``CostModel`` itself (``FullAttentionModel``'s pricing, nothing added); one with
``layer_mix`` gives a ``LayerMixCostModel``, as it always did. The picking lives here, above both
classes, rather than in a base class that would have to import its own subclass (the import
circle ``model`` <-> ``layer_mix`` this layout removes). So that ``isinstance(m, CostModel)``
still holds for every model ``CostModel(...)`` returns, ``LayerMixCostModel`` is registered as a
virtual subclass (``abc.ABCMeta.register``): one explicit line below, no registry to fill.

Planner, cost model and simulator import no torch; everything here is numpy.
"""

from __future__ import annotations

from abc import ABCMeta

from dyncp.cost_model.full_attention import FullAttentionModel
from dyncp.cost_model.head_split import HeadSplit
from dyncp.cost_model.layer_mix import LayerMixCostModel

__all__ = ["CostModel", "HeadSplit"]  # HeadSplit: defined in head_split, kept here for 0.1 code


class CostModel(FullAttentionModel, metaclass=ABCMeta):
    """Predicts micro-batch seconds and memory for a profile on a given node size.

    ``CostModel(profile, ranks_per_node)`` returns a ``LayerMixCostModel`` for a profile with
    ``layer_mix`` (sliding windows, SSM mixers) and a ``CostModel`` otherwise.

    Args:
        profile: the validated profile.
        ranks_per_node: groups larger than this use the profile's inter-node link.
    """

    def __new__(cls, *args: object, **kwargs: object) -> CostModel:
        # No arguments (unpickling, copies): the class is already the right one.
        profile = args[0] if args else kwargs.get("profile")
        if cls is CostModel and getattr(profile, "layer_mix", None) is not None:
            # Not an instance of cls, so type() does not call __init__ again on it.
            return LayerMixCostModel(*args, **kwargs)  # type: ignore[arg-type, return-value]
        return super().__new__(cls)


CostModel.register(LayerMixCostModel)
