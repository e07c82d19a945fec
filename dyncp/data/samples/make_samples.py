"""Regenerate the bundled length samples from the full shared datasets.

Run from anywhere: ``python dyncp/sim/data/make_samples.py [--src DIR] [--out DIR]``.
The full files are too large to ship in the package, so we ship a deterministic 20,000-row
sample of each (numpy ``default_rng(20261130)``, a fresh generator per file, drawn without
replacement) that keeps the rows in their original file order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SEED = 20261130
ROWS = 20_000
HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
SAMPLES = {
    "wikipedia_flexsp.parquet": "wikipedia_flexsp_sample.parquet",
    "wlbllm_distca.parquet": "wlbllm_distca_sample.parquet",
}


def sample(src: Path, dst: Path, rows: int = ROWS, seed: int = SEED) -> np.ndarray:
    """Write a sorted-index random sample of ``src``'s ``length`` column to ``dst``."""
    lengths = pq.read_table(src, columns=["length"]).column("length").to_numpy()
    idx = np.sort(np.random.default_rng(seed).choice(len(lengths), size=rows, replace=False))
    out = lengths[idx].astype(np.int32)
    pq.write_table(pa.table({"length": pa.array(out, type=pa.int32())}), dst)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--src",
        type=Path,
        default=REPO_ROOT.parent / "shared" / "datasets",
        help="folder holding the full parquet files (default: ../shared/datasets "
        "relative to the repo root)",
    )
    ap.add_argument("--out", type=Path, default=HERE, help="output folder (default: this one)")
    args = ap.parse_args()
    for src_name, dst_name in SAMPLES.items():
        a = sample(args.src / src_name, args.out / dst_name)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        print(
            f"{dst_name}: rows={a.size} mean={a.mean():.1f} p50={p50:g} p90={p90:g} "
            f"p99={p99:g} max={a.max()}"
        )


if __name__ == "__main__":
    main()
