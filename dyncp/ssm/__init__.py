"""State-space (linear recurrence) mixers under context parallelism.

Modules: ``scan`` (the diagonal linear recurrence over a zigzag-sharded micro-batch, chunk states
exchanged by one all-gather).
"""

from dyncp.ssm.scan import diagonal_scan

__all__ = ["diagonal_scan"]
