"""MeasurementChannel.drain: every pushed record reaches the calibrator once, in push order, even
when a drain runs between a push's counter increment and its write."""

from __future__ import annotations

import torch.distributed as dist

from dyncp.control.model_channel import MeasurementChannel
from dyncp.control.signing import PlanSigner
from dyncp.cost_model import load_profile
from dyncp.cost_model.calibration.fit import Measurement
from dyncp.cost_model.calibration.online import (
    OnlineCalibrator,
    decode_measurements,
    encode_measurements,
)

PROFILE = load_profile("cpu-gloo")
SIGNER = PlanSigner(b"s" * 32)


class Recording(OnlineCalibrator):
    """The real calibrator, noting the step of each record it is fed."""

    def __init__(self) -> None:
        super().__init__(PROFILE, ranks_per_node=4, refit_every=1000, min_measurements=10_000)
        self.fed: list[int] = []

    def observe_record(self, raw: bytes):
        self.fed.append(decode_measurements(raw).step)
        return super().observe_record(raw)


def step_measurements(step: int) -> list[Measurement]:
    return [Measurement(1 + step % 2, (100 + step, 50), 1e-3 * (1 + step))]


def half_push(store, step: int) -> str:
    """What ``push`` does up to the write: the record's number is taken, nothing written yet."""
    n = int(store.add("dyncp/job/meas/next", 1))
    return f"dyncp/job/meas/{n}"


def write(store, key: str, step: int) -> None:
    store.set(key, SIGNER.seal(key, encode_measurements(step, step_measurements(step))))


def test_a_record_numbered_but_not_yet_written_is_read_by_the_next_drain_in_order():
    store = dist.HashStore()
    pusher = MeasurementChannel(store, "job", signer=SIGNER)
    service = MeasurementChannel(store, "job", signer=SIGNER)
    cal = Recording()
    pusher.push(0, step_measurements(0))
    late = half_push(store, 1)  # a pusher between store.add and store.set
    pusher.push(2, step_measurements(2))
    service.drain(cal)
    assert cal.fed == [0]  # record 3 waits behind the gap: push order is kept
    write(store, late, 1)
    pusher.push(3, step_measurements(3))
    service.drain(cal)
    assert cal.fed == [0, 1, 2, 3]
    assert service.lost == 0 and cal.buffer.seen == 4
    service.drain(cal)
    assert cal.fed == [0, 1, 2, 3]  # nothing read twice


def test_a_record_never_written_is_counted_lost_after_the_grace_and_the_rest_read():
    store = dist.HashStore()
    pusher = MeasurementChannel(store, "job", signer=SIGNER)
    service = MeasurementChannel(store, "job", signer=SIGNER, grace=0.0)
    cal = Recording()
    half_push(store, 0)  # the pusher died between the counter and the write
    pusher.push(1, step_measurements(1))
    service.drain(cal)
    assert cal.fed == [1] and service.lost == 1


def test_records_evicted_before_any_drain_are_counted_lost():
    store = dist.HashStore()
    pusher = MeasurementChannel(store, "job", signer=SIGNER, max_pending=2)
    service = MeasurementChannel(store, "job", signer=SIGNER, max_pending=2)
    cal = Recording()
    for step in range(5):
        pusher.push(step, step_measurements(step))
    service.drain(cal)
    assert cal.fed == [3, 4] and service.lost == 3
