"""SamplerConfig: the sampler's options as one typed, frozen record; the keywords still work."""

from __future__ import annotations

import dataclasses

import pytest
from test_sampler import CAPACITY, make_lengths, make_planner

from dyncp.sampler import DynamicCPSampler, SamplerConfig


def test_a_config_and_the_same_keywords_make_the_same_sampler() -> None:
    lengths, planner = make_lengths(50, seed=0), make_planner(4)
    config = SamplerConfig(world_size=4, rank=1, capacity=CAPACITY, global_batch_size=8, seed=3)
    by_config = DynamicCPSampler(lengths, planner=planner, config=config)
    by_keywords = DynamicCPSampler(
        lengths, planner=planner, world_size=4, rank=1, capacity=CAPACITY, global_batch_size=8,
        seed=3,
    )  # fmt: skip
    assert by_config.config == by_keywords.config == config
    assert [list(mb) for mb in by_config] == [list(mb) for mb in by_keywords]
    other = DynamicCPSampler(lengths, planner=planner, config=config, rank=2)
    assert other.config == dataclasses.replace(config, rank=2) and other.rank == 2


def test_the_config_is_frozen_keyword_only_and_checked() -> None:
    config = SamplerConfig(world_size=2, rank=0, capacity=8, secret="s3cret")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rank = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplerConfig(2, 0, 8)  # type: ignore[misc]
    assert "s3cret" not in repr(config)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        SamplerConfig(world_size=2, rank=2, capacity=8)
    with pytest.raises(ValueError, match="lookahead must be an integer >= 0, got -1"):
        SamplerConfig(world_size=2, rank=0, capacity=8, lookahead=-1)
    with pytest.raises(ValueError, match="agree_ahead must be an integer >= 0, got 1.5"):
        SamplerConfig(world_size=2, rank=0, capacity=8, agree_ahead=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"service_wait must be seconds in \[0, 1e7\), got -1"):
        SamplerConfig(world_size=2, rank=0, capacity=8, service_wait=-1)
    with pytest.raises(TypeError, match="no_such_option"):
        DynamicCPSampler([1], planner=make_planner(2), world_size=2, rank=0, capacity=8,
                         no_such_option=1)  # fmt: skip


def test_slices_are_the_default_with_a_store_and_whole_plans_where_they_cannot_be() -> None:
    """Finding 10: ``slices="auto"`` (the default) reads slices with a store from
    ``SLICES_FROM`` ranks; planned locally, or pipelined, plans stay whole; a bad value is one
    line naming what is allowed."""
    import torch.distributed as dist

    from dyncp.plan import Topology, use_slices

    lengths = make_lengths(50, seed=0)
    common = dict(world_size=4, rank=1, capacity=CAPACITY, global_batch_size=8, serve=False)
    assert SamplerConfig(world_size=4, rank=1, capacity=CAPACITY).slices == "auto"
    served = DynamicCPSampler(lengths, planner=make_planner(4), store=dist.HashStore(), **common)
    assert served.slices and served._source.client.slices
    assert not DynamicCPSampler(lengths, planner=make_planner(4), **common).slices  # local
    assert use_slices("auto", Topology(4, 4, CAPACITY), pipelined=False)
    assert not use_slices("auto", Topology(4, 4, CAPACITY), pipelined=True)
    assert not use_slices("auto", Topology(1, 1, CAPACITY), pipelined=False)
    assert not use_slices(False, Topology(4, 4, CAPACITY), pipelined=False)
    with pytest.raises(ValueError, match="slices must be True, False or 'auto', got 'yes'"):
        SamplerConfig(world_size=4, rank=1, capacity=CAPACITY, slices="yes")
    with pytest.raises(ValueError, match="slices=True needs store="):
        DynamicCPSampler(lengths, planner=make_planner(4), slices=True, **common)
