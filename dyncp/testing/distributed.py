"""Run a function on N spawned gloo ranks on CPU, with a deadline instead of a hang.

    results = run_gloo(worker, world=4, args=(...,), timeout=60)   # one result per rank

``worker(rank, world, *args)`` must be importable (a module-level function). Each rank's return
value comes back (pickled); an exception on any rank fails the whole run with that rank's
traceback; ranks that do not finish by the deadline are killed and reported.

Ranks are forked from a ``forkserver`` that has imported torch and dyncp once (``start_ranks``):
a freshly spawned interpreter spends seconds of CPU importing torch before it runs a line, which
on a small machine was most of a multi-process test's time. Each rank still starts from a clean
process (the server runs nothing but imports) with the caller's current environment.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import re
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["CountingStore", "SpawnError", "run_gloo", "start_ranks"]

# What the forkserver imports once, before it forks any rank (a name that fails to import is
# skipped by multiprocessing): torch and the parts of dyncp that workers use, and megatron-core's
# dynamic-CP path when the megatron extra is installed (five seconds of CPU per rank otherwise,
# 8 ranks in tests/multirank/test_megatron.py; once here).
_PRELOAD = (
    "torch",
    "torch.distributed",
    "dyncp.testing.distributed",
    "dyncp.planner",
    "dyncp.runtime",
    "megatron.core.datasets.data_schedule",
    "megatron.core.pipeline_parallel.schedules",
)

_COMM = re.compile(r"connectFullMesh|Connection (closed|reset)|timed out|Timed out", re.IGNORECASE)


class SpawnError(RuntimeError):
    """A spawned rank raised, or the ranks did not finish in time."""


def _entry(rank: int, fn: Callable, world: int, tmp: str, args: tuple, pg_timeout: float) -> None:
    torch.set_num_threads(1)
    out = Path(tmp, f"rank{rank}.pkl")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            result = ("ok", fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = ("error", traceback.format_exc())
    out.write_bytes(pickle.dumps(result))


def _with_env(rank: int, env: dict[str, str], payload: bytes) -> None:
    os.environ.clear()  # the caller's environment now, not the server's when it started
    os.environ.update(env)
    fn, args = pickle.loads(payload)
    fn(rank, *args)


def start_ranks(fn: Callable[..., Any], *, nprocs: int, args: tuple = ()) -> mp.ProcessContext:
    """Start ``fn(rank, *args)`` on ``nprocs`` processes without waiting (``join=False``).

    The processes are forked from a forkserver that imported ``torch`` and dyncp once, not
    spawned interpreters that import them again: ``fn`` must be importable, as for ``spawn``.
    ``fn`` and ``args`` travel as one plain pickle (tensors by value): torch's own reductions
    would send a file descriptor per tensor, and a forkserver takes at most a few hundred.
    """
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_PRELOAD))
    return mp.start_processes(
        _with_env,
        args=(dict(os.environ), pickle.dumps((fn, args))),
        nprocs=nprocs,
        join=False,
        start_method="forkserver",
    )


def run_gloo(
    fn: Callable[..., Any],
    *,
    world: int,
    args: tuple = (),
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return their results in order.

    Args:
        timeout: seconds for the whole run before the ranks are killed.
        pg_timeout: the process group's own timeout (bounds any blocked collective).
    """
    with tempfile.TemporaryDirectory() as tmp:
        ctx = start_ranks(_entry, nprocs=world, args=(fn, world, tmp, args, pg_timeout))
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise SpawnError(f"{world} gloo ranks did not finish within {timeout} s")
        results, errors = [], []
        for rank in range(world):
            path = Path(tmp, f"rank{rank}.pkl")
            if not path.exists():
                raise SpawnError(f"rank {rank} exited without a result")
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                errors.append((rank, value))
            results.append(value)
        if errors:
            # The cause, not its echo: a rank that raised takes its connections down, and a
            # slower peer (still connecting, or in a collective with it) then fails on those.
            causes = [e for e in errors if not _COMM.search(e[1].strip().splitlines()[-1])]
            rank, text = (causes or errors)[0]
            raise SpawnError(f"rank {rank} raised:\n{text}")
        return results


class CountingStore(dist.Store):
    """A Store written in Python that counts every request before passing it on.

    A seam for tests and benchmarks (how many Store requests a step makes), and a Python
    subclass of ``torch.distributed.Store``: whoever keeps only a wrapper around it (a
    ``PrefixStore``) lets it be collected.
    """

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner, self.requests = inner, 0

    def set(self, key, value):
        self.requests += 1
        self.inner.set(key, value)

    def get(self, key):
        self.requests += 1
        return self.inner.get(key)

    def multi_get(self, keys):
        self.requests += 1  # one request on the wire (TCPStore's MULTI_GET)
        return self.inner.multi_get(keys)

    def add(self, key, amount):
        self.requests += 1
        return self.inner.add(key, amount)

    def check(self, keys):
        self.requests += 1
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        self.requests += 1
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        self.requests += 1
        return self.inner.delete_key(key)

    def num_keys(self):
        self.requests += 1
        return self.inner.num_keys()
