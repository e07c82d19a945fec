"""Every bad input of ``python -m dyncp.sim`` is one line naming its flag; usage only for an
option the parser does not know (``dyncp.sim.options``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dyncp.sim.__main__ import main

PREFIX = "python -m dyncp.sim: error: "

#: (arguments, what the one line must name)
CASES = [
    (["--world", "12"], "--world 12 is not a whole number of nodes of --ranks-per-node 8"),
    (["--world", "0"], "argument --world: expected a positive integer"),
    (["--world", "4"], "the default --max-length 131072 exceeds"),
    (["--world", "4", "--max-length", "40000"], "give --max-length 32768 or less"),
    (["--capacity", "0"], "argument --capacity"),
    (["--capacity", "x"], "argument --capacity: expected a positive integer, got 'x'"),
    (["--ranks-per-node", "-1"], "argument --ranks-per-node"),
    (["--steps", "0"], "argument --steps"),
    (["--seed", "-1"], "argument --seed"),
    (["--policies", "static,fifo"], "--policies 'static,fifo': choose from"),
    (["--policies", "megatron-core", "--pp", "2"], "megatron-core with --pp: the release's"),
    (["--policies", "dyncp-hybrid"], "give --head-sizes beyond 1, such as --head-sizes 1,2,4,8"),
    (["--head-sizes", "1,x"], "argument --head-sizes"),
    (["--head-sizes", "1,128"], "--head-sizes 1,128: [128] exceed the largest group"),
    (["--group-sizes", "0"], "argument --group-sizes"),
    (
        ["--group-sizes", "1,128"],
        "--group-sizes 1,128: group sizes [128] not allowed for --world 64",
    ),
    (["--profile", "nope"], "--profile nope: profile 'nope' is neither a file"),
    (["--dataset", "nope.parquet"], "--dataset nope.parquet: "),
    (["--timing", "x"], "argument --timing: invalid choice: 'x'"),
    (["--overlong", "drop"], "argument --overlong: invalid choice"),
    (["--time-limit", "0"], "argument --time-limit"),
    (["--hold", "5"], "--hold needs --metrics-port"),
    (["--step-delay", "1"], "--step-delay needs --metrics-port"),
    (["--metrics-port", "70000"], "argument --metrics-port"),
    (["--plot-step", "5", "--steps", "2"], "--plot-step 5: choose a step in 0..1"),
    (["--global-batch-tokens", "10", "--global-batch-size", "3"], "not allowed with argument"),
]


@pytest.mark.parametrize(("args", "named"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_input_is_one_line_naming_its_flag(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*args, "--steps", "1"] if "--steps" not in args else args)
    assert info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(PREFIX) and named in lines[0], lines[0]
    assert captured.out == ""


def test_a_json_path_in_a_missing_folder_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["--json", str(tmp_path / "missing" / "out.json")])
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "--json" in lines[0]


def test_an_unknown_option_shows_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--bogus", "3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m dyncp.sim") and len(err.splitlines()) > 3
    assert err.splitlines()[-1] == PREFIX + "unrecognized arguments: --bogus 3"
