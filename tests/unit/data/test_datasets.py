"""Tests for dyncp.data.readers: every format, every rejection, the bundled samples."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyncp.data.readers import (
    BUNDLED,
    DEFAULT_DATASET,
    DatasetError,
    describe,
    load_lengths,
    resolve_dataset,
)

VALUES = [5, 1, 4096, 3]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def write_parquet(path: Path, **cols: list) -> Path:
    pq.write_table(pa.table(cols), path)
    return path


def check(arr: np.ndarray, expected: list[int] = VALUES) -> None:
    assert arr.dtype == np.int64 and arr.ndim == 1
    assert arr.tolist() == expected


# --- each format reads correctly ----------------------------------------------------------


def test_parquet(tmp_path: Path) -> None:
    check(load_lengths(write_parquet(tmp_path / "a.parquet", length=VALUES)))


def test_parquet_int32_and_integral_float(tmp_path: Path) -> None:
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"length": pa.array(VALUES, pa.int32())}), p)
    check(load_lengths(p))
    check(load_lengths(write_parquet(p, length=[float(v) for v in VALUES])))


def test_csv(tmp_path: Path) -> None:
    text = "id,length\n" + "".join(f"{i},{v}\n" for i, v in enumerate(VALUES)) + "\n"
    check(load_lengths(write(tmp_path / "a.csv", text)))
    check(load_lengths(write(tmp_path / "b.csv", "length\n12.0\n")), [12])


def test_jsonl_bare_ints(tmp_path: Path) -> None:
    check(load_lengths(write(tmp_path / "a.jsonl", "5\n1\n\n4096\n3\n")))


def test_jsonl_objects(tmp_path: Path) -> None:
    text = "".join(json.dumps({"id": i, "length": v}) + "\n" for i, v in enumerate(VALUES))
    check(load_lengths(write(tmp_path / "a.jsonl", text)))


def test_txt(tmp_path: Path) -> None:
    check(load_lengths(write(tmp_path / "a.txt", "5\n1\n\n  4096 \n3")))


def test_npy(tmp_path: Path) -> None:
    p = tmp_path / "a.npy"
    for dtype in (np.int64, np.int32, np.uint16, np.float64):
        np.save(p, np.array(VALUES, dtype=dtype))
        check(load_lengths(p))


@pytest.mark.parametrize(
    "name,text",
    [
        ("a.parquet", None),
        ("a.csv", "length,tokens\n99,5\n99,1\n99,4096\n99,3\n"),
        ("a.jsonl", "".join(json.dumps({"length": 99, "tokens": v}) + "\n" for v in VALUES)),
    ],
)
def test_column_option(tmp_path: Path, name: str, text: str | None) -> None:
    p = tmp_path / name
    if text is None:
        write_parquet(p, length=[99] * 4, tokens=VALUES)
    else:
        write(p, text)
    check(load_lengths(p, column="tokens"))
    check(load_lengths(p), [99] * 4)


# --- each bad input is rejected with a useful message -------------------------------------


def raises(path: Path, *fragments: str, column: str | None = None) -> str:
    with pytest.raises(DatasetError) as info:
        load_lengths(path, column=column)
    msg = str(info.value)
    assert str(path) in msg
    for frag in fragments:
        assert frag in msg, (frag, msg)
    return msg


def test_missing_file(tmp_path: Path) -> None:
    raises(tmp_path / "nope.parquet", "not found")


def test_unknown_suffix(tmp_path: Path) -> None:
    raises(write(tmp_path / "a.tsv", "1\n"), ".tsv", ".parquet", ".csv", ".jsonl", ".txt", ".npy")


def test_missing_column(tmp_path: Path) -> None:
    raises(write_parquet(tmp_path / "a.parquet", tokens=[1], id=[2]), "'length'", "tokens", "id")
    raises(write(tmp_path / "a.csv", "tokens,id\n1,2\n"), "'length'", "tokens", "id")
    raises(write(tmp_path / "h.csv", "5\n6\n"), "'length'", "header row")
    raises(write(tmp_path / "a.jsonl", '{"tokens": 1}\n'), "'length'", "tokens", "line 1")
    raises(write(tmp_path / "b.csv", "length\n1\n"), "'n_tok'", "length", column="n_tok")


@pytest.mark.parametrize(
    "name,text,fragments",
    [
        ("a.txt", "1\n2\n3.5\n", ["'3.5'", "line 3", "not an integer"]),
        ("a.txt", "1\n\nabc\n", ["'abc'", "line 3"]),
        ("a.txt", "1\ntrue\n", ["'true'", "line 2"]),
        ("a.txt", "1\n1_000\n", ["'1_000'", "line 2"]),
        ("a.csv", "length\n1\n3.5\n", ["'3.5'", "line 3"]),
        ("a.csv", "length\n1\nabc\n", ["'abc'", "line 3"]),
        ("a.jsonl", "1\n3.5\n", ["3.5", "line 2"]),
        ("a.jsonl", "1\ntrue\n", ["true", "line 2"]),
        ("a.jsonl", '{"length": false}\n', ["false", "line 1"]),
        ("a.jsonl", '{"length": "12"}\n', ['"12"', "line 1"]),
        ("a.jsonl", "1\n{oops\n", ["invalid JSON", "line 2"]),
    ],
)
def test_non_integer_text(tmp_path: Path, name: str, text: str, fragments: list[str]) -> None:
    raises(write(tmp_path / name, text), *fragments)


def test_non_integer_parquet_and_npy(tmp_path: Path) -> None:
    raises(write_parquet(tmp_path / "a.parquet", length=[1.0, 3.5]), "3.5", "row 2")
    raises(write_parquet(tmp_path / "b.parquet", length=[True]), "bool", "True")
    raises(write_parquet(tmp_path / "c.parquet", length=["12"]), "string", "'12'")
    np.save(tmp_path / "a.npy", np.array([1.0, 2.0, 3.5]))
    raises(tmp_path / "a.npy", "3.5", "index 2")
    np.save(tmp_path / "b.npy", np.array([[1, 2]]))
    raises(tmp_path / "b.npy", "1-D")


@pytest.mark.parametrize("bad,kind", [(0, "zero"), (-7, "negative")])
def test_zero_and_negative(tmp_path: Path, bad: int, kind: str) -> None:
    raises(write(tmp_path / "a.txt", f"1\n{bad}\n"), kind, f"'{bad}'", "line 2")
    raises(write(tmp_path / "a.csv", f"length\n{bad}\n"), kind, "line 2")
    raises(write(tmp_path / "a.jsonl", f'{{"length": {bad}}}\n'), kind, "line 1")
    raises(write_parquet(tmp_path / "a.parquet", length=[1, 2, bad]), kind, "row 3")
    np.save(tmp_path / "a.npy", np.array([bad, 1]))
    raises(tmp_path / "a.npy", kind, "index 0")


def test_nan_inf_null(tmp_path: Path) -> None:
    raises(write(tmp_path / "a.txt", "1\nnan\n"), "NaN", "line 2")
    raises(write(tmp_path / "a.csv", "length\ninf\n"), "infinite", "line 2")
    raises(write(tmp_path / "b.csv", "id,length\n1,\n"), "missing", "line 2")
    raises(write(tmp_path / "a.jsonl", "1\nNaN\n"), "NaN", "line 2")
    raises(write(tmp_path / "b.jsonl", '{"length": null}\n'), "null", "line 1")
    raises(write_parquet(tmp_path / "a.parquet", length=[1.0, float("nan")]), "NaN", "row 2")
    raises(write_parquet(tmp_path / "b.parquet", length=[1, None]), "null", "row 2")
    np.save(tmp_path / "a.npy", np.array([1.0, np.inf]))
    raises(tmp_path / "a.npy", "infinite", "index 1")


def test_int64_overflow(tmp_path: Path) -> None:
    raises(write(tmp_path / "a.txt", f"{2**63}\n"), "int64")
    raises(write(tmp_path / "a.jsonl", f"{2**70}\n"), "int64")
    np.save(tmp_path / "a.npy", np.array([2**64 - 1], dtype=np.uint64))
    raises(tmp_path / "a.npy", "int64")
    assert load_lengths(write(tmp_path / "b.txt", f"{2**63 - 1}\n")).tolist() == [2**63 - 1]


def test_empty(tmp_path: Path) -> None:
    for name, text in [("a.txt", "\n\n"), ("a.jsonl", ""), ("a.csv", "length\n"), ("b.csv", "")]:
        raises(write(tmp_path / name, text), "empty")
    raises(write_parquet(tmp_path / "a.parquet", length=pa.array([], pa.int32())), "empty")
    np.save(tmp_path / "a.npy", np.array([], dtype=np.int64))
    raises(tmp_path / "a.npy", "empty")


def test_corrupt_parquet(tmp_path: Path) -> None:
    raises(write(tmp_path / "a.parquet", "not parquet"), "parquet")


# --- bundled samples, resolve_dataset, describe -------------------------------------------


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_samples(name: str) -> None:
    arr = load_lengths(resolve_dataset(name))
    assert arr.dtype == np.int64 and arr.shape == (20_000,)
    assert (arr > 0).all()
    assert Path(BUNDLED[name]).parent.parts[-3:] == ("dyncp", "data", "samples")


def test_resolve_dataset(tmp_path: Path) -> None:
    assert set(BUNDLED) == {"wikipedia", "wlbllm"} and DEFAULT_DATASET in BUNDLED
    p = write(tmp_path / "a.txt", "1\n")
    assert resolve_dataset(str(p)) == p
    with pytest.raises(DatasetError) as info:
        resolve_dataset(str(tmp_path / "missing.parquet"))
    assert "missing.parquet" in str(info.value)
    assert "wikipedia" in str(info.value) and "wlbllm" in str(info.value)


def test_describe() -> None:
    d = describe(np.arange(1, 101))
    assert d["count"] == 100 and d["max"] == 100 and d["mean"] == 50.5
    assert d["p50"] == 50.5 and 90 <= d["p90"] <= 91 and 99 <= d["p99"] <= 100
    json.dumps(d)
    json.dumps(describe([3, 1, 2]))
    with pytest.raises(DatasetError):
        describe([])


def test_no_torch_import() -> None:
    src = Path(__file__).resolve().parents[3] / "dyncp" / "data" / "readers.py"
    imported = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "torch" not in imported


# --- round trip ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.integers(min_value=1, max_value=2**63 - 1), min_size=1, max_size=50),
    fmt=st.sampled_from(["txt", "npy", "parquet"]),
)
def test_round_trip(tmp_path_factory: pytest.TempPathFactory, values: list[int], fmt: str) -> None:
    p = tmp_path_factory.mktemp("rt") / f"x.{fmt}"
    if fmt == "txt":
        p.write_text("\n".join(map(str, values)) + "\n")
    elif fmt == "npy":
        np.save(p, np.array(values, dtype=np.int64))
    else:
        pq.write_table(pa.table({"length": pa.array(values, pa.int64())}), p)
    assert load_lengths(p).tolist() == values


def test_resolve_dataset_names_a_directory(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="is a directory; give a file of lengths"):
        resolve_dataset(str(tmp_path))
    with pytest.raises(DatasetError, match="no such file"):
        resolve_dataset(str(tmp_path / "absent.parquet"))
