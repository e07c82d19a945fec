"""Measuring the machine: the profiler, profile validation and pack timing.

These run real forward and backward passes (torch, ring attention, the tiny model of
``dyncp.testing``), so they live above the runtime; ``dyncp.cost_model``, which only reads what
they write, stays importable without torch.

    python -m dyncp.profiling.profile --out profiles/mine.json      # measure a profile
    python -m dyncp.profiling.validate --profile profiles/mine.json  # check it against reality
"""
