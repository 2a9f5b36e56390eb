"""Eventer and Mariner across two brokers joined by a real nats-server, with the real
hat-event clients: one EventId per event cluster-wide, queries that see every broker."""

from __future__ import annotations

import pytest
import trio

from tests.cluster.natsproc import NatsCluster, cluster_broker
from tests.hatpeer import PeerProcess
from tests.peerenv import EVENTER09_PEER

pytestmark = [pytest.mark.trio, pytest.mark.peers]


@pytest.fixture
def two_brokers():
    with NatsCluster(1) as nats:
        url = nats.nodes[0].url
        with cluster_broker(1, url) as a, cluster_broker(2, url) as b:
            yield a, b


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
        await trio.sleep(0.6)  # heartbeats: each broker sees the other; NATS has the interest
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
        # The subscriber on b sees a's events with a's EventIds and timestamps
        # (not its own: never to the sender).
        got = (await on_b.call("events", count=2))["events"]
        assert {tuple(e["id"]): e["timestamp"] for e in got} == {
            tuple(e["id"]): e["timestamp"] for e in reg_a}

        ordered = [ids_a[0], ids_a[1], ids_b[0], ids_b[1]]  # registration (= time) order
        for peer in (on_a, on_b):  # either broker answers for the whole cluster
            latest = await peer.call("query", kind="latest", event_types=[["q", "*"]])
            assert sorted(e["payload"]["json"] for e in latest["events"]) == ["2", "3"]
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
