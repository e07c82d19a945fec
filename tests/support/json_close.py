"""Compare rebuilt JSON-like data with a relative tolerance on floats and exactness elsewhere.

A profile rebuilt from measured CSVs runs least-squares fits through numpy; the BLAS kernel a CPU
selects may change the last bit of a fitted float (3.32076116567818e-05 against
3.320761165678179e-05). Such a difference is not a change of the profile, so floats are compared
within a relative tolerance, while keys, strings, integers, booleans, list lengths and ``None``
must match exactly: a missing field, a renamed assumption or an extra link is still caught.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["assert_json_close", "json_differences"]


def json_differences(
    got: Any, want: Any, *, rel: float = 1e-9, abs_tol: float = 0.0, path: str = "$"
) -> list[str]:
    """Every place where ``got`` and ``want`` differ, as ``path: got != want`` lines.

    Two numbers where either is a float match when ``math.isclose(got, want, rel_tol=rel,
    abs_tol=abs_tol)``; a float never matches a non-number, and ``bool`` is not a number here.
    Tuples and lists are the same sequence (pydantic dumps one, JSON loads the other).
    """
    if _is_float_pair(got, want):
        if math.isnan(got) and math.isnan(want):
            return []
        if math.isclose(got, want, rel_tol=rel, abs_tol=abs_tol):
            return []
        return [f"{path}: {got!r} != {want!r} (rel {rel:g})"]
    if isinstance(got, dict) and isinstance(want, dict):
        out: list[str] = []
        for key in sorted(set(got) | set(want), key=str):
            if key not in got:
                out.append(f"{path}.{key}: missing from the first")
            elif key not in want:
                out.append(f"{path}.{key}: missing from the second")
            else:
                out += json_differences(
                    got[key], want[key], rel=rel, abs_tol=abs_tol, path=f"{path}.{key}"
                )
        return out
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{path}: length {len(got)} != {len(want)}"]
        out = []
        for i, (a, b) in enumerate(zip(got, want)):
            out += json_differences(a, b, rel=rel, abs_tol=abs_tol, path=f"{path}[{i}]")
        return out
    if type(got) is not type(want) or got != want:
        return [f"{path}: {got!r} != {want!r}"]
    return []


def assert_json_close(got: Any, want: Any, *, rel: float = 1e-9, abs_tol: float = 0.0) -> None:
    """Fail with every differing path when ``got`` and ``want`` differ beyond ``rel`` on floats."""
    diffs = json_differences(got, want, rel=rel, abs_tol=abs_tol)
    assert not diffs, f"{len(diffs)} difference(s):\n" + "\n".join(diffs[:40])


def _is_float_pair(got: Any, want: Any) -> bool:
    numbers = (int, float)
    if isinstance(got, bool) or isinstance(want, bool):
        return False
    if not (isinstance(got, numbers) and isinstance(want, numbers)):
        return False
    return isinstance(got, float) or isinstance(want, float)
