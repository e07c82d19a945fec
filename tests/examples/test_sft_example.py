"""examples/sft.py runs end to end: 2 torchrun processes, a few steps of a very small configuration.

The full run (and its loss curve) is in docs/guides/trainers.md; this only checks that the script
works as shipped: stdlib documents, a locally trained BPE, DynamicCPSampler plans with CP 1 and 2,
FSDP2 through FSDPRunner, finite losses and the metrics it prints.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


@pytest.mark.timeout(180)
def test_sft_example_runs() -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples" / "sft.py"), "--files", "4", "--steps", str(STEPS), "--vocab", "300",
        "--hidden", "32", "--layers", "1", "--heads", "2", "--max-length", "256",
        "--capacity", "128", "--global-batch-tokens", "1024",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = re.findall(r"step +(\d+): loss ([0-9.]+) .* cp sizes \[([0-9, ]+)\]", done.stdout)
    assert [int(s) for s, _, _ in steps] == list(range(STEPS)), done.stdout
    assert all(math.isfinite(float(loss)) and float(loss) > 0 for _, loss, _ in steps)
    assert any(sizes == "1, 2" for _, _, sizes in steps), done.stdout  # a ring and single ranks
    assert "loss: first" in done.stdout
    assert 'dyncp_microbatches_total{cp_size="2",policy="dyncp"}' in done.stdout
    # The whole step is predicted, calibrated online by default, and the output says so.
    assert "cost model: profile cpu-gloo (" in done.stdout and "calibrating online" in done.stdout
    predicted = re.findall(r"predicted ([0-9.]+) s \(cpu-gloo v\d+, whole step\)", done.stdout)
    assert len(predicted) == STEPS and all(float(x) > 0 for x in predicted), done.stdout
    assert "calibration: model v" in done.stdout and "per-step part" in done.stdout
