"""State-space (linear recurrence) mixers under context parallelism.

Modules: ``scan`` (the diagonal linear recurrence over a zigzag-sharded micro-batch, chunk states
exchanged by one all-gather), ``channel`` (the same recurrence by all-to-all to channel
parallelism).
"""

from dyncp.ssm.channel import channel_parallel_scan
from dyncp.ssm.scan import diagonal_scan

__all__ = ["channel_parallel_scan", "diagonal_scan"]
