"""MeasurementChannel.drain: every pushed record reaches the calibrator once, in push order; a
missing record is waited for, then counted lost; no value another Store client writes (a
poisoned head, the old counter) stops the pusher or the drain."""

from __future__ import annotations

import torch.distributed as dist

from dyncp.control.model_channel import MeasurementChannel
from dyncp.control.signing import PlanSigner
from dyncp.cost_model import load_profile
from dyncp.cost_model.calibration.fit import Measurement
from dyncp.cost_model.calibration.online import OnlineCalibrator, decode_measurements

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


def test_records_reach_the_drain_once_in_push_order():
    store = dist.HashStore()
    pusher = MeasurementChannel(store, "job", signer=SIGNER)
    service = MeasurementChannel(store, "job", signer=SIGNER)
    cal = Recording()
    pusher.push(0, step_measurements(0))
    pusher.push(1, step_measurements(1))
    service.drain(cal)
    assert cal.fed == [0, 1]
    pusher.push(2, step_measurements(2))
    service.drain(cal)
    service.drain(cal)
    assert cal.fed == [0, 1, 2] and service.lost == 0  # nothing read twice


def test_a_poisoned_counter_or_head_stops_neither_the_pusher_nor_the_drain():
    """The old ``meas/next`` counter set to "abc" is read by nobody; a forged head is counted and
    ignored, and the next genuine head is read from where the drain was."""
    store = dist.HashStore()
    store.set("dyncp/job/meas/next", "abc")
    pusher = MeasurementChannel(store, "job", signer=SIGNER)
    service = MeasurementChannel(store, "job", signer=SIGNER)
    cal = Recording()
    pusher.push(0, step_measurements(0))
    service.drain(cal)
    store.set("dyncp/job/meas/head", "abc")  # no pushes lost to it: the next push rewrites it
    assert service.drain(cal) is None and service.bad_heads == 1
    pusher.push(1, step_measurements(1))
    service.drain(cal)
    assert cal.fed == [0, 1] and service.lost == 0


def test_a_record_never_written_is_counted_lost_after_the_grace_and_the_rest_read():
    store = dist.HashStore()
    pusher = MeasurementChannel(store, "job", signer=SIGNER)
    service = MeasurementChannel(store, "job", signer=SIGNER, grace=0.0)
    cal = Recording()
    pusher.push(0, step_measurements(0))
    store.delete_key(pusher._record_key(1))  # another client deleted it before any drain
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
