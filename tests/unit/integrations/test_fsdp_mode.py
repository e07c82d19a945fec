"""choose_fsdp_mode: the fastest FSDP2 mode whose per-rank bytes fit, on both sides of each line.

The sizes are those of a bf16 model with fp32 master weights, fp32 reduction and AdamW; the
bytes each mode needs are written out from the module docstring's formulas, so a change of the
formulas or of the order of the modes fails here. The model-reading side (``FSDPSizes.of`` on a
real ``fully_shard`` model) is checked on 4 gloo ranks in ``tests/multirank/test_fsdp_sharded``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from dyncp.integrations.fsdp_mode import FSDPSizes, choose_fsdp_mode, mode_bytes  # noqa: E402

P, T, R, B, W = 8_000, 7_000, 1_000, 800, 4
SIZES = FSDPSizes(
    params=P,
    trainable=T,
    root=R,
    root_trainable=R,
    block=B,
    block_trainable=B,
    world=W,
    compute_bytes=2,
    reduce_bytes=4,
    master_bytes=4,
    optimizer_bytes=8,
)
ACT = 1_000
COMMON = P * 4 / W + T * (4 + 8) / W + ACT  # shards, sharded grads, AdamW moments
NEEDS = {
    "gather-once": round(COMMON + P * 2 + T * 4 * (1 + 1 / W)),
    "sharded-once": round(COMMON + (R + 2 * B) * 2 + T * 4),
    "sharded-every-pass": round(COMMON + (R + 2 * B) * 2 + (R + 2 * B) * 4),
}


def test_bytes_follow_the_formulas() -> None:
    assert mode_bytes(SIZES, activation_bytes=ACT) == NEEDS
    # the order the choice relies on: each later mode needs less
    assert NEEDS["gather-once"] > NEEDS["sharded-once"] > NEEDS["sharded-every-pass"]


@pytest.mark.parametrize(
    ("budget", "mode", "reduce"),
    [
        (NEEDS["gather-once"], "gather-once", None),
        (NEEDS["gather-once"] - 1, "sharded-once", "once"),
        (NEEDS["sharded-once"], "sharded-once", "once"),
        (NEEDS["sharded-once"] - 1, "sharded-every-pass", "every-pass"),
        (NEEDS["sharded-every-pass"], "sharded-every-pass", "every-pass"),
    ],
)
def test_each_side_of_each_threshold(budget: int, mode: str, reduce: str | None) -> None:
    choice = choose_fsdp_mode(SIZES, memory_budget=budget, activation_bytes=ACT)
    assert choice.mode == mode
    assert choice.reduce == reduce
    assert choice.needs == NEEDS
    # the reason names the chosen mode's bytes against the budget, and those of faster modes
    assert choice.reason.startswith(f"{mode} needs {NEEDS[mode]:,} B per rank <= budget")
    if mode != "gather-once":
        assert f"gather-once needs {NEEDS['gather-once']:,} B" in choice.reason


def test_nothing_fits_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no FSDP2 mode fits the budget"):
        choose_fsdp_mode(SIZES, memory_budget=NEEDS["sharded-every-pass"] - 1, activation_bytes=ACT)
    with pytest.raises(ValueError, match="memory_budget must be > 0"):
        choose_fsdp_mode(SIZES, memory_budget=0)
    with pytest.raises(ValueError, match="activation_bytes must be >= 0"):
        mode_bytes(SIZES, activation_bytes=-1)
    with pytest.raises(ValueError, match="must not exceed params"):
        FSDPSizes(
            params=10,
            trainable=11,
            root=1,
            root_trainable=1,
            block=1,
            block_trainable=1,
            world=2,
            compute_bytes=2,
            reduce_bytes=4,
            master_bytes=4,
            optimizer_bytes=8,
        )
    with pytest.raises(ValueError, match="not an FSDPModule"):
        import torch

        choose_fsdp_mode(torch.nn.Linear(2, 2), memory_budget=1)
