"""Read sequence lengths (token counts of training documents) from files.

The scheduler only needs one number per document, so every loader returns a 1-D int64 array in
file order. Bad input is rejected loudly with :class:`DatasetError` rather than silently coerced,
because a wrong length (0, a truncated float, a NaN turned into a huge int) quietly skews every
plan and cost estimate built on top of it. This module must not import torch: it is used by the
CPU-only simulator and benchmarks.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BUNDLED",
    "DEFAULT_DATASET",
    "SUPPORTED_SUFFIXES",
    "DatasetError",
    "describe",
    "load_lengths",
    "resolve_dataset",
]

INT64_MAX = int(np.iinfo(np.int64).max)
DEFAULT_COLUMN = "length"
SUPPORTED_SUFFIXES = (".parquet", ".csv", ".jsonl", ".txt", ".npy")
_ALLOWED = f"allowed: positive integers 1..{INT64_MAX} (integral floats such as 12.0 are accepted)"

_DATA_DIR = Path(__file__).resolve().parent / "samples"
#: Short names of the samples shipped inside the package (regenerate with make_samples.py).
BUNDLED: dict[str, str] = {
    "wikipedia": str(_DATA_DIR / "wikipedia_flexsp_sample.parquet"),
    "wlbllm": str(_DATA_DIR / "wlbllm_distca_sample.parquet"),
}
DEFAULT_DATASET = "wikipedia"

_INT_RE = re.compile(r"[+-]?\d+")
_FLOAT_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_NONFINITE = {"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or holds a value that is not a valid length.

    Subclasses ValueError so callers that already catch ValueError keep working; the message
    always names the file, what is wrong, where, and what is allowed.
    """


def _fail(path: Path, where: str, problem: str) -> DatasetError:
    return DatasetError(f"{path}: {where}: {problem}; {_ALLOWED}")


def _check_int(path: Path, where: str, raw: object, value: int) -> int:
    """Range-check one Python int; ``raw`` is what the file said, echoed in the message."""
    if value <= 0:
        kind = "zero" if value == 0 else "negative"
        raise _fail(path, where, f"value {raw!r} is {kind}")
    if value > INT64_MAX:
        raise _fail(path, where, f"value {raw!r} does not fit in int64")
    return value


def _check_float(path: Path, where: str, raw: object, value: float) -> int:
    if math.isnan(value):
        raise _fail(path, where, f"value {raw!r} is NaN")
    if math.isinf(value):
        raise _fail(path, where, f"value {raw!r} is infinite")
    if not value.is_integer():
        raise _fail(path, where, f"value {raw!r} is not an integer")
    return _check_int(path, where, raw, int(value))


def _parse_text(path: Path, where: str, text: str) -> int:
    """Parse one textual cell; strict so that '1_000', 'true' or '' are not silently accepted."""
    s = text.strip()
    if s == "" or s.lower() in {"null", "none", "na", "n/a"}:
        raise _fail(path, where, f"value {text!r} is missing (null)")
    if _INT_RE.fullmatch(s):
        return _check_int(path, where, text, int(s))
    if s.lower() in _NONFINITE or _FLOAT_RE.fullmatch(s):
        return _check_float(path, where, text, float(s))
    raise _fail(path, where, f"value {text!r} is not an integer")


def _check_json(path: Path, where: str, value: Any) -> int:
    # bool is a subclass of int in Python, so it must be rejected before the int branch.
    if value is None:
        raise _fail(path, where, "value null is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, where, f"value {json.dumps(value)} is not an integer")
    if isinstance(value, float):
        return _check_float(path, where, value, value)
    return _check_int(path, where, value, value)


def _check_array(path: Path, arr: np.ndarray, row: Callable[[int], str]) -> np.ndarray:
    """Vectorised validation of a numeric array; ``row(i)`` describes position ``i``."""
    if arr.ndim != 1:
        raise DatasetError(f"{path}: expected a 1-D array, got shape {arr.shape}; {_ALLOWED}")
    if arr.size == 0:
        raise DatasetError(f"{path}: dataset is empty (no rows); need at least one length")
    kind = arr.dtype.kind
    if kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.floor(arr)) | (arr >= 2.0**63) | (arr <= 0)
        if bad.any():
            i = int(np.argmax(bad))
            _check_float(path, row(i), float(arr[i]), float(arr[i]))  # always raises here
        return arr.astype(np.int64)
    if kind not in "iu":
        first = arr[0].item() if arr.dtype != object else arr[0]
        raise _fail(path, row(0), f"dtype {arr.dtype} is not numeric (first value {first!r})")
    bad = arr <= 0
    if kind == "u":
        bad |= arr > INT64_MAX
    if bad.any():
        i = int(np.argmax(bad))
        _check_int(path, row(i), arr[i].item(), arr[i].item())
    return arr.astype(np.int64)


def _finish(path: Path, values: list[int]) -> np.ndarray:
    if not values:
        raise DatasetError(f"{path}: dataset is empty (no rows); need at least one length")
    return np.array(values, dtype=np.int64)


def _load_parquet(path: Path, column: str) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"{path}: cannot read as parquet: {e}") from e
    if column not in schema.names:
        raise DatasetError(f"{path}: column {column!r} not found; columns present: {schema.names}")
    col = pq.read_table(path, columns=[column]).column(column).combine_chunks()

    def row(i: int) -> str:
        return f"row {i + 1} (column {column!r})"

    if len(col) == 0:
        raise DatasetError(f"{path}: dataset is empty (no rows); need at least one length")
    if col.null_count:
        i = int(np.argmax(pc.is_null(col).to_numpy(zero_copy_only=False)))
        raise _fail(path, row(i), "value is null")
    t = col.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        raise _fail(path, row(0), f"type {t} is not numeric (first value {col[0].as_py()!r})")
    return _check_array(path, col.to_numpy(zero_copy_only=False), row)


def _load_npy(path: Path) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: cannot read as .npy: {e}") from e
    return _check_array(path, np.asarray(arr), lambda i: f"index {i}")


def _load_csv(path: Path, column: str) -> np.ndarray:
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next((r for r in reader if r), None)
        if header is None:
            raise DatasetError(
                f"{path}: dataset is empty (no header row, no rows); a CSV needs a header row "
                f"naming the column {column!r}"
            )
        names = [h.strip() for h in header]
        if column not in names:
            hint = ""
            if all(_INT_RE.fullmatch(n) for n in names):
                hint = " (the first line looks like data: a header row is required)"
            raise DatasetError(
                f"{path}: column {column!r} not found in header row; columns present: {names}{hint}"
            )
        idx = names.index(column)
        values: list[int] = []
        for rec in reader:
            if not rec:
                continue
            where = f"line {reader.line_num} (column {column!r})"
            if idx >= len(rec):
                raise _fail(path, where, f"row has {len(rec)} fields, value is missing")
            values.append(_parse_text(path, where, rec[idx]))
    return _finish(path, values)


def _lines(path: Path) -> Iterable[tuple[int, str]]:
    with path.open(encoding="utf-8-sig") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                yield n, line.rstrip("\r\n")


def _load_jsonl(path: Path, column: str) -> np.ndarray:
    values: list[int] = []
    for n, line in _lines(path):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _fail(path, f"line {n}", f"invalid JSON ({e.msg}): {line.strip()!r}") from e
        if isinstance(obj, dict):
            if column not in obj:
                raise DatasetError(
                    f"{path}: line {n}: key {column!r} not found; keys present: {list(obj)}"
                )
            values.append(_check_json(path, f"line {n} (key {column!r})", obj[column]))
        else:
            values.append(_check_json(path, f"line {n}", obj))
    return _finish(path, values)


def _load_txt(path: Path) -> np.ndarray:
    return _finish(path, [_parse_text(path, f"line {n}", s) for n, s in _lines(path)])


def load_lengths(path: str | os.PathLike[str], column: str | None = None) -> np.ndarray:
    """Return the sequence lengths stored in ``path`` as a 1-D int64 array in file order.

    The format is chosen by suffix (``.parquet``, ``.csv``, ``.jsonl``, ``.txt``, ``.npy``) so
    that callers never have to say it twice. ``column`` selects the column (parquet, csv) or
    JSON key (jsonl) and defaults to ``"length"``; it is ignored for ``.txt`` and ``.npy``.
    Every value must be a positive integer that fits in int64; anything else raises
    :class:`DatasetError` naming the first offending value and its position.
    """
    p = Path(path)
    col = DEFAULT_COLUMN if column is None else column
    suffix = p.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DatasetError(
            f"{p}: unsupported file suffix {p.suffix!r}; supported suffixes: "
            f"{', '.join(SUPPORTED_SUFFIXES)}"
        )
    if not p.exists():
        raise DatasetError(f"{p}: file not found")
    if not p.is_file():
        raise DatasetError(f"{p}: not a regular file")
    try:
        if suffix == ".parquet":
            return _load_parquet(p, col)
        if suffix == ".npy":
            return _load_npy(p)
        if suffix == ".csv":
            return _load_csv(p, col)
        if suffix == ".jsonl":
            return _load_jsonl(p, col)
        return _load_txt(p)
    except UnicodeDecodeError as e:
        raise DatasetError(f"{p}: not UTF-8 text: {e}") from e


def resolve_dataset(name_or_path: str) -> Path:
    """Map a bundled sample name (see :data:`BUNDLED`) or a file path to an existing file.

    Lets command-line tools take either ``wikipedia`` or ``/data/my_lengths.parquet`` in the
    same argument; bundled names win over relative paths with the same spelling.
    """
    if name_or_path in BUNDLED:
        p = Path(BUNDLED[name_or_path])
        if not p.is_file():
            raise DatasetError(
                f"{p}: bundled dataset {name_or_path!r} is missing from the package; "
                "regenerate it with: python dyncp/data/samples/make_samples.py"
            )
        return p
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        raise DatasetError(
            f"{p}: is a directory; give a file of lengths ({', '.join(SUPPORTED_SUFFIXES)}) or a "
            f"bundled name ({', '.join(sorted(BUNDLED))})"
        )
    if p.exists():
        raise DatasetError(f"{p}: not a regular file")
    raise DatasetError(
        f"{p}: no such file and not a bundled dataset name; "
        f"bundled names: {', '.join(sorted(BUNDLED))}"
    )


def describe(lengths: np.ndarray | Iterable[int]) -> dict[str, int | float]:
    """Summary statistics of a length distribution as plain JSON-serialisable numbers.

    Percentiles use numpy's default linear interpolation; the tail (p99, max) matters most
    because the longest documents dominate attention cost.
    """
    a = np.asarray(lengths if isinstance(lengths, np.ndarray) else list(lengths))
    if a.ndim != 1 or a.size == 0:
        raise DatasetError(f"describe: need a non-empty 1-D array of lengths, got shape {a.shape}")
    p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
    return {
        "count": int(a.size),
        "mean": float(a.mean()),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": int(a.max()),
    }
