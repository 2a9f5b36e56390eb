"""Eventer and Mariner across two brokers joined by a real nats-server, with the real
hat-event clients: one EventId per event cluster-wide, queries that see every broker."""

from __future__ import annotations

import json
import signal

import pytest
import trio

from clients.skan import SkanClient
from tests.cluster.natsproc import NatsCluster, cluster_broker
from tests.cluster.test_interest_nats import wait_known
from tests.hatpeer import PeerProcess
from tests.peerenv import EVENTER09_PEER, HAT08_PEER
from tests.peerproc import PeerProcess as LinePeer
from tests.protocols.eventer.test_fidelity import (
    GROUP,
    PAYLOADS,
    check_exact,
    check_mariner,
    registrations,
)
from toolkit.mariner_client import MarinerClient

pytestmark = [pytest.mark.trio, pytest.mark.peers]


@pytest.fixture
def two_brokers():
    with NatsCluster(1) as nats:
        url = nats.nodes[0].url
        with cluster_broker(1, url) as a, cluster_broker(2, url) as b:
            yield a, b


async def cluster_ready(*brokers) -> None:
    """Until every broker has seen the others and knows their interest (on a
    loaded machine a fixed sleep was sometimes too short), then one more
    heartbeat for the subscriptions' own announcements."""
    for broker in brokers:
        async with SkanClient.connect(*broker.skan) as client:
            await wait_known(client, len(brokers))
    await trio.sleep(0.2)


async def hat_client(broker, **kw) -> PeerProcess:
    peer = await PeerProcess.start(EVENTER09_PEER, "eventer09_client.py")
    res = await peer.call("connect", port=broker.addr["eventer"][1], **kw)
    assert res == {"status": "operational"}, res
    return peer


async def test_queries_and_events_see_the_whole_cluster(two_brokers):
    a, b = two_brokers
    on_a = await hat_client(a)
    on_b = await hat_client(b, subscriptions=[["q", "*"]])
    async with on_a, on_b:
        await cluster_ready(a, b)
        reg_a = (await on_a.call("register", events=[
            {"type": ["q", "a"], "payload": {"json": 1}, "source_timestamp": 30.0},
            {"type": ["q", "b"], "payload": {"json": 2}, "source_timestamp": 10.0},
        ]))["events"]
        reg_b = (await on_b.call("register", events=[
            {"type": ["q", "a"], "payload": {"json": 3}, "source_timestamp": 20.0},
            {"type": ["z"], "payload": {"json": 4}},
        ]))["events"]
        ids_a = [e["id"] for e in reg_a]
        ids_b = [e["id"] for e in reg_b]
        assert {i[0] for i in ids_a} == {1} and {i[0] for i in ids_b} == {2}
        # The subscriber on b sees a's events with a's EventIds and timestamps,
        # and its own q/a (a Hat client subscribed to what it registers is
        # notified of it, as by hat-event-server).
        got = (await on_b.call("events", count=3))["events"]
        assert {tuple(e["id"]): e["timestamp"] for e in got} == {
            tuple(e["id"]): e["timestamp"] for e in [*reg_a, reg_b[0]]}

        ordered = [ids_a[0], ids_a[1], ids_b[0], ids_b[1]]  # registration (= time) order
        for peer in (on_a, on_b):  # either broker answers for the whole cluster
            latest = await peer.call("query", kind="latest", event_types=[["q", "*"]])
            assert sorted(e["payload"]["json"] for e in latest["events"]) == [2, 3]
            everything = await peer.call("query", kind="latest")
            assert len(everything["events"]) == 3

            page1 = await peer.call("query", kind="timeseries", max_results=3)
            assert [e["id"] for e in page1["events"]] == ordered[::-1][:3]
            assert page1["more_follows"] is True
            # lastEventId of an event that entered the other broker
            page2 = await peer.call("query", kind="timeseries", max_results=3,
                                    last_event_id=page1["events"][-1]["id"])
            assert [e["id"] for e in page2["events"]] == [ordered[0]]
            asc = await peer.call("query", kind="timeseries", order="ascending",
                                  order_by="sourceTimestamp", event_types=[["q", "?"]])
            assert [e["id"] for e in asc["events"]] == [ids_a[1], ids_b[0], ids_a[0]]

            for server, ids in ((1, ids_a), (2, ids_b)):
                s = await peer.call("query", kind="server", server_id=server)
                assert [e["id"] for e in s["events"]] == ids
            after = await peer.call("query", kind="server", server_id=2,
                                    last_event_id=ids_b[0])
            assert [e["id"] for e in after["events"]] == ids_b[1:]

        # A broker that stops answering (frozen, its heartbeats not yet stale)
        # delays a query by at most the gather timeout, then a answers alone.
        b.proc.send_signal(signal.SIGSTOP)
        try:
            started = trio.current_time()
            alone = await on_a.call("query", kind="timeseries", order="ascending")
            assert [e["id"] for e in alone["events"]] == ids_a
            assert trio.current_time() - started < 4.5
        finally:
            b.proc.send_signal(signal.SIGCONT)


async def test_mariner_replay_gathers_every_broker(two_brokers):
    """A Hat Mariner client on broker b replays from an EventId of broker a: the events
    after it, from both brokers, in time order, then live ones."""
    a, b = two_brokers
    async with (
        SkanClient.connect(*a.skan) as pub_a,
        SkanClient.connect(*b.skan) as pub_b,
        MarinerClient.connect(*a.addr["mariner"], client_id="watch",
                              subscriptions=[("rp", "*")]) as watcher,
    ):
        await watcher.barrier()
        await cluster_ready(a, b)
        # The brokers have no total order across publishers (a message from b
        # crosses NATS): each message is seen on a before the next is sent, so
        # the six have distinct, increasing timestamps across the brokers.
        seen = []
        for i in range(6):
            await (pub_a if i % 2 == 0 else pub_b).send("rp", str(i))
            with trio.fail_after(10):
                while len(seen) < i + 1:
                    seen += await watcher.receive()
        await pub_a.send("other", "not subscribed")
        assert [e.id.server for e in seen] == [1, 2, 1, 2, 1, 2]
        last = seen[2].id  # from broker a; the client connects to broker b
        peer = await LinePeer.start(
            HAT08_PEER, "hat08_mariner_client.py", str(b.addr["mariner"][1]),
            "--subscriptions", json.dumps([["rp", "*"]]),
            "--last-event-id", f"{last.server},{last.session},{last.instance}",
        )
        async with peer:
            assert await peer.line_with("connected", timeout=30)
            replayed = [await peer.line_with("event") for _ in range(3)]
            await trio.sleep(0.3)
            await pub_a.send("rp", "live")
            live = await peer.line_with("event")
    assert [e["payload"]["data"] for e in replayed] == ["3", "4", "5"]
    assert [tuple(e["id"]) for e in replayed] == [
        (e.id.server, e.id.session, e.id.instance) for e in seen[3:]]
    assert live["payload"]["data"] == "live" and live["id"][0] == 1


async def test_hat_payloads_cross_the_cluster_exactly(two_brokers):
    """A Hat client on broker b gets broker a's registered payloads exactly: in its
    notifications, in queries answered for the whole cluster, and over Mariner."""
    a, b = two_brokers
    n = len(PAYLOADS)
    on_a = await hat_client(a)
    on_b = await hat_client(b, subscriptions=[[GROUP, "*"]])
    async with on_a, on_b:
        await cluster_ready(a, b)
        mariner_b = await LinePeer.start(
            HAT08_PEER, "hat08_mariner_client.py", str(b.addr["mariner"][1]),
            "--subscriptions", json.dumps([[GROUP, "*"]]))
        async with mariner_b:
            assert await mariner_b.line_with("connected", timeout=60)
            await trio.sleep(0.3)  # b's Mariner interest reaches a
            registered = (await on_a.call("register", events=registrations()))["events"]
            assert {e["id"][0] for e in registered} == {1}
            check_exact((await on_b.call("events", count=n))["events"], "notify on b")
            check_mariner([await mariner_b.line_with("event", timeout=15) for _ in range(n)],
                          "Mariner on b")
        latest = await on_b.call("query", kind="latest", event_types=[[GROUP, "*"]])
        check_exact(latest["events"], "latest on b")
        series = await on_b.call("query", kind="timeseries", event_types=[[GROUP, "*"]],
                                 max_results=n + 5)
        check_exact(series["events"], "timeseries on b")
