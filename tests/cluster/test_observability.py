"""The cluster view of ``stats`` and ``/metrics``, on brokers joined by a real nats-server."""

from __future__ import annotations

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.cluster.natsproc import NatsCluster, cluster_broker, wait_cluster
from tests.observability.metrics.httpc import scrape, value

CLUSTER_SERIES = (
    ("skan_cluster_up", {}),
    ("skan_cluster_brokers_seen", {}),
    ("skan_backplane_messages_total", {"direction": "out"}),
    ("skan_backplane_messages_total", {"direction": "in"}),
    ("skan_backplane_drops_total", {}),
    ("skan_backplane_duplicates_total", {}),
    ("skan_backplane_withheld_total", {}),
    ("skan_backplane_malformed_total", {}),
)


@pytest.mark.trio
async def test_stats_and_metrics_show_the_cluster():
    with NatsCluster(1) as nats:
        url = nats.nodes[0].url
        with cluster_broker(1, url) as a, cluster_broker(2, url) as b:
            async with SkanClient.connect(*a.skan) as pub, SkanClient.connect(*b.skan) as sub:
                await sub.subscribe("obs")
                await trio.sleep(0.3)
                seen = await wait_cluster(pub, 2)
                assert seen["brokers"] == ["1", "2"]
                assert seen["server_id"] == "1" and seen["up"] == "1" and seen["url"] == url
                for i in range(25):
                    await pub.send("obs", str(i))
                for i in range(25):
                    assert (await sub.receive()).msg == str(i).encode()
                out = (await pub.stats())["cluster"]
                inn = (await sub.stats())["cluster"]
                # Broker a published each message once; b routed each one once.
                assert out["backplane_out"] == "25" and out["backplane_in"] == "0"
                assert inn["backplane_in"] == "25" and inn["backplane_out"] == "0"
                assert out["backplane_drops"] == inn["duplicates"] == "0"
                ma = await scrape(a.addr["metrics"])
                mb = await scrape(b.addr["metrics"])
            assert value(ma, "skan_cluster_up") == value(mb, "skan_cluster_up") == 1
            assert value(ma, "skan_cluster_brokers_seen") == 2
            assert value(ma, "skan_backplane_messages_total", direction="out") == 25
            assert value(mb, "skan_backplane_messages_total", direction="in") == 25
            assert value(mb, "skan_backplane_messages_total", direction="out") == 0
            assert value(mb, "skan_backplane_duplicates_total") == 0

            # NATS goes away: a's messages to the backplane are dropped and counted.
            nats.nodes[0].stop()
            async with SkanClient.connect(*a.skan) as pub:
                with trio.fail_after(5):
                    while (await pub.stats())["cluster"]["up"] != "0":
                        await trio.sleep(0.05)
                for i in range(7):
                    await pub.send("obs", str(i))
                cluster = (await pub.stats())["cluster"]
                assert cluster["backplane_drops"] == "7"
                assert cluster["backplane_out"] == "25"
                ma = await scrape(a.addr["metrics"])
            assert value(ma, "skan_cluster_up") == 0
            assert value(ma, "skan_backplane_drops_total") == 7


@pytest.mark.trio
async def test_without_a_cluster_the_series_exist_at_zero():
    with BrokerProcess() as broker:
        async with SkanClient.connect(*broker.skan) as client:
            assert "cluster" not in await client.stats()
        metrics = await scrape(broker.addr["metrics"])
    for name, labels in CLUSTER_SERIES:
        assert value(metrics, name, **labels) == 0, name
