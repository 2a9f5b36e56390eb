"""Signals during a graceful stop (BROKER-SPEC 10: a second stop signal shortens the drain
but never skips the final commit of the store and the routing log).

Real broker processes.  A Skan subscriber that never reads (its socket
buffers full, its queue full under the ``drop`` policy) keeps the drain
waiting for ``drain_timeout``; an Eventer client registers events while
another asks for persisted notifications.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.rawskan import RawSkan
from tests.store.test_missing_files import TYPE, all_events, key
from tests.store.test_restart import eventer_client, ids, workdir
from toolkit.eventer_client import EventerClient
from wire.eventer.messages import RegisterEvent

pytestmark = [pytest.mark.trio]

Id = tuple[int, int, int]


def config(drain_timeout: float) -> str:
    # drop: the stuck subscriber stays connected with a full queue (disconnect
    # would end its connection, and the drain with it); no grace: the flood
    # is not held back by back-pressure.
    return (f"[broker]\ndrain_timeout = {drain_timeout}\nslow_consumer = \"drop\"\n"
            "slow_consumer_grace = 0\nmax_frame = 262144\nqueue_limit = 1048576\n")


async def stuck_subscriber(proc: BrokerProcess) -> RawSkan:
    """A subscriber whose socket and queue are full and who never reads."""
    raw = await RawSkan.open(proc.skan)
    await raw.getlname()
    await raw.send({"type": "subscribe", "group": "flood", "instance": "*",
                    "subtype": "normal"})
    async with SkanClient.connect(*proc.skan) as pub:
        await pub.stats()  # the subscription is in place once our own request is answered
        payload = "x" * 10_000
        for _ in range(1500):  # 15 MB: far more than socket buffers and queue hold
            await pub.send("flood", payload)
        await pub.stats()
    return raw


def alive_after(proc: BrokerProcess, seconds: float) -> bool:
    assert proc.proc is not None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            return False
        time.sleep(0.05)
    return True


def wait_exit(proc: BrokerProcess, timeout: float) -> tuple[int, float]:
    assert proc.proc is not None
    started = time.monotonic()
    code = proc.proc.wait(timeout)
    return code, time.monotonic() - started


class Traffic:
    """Registrations (with their responses) and the persisted notifications they caused."""

    def __init__(self) -> None:
        self.registered: list[Id] = []
        self.persisted: set[Id] = set()

    async def run(self, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with EventerClient.connect(port=port, subscriptions=[TYPE],
                                         persisted=True) as watcher, \
                EventerClient.connect(port=port) as reg:

            async def watch() -> None:
                with contextlib.suppress(Exception):
                    async for events in watcher:
                        self.persisted.update(key(e.id) for e in events)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                started = False
                with contextlib.suppress(Exception):  # ends when the broker stops
                    while True:
                        events = await reg.register(
                            [RegisterEvent(("mf", str(i % 3))) for i in range(20)])
                        self.registered.extend(key(e.id) for e in events or ())
                        if not started and self.persisted:
                            started = True
                            task_status.started()
                nursery.cancel_scope.cancel()


async def test_a_second_sigterm_cuts_the_drain_short_and_keeps_the_final_commit():
    wd = workdir()
    proc = BrokerProcess(config(drain_timeout=60), workdir=wd).start()
    traffic = Traffic()
    raw = await stuck_subscriber(proc)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(traffic.run, proc.addr["eventer"][1])
            await trio.sleep(0.3)
            assert proc.proc is not None
            proc.proc.send_signal(signal.SIGTERM)
            # The stuck subscriber holds the drain (60 s).
            assert alive_after(proc, 1.5), "".join(proc.stderr_lines)
            proc.proc.send_signal(signal.SIGTERM)
            code, took = wait_exit(proc, 20)
            nursery.cancel_scope.cancel()
    finally:
        await raw.aclose()
    log = "".join(proc.stderr_lines)
    assert code == 0, log
    assert took < 5, took
    assert "received SIGTERM again: cutting the drain short" in log
    assert "routing log:" in log and "record(s) in" in log  # the log's final flush
    store = wd / "store"
    state = json.loads((store / "store.state").read_text())
    assert state["clean"] is True  # the final commit and checkpoint happened
    assert not (store / "store.sqlite3-wal").exists()
    assert traffic.persisted and traffic.registered

    proc = BrokerProcess(config(drain_timeout=60), workdir=wd).start()
    try:
        stored = set(await all_events(proc))
    finally:
        proc.stop()
    # Every event notified as persisted, and every one whose registration
    # was answered (routed before the stop), is in the store.
    assert traffic.persisted <= stored
    assert set(traffic.registered) <= stored


async def test_sighup_during_a_stop_is_ignored():
    wd = workdir()
    proc = BrokerProcess(config(drain_timeout=5), workdir=wd).start()
    raw = await stuck_subscriber(proc)
    try:
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        assert alive_after(proc, 0.5)
        proc.proc.send_signal(signal.SIGHUP)
        # The drain goes on for its 5 s: SIGHUP does not end the process.
        assert alive_after(proc, 1.5), "".join(proc.stderr_lines)
        code, _ = wait_exit(proc, 20)
    finally:
        await raw.aclose()
    log = "".join(proc.stderr_lines)
    assert code == 0, log
    assert "received SIGHUP while stopping: ignored" in log
    assert json.loads((wd / "store" / "store.state").read_text())["clean"] is True


async def test_a_third_signal_aborts():
    wd = workdir()
    proc = BrokerProcess(config(drain_timeout=60), workdir=wd).start()
    raw = await stuck_subscriber(proc)
    try:
        assert proc.proc is not None
        for _ in range(2):
            proc.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        proc.proc.send_signal(signal.SIGINT)
        code, _ = wait_exit(proc, 20)
    finally:
        await raw.aclose()
    log = "".join(proc.stderr_lines)
    # Either the third came in time to abort, or the hurried stop had finished.
    assert code in (0, 128 + signal.SIGINT), log
    if code:
        assert "received SIGINT a third time: exiting at once" in log
        # The store opens again (SQLite's recovery from the WAL).
        BrokerProcess(workdir=wd).start().stop()


async def test_a_hat_client_s_persisted_events_survive_a_double_sigterm():
    """The real hat-event 0.9 client, asking for persisted notifications, sees only
    events that are in the store after a stop signalled twice."""
    wd = workdir()
    proc = BrokerProcess(config(drain_timeout=60), workdir=wd).start()
    raw = await stuck_subscriber(proc)
    try:
        hat = await eventer_client(proc, subscriptions=[["mf", "*"]], persisted=True)
        async with hat:
            async with trio.open_nursery() as nursery:
                traffic = Traffic()
                await nursery.start(traffic.run, proc.addr["eventer"][1])
                assert proc.proc is not None
                proc.proc.send_signal(signal.SIGTERM)
                assert alive_after(proc, 1.0)
                proc.proc.send_signal(signal.SIGTERM)
                code, _ = wait_exit(proc, 20)
                nursery.cancel_scope.cancel()
            notified = (await hat.call("events", count=10**6, timeout=1))["events"]
    finally:
        await raw.aclose()
    assert code == 0, "".join(proc.stderr_lines)
    assert notified, "the hat client was notified of nothing"
    first_log = "".join(proc.stderr_lines[-30:])
    proc = BrokerProcess(config(drain_timeout=60), workdir=wd).start()
    try:
        stored = set(await all_events(proc))
    finally:
        proc.stop()
    missing = set(ids(notified)) - stored
    # (Seen once, under a full suite's load, not reproduced since: the
    # details say whether the missing ones are the newest.)
    assert not missing, (len(missing), len(notified), len(stored), min(missing), max(missing),
                         max(stored), "".join(proc.stderr_lines[-20:]), first_log)
