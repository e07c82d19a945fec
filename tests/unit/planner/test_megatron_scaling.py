"""The vectorised megatron policy makes exactly the plans of the plain loop it replaced."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron_reference import reference_megatron_plan
from planner_helpers import topologies

from dyncp.planner.baselines.megatron import megatron_plan


@settings(max_examples=150, deadline=None)
@given(topo=topologies(full_world=True), data=st.data())
def test_same_plans_as_the_plain_loop(topo, data: st.DataObject) -> None:
    longest = topo.max_length()
    lengths = data.draw(st.lists(st.integers(1, longest), min_size=1, max_size=80).map(np.asarray))
    new, old = megatron_plan(lengths, topo), reference_megatron_plan(lengths, topo)
    assert new.to_json() == old.to_json()
    new.validate()


def test_same_plans_on_long_tailed_batches() -> None:
    from dyncp.plan import Topology

    rng = np.random.default_rng(3)
    for world, n in ((64, 600), (256, 2000)):
        topo = Topology(world, 8, 8192)
        lengths = np.minimum(rng.lognormal(6.0, 1.4, n).astype(np.int64) + 1, 131072)
        assert (
            megatron_plan(lengths, topo).to_json()
            == reference_megatron_plan(lengths, topo).to_json()
        )
