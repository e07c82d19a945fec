"""The whole step of the H100 reference profile, from cited figures: ``h100-reference-step``.

    python -m dyncp.cost_model.step_reference            # writes profiles/h100-reference-step.json

``h100-reference`` prices a step's micro-batches; this adds its ``step`` (schema version 2,
``dyncp.cost_model.step_parts``) with every number a stated assumption named in the provenance,
none fitted to a table it is compared with:

- embedding and LM head per token: 0 -- the LM head's GEMM (hidden x vocab) is already among
  ``linear_seconds_per_token``'s FLOPs (``DecoderShape.gemm_params``) and an embedding lookup
  is a gather of one row per token, negligible beside it; pricing them again would count twice;
- parameters: ``DecoderShape.parameters``, the shape's GEMM weights plus its input embedding
  (hidden x vocab) unless the shape ties it to the output layer, plus learned positions;
- optimizer: AdamW with fp32 master weights is memory-bound; one parameter's update reads its
  fp32 gradient, master weight and two moments (16 bytes) and writes the master weight, the
  moments and the bf16 weight (14 bytes), 30 bytes at the H100 SXM's 3.35 TB/s of HBM3
  (NVIDIA H100 datasheet), taken as achieved: a lower bound on the update;
- gradients are reduced in fp32 (4 bytes, Megatron-LM's default of accumulating and
  all-reducing gradients in fp32) and parameters gathered in bf16 (2 bytes), over the links of
  ``h100-reference`` (NVLink all-gather fits inside a node, InfiniBand across:
  ``sharding.collective_from_profile``), unhidden: DDP's overlap of buckets with the backward
  is not priced, so the reduction is an upper bound;
- no other fixed per-step part (``fixed_seconds`` 0: calibration measures it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dyncp.cost_model.schema import PROFILES_DIR, Profile, load_profile
from dyncp.cost_model.shapes import SHAPES

__all__ = ["HBM_BYTES_PER_SECOND", "OPTIMIZER_BYTES_PER_PARAMETER", "reference_step_profile"]

#: H100 SXM HBM3 bandwidth (NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s).
HBM_BYTES_PER_SECOND = 3.35e12
#: AdamW, fp32 master weights: read grad, master, m, v (4 x 4 B); write master, m, v (3 x 4 B)
#: and the bf16 weight (2 B).
OPTIMIZER_BYTES_PER_PARAMETER = 30.0


def reference_step_profile(base: str = "h100-reference", shape: str = "llama3-8b") -> Profile:
    """``base`` with the step of ``shape`` (a ``dyncp.cost_model.shapes.SHAPES`` name)."""
    profile = load_profile(base)
    dec = SHAPES[shape]
    parameters = dec.parameters
    per_parameter = OPTIMIZER_BYTES_PER_PARAMETER / HBM_BYTES_PER_SECOND
    data = json.loads(profile.to_json())
    data["schema_version"] = 2
    data["name"] = f"{base}-step"
    data["description"] = f"{profile.description} With the whole step (gradient reduction, AdamW)."
    data["step"] = {
        "embedding_seconds_per_token": 0.0,
        "head_loss_seconds_per_token": 0.0,
        "parameters": parameters,
        "gradient_bytes_per_parameter": 4.0,
        "parameter_bytes_per_parameter": 2.0,
        "optimizer_seconds_per_parameter": per_parameter,
        "fixed_seconds": 0.0,
        "integration": "ddp",
    }
    prov = data["provenance"]
    prov["method"] = "python -m dyncp.cost_model.step_reference"
    prov["assumptions"] = [
        *prov["assumptions"],
        {
            "name": "step.embedding and head per token (s)",
            "value": 0.0,
            "source": "the LM head GEMM is in linear_seconds_per_token; an embedding lookup is a "
            "row gather per token, negligible beside it",
        },
        {
            "name": "step.parameters",
            "value": parameters,
            "source": f"{shape}: {dec.gemm_params} GEMM weights"
            + (
                " (the input embedding tied to the output layer)"
                if dec.tied_embeddings
                else f" + {dec.hidden_size} x {dec.vocab_size} input embedding (untied)"
            )
            + (
                f" + {dec.position_embeddings} x {dec.hidden_size} learned positions"
                if dec.position_embeddings
                else ""
            ),
        },
        {
            "name": "step.optimizer_seconds_per_parameter",
            "value": per_parameter,
            "source": "AdamW with fp32 master weights, memory-bound: 30 bytes per parameter "
            "(read grad, master, m, v; write master, m, v, bf16 weight) at 3.35 TB/s, the H100 "
            "SXM HBM3 bandwidth (NVIDIA H100 datasheet), taken as achieved",
        },
        {
            "name": "step.gradient_bytes_per_parameter",
            "value": 4.0,
            "source": "fp32 gradient reduction (Megatron-LM accumulates and all-reduces "
            "gradients in fp32 by default); reduction priced unhidden (no overlap with the "
            "backward), an upper bound",
        },
    ]
    return Profile.model_validate(data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROFILES_DIR / "h100-reference-step.json")
    args = parser.parse_args(argv)
    args.out.write_text(reference_step_profile().to_json())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
