"""Online calibration: the refit recovers a known true model from noisy, outlier-laden
measurements, never produces a broken profile, is deterministic, and every rank ends up planning
with the same model version at the same step."""

from __future__ import annotations

import contextlib
import json
import math

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dyncp.control.model_channel import MeasurementChannel, ModelChannel
from dyncp.cost_model import CostModel, Profile, ProfileError, load_profile
from dyncp.cost_model.calibration.coefficients import apply_coefficients, profile_coefficients
from dyncp.cost_model.calibration.fit import (
    CalibrationError,
    Measurement,
    MeasurementBuffer,
    WaveMeasurement,
    fit_profile,
)
from dyncp.cost_model.calibration.online import (
    ModelVersion,
    OnlineCalibrator,
    decode_measurements,
    encode_measurements,
)
from dyncp.data.readers import load_lengths, resolve_dataset
from dyncp.observability.metrics import Metrics
from dyncp.planner import Planner, VersionedPlanner

PROFILE = load_profile("cpu-gloo")
RPN = 4
SIZES = [2, 4]
POOL = np.minimum(load_lengths(resolve_dataset("wikipedia")), 2048)


def random_pack(rng: np.random.Generator, cp: int, capacity: int = 1024) -> tuple[int, ...]:
    out: list[int] = []
    tokens = 0
    while True:
        s = int(rng.choice(POOL))
        padded = s if cp == 1 else -(-s // (2 * cp)) * (2 * cp)
        if tokens + padded > cp * capacity:
            return tuple(out or [s])
        out.append(s)
        tokens += padded


def true_profile():
    """The 'machine': 25% slower per-token work, 2x ring latency, 1.7x micro-batch constant,
    0.6x per-sequence cost, a different wave cost."""
    model = CostModel(PROFILE, RPN)
    theta = profile_coefficients(model, SIZES).copy()
    theta[0] *= 1.25
    theta[2] *= 0.6
    theta[4] *= 1.7
    theta[5::2] *= 2.0  # ring latency of every group size
    return apply_coefficients(PROFILE, theta, 0.02, SIZES, model)


def synthetic_step(rng, truth: CostModel, n: int = 16, noise=0.05, outliers=0.10):
    mbs = []
    for i in range(n):
        cp = (1, 2, 4)[i % 3]
        lengths = random_pack(rng, cp)
        t = truth.microbatch_seconds(cp, lengths) * (1 + noise * rng.standard_normal())
        if rng.random() < outliers:
            t *= 1 + rng.uniform(0.5, 4.0)  # a GC pause, a straggler
        mbs.append(Measurement(cp, lengths, max(t, 1e-6)))
    waves = [WaveMeasurement(1.0 + 0.02 * (1 + 0.05 * rng.standard_normal()), 1.0)]
    return mbs, waves


def mean_error(model: CostModel, truth: CostModel, seed: int = 99, n: int = 300) -> float:
    rng = np.random.default_rng(seed)
    errs = []
    for i in range(n):
        cp = (1, 2, 4)[i % 3]
        lengths = random_pack(rng, cp)
        errs.append(model.microbatch_seconds(cp, lengths) / truth.microbatch_seconds(cp, lengths))
    return float(np.mean(np.abs(np.array(errs) - 1)))


def test_fit_predicts_exactly_what_the_cost_model_predicts():
    """Measurements from the profile itself: the refit keeps it (the vectorised formula and
    CostModel agree), and the fitted profile's predictions equal the measurements."""
    model = CostModel(PROFILE, RPN)
    rng = np.random.default_rng(0)
    ms = []
    for i in range(60):
        cp = (1, 2, 4)[i % 3]
        lengths = random_pack(rng, cp)
        ms.append(Measurement(cp, lengths, model.microbatch_seconds(cp, lengths)))
    res = fit_profile(PROFILE, ms, ranks_per_node=RPN)
    assert res.error_before < 1e-12
    assert res.error_after < 1e-6
    for name, before in res.coefficients_before.items():
        assert res.coefficients_after[name] == pytest.approx(before, rel=1e-4, abs=1e-9), name


def test_calibration_recovers_the_true_model_within_eight_steps():
    """5% noise, 10% outliers (+50% .. +400%): after 8 steps of 16 micro-batches (refits every
    64 measurements) the model predicts the true one within 3% on fresh micro-batches."""
    truth = CostModel(true_profile(), RPN)
    before = mean_error(CostModel(PROFILE, RPN), truth)
    assert before > 0.10  # the starting model really is wrong
    cal = OnlineCalibrator(PROFILE, ranks_per_node=RPN, refit_every=4, min_measurements=32)
    rng = np.random.default_rng(1)
    for _ in range(8):
        cal.observe(*synthetic_step(rng, truth))
    assert cal.current.version >= 1
    after = mean_error(cal.current.model(RPN), truth)
    assert after < 0.03, (before, after)
    assert cal.current.profile.overheads.wave_seconds == pytest.approx(0.02, rel=0.1)
    result = cal.last
    assert result is not None and result.error_after < result.error_before
    assert result.outliers >= 5


def test_the_fit_chooses_the_overlap_rule_the_measurements_follow():
    """A machine whose ring transfers do not overlap compute (as on a CPU, where both take the
    same cores): the refit switches the rule and predicts it within 3%."""
    data = json.loads(true_profile().to_json())
    data["communication"]["overlap"] = False
    truth = CostModel(Profile.model_validate(data), RPN)
    rng = np.random.default_rng(8)
    ms = []
    for _ in range(8):
        ms += synthetic_step(rng, truth, noise=0.02, outliers=0.0)[0]
    res = fit_profile(PROFILE, ms, ranks_per_node=RPN)
    assert PROFILE.communication.overlap and res.overlap is False
    assert not res.profile.communication.overlap
    assert mean_error(CostModel(res.profile, RPN), truth) < 0.03


def test_calibration_is_deterministic():
    truth = CostModel(true_profile(), RPN)
    rng = np.random.default_rng(2)
    steps = [synthetic_step(rng, truth) for _ in range(6)]
    outs = []
    for _ in range(2):
        cal = OnlineCalibrator(PROFILE, ranks_per_node=RPN, refit_every=2)
        for s in steps:
            cal.observe(*s)
        outs.append(cal.current.profile.to_json())
    assert cal.current.version >= 1
    assert outs[0] == outs[1]


def test_one_straggler_does_not_move_the_model():
    """A clean set plus one 100x measurement: no coefficient moves by more than 1%."""
    truth = CostModel(true_profile(), RPN)
    rng = np.random.default_rng(3)
    clean = []
    for _ in range(5):
        clean += synthetic_step(rng, truth, noise=0.01, outliers=0.0)[0]
    base = fit_profile(PROFILE, clean, ranks_per_node=RPN)
    bad = list(clean)
    bad[7] = Measurement(bad[7].cp, bad[7].lengths, bad[7].seconds * 100)
    hit = fit_profile(PROFILE, bad, ranks_per_node=RPN)
    for name, v in base.coefficients_after.items():
        assert hit.coefficients_after[name] == pytest.approx(v, rel=0.01, abs=1e-9), name
    assert hit.outliers >= 1


def test_unobserved_coefficients_keep_their_profiled_values():
    """Only CP-1 micro-batches: nothing says anything about the ring, so its latency and
    bandwidth stay as profiled."""
    truth = CostModel(true_profile(), RPN)
    rng = np.random.default_rng(4)
    ms = [
        Measurement(1, lengths := random_pack(rng, 1), truth.microbatch_seconds(1, lengths))
        for _ in range(40)
    ]
    res = fit_profile(PROFILE, ms, ranks_per_node=RPN)
    assert res.profile.communication == PROFILE.communication
    assert res.coefficients_after["lin"] == pytest.approx(
        res.coefficients_before["lin"] * 1.25, rel=0.05
    )


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from((1, 2, 4)),
            st.lists(st.integers(1, 4096), min_size=1, max_size=6),
            st.floats(1e-7, 1e4),
        ),
        min_size=8,
        max_size=40,
    )
)
def test_any_measurements_give_a_valid_finite_profile(rows):
    ms = [Measurement(cp, tuple(ls), s) for cp, ls, s in rows]
    res = fit_profile(PROFILE, ms, ranks_per_node=RPN)
    for name, v in res.coefficients_after.items():
        assert math.isfinite(v) and v >= 0, (name, v)
    model = CostModel(res.profile, RPN)  # the profile passed the schema (finite, >= 0)
    for m in ms:
        t = model.microbatch_seconds(m.cp, m.lengths)
        assert math.isfinite(t) and t > 0


def test_bad_measurements_are_refused_with_a_reason():
    with pytest.raises(CalibrationError, match="seconds"):
        Measurement(1, (3,), float("nan"))
    with pytest.raises(CalibrationError, match="cp"):
        Measurement(0, (3,), 1.0)
    with pytest.raises(CalibrationError, match="lengths"):
        Measurement(2, (), 1.0)
    with pytest.raises(CalibrationError, match="at least 8"):
        fit_profile(PROFILE, [Measurement(1, (3,), 1.0)], ranks_per_node=RPN)


def test_layer_mix_profiles_refuse_head_split_measurements_with_a_reason():
    mix = load_profile("h100-falcon-h1-7b-like")
    ms = [Measurement(2, (100,), 1.0, heads=2)] * 8
    with pytest.raises(CalibrationError, match="layer_mix"):
        fit_profile(mix, ms, ranks_per_node=8)


def test_buffer_is_bounded_per_cp_size():
    buf = MeasurementBuffer(per_cp=5, waves=3)
    buf.add(Measurement(1, (10,), 1.0) for _ in range(20))
    buf.add(Measurement(2, (10,), 1.0) for _ in range(2))
    buf.add(WaveMeasurement(1.0, 0.5) for _ in range(10))
    assert len(buf) == 7 and buf.seen == 22 and len(buf.waves()) == 3
    assert [m.cp for m in buf.microbatches()] == [1] * 5 + [2] * 2


def test_refit_is_adopted_only_when_it_predicts_better():
    model = CostModel(PROFILE, RPN)
    rng = np.random.default_rng(5)
    cal = OnlineCalibrator(PROFILE, ranks_per_node=RPN, refit_every=1, min_measurements=16)
    for _ in range(4):  # measurements the current model already predicts exactly
        lengths = [random_pack(rng, 2) for _ in range(16)]
        cal.observe(Measurement(2, ls, model.microbatch_seconds(2, ls)) for ls in lengths)
    assert cal.current.version == 0
    assert cal.history and not any(adopted for _, adopted in cal.history)


# ---------------------------------------------------------------------------------- records


def test_measurement_records_round_trip():
    mbs = [Measurement(2, (5, 7), 0.25), Measurement(1, (9,), 0.5)]
    waves = [WaveMeasurement(1.0, 0.75)]
    record = decode_measurements(encode_measurements(3, mbs, waves))
    assert record == (3, mbs, waves, 0)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(["step", "mb", "waves", "x"]), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_decoding_any_json_is_a_record_or_a_calibration_error(value):
    try:
        raw = json.dumps(value).encode()
    except ValueError:
        return
    with contextlib.suppress(CalibrationError):
        decode_measurements(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[]",
        b'"x"',
        b"1e999",
        b"[" * 100000,
        b"\xff\xfe",
        b'{"step":1,"mb":7,"waves":[]}',
        b'{"step":1.0,"mb":[],"waves":[]}',
        b'{"step":1,"mb":[[1,[' + b"9" * 5000 + b"],1]]}",
    ],
)
def test_hostile_records_are_calibration_errors(raw):
    with pytest.raises(CalibrationError):
        decode_measurements(raw)


@pytest.mark.parametrize(
    "entry",
    [
        b"[1,[5],1e999]",
        b"[1,[5],NaN]",
        b"[1,[10000000000000],1]",
        b"[4,[5],1e300]",
        b"[true,[5],1]",
        b"[2.0,[5],1]",
        b'["2",[5],1]',
        b"[2,[5.0],1]",
        b"[2,[5],true]",
        b"[2,[5],-1]",
        b"[2,[],1]",
        b"[2,[5]]",
        b"[4,[5],1,3]",
        b"[2097152,[5],1]",
        b"{}",
    ],
)
def test_a_bad_microbatch_is_refused_alone(entry):
    """One malformed micro-batch costs only itself: the record's others are kept, and the
    refusal is counted."""
    raw = b'{"step":4,"mb":[[2,[7,9],0.5],' + entry + b',[1,[3],0.25]],"waves":[[1,0.5],[1]]}'
    record = decode_measurements(raw)
    assert record.step == 4 and record.refused == 2
    assert record.microbatches == [Measurement(2, (7, 9), 0.5), Measurement(1, (3,), 0.25)]
    assert record.waves == [WaveMeasurement(1.0, 0.5)]
    cal = OnlineCalibrator(PROFILE, ranks_per_node=RPN)
    cal.observe_record(raw)
    assert cal.refused == 2 and len(cal.buffer) == 2 and cal.rejected == 0


def test_model_versions_round_trip_and_refuse_garbage():
    mv = ModelVersion(3, PROFILE)
    back = ModelVersion.from_json(mv.to_json())
    assert back.version == 3 and back.digest == mv.digest
    for raw in (b"[]", b"{}", b'{"version": -1, "profile": {}}', b"[" * 100000, b"\xff"):
        with pytest.raises(ProfileError):
            ModelVersion.from_json(raw)


def test_versioned_planner_stamps_and_switches_the_model():
    base = Planner(
        CostModel(PROFILE, RPN),
        world=4,
        ranks_per_node=RPN,
        capacity=1024,
        deterministic=True,
        cpsat=None,
    )
    v0 = VersionedPlanner(base, ModelVersion(0, PROFILE))
    v1 = VersionedPlanner.rebuild(v0, ModelVersion(1, true_profile()))
    lengths = [2000, 700, 300, 120, 60, 900]
    p0, p1 = v0.plan(lengths), v1.plan(lengths)
    assert p0.stats["model_version"] == 0 and p1.stats["model_version"] == 1
    assert v0.model.profile is PROFILE and base.model.profile is PROFILE  # the original is intact
    assert p1.stats["predicted_step_seconds"] != p0.stats["predicted_step_seconds"]
    assert v1.topology == base.topology


# ---------------------------------------------------------------------------------- channels


def test_store_channels_carry_measurements_and_versions():
    store = dist.HashStore()
    pusher = MeasurementChannel(store, "job", max_pending=4)
    truth = CostModel(true_profile(), RPN)
    rng = np.random.default_rng(6)
    cal = OnlineCalibrator(PROFILE, ranks_per_node=RPN, refit_every=2, min_measurements=32)
    service_side = MeasurementChannel(store, "job", max_pending=4)
    models = ModelChannel(store, "job")
    assert models.latest() is None
    for step in range(3):
        pusher.push(step, *synthetic_step(rng, truth, outliers=0.0))
    store.set(pusher._record_key(3), b"garbage")  # a hostile client overwrites the third record
    new = service_side.drain(cal)
    assert cal.rejected == 1 and cal.buffer.seen == 32
    assert new is not None and new.version == 1
    models.publish(new)
    reader = ModelChannel(store, "job")
    assert reader.latest() == 1 and reader.get(1).digest == new.digest
    assert reader.get(7) is None
    for step in range(10):  # nobody drains: at most max_pending records stay
        pusher.push(step, *synthetic_step(rng, truth))
    assert sum(store.check([pusher._record_key(n)]) for n in range(1, 20)) == 4
    store.set("dyncp/job/model/latest", b"not a number")
    assert reader.latest() is None and reader.rejected == 1


def test_metrics_export_calibration():
    truth = CostModel(true_profile(), RPN)
    rng = np.random.default_rng(7)
    ms = []
    for _ in range(4):
        ms += synthetic_step(rng, truth, outliers=0.0)[0]
    res = fit_profile(PROFILE, ms, ranks_per_node=RPN)
    metrics = Metrics()
    metrics.observe_calibration(res, adopted=True, version=1)
    text = metrics.exposition().decode()
    assert f'dyncp_cost_model_calibration_error_ratio{{stage="before"}} {res.error_before}' in text
    assert f'dyncp_cost_model_calibration_error_ratio{{stage="after"}} {res.error_after}' in text
    assert "dyncp_cost_model_version 1.0" in text
    assert 'dyncp_cost_model_refits_total{outcome="adopted"} 1.0' in text
    with pytest.raises(ValueError, match="version"):
        metrics.observe_calibration(res, adopted=True, version=-1)
