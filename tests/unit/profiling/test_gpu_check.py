"""bench/gpu_check.py on CPU with tiny sizes (--dry-run), and that its check can fail."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from bench_modules import load_bench

from dyncp.cost_model.schema import load_profile
from dyncp.ring_attention import MathKernel

gpu_check = load_bench("gpu_check")


@pytest.mark.timeout(120)
def test_dry_run_checks_kernels_writes_a_profile_and_a_mape(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    argv = ["--dry-run", "--out-dir", str(tmp_path), "--json", str(report_path)]
    assert gpu_check.main(argv) == 0
    report = json.loads(report_path.read_text())
    assert report["all_checks_ok"] and report["dry_run"]
    assert {row["cp"] for row in report["checks"]} == {1, 2, 4, 8}
    assert {row["kernel"] for row in report["checks"]} == {"sdpa", "math"}
    assert all(max(row["errors"].values()) < 1e-4 for row in report["checks"])
    assert all(row["tflops_fwd"] > 0 and row["tflops_fwd_bwd"] > 0 for row in report["throughput"])
    profile = load_profile(report["profile"])
    assert profile.name == "cpu-dry-run-tiny"
    assert profile.model.hidden_size == 64 and profile.linear_seconds_per_token > 0
    assert profile.provenance.device == "cpu"
    mape = report["mape"]
    assert len(mape["packs"]) == 4 and math.isfinite(mape["mape"])
    assert all(r["measured"] > 0 and r["predicted"] > 0 for r in mape["packs"])
    optimizer = report["optimizer"]  # the whole step's optimizer, measured beside its assumption
    assert optimizer["optimizer_seconds_per_parameter"] > 0
    assert optimizer["shape_parameters"] > optimizer["parameters_timed"] > 0


class _WrongScale(MathKernel):
    """A kernel with a wrong softmax scale on every step but the diagonal one."""

    name = "math"

    def forward(self, q, k, v, *, spec, softmax_scale):
        scale = softmax_scale if spec.causal else 1.1 * softmax_scale
        return super().forward(q, k, v, spec=spec, softmax_scale=scale)


def test_ring_emulation_matches_fp64_and_catches_a_wrong_step() -> None:
    torch.manual_seed(0)
    pack = (37, 5, 64)
    q, dout = torch.randn(106, 4, 16, dtype=torch.float64), torch.randn(106, 4, 16).double()
    k, v = torch.randn(106, 2, 16).double(), torch.randn(106, 2, 16).double()
    ref = gpu_check.reference_attention(q, k, v, dout, pack)
    for cp in (1, 2, 4):
        got = gpu_check.emulate_ring(MathKernel(), q, k, v, dout, pack, cp)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)
    bad = gpu_check.emulate_ring(_WrongScale(), q, k, v, dout, pack, 4)
    assert (bad[0] - ref[0]).abs().max() > 1e-3


def test_no_gpu_is_an_error_not_a_fake_figure(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        gpu_check.main([])
    assert "no CUDA device" in capsys.readouterr().err
