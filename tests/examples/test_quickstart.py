"""The README's Quickstart is examples/quickstart.py, and it runs as written on 2 gloo processes:
it stops after its steps, logs the loss and the CP sizes of each, and says what it ran."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "quickstart.py"


def test_the_readme_shows_the_quickstart_file_as_it_is() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quickstart\n") :]
    shown = re.search(r"^```python\n(.*?)^```", section, re.S | re.M).group(1)
    code = SCRIPT.read_text()
    assert shown == code[code.index("import torch\n") :]


@pytest.mark.timeout(400)
def test_the_quickstart_runs_as_written() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    # --standalone: torchrun picks a free port (a fixed one collides with any other job on it)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += ["2", str(SCRIPT)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == [f"step {k}" for k in range(5)], lines
    for line in steps:
        loss = float(re.search(r"loss ([0-9.]+)", line).group(1))
        assert 0 < loss < 10 and re.search(r"CP sizes \[[0-9, ]+\]", line), line
    assert lines[-1] == "ran 5 steps of LlamaForCausalLM on 2 processes under dynamic CP"
