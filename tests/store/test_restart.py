"""What the broker kept survives its restart: real broker processes, real Hat clients.

Each test runs a broker, feeds it through real clients (hat-event 0.9
Eventer client, hat-event 0.8 Mariner client, Skan), stops it by SIGTERM
or SIGKILL while other traffic flows, starts a new broker process on the
same directory and checks what the clients see.
"""

from __future__ import annotations

import atexit
import contextlib
import pathlib
import shutil
import signal
import sqlite3
import tempfile

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.hatpeer import PeerProcess as HatPeer
from tests.peerenv import EVENTER09_PEER, HAT08_PEER
from tests.peerproc import PeerProcess
from tests.protocols.hsp.test_bridge import PeerServer, bridge_config, free_port, until

pytestmark = [pytest.mark.trio]

# Long enough for the writer to commit what was routed (flush_interval is
# 10 ms by default) on a busy test machine.
SETTLE = 0.5
SIGNALS = [pytest.param(signal.SIGTERM, id="sigterm"), pytest.param(signal.SIGKILL, id="sigkill")]


def workdir() -> pathlib.Path:
    path = pathlib.Path(tempfile.mkdtemp(prefix="skan-store-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def stopped(proc: BrokerProcess, sig: int) -> None:
    code = proc.stop(sig)
    expected = -signal.SIGKILL if sig == signal.SIGKILL else 0
    assert code == expected, "".join(proc.stderr_lines[-30:])


async def background_traffic(skan: tuple[str, int], group: str, *, task_status) -> None:
    """Publish to ``group`` until cancelled or until the broker goes away."""
    # Any failure (also wrapped in the client's exception group) means the broker went.
    with contextlib.suppress(Exception):
        async with SkanClient.connect(*skan) as pub:
            task_status.started()
            i = 0
            while True:
                await pub.send(group, f"bg{i}")
                i += 1
                if i % 50 == 0:
                    await trio.sleep(0.005)


async def eventer_client(proc: BrokerProcess, **kw) -> HatPeer:
    peer = await HatPeer.start(EVENTER09_PEER, "eventer09_client.py")
    res = await peer.call("connect", port=proc.addr["eventer"][1], **kw)
    assert res == {"status": "operational"}, res
    return peer


def ids(events: list[dict]) -> list[tuple[int, int, int]]:
    return [tuple(e["id"]) for e in events]


@pytest.mark.parametrize("sig", SIGNALS)
async def test_latest_and_timeseries_survive_a_restart(sig):
    wd = workdir()
    proc = BrokerProcess(workdir=wd).start()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(background_traffic, proc.skan, "bg")
            watcher = await eventer_client(proc, subscriptions=[["bg", "*"]])
            async with watcher, await eventer_client(proc) as hat:
                registered = []
                for batch in range(5):
                    res = await hat.call("register", events=[
                        {"type": ["st", "dev", str(i % 3)],
                         "payload": {"json": {"n": batch * 4 + i}},
                         "source_timestamp": 1_700_000_000.0 + batch * 4 + i}
                        for i in range(4)])
                    registered += res["events"]
                seen_bg = (await watcher.call("events", count=10))["events"]
                assert seen_bg, "no background traffic seen"
                await trio.sleep(SETTLE)
                # Killed while the background publisher keeps sending.
                stopped(proc, sig)
            nursery.cancel_scope.cancel()
        before_max = max(ids(registered) + ids(seen_bg))

        proc = BrokerProcess(workdir=wd).start()
        async with await eventer_client(proc) as hat:
            latest = (await hat.call("query", kind="latest", event_types=[["st", "*"]]))["events"]
            newest_per_type = {}
            for e in registered:
                newest_per_type[tuple(e["type"])] = e
            assert sorted(ids(latest)) == sorted(ids(newest_per_type.values()))
            assert {tuple(e["type"]): e["payload"] for e in latest} == {
                k: e["payload"] for k, e in newest_per_type.items()}

            series = (await hat.call("query", kind="timeseries", event_types=[["st", "*"]],
                                     order="ascending"))
            assert series["more_follows"] is False
            assert series["events"] == registered

            # Paged, newest first, by source timestamp, through lastEventId.
            pages, last = [], None
            while True:
                page = await hat.call("query", kind="timeseries", event_types=[["st", "?", "1"]],
                                      order_by="sourceTimestamp", max_results=2,
                                      last_event_id=last)
                pages += page["events"]
                if not page["more_follows"]:
                    break
                last = page["events"][-1]["id"]
            expected = [e for e in registered if e["type"] == ["st", "dev", "1"]]
            assert pages == expected[::-1]

            new = (await hat.call("register", events=[{"type": ["st", "new"]}]))["events"]
            assert tuple(new[0]["id"]) > before_max
    finally:
        stopped(proc, signal.SIGTERM)


@pytest.mark.parametrize("sig", SIGNALS)
async def test_mariner_replay_continues_after_a_restart(sig):
    wd = workdir()
    proc = BrokerProcess(workdir=wd).start()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(background_traffic, proc.skan, "noise")
            async with SkanClient.connect(*proc.skan) as pub:
                for i in range(10):
                    await pub.send("mr", f"before{i}", instance=f"dev/{i % 2}")
                await pub.stats()
            first = await PeerProcess.start(
                HAT08_PEER, "hat08_mariner_client.py", str(proc.addr["mariner"][1]),
                "--subscriptions", '[["mr", "*"]]', "--last-event-id", "1,0,0")
            async with first:
                assert await first.line_with("connected", timeout=30)
                seen = [await first.line_with("event") for _ in range(10)]
            await trio.sleep(SETTLE)
            stopped(proc, sig)
            nursery.cancel_scope.cancel()
        assert [e["payload"]["data"] for e in seen] == [f"before{i}" for i in range(10)]
        resume_from = seen[4]["id"]  # the client had processed five events

        proc = BrokerProcess(workdir=wd).start()
        async with SkanClient.connect(*proc.skan) as pub:
            for i in range(3):
                await pub.send("mr", f"after{i}", instance="dev/0")
            await pub.stats()
            second = await PeerProcess.start(
                HAT08_PEER, "hat08_mariner_client.py", str(proc.addr["mariner"][1]),
                "--subscriptions", '[["mr", "*"]]',
                "--last-event-id", ",".join(map(str, resume_from)))
            async with second:
                assert await second.line_with("connected", timeout=30)
                replayed = [await second.line_with("event") for _ in range(8)]
                await pub.send("mr", "live", instance="dev/1")
                live = await second.line_with("event")
        assert [e["payload"]["data"] for e in replayed] == (
            [f"before{i}" for i in range(5, 10)] + [f"after{i}" for i in range(3)])
        assert replayed[:5] == seen[5:]  # same ids, types, timestamps and payloads
        all_ids = [tuple(e["id"]) for e in [*replayed, live]]
        assert all_ids == sorted(set(all_ids))  # no repeats, in order
        assert min(all_ids[5:]) > max(tuple(e["id"]) for e in seen)
    finally:
        stopped(proc, signal.SIGTERM)


@pytest.mark.parametrize("sig", SIGNALS)
async def test_hsp_bridge_spool_is_delivered_after_a_restart(sig):
    port = free_port()  # nobody listens here until after the restart
    wd = workdir()
    config = bridge_config(port, buffer=1000)
    proc = BrokerProcess(config, workdir=wd).start()
    try:
        sent = [f"spooled{i}".encode() for i in range(500)]
        async with trio.open_nursery() as nursery:
            await nursery.start(background_traffic, proc.skan, "unbridged")
            async with SkanClient.connect(*proc.skan) as pub:
                for payload in sent:
                    await pub.send("bridged", payload)
                await pub.stats()
            await trio.sleep(SETTLE)
            stopped(proc, sig)
            nursery.cancel_scope.cancel()

        server = PeerServer(port)
        async with trio.open_nursery() as nursery:
            await server.start(nursery)
            proc = BrokerProcess(config, workdir=wd).start()
            await until(lambda: {p for _, p in server.received} >= set(sent), timeout=20)
            nursery.cancel_scope.cancel()
        # Nothing lost; the spool keeps the routing order.
        assert list(dict.fromkeys(p for _, p in server.received)) == sent
    finally:
        stopped(proc, signal.SIGTERM)


async def test_hsp_bridge_spool_keeps_the_newest_within_spool_max_bytes():
    port = free_port()  # nobody listens here until after the restart
    wd = workdir()
    bound = 20_000
    config = f"[store]\nspool_max_bytes = {bound}\n" + bridge_config(port, buffer=1000)
    proc = BrokerProcess(config, workdir=wd).start()
    try:
        sent = [f"spooled{i}".encode() for i in range(500)]
        async with SkanClient.connect(*proc.skan) as pub:
            for payload in sent:
                await pub.send("bridged", payload)
            await pub.stats()
        await trio.sleep(SETTLE)
        stopped(proc, signal.SIGTERM)
        assert any("spool full" in line for line in proc.stderr_lines)
        [db] = wd.glob("**/store.sqlite3")
        with contextlib.closing(sqlite3.connect(db)) as conn:
            n, nbytes = conn.execute("SELECT count(*), sum(length(frame)) FROM spool").fetchone()
        assert 0 < n < len(sent) and nbytes <= bound

        server = PeerServer(port)
        async with trio.open_nursery() as nursery:
            await server.start(nursery)
            proc = BrokerProcess(config, workdir=wd).start()
            await until(lambda: len({p for _, p in server.received}) >= n, timeout=20)
            await trio.sleep(SETTLE)  # nothing else comes
            nursery.cancel_scope.cancel()
        # The newest that fit, in routing order; the oldest were pushed out.
        assert list(dict.fromkeys(p for _, p in server.received)) == sent[-n:]
    finally:
        stopped(proc, signal.SIGTERM)


async def test_persisted_notifications_only_with_the_store():
    for enabled in (True, False):
        proc = BrokerProcess(f"[store]\nenabled = {str(enabled).lower()}\n").start()
        try:
            persisted = await eventer_client(proc, subscriptions=[["ps", "*"]], persisted=True)
            plain = await eventer_client(proc, subscriptions=[["ps", "*"]])
            async with persisted, plain, await eventer_client(proc) as hat:
                reg = (await hat.call("register", events=[{"type": ["ps", str(i)]}
                                                          for i in range(3)]))["events"]
                got_plain = (await plain.call("events", count=3))["events"]
                got_persisted = (await persisted.call("events", count=3, timeout=2))["events"]
                server = await hat.call("query", kind="server", server_id=1, persisted=True)
        finally:
            stopped(proc, signal.SIGTERM)
        assert ids(got_plain) == ids(reg)
        if enabled:
            assert ids(got_persisted) == ids(reg)
            assert ids(reg) == [i for i in ids(server["events"]) if i in ids(reg)]
        else:
            # Nothing is persisted without the store: nothing is reported so.
            assert got_persisted == [] and server["events"] == []


async def test_a_foreign_or_damaged_directory_is_refused():
    cases = {}
    foreign = workdir()
    (foreign / "notes.txt").write_text("someone else's files")
    cases["other files"] = (foreign, "not a broker store")
    other_db = workdir()
    with contextlib.closing(sqlite3.connect(other_db / "store.sqlite3")) as conn:
        conn.execute("CREATE TABLE t (x)")
    cases["foreign database"] = (other_db, "not a broker store")
    garbage = workdir()
    (garbage / "store.sqlite3").write_bytes(b"this is not a database" * 200)
    cases["garbage"] = (garbage, "not a database")
    for name, (directory, reason) in cases.items():
        contents = {p.name: p.read_bytes() for p in directory.iterdir()}
        proc = BrokerProcess(f'[store]\ndir = "{directory}"\n')
        with pytest.raises(RuntimeError) as info:
            proc.start()
        message = str(info.value)
        assert f"store {directory}" in message and reason in message, (name, message)
        assert "Traceback" not in message, message
        assert proc.proc is not None and proc.proc.wait(5) == 1
        # Never emptied, never written to.
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == contents, name


async def test_hsp_bridge_buffer_in_memory_also_keeps_only_the_newest_within_the_bound():
    """Without a restart: what the spool's byte bound pushed out is not sent either."""
    port = free_port()  # nobody listens here until the messages are routed
    bound = 20_000
    config = f"[store]\nspool_max_bytes = {bound}\n" + bridge_config(port, buffer=1000)
    proc = BrokerProcess(config, workdir=workdir()).start()
    try:
        sent = [f"kept{i}".encode() for i in range(500)]
        async with SkanClient.connect(*proc.skan) as pub:
            for payload in sent:
                await pub.send("bridged", payload)
            await pub.stats()
        server = PeerServer(port)
        async with trio.open_nursery() as nursery:
            await server.start(nursery)
            await until(lambda: sent[-1] in {p for _, p in server.received}, timeout=30)
            await trio.sleep(SETTLE)  # nothing else comes
            nursery.cancel_scope.cancel()
        got = list(dict.fromkeys(p for _, p in server.received))
        assert 0 < len(got) < len(sent) and got == sent[-len(got):]
    finally:
        stopped(proc, signal.SIGTERM)
