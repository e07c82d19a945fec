"""examples/sft_trl.py runs end to end: 2 torchrun processes, a few steps, with TRL's packing.

Checks that the script works as shipped (TRL's SFTTrainer preparing a prompt/completion dataset
with a local tokenizer, DynCPSFTTrainer planning CP 1 and 2 rings): finite losses that start
near a uniform guess over the vocabulary, printed for every step. The packed run covers the
unpacking too; the unpacked path is tested against SFTTrainer in tests/multirank/test_trl.py
(one run here, as the example runs take most of a minute each on 2 cores).
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
pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
VOCAB = 55  # 50 numbers, sort, :, pad, EOS, unk


@pytest.mark.timeout(300)
def test_sft_trl_example_runs_packed(tmp_path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples" / "sft_trl.py"), "--steps", str(STEPS), "--examples", "120",
        "--out", str(tmp_path), "--packing",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=270, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = re.findall(r"step +(\d+): loss ([0-9.]+) .* cp sizes \[([0-9, ]+)\]", done.stdout)
    assert [int(s) for s, _, _ in steps] == list(range(STEPS)), done.stdout
    losses = [float(loss) for _, loss, _ in steps]
    assert all(math.isfinite(x) and x > 0 for x in losses)
    assert abs(losses[0] - math.log(VOCAB)) < 0.2  # an untrained model: about a uniform guess
    assert any(sizes == "1, 2" for _, _, sizes in steps), done.stdout  # a ring and single ranks
