"""Construction: the greedy constructor that builds a plan from scratch, anytime, and its parts.

Modules:

- ``greedy``: ``GreedyConstructor``, candidates in order of promise, then the local search;
- ``base``: the batch state and plan assembly every candidate family shares;
- ``stretch``, ``level``, ``structured``: the three candidate families;
- ``pouring``: the pouring engine that realises a structure with its short sequences;
- ``fluid``, ``structure``, ``structure_moves``: the structure search and its fluid model;
- ``packing``: first-fit-decreasing micro-batches, LPT, placement of groups on blocks;
- ``local_search``: moves and swaps out of each wave's critical slot;
- ``assignment``: a plan as fixed slots holding sequences (what the local search and CP-SAT edit);
- ``dataflow``: the same groups re-laid out on the ranks free first.
"""

from dyncp.planner.construction.assignment import Assignment
from dyncp.planner.construction.dataflow import relayout
from dyncp.planner.construction.fluid import Structure
from dyncp.planner.construction.greedy import GreedyConstructor, greedy_plan
from dyncp.planner.construction.local_search import improve
from dyncp.planner.construction.packing import lpt, pack_ffd, place_groups, place_waves
from dyncp.planner.construction.structure import StructureSearch

__all__ = [
    "Assignment",
    "GreedyConstructor",
    "Structure",
    "StructureSearch",
    "greedy_plan",
    "improve",
    "lpt",
    "pack_ffd",
    "place_groups",
    "place_waves",
    "relayout",
]
