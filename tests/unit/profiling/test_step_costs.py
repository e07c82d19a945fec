"""The profiler's step section: the optimizer timed over the model's own parameters."""

from __future__ import annotations

import pytest
import torch

from dyncp.cost_model import CostModel
from dyncp.cost_model.schema import load_profile
from dyncp.cost_model.step_parts import common_parts
from dyncp.profiling.decoder import MODELS, TinyDecoder
from dyncp.profiling.step_costs import measure_step_costs, with_step_costs


def test_measured_step_prices_the_optimizer_of_the_model() -> None:
    torch.manual_seed(0)
    model = TinyDecoder(MODELS["tiny"])
    count = sum(p.numel() for p in model.parameters())
    measured = measure_step_costs(model, repeats=3)
    step = measured["step"]
    assert step["parameters"] == count
    assert step["gradient_bytes_per_parameter"] == 4.0  # float32 parameters
    assert step["optimizer_seconds_per_parameter"] > 0
    assert measured["all_reduce_seconds"] is None  # one process: nothing to reduce
    base = load_profile("cpu-gloo")
    profile = with_step_costs(base, measured, world=1, command="test")
    assert profile.schema_version == 2 and profile.provenance.notes[-1].startswith("step:")
    _, optimizer, _ = common_parts(profile, world=1, ranks_per_node=1)
    assert optimizer == pytest.approx(count * step["optimizer_seconds_per_parameter"])
    # The embedding and head are in the measured linear work: micro-batches price as before.
    assert CostModel(profile, 2).microbatch_seconds(2, [300, 900]) == CostModel(
        base, 2
    ).microbatch_seconds(2, [300, 900])


def test_a_model_without_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a model with trainable parameters"):
        measure_step_costs(torch.nn.ReLU())
