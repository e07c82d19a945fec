"""The job's collective timeout: how long a rank waits on a collective before it gives up.

The control plane (the agreement's wait) and the runtime (every
pre-built group) all size their waits from it, so it is read from the one place the launcher set
it, the default process group, below both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["job_timeout"]

#: torch's default for gloo process groups, used when the job's own timeout cannot be read.
_TORCH_DEFAULT_TIMEOUT = 1800.0


def job_timeout() -> float:
    """Seconds of the default process group's timeout (the one ``init_process_group`` got)."""
    pg = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
            return backend.options._timeout.total_seconds()
        except (RuntimeError, AttributeError):
            continue
    return _TORCH_DEFAULT_TIMEOUT
