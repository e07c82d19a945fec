"""Measuring the machine: the profiler, profile validation and pack timing.

These run real forward and backward passes (torch, ring attention, the profiler's own decoder),
so they live above the runtime; ``dyncp.cost_model``, which only reads what they write, stays
importable without torch.

    python -m dyncp.profiling.profile --out profiles/mine.json      # measure a profile
    python -m dyncp.profiling.validate --profile profiles/mine.json  # check it against reality

Modules, one line each:

- ``decoder``: the decoder the profiler measures (TinyConfig, TinyDecoder, MODELS);
- ``measure``: the measurements (attention, model packs, ring steps, head exchanges, waves);
- ``fits``: from those measurements to a Profile (build_profile);
- ``packs``: timing packs of real document lengths, as a training wave runs them;
- ``profile``: the profiler's command line (``python -m dyncp.profiling.profile``);
- ``validate``: a profile's predictions against measured packs (``python -m ...validate``).

The two command-line modules are not imported here (``python -m`` runs them as ``__main__``).
"""

from dyncp.profiling.decoder import MODELS, TinyConfig, TinyDecoder, rope
from dyncp.profiling.fits import all_to_all_section, build_profile, fit_link_robust
from dyncp.profiling.measure import measure, measure_all_to_all, run_context
from dyncp.profiling.packs import measure_packs, random_pack, ring_sizes

__all__ = [
    "MODELS",
    "TinyConfig",
    "TinyDecoder",
    "all_to_all_section",
    "build_profile",
    "fit_link_robust",
    "measure",
    "measure_all_to_all",
    "measure_packs",
    "random_pack",
    "ring_sizes",
    "rope",
    "run_context",
]
