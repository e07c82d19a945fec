"""Published cost-model forms as profiles: Megatron's, FlexSP's and WLB-LLM's.

    python -m dyncp.cost_model.published [--out profiles/]

Each form is written as a profile JSON (``profiles/published-*.json``) whose predictions equal the
published formula exactly (tests/unit/cost_model/test_published_profiles.py checks it to 1e-12).
The formulas, with L the document lengths of one micro-batch and s (= cp) the group size:

- ``megatron``: ``a1 * sum(L^2) / s`` -- the workload Megatron Core's dynamic-CP packing balances;
- ``flexsp``:  ``sum(a1 L^2 + a2 L) / s + beta + [s > 1] V * sum(L) / (s * bw[s])`` -- FlexSP's
  per-micro-batch model (arXiv:2412.01523): attention and linear work split over the SP group, a
  constant per micro-batch, and an all-to-all volume over a bandwidth measured per SP size, added
  without overlap;
- ``wlbllm``: ``(a1 sum(L^2) + a2 sum(L)) / s`` -- WLB-LLM's (arXiv:2503.17924) attention term
  quadratic in each document plus linear work, shared evenly by per-document CP sharding.

The coefficients are not tuned: they are read from the bundled ``h100-reference`` profile (itself
built from measured H100 data) and the measured NCCL bandwidths in ``../shared/reference``, each
recorded as a provenance assumption (name, value, source) that the tests read back:

- ``a1`` = layers x the reference's per-layer attention seconds at its longest measured length,
  over that length squared;
- ``a2`` = the reference's linear seconds per token; ``beta`` = its micro-batch overhead;
- ``V`` = bytes per token all-to-alls move in a forward+backward of the whole model: per layer
  q, k, v in and the output back, twice (forward and backward):
  2 x (2 hidden + 2 kv_heads x head_dim) x dtype bytes;
- ``bw[s]``: s <= 8 the measured NCCL all_gather bus bandwidth on s H100s (8 GiB messages: the
  all-to-all moves the same (s-1)/s of a rank's buffer over NVLink); s > 8 the reference's
  inter-node bandwidth (its stated assumption).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from dyncp.cost_model.schema import PROFILES_DIR, AttentionTable, Profile, load_profile

__all__ = ["FORMS", "published_profiles", "NCCL_BUSBW_GBS"]

FORMS = ("megatron", "flexsp", "wlbllm")

# Measured all_gather bus bandwidth (GB/s, 8 GiB messages, out of place) on 2/4/8 H100s, from
# ../shared/reference/h100-distca/nccl_perf.csv (read by ``read_busbw`` when the file is there).
NCCL_BUSBW_GBS = {2: 363.34, 4: 367.83, 8: 367.69}
NCCL_SOURCE = "../shared/reference/h100-distca/nccl_perf.csv, all_gather busbw_out_gbs at 8 GiB"


def read_busbw(path: Path) -> dict[int, float]:
    """All_gather bus bandwidth (GB/s) per GPU count at the largest message size in ``path``."""
    best: dict[int, tuple[int, float]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if row["op"] != "all_gather":
                continue
            n, size = int(row["ngpu"]), int(row["size_bytes"])
            if n not in best or size > best[n][0]:
                best[n] = (size, float(row["busbw_out_gbs"]))
    return {n: v for n, (_, v) in sorted(best.items())}


def coefficients(ref: Profile, busbw: dict[int, float]) -> dict[str, float]:
    """The published forms' coefficients derived from the reference profile (module docstring)."""
    att = ref.attention
    if not isinstance(att, AttentionTable):
        raise ValueError("the reference profile must have a measured attention table")
    layers = ref.model.num_layers
    longest = att.lengths[-1]
    net = att.seconds[-1] - att.step_overhead_seconds - att.sequence_overhead_seconds
    shape = ref.model
    out = {
        "a1": layers * net / longest**2,
        "a2": ref.linear_seconds_per_token,
        "beta": ref.overheads.microbatch_seconds,
        "V": float(
            layers
            * 2
            * (2 * shape.hidden_size + 2 * shape.num_kv_heads * shape.head_dim)
            * shape.dtype_bytes
        ),
    }
    inter = ref.communication.inter_node.bandwidth_bytes_per_second
    for s in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384):
        out[f"bw{s}"] = busbw[s] * 1e9 if s in busbw else inter
    return out


def _assumptions(coef: dict[str, float], ref: Profile) -> list[dict]:
    src = {
        "a1": f"{ref.name}: layers x attention seconds at its longest length / length^2",
        "a2": f"{ref.name}: linear_seconds_per_token",
        "beta": f"{ref.name}: overheads.microbatch_seconds",
        "V": f"{ref.name} model shape: 2 x (2 hidden + 2 kv_heads x head_dim) x dtype x layers",
    }
    out = []
    for name, value in coef.items():
        if name.startswith("bw"):
            s = int(name[2:])
            source = NCCL_SOURCE if s in NCCL_BUSBW_GBS else f"{ref.name}: inter_node bandwidth"
        else:
            source = src[name]
        out.append({"name": name, "value": value, "source": source})
    return out


def published_profiles(ref: Profile | None = None, busbw: dict[int, float] | None = None):
    """The three published forms as validated profiles, keyed by form name."""
    ref = ref if ref is not None else load_profile("h100-reference")
    coef = coefficients(ref, busbw if busbw is not None else NCCL_BUSBW_GBS)
    layers = ref.model.num_layers
    base = ref.model_dump(mode="json")
    no_link = {"latency_seconds": 0.0, "bandwidth_bytes_per_second": 1.0}
    quiet = {
        "kv_bytes_per_token": 0.0,
        "backward_bytes_factor": 2.0,
        "overlap": True,
        "intra_node": no_link,
        "inter_node": no_link,
    }
    forms = {
        "megatron": dict(
            lin=0.0, beta=0.0, comm=quiet, text="a1 * sum(L^2) / cp (Megatron Core dynamic CP)"
        ),
        "wlbllm": dict(
            lin=coef["a2"],
            beta=0.0,
            comm=quiet,
            text="(a1 * sum(L^2) + a2 * sum(L)) / cp (WLB-LLM, arXiv:2503.17924)",
        ),
        "flexsp": dict(
            lin=coef["a2"],
            beta=coef["beta"],
            comm={
                "kind": "all_to_all",
                "kv_bytes_per_token": coef["V"] / layers,
                "backward_bytes_factor": 2.0,
                "overlap": False,
                "intra_node": {"latency_seconds": 0.0, "bandwidth_bytes_per_second": coef["bw8"]},
                "inter_node": {"latency_seconds": 0.0, "bandwidth_bytes_per_second": coef["bw16"]},
                "links": [
                    {
                        "group_size": int(k[2:]),
                        "latency_seconds": 0.0,
                        "bandwidth_bytes_per_second": v,
                    }
                    for k, v in coef.items()
                    if k.startswith("bw")
                ],
            },
            text=(
                "sum(a1 L^2 + a2 L) / s + beta + [s > 1] V sum(L) / (s bw[s]) "
                "(FlexSP, arXiv:2412.01523)"
            ),
        ),
    }
    out = {}
    for form, spec in forms.items():
        data = dict(base)
        data["name"] = f"published-{form}"
        data["description"] = f"Published form {spec['text']}; coefficients from {ref.name}"
        data["provenance"] = {
            "source": f"analytic form, coefficients derived from the {ref.name} profile",
            "device": ref.provenance.device,
            "date": ref.provenance.date,
            "method": "python -m dyncp.cost_model.published",
            "assumptions": _assumptions(coef, ref),
            "notes": [spec["text"]],
        }
        data["linear_seconds_per_token"] = spec["lin"]
        data["attention"] = {
            "form": "quadratic",
            "alpha": coef["a1"] / layers,
            "beta": 0.0,
            "step_overhead_seconds": 0.0,
            "backward_forward_ratio": ref.attention.backward_forward_ratio,
            "sequence_overhead_seconds": 0.0,
        }
        data["communication"] = spec["comm"]
        data["overheads"] = {"microbatch_seconds": spec["beta"], "wave_seconds": 0.0}
        data["padding"] = {"multiple_per_rank": 0}
        out[form] = Profile.model_validate(data)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROFILES_DIR)
    parser.add_argument("--nccl", type=Path, default=None, help="nccl_perf.csv to read bw from")
    args = parser.parse_args()
    busbw = read_busbw(args.nccl) if args.nccl else None
    for form, profile in published_profiles(busbw=busbw).items():
        path = args.out / f"published-{form}.json"
        path.write_text(profile.to_json())
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
