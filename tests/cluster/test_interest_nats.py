"""Publishing only where another broker may want it, through a real nats-server:
a NATS-level observer (a plain NATS client on ``sk.>``) sees what the brokers
publish."""

from __future__ import annotations

import pytest
import trio

from clients.skan import SkanClient
from tests.cluster.natsproc import (
    NatsCluster,
    cluster_broker,
    send_until_received,
    wait_cluster,
)
from tests.observability.metrics.httpc import scrape, value
from wire import nats


class Observer:
    """A plain NATS client counting the routed messages (runs) on ``sk.>``."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = nats.NatsConnection()
        self.runs = 0

    @classmethod
    async def open(cls, url: str) -> Observer:
        host, port = url.removeprefix("nats://").rsplit(":", 1)
        self = cls(await trio.open_tcp_stream(host, int(port)))
        await self.stream.send_all(
            nats.connect({"verbose": False, "headers": True, "protocol": 1})
            + nats.sub(b"sk.>", b"1") + nats.PING)
        await self.until(lambda ev: isinstance(ev, nats.Pong))  # SUB is in place
        return self

    async def until(self, done) -> None:
        while True:
            data = await self.stream.receive_some(65536)
            assert data, "NATS closed the observer"
            for ev in self.conn.receive_data(data):
                if isinstance(ev, nats.Msg):
                    self.runs += 1
                elif isinstance(ev, nats.Ping):
                    await self.stream.send_all(nats.PONG)
                if done(ev):
                    return

    async def drain(self) -> int:
        """Runs seen up to now (a PING round trip flushes what NATS holds for us)."""
        await self.stream.send_all(nats.PING)
        await self.until(lambda ev: isinstance(ev, nats.Pong))
        return self.runs


async def cluster_stats(client: SkanClient) -> dict:
    return (await client.stats())["cluster"]


async def wait_known(client: SkanClient, brokers: int) -> None:
    """Until the broker has seen ``brokers`` and knows every other one's interest."""
    await wait_cluster(client, brokers, known=True)


@pytest.mark.trio
async def test_published_only_once_another_broker_announced_interest():
    with NatsCluster(1) as nc:
        url = nc.nodes[0].url
        with cluster_broker(1, url) as a, cluster_broker(2, url) as b:
            observer = await Observer.open(url)
            async with SkanClient.connect(*a.skan) as pub, SkanClient.connect(*b.skan) as sub:
                await wait_known(pub, 2)
                # Nobody else wants "quiet": nothing reaches NATS.
                for i in range(50):
                    await pub.send("quiet", str(i))
                cluster = await cluster_stats(pub)
                assert cluster["backplane_out"] == "0" and cluster["backplane_withheld"] == "50"
                assert await observer.drain() == 0
                metrics = await scrape(a.addr["metrics"])
                assert value(metrics, "skan_backplane_withheld_total") == 50
                assert value(metrics, "skan_backplane_messages_total", direction="out") == 0

                # Traffic goes on on A while B's client subscribes: it receives A's
                # messages once B's interest is announced.
                stop = trio.Event()
                sent = 0

                async def publish() -> None:
                    nonlocal sent
                    while not stop.is_set():
                        sent += 1
                        await pub.send("quiet", f"live-{sent}")
                        await trio.sleep(0.002)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(publish)
                    await trio.sleep(0.1)
                    before = sent
                    # A has routed (and withheld) live-1 .. live-<before> before B's
                    # client subscribes: the barrier queues behind them on pub.
                    await pub.barrier()
                    await sub.subscribe("quiet")
                    with trio.fail_after(2):
                        first = await sub.receive()
                    stop.set()
                n = int(first.msg.decode().removeprefix("live-"))
                assert n > before  # only what A sent after the subscription
                assert await observer.drain() > 0
                out = int((await cluster_stats(pub))["backplane_out"])
                assert 0 < out <= sent - before + 50

                # The last subscriber leaves: publishing stops again.
                await sub.unsubscribe("quiet")
                await trio.sleep(0.2)
                await observer.drain()
                runs = observer.runs
                for i in range(20):
                    await pub.send("quiet", str(i))
                await pub.barrier()
                assert await observer.drain() == runs
                assert (await cluster_stats(pub))["backplane_out"] == str(out)
            await observer.stream.aclose()


@pytest.mark.trio
async def test_a_broker_that_joins_later_gets_what_it_subscribes_to():
    """Broker B starts after A knows the cluster: its hello and subscriptions are
    announced, and A publishes to it; its interest is forgotten when it stops."""
    with NatsCluster(1) as nc:
        url = nc.nodes[0].url
        with cluster_broker(1, url) as a:
            async with SkanClient.connect(*a.skan) as pub:
                await wait_known(pub, 1)
                with cluster_broker(2, url) as b:
                    async with SkanClient.connect(*b.skan) as sub:
                        await sub.subscribe("late")
                        await send_until_received(pub, sub, "late", "x", timeout=3, poll=0.05)
                # B gone: after three heartbeats A forgets it and withholds again.
                await trio.sleep(0.8)
                await wait_known(pub, 1)
                before = (await cluster_stats(pub))["backplane_out"]
                await pub.send("late", "y")
                await pub.barrier()
                assert (await cluster_stats(pub))["backplane_out"] == before
