"""The README's figure, drawn by the command its caption names, and a record of what it shows.

    python bench/readme_figures.py            # redraw docs/gantt-wikipedia.png and its record
    python bench/readme_figures.py --check    # exit 1 if the record is not what the command gives

The README (and docs/index.md, docs/guides/observability.md) shows ``docs/gantt-wikipedia.png``
under the caption command ``python -m dyncp.sim --plot plots/``: that command's ``gantt.png``, one
step of every policy. This script runs the command in-process (``dyncp.sim.__main__.main``, its
arguments exactly, ``--json`` added to read what was drawn), copies ``gantt.png`` over the image
and writes ``docs/gantt-wikipedia.json`` beside it: the command, the policies in the order of the
panels, the step drawn, the machine's flags, and each policy's predicted seconds of that step (the
number in its panel's title) and over the whole replay.

Why a record and not the picture's bytes: matplotlib draws different bytes from the same data from
one version to the next, while the record depends only on the plans, which the simulator's
deterministic planners make the same on any machine. ``--check`` (run by
``tests/unit/test_readme_figures.py``) replays the command without drawing and compares; a change
of a planner, a cost model, a default flag or the bundled sample that moves the picture fails it,
naming what changed, and running this script redraws the picture and the record together.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from dyncp.sim.__main__ import main as sim_main

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "docs" / "gantt-wikipedia.png"
RECORD = IMAGE.with_suffix(".json")
#: The caption's command, as the pages print it: ``python -m dyncp.sim`` and these arguments.
ARGS = ("--plot", "plots/")
COMMAND = "python -m dyncp.sim " + shlex.join(ARGS)
#: What the image is drawn from, read from the simulator's JSON report.
CONFIG_KEYS = ("world", "ranks_per_node", "capacity", "profile", "steps", "seed", "timing")
#: Predicted seconds are compared to this relative tolerance: deterministic plans repeat exactly,
#: but the last bits of a float sum may differ across numpy builds.
RTOL = 1e-9


def _run(folder: Path, *, draw: bool) -> dict:
    """Run the caption command with its plot folder replaced by ``folder``; the record."""
    args = list(ARGS)
    args[args.index("--plot") + 1] = str(folder / "plots")
    if not draw:
        del args[args.index("--plot") : args.index("--plot") + 2]
    report_path = folder / "report.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = sim_main([*args, "--json", str(report_path)])
    if status != 0:
        raise SystemExit(f"{COMMAND} exited with {status}")
    report = json.loads(report_path.read_text())
    config = report["config"]
    step = 0  # the command draws --plot-step, whose default is step 0
    policies = config["policies"]
    return {
        "command": COMMAND,
        "image": IMAGE.name,
        "drawn_from": "gantt.png (one panel per policy, in this order)",
        "dataset": Path(config["dataset"]).name,
        "config": {key: config[key] for key in CONFIG_KEYS},
        "step": step,
        "policies": policies,
        "step_seconds": {p: report["policies"][p]["step_seconds"][step] for p in policies},
        "mean_step_seconds": {p: report["policies"][p]["mean_step_seconds"] for p in policies},
    }


def differences(recorded: dict, fresh: dict) -> list[str]:
    """What differs between two records: one line per key (floats to ``RTOL``)."""

    def same(a: object, b: object) -> bool:
        if isinstance(a, float) and isinstance(b, float):
            return math.isclose(a, b, rel_tol=RTOL)
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b

    keys = sorted(set(recorded) | set(fresh))
    return [
        f"{key}: recorded {recorded.get(key)!r}, now {fresh.get(key)!r}"
        for key in keys
        if not same(recorded.get(key), fresh.get(key))
    ]


def regenerate() -> dict:
    """Draw the image with the caption's command and write it and its record; the record."""
    with tempfile.TemporaryDirectory() as tmp:
        record = _run(Path(tmp), draw=True)
        shutil.copyfile(Path(tmp) / "plots" / "gantt.png", IMAGE)
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    return record


def check() -> list[str]:
    """The differences between the committed record and the caption command's plans now."""
    if not RECORD.exists():
        return [f"{RECORD.relative_to(ROOT)} is missing"]
    with tempfile.TemporaryDirectory() as tmp:
        fresh = _run(Path(tmp), draw=False)
    return differences(json.loads(RECORD.read_text()), fresh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        diff = check()
        for line in diff:
            print(line, file=sys.stderr)
        if diff:
            print(f"stale: python bench/readme_figures.py redraws {IMAGE.name}", file=sys.stderr)
        return 1 if diff else 0
    record = regenerate()
    panels = ", ".join(record["policies"])
    print(f"wrote {IMAGE.relative_to(ROOT)} ({panels}) and {RECORD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
