"""The failure board's rules, on synthetic reports in an in-memory Store (one process).

Properties asserted: a rank that raised is named first; else the ranks that stayed silent; else
the ranks that arrived after the first timeout fired -- never a rank that timed out waiting, nor
one whose connection closed behind a timeout within the margin; nobody when every rank reported
in time. Unsigned, wrongly signed, garbled and out-of-range records are ignored and counted. A
report cannot be replaced or removed by another Store client once written (write-once keys no
client can predict, kept once read), and a poisoned counter decides nothing. The pool keeps a
Store written in Python alive.
"""

from __future__ import annotations

import datetime
import gc
import time

import pytest
import torch.distributed as dist

from dyncp.control.failures import LATE_MARGIN, FailureBoard, Report, is_timeout
from dyncp.runtime import GroupPool
from dyncp.testing.distributed import CountingStore

T = 2.0
SECRET = b"k" * 32
NAMES = (10, 11, 12, 13)  # global ranks of the 4 positions: messages name these


def board(store: dist.Store | None = None, secret: bytes = SECRET) -> FailureBoard:
    return FailureBoard(
        store or dist.HashStore(), scope="c0", world=4, names=NAMES, secret=secret, timeout=T
    )


def report(b: FailureBoard, position: int, kind: str, timed_out: bool, arrived: float) -> None:
    failed = arrived + T if timed_out else arrived
    b.report(0, position, Report(kind, timed_out, arrived, failed, f"{kind} at {position}"))


def now_culprit(b: FailureBoard, suspects=None):
    return b.culprit(0, suspects=suspects, until=time.monotonic(), label="call 0")


def test_a_rank_that_raised_is_named_before_anything_else() -> None:
    b = board()
    report(b, 0, "comm", True, 100.0)
    report(b, 2, "raised", False, 100.5)
    got = now_culprit(b)  # rank 13 (position 3) is silent too: raising comes first
    assert got.ranks == (12,) and "rank 12 failed in wave 0: raised at 2" in got.message


def test_silent_ranks_are_named_when_the_wait_ends() -> None:
    b = board()
    report(b, 0, "comm", False, 100.0)  # a ring peer saw the connection reset at once
    report(b, 1, "comm", True, 100.0)  # another waited T and timed out
    report(b, 3, "comm", False, 100.0)
    got = now_culprit(b)
    assert got.ranks == (12,) and "rank(s) [12] stopped responding" in got.message
    assert now_culprit(b, suspects=(0, 1)).ranks == ()  # position 2 is not a suspect here


def test_a_rank_that_resumed_after_the_others_timed_out_is_late() -> None:
    """The stall of 1.1 T: three ranks time out at t0 + T; the fourth resumes at t0 + 1.1 T and
    finds its peers gone (a closed connection, not a timeout)."""
    b = board()
    t0 = 1000.0
    for p in (0, 1, 3):
        report(b, p, "comm", True, t0)
    report(b, 2, "comm", False, t0 + 1.1 * T)
    got = now_culprit(b)
    assert got.ranks == (12,), got
    assert "arrived after the others had timed out" in got.message


def test_a_rank_that_timed_out_after_arriving_late_is_late() -> None:
    b = board()
    t0 = 1000.0
    for p in (0, 1, 3):
        report(b, p, "comm", True, t0)
    report(b, 2, "comm", True, t0 + 1.1 * T)  # it arrived at t0 + 1.1 T, then waited T itself
    assert now_culprit(b).ranks == (12,)


def test_closures_behind_a_timeout_and_reports_in_time_name_nobody() -> None:
    """A ring cascade: one rank times out, the ranks blocked behind it see its connection
    close milliseconds later (within the margin). Nobody arrived late and nobody raised: no
    rank is named, rather than the one that happened to report first."""
    b = board()
    t0 = 1000.0
    report(b, 1, "comm", True, t0)
    first_timeout = t0 + T
    for p in (0, 2):
        report(b, p, "comm", False, first_timeout + 0.5 * LATE_MARGIN * T)
    report(b, 3, "ok", False, t0 + 0.2)  # waited at the exchange
    got = now_culprit(b)
    assert got.ranks == () and "no rank can be named" in got.message


def test_the_survivors_wait_for_one_another_until_their_deadline() -> None:
    b = board()
    report(b, 0, "comm", False, 100.0)
    start = time.monotonic()
    got = b.culprit(0, suspects=None, until=start + 0.3, label="call 0")
    assert time.monotonic() - start >= 0.3  # positions 1..3 never reported
    assert got.ranks == (11, 12, 13)


@pytest.mark.parametrize(
    "record",
    [
        b"raised 0 1.0 1.0 unsigned but well formed",
        b"\xff\x00 garbage",
        b"",
    ],
)
def test_unsigned_and_garbled_records_are_ignored_and_counted(record: bytes) -> None:
    store = dist.HashStore()
    b = board(store)
    store.set(b._key(0, 1), record)  # at the real key (as if a client could guess it)
    store.set("c0/w0/r99", b"raised 0 1.0 1.0 beyond the axis")  # never read: not a position
    store.set("c0/n", "abc")  # a poisoned counter: nothing reads it
    assert b.changed()  # new keys only make the waiters look...
    assert b.reports(0) == {}  # ...at nothing that verifies
    assert b.forged == 1
    assert now_culprit(b).ranks == NAMES  # everyone silent: no forged blame


def test_records_sealed_with_another_key_or_for_another_slot_are_ignored() -> None:
    store = dist.HashStore()
    other = board(store, secret=b"o" * 32)
    report(other, 1, "raised", False, 1.0)
    b = board(store)
    report(b, 2, "raised", False, 1.0)
    store.set(b._key(0, 3), store.get(b._key(0, 2)))  # a genuine record copied to another slot
    assert set(b.reports(0)) == {2} and b.forged == 1  # the other key's reports: elsewhere


def test_report_keys_cannot_be_predicted_without_the_secret() -> None:
    keys = {board(secret=s)._key(0, p) for s in (SECRET, b"o" * 32) for p in range(4)}
    assert len(keys) == 8 and not any(k.endswith(f"/r{p}") for k in keys for p in range(4))


def test_a_report_cannot_be_replaced_or_removed_once_written() -> None:
    """A second write to a slot leaves the first; a deletion after the report was read changes
    nothing (the reader keeps what it verified)."""
    store = dist.HashStore()
    b = board(store)
    report(b, 2, "raised", False, 1.0)
    report(b, 2, "ok", False, 2.0)  # a later write to the same slot: the first stands
    got = b.reports(0)
    assert got[2].kind == "raised"
    store.delete_key(b._key(0, 2))
    store.set(b._key(0, 2), b"garbage")
    assert b.reports(0)[2].kind == "raised" and now_culprit(b).ranks == (12,)


@pytest.mark.parametrize(
    "body",
    [
        b"raised 0 1.0 1.0",  # no message field
        b"boom 0 1.0 1.0 x",  # unknown kind
        b"raised 2 1.0 1.0 x",  # timed_out not 0/1
        b"raised 0 nan 1.0 x",
        b"raised 0 1.0 inf x",
        b"raised 0 1e999 1.0 x",
    ],
)
def test_report_decoding_is_strict(body: bytes) -> None:
    with pytest.raises(ValueError):
        Report.decode(body)


def test_timeouts_are_told_from_other_communication_errors() -> None:
    assert is_timeout(RuntimeError("[gloo] Timed out waiting 1500ms for recv operation"))
    assert not is_timeout(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not is_timeout(ValueError("timeout in user code"))  # not a communication error


@pytest.mark.timeout(60)
def test_the_pool_keeps_a_python_store_alive(tmp_path) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path}/pg",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=10),
    )
    try:
        store = CountingStore(dist.HashStore())
        pool = GroupPool(store=store)
        del store
        gc.collect()  # only the pool holds it now
        b = pool.board("c0")
        b.report_ok(0, 0, arrived=1.0, timed_out=False)
        assert set(b.reports(0)) == {0}
        assert pool._base_store.requests >= 3
    finally:
        dist.destroy_process_group()
