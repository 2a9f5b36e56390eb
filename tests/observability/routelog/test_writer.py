"""The writer thread: rotation by size and age, back-pressure signals, stop flushes all."""

from __future__ import annotations

import json
import os
import threading
import time

from broker.core.router import NORMAL, Router
from broker.observability.routelog.files import LogDirectory
from broker.observability.routelog.writer import RoutingLog
from tests.observability.routelog.test_record import send, sink


def published(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


def read_all(path) -> list[dict]:
    out = []
    for name in published(path):
        data = (path / name).read_text()
        assert data.endswith("\n")
        out += [json.loads(line) for line in data.splitlines()]
    return out


def make_log(tmp_path, router=None, **kw) -> tuple[Router, RoutingLog]:
    router = router or Router(hostname="test")
    d = LogDirectory(str(tmp_path), 1)
    d.open()
    opts = {"rotate_bytes": 1 << 30, "rotate_seconds": 3600.0, "queue_records": 1000, **kw}
    rl = RoutingLog(d, **opts)
    rl.attach(router)
    return router, rl


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_stop_writes_every_record_in_order(tmp_path):
    router, rl = make_log(tmp_path)
    rl.start()
    pub, sub = sink(router), sink(router)
    router.subscribe(sub, b"g", b"*", NORMAL)
    for i in range(2500):
        send(router, pub, seq=str(i).encode())
    rl.stop()
    rl.join()
    recs = read_all(tmp_path)
    assert [r["seq"] for r in recs] == [str(i) for i in range(2500)]
    assert (rl.records, rl.files, rl.queued, rl.lag_seconds) == (2500, 1, 0, 0.0)


def test_rotation_by_size(tmp_path):
    router, rl = make_log(tmp_path, rotate_bytes=4000, queue_records=40)  # 10 per hand-off
    rl.start()
    pub = sink(router)
    for i in range(300):
        send(router, pub, seq=str(i).encode())
        if i % 10 == 9:
            wait_for(lambda: rl.queued == 0)
    rl.stop()
    rl.join()
    names = published(tmp_path)
    assert len(names) == rl.files > 5
    for name in names:
        assert (tmp_path / name).stat().st_size <= 4000
    assert [r["seq"] for r in read_all(tmp_path)] == [str(i) for i in range(300)]


def test_rotation_by_age_publishes_without_more_traffic(tmp_path):
    router, rl = make_log(tmp_path, rotate_seconds=0.2)
    rl.start()
    pub = sink(router)
    send(router, pub)
    rl.handoff()
    wait_for(lambda: rl.files == 1)
    assert len(read_all(tmp_path)) == 1
    time.sleep(0.3)  # no traffic: no empty files
    assert rl.files == 1
    send(router, pub)
    rl.handoff()
    wait_for(lambda: rl.files == 2)
    rl.stop()
    rl.join()
    assert len(read_all(tmp_path)) == 2


def test_backlog_closes_the_gate_and_draining_reopens_it(tmp_path):
    events = []
    opened = threading.Event()

    def request_open():
        events.append("request-open")
        opened.set()

    router, rl = make_log(tmp_path, queue_records=20,
                          close_gate=lambda: events.append("close"), request_open=request_open)
    pub = sink(router)
    # The writer thread is not running yet: nothing drains, the backlog grows.
    for _ in range(30):
        send(router, pub)
    assert events == ["close"] and rl.gate_closed and rl.backpressure_closes == 1
    for _ in range(100):  # routing still never blocks nor loses a record
        send(router, pub)
    assert events == ["close"] and rl.queued == 130
    assert not rl.reopen_if_drained()
    rl.start()
    assert opened.wait(10)
    wait_for(lambda: rl.queued == 0)
    assert rl.reopen_if_drained() and not rl.gate_closed
    rl.stop()
    rl.join()
    assert len(read_all(tmp_path)) == 130


def test_lag_is_reported_while_records_wait(tmp_path):
    router, rl = make_log(tmp_path)
    pub = sink(router)
    send(router, pub)
    time.sleep(0.05)
    assert rl.queued == 1 and rl.lag_seconds >= 0.05
    rl.start()
    rl.stop()
    rl.join()
    assert rl.queued == 0 and rl.lag_seconds == 0.0
