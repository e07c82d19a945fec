"""The simulator: admission of overlong documents, batch drawing, the CLI and its report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyncp.data.readers import load_lengths, resolve_dataset
from dyncp.planner.planner import ALL_POLICIES, POLICIES
from dyncp.sim.__main__ import main
from dyncp.sim.replay import OVERLONG_ACTIONS, admit, draw_batch_indices, draw_batches

REPO = Path(__file__).resolve().parents[3]

# A small, fast configuration: 8 ranks of 512 tokens; the largest group holds 4096 tokens.
SMALL = ["--world", "8", "--ranks-per-node", "4", "--capacity", "512", "--max-length", "4096"]
POLICY_FIELDS = (
    "mean_step_seconds",
    "mean_imbalance",
    "plan_seconds_p50",
    "plan_seconds_p99",
    "cp_histogram",
)

LENGTHS = st.lists(st.integers(1, 5000), min_size=1, max_size=60)


# ----------------------------------------------------------------------------- admit


@settings(max_examples=60, deadline=None)
@given(lengths=LENGTHS, max_length=st.integers(1, 3000))
def test_admit_skip(lengths: list[int], max_length: int) -> None:
    out, rep = admit(np.asarray(lengths), max_length, "skip")
    over = [s for s in lengths if s > max_length]
    assert out.tolist() == [s for s in lengths if s <= max_length]
    assert out.dtype == np.int64
    assert rep.action == "skip" and rep.max_length == max_length
    assert rep.overlong_documents == len(over)
    assert rep.overlong_tokens == sum(over)
    assert rep.dropped_tokens == sum(over)
    assert rep.admitted_documents == len(out)
    assert sum(lengths) - int(out.sum()) == rep.dropped_tokens


@settings(max_examples=60, deadline=None)
@given(lengths=LENGTHS, max_length=st.integers(1, 3000))
def test_admit_truncate(lengths: list[int], max_length: int) -> None:
    out, rep = admit(np.asarray(lengths), max_length, "truncate")
    over = [s for s in lengths if s > max_length]
    assert out.tolist() == [min(s, max_length) for s in lengths]
    assert rep.overlong_documents == len(over)
    assert rep.overlong_tokens == sum(over)
    assert rep.dropped_tokens == sum(s - max_length for s in over)
    assert rep.admitted_documents == len(lengths)
    assert sum(lengths) - int(out.sum()) == rep.dropped_tokens


@settings(max_examples=60, deadline=None)
@given(lengths=LENGTHS, max_length=st.integers(1, 3000))
def test_admit_split(lengths: list[int], max_length: int) -> None:
    out, rep = admit(np.asarray(lengths), max_length, "split")
    over = [s for s in lengths if s > max_length]
    assert rep.overlong_documents == len(over)
    assert rep.overlong_tokens == sum(over)
    assert rep.dropped_tokens == 0
    assert rep.admitted_documents == len(out)
    assert int(out.sum()) == sum(lengths)
    assert ((out >= 1) & (out <= max_length)).all()
    # Each document becomes, in order, full pieces then its remainder; pieces sum to it.
    pieces = out.tolist()
    pos = 0
    for s in lengths:
        k = -(-s // max_length)
        doc = pieces[pos : pos + k]
        assert sum(doc) == s
        assert doc[:-1] == [max_length] * (k - 1)
        pos += k
    assert pos == len(pieces)


def test_admit_examples_and_summary() -> None:
    lengths = np.array([10, 25, 5, 40])
    out, rep = admit(lengths, 10, "split")
    assert out.tolist() == [10, 10, 10, 5, 5, 10, 10, 10, 10]
    assert rep.summary() == (
        "2 documents longer than --max-length 10 split into pieces of at most 10 (no token dropped)"
    )
    out, rep = admit(lengths, 10, "skip")
    assert out.tolist() == [10, 5] and rep.dropped_tokens == 65
    assert rep.summary() == "2 documents longer than --max-length 10 skipped (65 tokens dropped)"
    out, rep = admit(np.array([5, 2500]), 10, "truncate")
    assert rep.summary() == (
        "1 document longer than --max-length 10 truncated to it (2,490 of their 2,500 tokens "
        "dropped)"
    )
    out, rep = admit(lengths, 100, "truncate")
    assert out.tolist() == lengths.tolist() and rep.overlong_documents == 0
    assert "no document exceeds" in rep.summary()


def test_admit_errors() -> None:
    with pytest.raises(ValueError) as info:
        admit(np.array([1, 2]), 10, "drop")
    msg = str(info.value)
    assert "drop" in msg
    for action in OVERLONG_ACTIONS:
        assert action in msg
    with pytest.raises(ValueError, match="max_length"):
        admit(np.array([1, 2]), 0, "skip")


# ----------------------------------------------------------------------------- draw_batches


def stream(batches: list[np.ndarray]) -> list[int]:
    return [int(x) for b in batches for x in b]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    steps=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
    budget=st.integers(1, 400),
)
def test_draw_batches_by_tokens(n: int, steps: int, seed: int, budget: int) -> None:
    # Distinct lengths identify the documents.
    lengths = np.random.default_rng(seed).permutation(np.arange(1, n + 1)) * 3
    if int(lengths.sum()) < budget:  # smaller than one batch: refused, never recycled
        with pytest.raises(ValueError, match="fewer than one global batch"):
            list(draw_batches(lengths, steps=steps, seed=seed, global_batch_tokens=budget))
        return
    batches = list(draw_batches(lengths, steps=steps, seed=seed, global_batch_tokens=budget))
    assert len(batches) == steps
    for b in batches:
        assert b.dtype == np.int64 and len(b) >= 1
        assert len(set(b.tolist())) == len(b)  # no document twice in a step
        assert int(b.sum()) >= budget
        assert int(b[:-1].sum()) < budget  # the last document is what reached the budget
    # The stream of documents is a concatenation of shuffles of the whole dataset: every epoch
    # holds each document exactly once.
    docs = stream(batches)
    for start in range(0, len(docs) - n + 1, n):
        assert sorted(docs[start : start + n]) == sorted(lengths.tolist())
    tail = docs[len(docs) - len(docs) % n :]
    assert len(set(tail)) == len(tail)
    again = list(draw_batches(lengths, steps=steps, seed=seed, global_batch_tokens=budget))
    assert [b.tolist() for b in again] == [b.tolist() for b in batches]
    # The indices behind the batches (what examples use to name the rows they train on).
    rows = list(draw_batch_indices(lengths, steps=steps, seed=seed, global_batch_tokens=budget))
    assert [lengths[r].tolist() for r in rows] == [b.tolist() for b in batches]


@settings(max_examples=40, deadline=None)
@given(
    per_epoch=st.integers(1, 8),
    size=st.integers(1, 7),
    epochs=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_draw_batches_by_size(per_epoch: int, size: int, epochs: int, seed: int) -> None:
    n = per_epoch * size  # the batch size divides the dataset
    lengths = np.arange(1, n + 1) * 7
    steps = per_epoch * epochs
    batches = list(draw_batches(lengths, steps=steps, seed=seed, global_batch_size=size))
    assert [len(b) for b in batches] == [size] * steps
    for e in range(epochs):
        epoch = stream(batches[e * per_epoch : (e + 1) * per_epoch])
        assert sorted(epoch) == lengths.tolist()


def test_draw_batches_seeds_and_epochs() -> None:
    lengths = np.arange(1, 101)
    a = stream(list(draw_batches(lengths, steps=10, seed=1, global_batch_size=10)))
    b = stream(list(draw_batches(lengths, steps=10, seed=2, global_batch_size=10)))
    assert a != b and sorted(a) == sorted(b) == lengths.tolist()
    assert a != lengths.tolist()  # shuffled
    # Wrapping: the second epoch is a different shuffle of the same documents.
    two = stream(list(draw_batches(lengths, steps=20, seed=1, global_batch_size=10)))
    assert two[:100] == a and sorted(two[100:]) == lengths.tolist() and two[100:] != a
    # A batch that wraps across epochs mid-way holds no document twice.
    small = np.array([1, 2, 3, 4, 5])
    batches = list(draw_batches(small, steps=5, seed=0, global_batch_size=4))
    assert all(len(set(b.tolist())) == 4 for b in batches)
    docs = stream(batches)
    assert sorted(docs[:5]) == sorted(docs[5:10]) == [1, 2, 3, 4, 5]
    # Fewer documents than one batch: said so, not silently recycled within a step.
    with pytest.raises(ValueError, match="3 documents, fewer than one global batch of 5"):
        list(draw_batches(small[:3], steps=2, seed=0, global_batch_size=5))


def test_draw_batches_errors() -> None:
    lengths = np.array([1, 2, 3])
    with pytest.raises(ValueError, match="exactly one"):
        list(draw_batches(lengths, steps=1, seed=0))
    with pytest.raises(ValueError, match="exactly one"):
        list(draw_batches(lengths, steps=1, seed=0, global_batch_tokens=5, global_batch_size=2))
    with pytest.raises(ValueError, match="no documents"):
        list(draw_batches(np.array([], dtype=np.int64), steps=1, seed=0, global_batch_size=2))


# ----------------------------------------------------------------------------- CLI


def run_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str, name: str = "out.json"
) -> tuple[dict, str, str]:
    out = tmp_path / name
    assert main([*SMALL, "--steps", "3", *args, "--json", str(out)]) == 0
    captured = capsys.readouterr()
    return json.loads(out.read_text()), captured.out, captured.err


def without_timings(report: dict) -> dict:
    report = json.loads(json.dumps(report))
    for p in report["policies"].values():
        for key in [k for k in p if k.startswith("plan_seconds")]:
            del p[key]
    return report


def table_rows(stdout: str) -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        words = line.split()
        if words and words[0] in ALL_POLICIES:
            assert words[0] not in rows, line
            rows[words[0]] = words
    return rows


def check_report(report: dict, policies: tuple[str, ...] = POLICIES) -> None:
    assert set(report["policies"]) == set(policies)
    for name in policies:
        p = report["policies"][name]
        for key in POLICY_FIELDS:
            assert key in p, (name, key)
        assert p["mean_step_seconds"] > 0
        assert p["mean_imbalance"] >= 1.0 - 1e-9
        assert 0 <= p["plan_seconds_p50"] <= p["plan_seconds_p99"]
        hist = p["cp_histogram"]
        assert hist and all(int(cp) & (int(cp) - 1) == 0 for cp in hist)
        assert sum(hist.values()) > 0
        assert p["mean_step_seconds"] >= report["lower_bound_mean_step_seconds"] * (1 - 1e-9)
    assert report["lower_bound_mean_step_seconds"] > 0
    if "static" in policies:
        assert set(report["speedup_vs_static"]) == set(policies)
        assert report["speedup_vs_static"]["static"] == 1
        for name in policies:
            expected = (
                report["policies"]["static"]["mean_step_seconds"]
                / report["policies"][name]["mean_step_seconds"]
            )
            assert report["speedup_vs_static"][name] == pytest.approx(expected)


def test_cli_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report, out, err = run_cli(tmp_path, capsys)
    check_report(report)
    # Every policy schedules every document of the 3 batches exactly once.
    docs = report["mean_batch_documents"] * 3
    for p in report["policies"].values():
        assert sum(p["cp_histogram"].values()) == pytest.approx(docs)
        assert len(p["step_seconds"]) == 3
    # static runs everything at the CP size that holds --max-length 4096 on 512 tokens a rank.
    assert report["policies"]["static"]["cp_histogram"].keys() == {"8"}
    rows = table_rows(out)
    assert set(rows) == set(POLICIES)
    assert rows["static"][2] == "1.000x"
    for name, words in rows.items():
        assert float(words[1]) == pytest.approx(
            report["policies"][name]["mean_step_seconds"], abs=6e-4
        )
    assert report["config"]["world"] == 8 and report["config"]["policies"] == list(POLICIES)
    assert "truncated" in err  # the bundled Wikipedia sample has documents over 4096 tokens


def test_cli_timing_both_ways(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--timing``: dataflow by default, barrier on request; the report and the printed header
    say which, each policy's steps are priced (and planned) under it, and no policy is faster
    timed with a barrier than without one on the same batches (dataflow <= barrier per plan,
    and the dataflow planners optimise dataflow)."""
    flow, out_flow, _ = run_cli(tmp_path, capsys, name="flow.json")
    wall, out_wall, _ = run_cli(tmp_path, capsys, "--timing", "barrier", name="wall.json")
    assert flow["config"]["timing"] == "dataflow" and "dataflow timing" in out_flow
    assert wall["config"]["timing"] == "barrier" and "barrier timing" in out_wall
    check_report(flow)
    check_report(wall)
    for name in ("static", "megatron", "batch-adaptive", "dp-balanced"):
        # The baselines make the same plans either way: only the price changes.
        for f, w in zip(
            flow["policies"][name]["step_seconds"], wall["policies"][name]["step_seconds"]
        ):
            assert f <= w * (1 + 1e-12), name
    assert (
        flow["policies"]["megatron"]["step_seconds"] != wall["policies"]["megatron"]["step_seconds"]
    )
    with pytest.raises(SystemExit):
        main([*SMALL, "--timing", "async"])
    assert "--timing" in capsys.readouterr().err


class LoadedClock:
    """``time.perf_counter`` of a machine so loaded that each reading is ``step`` seconds after
    the previous one: any deadline the planners set has passed by the next reading."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 1000.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_cli_deterministic_per_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same arguments and seed, same numbers, whatever the load: the second run's clock jumps
    0.5 s at every reading, so a planner that consulted it would stop at its first candidate."""
    a, out_a, _ = run_cli(tmp_path, capsys, "--seed", "5", name="a.json")
    with monkeypatch.context() as m:
        m.setattr("time.perf_counter", LoadedClock(0.5))
        b, out_b, _ = run_cli(tmp_path, capsys, "--seed", "5", name="b.json")
    assert without_timings(a) == without_timings(b)
    assert a["config"]["planner"] == "deterministic" and a["config"]["time_limit"] is None
    c, _, _ = run_cli(tmp_path, capsys, "--seed", "6", name="c.json")
    for name in POLICIES:
        assert c["policies"][name]["step_seconds"] != a["policies"][name]["step_seconds"], name


def test_cli_time_limit_is_the_load_dependent_anytime_planner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--time-limit`` plans under a wall-clock deadline: on the loaded clock its dyncp plans
    differ from the quiet deterministic ones (what the default mode protects the numbers from)."""
    quiet, _, _ = run_cli(tmp_path, capsys, "--policies", "dyncp", name="quiet.json")
    with monkeypatch.context() as m:
        m.setattr("time.perf_counter", LoadedClock(0.5))
        loaded, _, _ = run_cli(
            tmp_path, capsys, "--policies", "dyncp", "--time-limit", "0.1", name="loaded.json"
        )
    assert loaded["config"]["planner"] == "wall-clock" and loaded["config"]["time_limit"] == 0.1
    assert without_timings(loaded)["policies"] != without_timings(quiet)["policies"]
    for bad in ("0", "-1", "nan", "1e9", "soon"):
        with pytest.raises(SystemExit):
            main([*SMALL, "--time-limit", bad])
        assert "--time-limit" in capsys.readouterr().err


def test_cli_policy_subset_and_wlbllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report, out, _ = run_cli(
        tmp_path, capsys, "--dataset", "wlbllm", "--policies", "megatron, dyncp"
    )
    check_report(report, ("megatron", "dyncp"))
    assert "speedup_vs_static" not in report
    assert report["speedup_vs_megatron"]["megatron"] == 1
    assert report["config"]["dataset"].endswith("wlbllm_distca_sample.parquet")
    assert set(table_rows(out)) == {"megatron", "dyncp"}


def test_cli_csv_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    values = rng.integers(1, 3000, size=200)
    csv = tmp_path / "lengths.csv"
    csv.write_text("id,n_tokens\n" + "".join(f"{i},{v}\n" for i, v in enumerate(values)))
    report, out, err = run_cli(
        tmp_path, capsys, "--dataset", str(csv), "--column", "n_tokens", "--global-batch-size", "16"
    )
    check_report(report)
    assert report["dataset"]["count"] == 200
    assert report["dataset"]["max"] == int(values.max())
    assert report["mean_batch_documents"] == 16
    assert report["config"]["global_batch_size"] == 16
    assert "no document exceeds" in err


def test_cli_overlong_skip_reports_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = load_lengths(resolve_dataset("wikipedia"))
    skipped = int((raw > 4096).sum())
    assert skipped > 0
    report, _, err = run_cli(tmp_path, capsys, "--overlong", "skip")
    assert re.search(rf"\b{skipped} documents longer than --max-length 4096\b.*skipped", err), err
    admission = report["dataset"]["admission"]
    assert admission["overlong_documents"] == skipped
    assert admission["admitted_documents"] == len(raw) - skipped
    assert admission["dropped_tokens"] == int(raw[raw > 4096].sum())


def cli_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*SMALL, "--steps", "1", *args])
    assert info.value.code == 2
    return capsys.readouterr().err


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = cli_error(capsys, "--policies", "static,fifo")
    assert "fifo" in err and all(p in err for p in ALL_POLICIES)
    missing = tmp_path / "nope.parquet"
    err = cli_error(capsys, "--dataset", str(missing))
    assert "nope.parquet" in err
    err = cli_error(capsys, "--profile", str(tmp_path / "nope.json"))
    assert "nope.json" in err
    bad_profile = tmp_path / "bad.json"
    bad_profile.write_text('{"schema_version": 1}')
    assert "bad.json" in cli_error(capsys, "--profile", str(bad_profile))
    # 8 ranks x 512 tokens hold 4096 tokens at most: with and without the static policy.
    for policies in (",".join(POLICIES), "dyncp"):
        err = cli_error(capsys, "--policies", policies, "--max-length", "4097")
        assert "4097" in err and "4096" in err, err
    assert "positive" in cli_error(capsys, "--capacity", "0")


def test_cli_everything_skipped_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    txt = tmp_path / "long.txt"
    txt.write_text("5000\n6000\n")
    cli_error(capsys, "--dataset", str(txt), "--overlong", "skip")


def test_cli_subprocess_bundled_defaults(tmp_path: Path) -> None:
    """The bundled default (Wikipedia sample, world 64, h100-reference) runs as a program."""
    proc = subprocess.run(
        [sys.executable, "-m", "dyncp.sim", "--steps", "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    assert set(rows) == set(POLICIES)
    assert rows["static"][2] == "1.000x"
    assert "wikipedia_flexsp_sample.parquet" in proc.stderr
    assert "world 64" in proc.stdout and "h100-reference" in proc.stdout


def test_cli_subprocess_error_exit_status(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dyncp.sim", "--dataset", str(tmp_path / "missing.csv")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "missing.csv" in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- no torch


def test_planner_and_simulator_do_not_import_torch(tmp_path: Path) -> None:
    """A stand-in torch package shadows any real one, so a guarded ``import torch`` is caught
    too, whether or not torch is installed."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    code = (
        "import sys\n"
        "import dyncp.sim.__main__, dyncp.planner.planner, dyncp.cost_model.model\n"
        "import dyncp.sim.replay, dyncp.sim.report, dyncp.cost_model.evaluate\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
        "import torch\n"
        "assert torch.__file__.startswith(sys.argv[1]), torch.__file__\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO)])}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(fake.parent)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ----------------------------------------------------------------------------- edges


def test_cli_seed_must_be_non_negative(capsys: pytest.CaptureFixture[str]) -> None:
    err = cli_error(capsys, "--seed", "-1")
    assert "--seed" in err and ">= 0" in err and "Traceback" not in err


def test_cli_json_into_a_missing_directory_fails_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = cli_error(capsys, "--json", str(tmp_path / "missing" / "out.json"))
    assert "does not exist" in err and "missing" in err
    assert "steps 1/" not in err  # nothing was replayed
    assert "is a directory" in cli_error(capsys, "--json", str(tmp_path))


def test_cli_world_must_be_whole_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    err = cli_error(capsys, "--world", "12", "--ranks-per-node", "8")
    assert "whole number of nodes" in err and "--ranks-per-node 8" in err


def test_cli_directory_as_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = cli_error(capsys, "--dataset", str(tmp_path))
    assert "is a directory" in err and "no such file" not in err


def test_cli_dataset_smaller_than_one_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    txt = tmp_path / "tiny.txt"
    txt.write_text("100\n200\n")
    err = cli_error(capsys, "--dataset", str(txt))
    assert "300 tokens, fewer than one global batch of 8192" in err, err
    assert "--global-batch-tokens" in err
    err = cli_error(capsys, "--dataset", str(txt), "--global-batch-size", "3")
    assert "2 documents, fewer than one global batch of 3" in err, err


def _summary(p50: float, p99: float, step: float = 1.234) -> dict:
    policy = {
        "mean_step_seconds": step,
        "mean_imbalance": 1.5,
        "mean_gap_to_lower_bound": 0.25,
        "plan_seconds_p50": p50,
        "plan_seconds_p99": p99,
        "cp_histogram": {"1": 3, "8": 1},
    }
    return {
        "policies": {"static": dict(policy), "megatron": dict(policy)},
        "speedup_vs_static": {"static": 1.0, "megatron": 1.0},
        "lower_bound_mean_step_seconds": 1.0,
    }


@pytest.mark.parametrize(
    ("p50", "p99", "shown"),
    [
        (0.0123, 0.5, ["12.3ms", "500.0ms"]),
        (99.0, 258.4, ["99.00s", "258s"]),
        (258.4, 3600.0, ["258s", "3600s"]),
        (120_000.0, 360_000.0, ["33.3h", "100.0h"]),
    ],
)
def test_report_columns_never_run_together(p50: float, p99: float, shown: list[str]) -> None:
    from dyncp.sim.report import format_table

    table = format_table(_summary(p50, p99, step=123456.789))
    for line in table.splitlines()[2:4]:
        words = line.split()
        assert words[:2] == [words[0], "123456.789"], line
        assert words[5:7] == shown, line
        assert len(words) == 9, line  # 7 columns and the 2-entry CP mix, all separated


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_lines_on_a_non_terminal_stream() -> None:
    import io

    from dyncp.sim.progress import Progress

    stream, clock = io.StringIO(), _Clock()
    bar = Progress(40, stream=stream, clock=clock)
    for _ in range(40):
        clock.now += 0.1
        bar.update()
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == [f"{4 * k}/40" for k in range(1, 11)]
    # A slow replay: a line every 30 s even between tenths.
    stream, clock = io.StringIO(), _Clock()
    bar = Progress(1000, stream=stream, clock=clock)
    for _ in range(20):
        clock.now += 16.0
        bar.update()
    assert len(stream.getvalue().splitlines()) == 10  # 320 s: every 2nd step crosses 30 s
    assert "steps 2/1000 (0%) 32.0 s" in stream.getvalue()


def test_cli_progress_is_printed_when_stderr_is_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, err = run_cli(tmp_path, capsys, "--policies", "static")
    assert "steps 3/3 (100%)" in err


def test_cli_group_size_menus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--group-sizes: a menu kind or a list, in the report; sizes the rules refuse, named."""
    six = ["--world", "12", "--ranks-per-node", "6", "--capacity", "512", "--max-length", "3072"]
    out = tmp_path / "menu.json"
    argv = [*six, "--steps", "2", "--policies", "dyncp", "--json", str(out)]
    assert main([*argv, "--group-sizes", "divisors"]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["group_sizes"] == [1, 2, 3, 6, 12]
    assert "group sizes [1, 2, 3, 6, 12]" in capsys.readouterr().out
    assert main([*argv, "--group-sizes", "1,3,6"]) == 0
    assert json.loads(out.read_text())["config"]["group_sizes"] == [1, 3, 6]
    capsys.readouterr()
    err = cli_error(capsys, *six, "--group-sizes", "1,4,8")  # 8 straddles nodes of 6
    assert "[8] not allowed" in err
    assert "divisors" in cli_error(capsys, "--group-sizes", "primes")
