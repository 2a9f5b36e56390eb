"""Brokers joined through real nats-server processes behave as one router."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import ROOT, BrokerProcess
from tests.cluster.natsproc import NatsCluster, cluster_broker
from tests.rawskan import RawSkan


async def settle() -> None:
    """NATS propagates a new subscription to the other servers asynchronously."""
    await trio.sleep(0.3)


@pytest.fixture
def nats1():
    with NatsCluster(1) as c:
        yield c


@pytest.fixture
def two_brokers(nats1):
    url = nats1.nodes[0].url
    with cluster_broker(1, url) as a, cluster_broker(2, url) as b:
        yield a, b


@pytest.mark.trio
async def test_broadcast_crosses_brokers_byte_identical(two_brokers):
    a, b = two_brokers
    sub = await RawSkan.open(b.skan)
    await sub.getlname()
    await sub.send({"type": "subscribe", "group": "g", "instance": "*"})
    await sub.getlname()  # barrier
    await settle()
    pub = await RawSkan.open(a.skan)
    lname = await pub.getlname()
    assert lname.endswith(b"/1")  # the lname names its broker
    from wire.skan import encode_frame
    frame = encode_frame({"type": "send", "group": "g", "instance": "i", "to": "*",
                          "from": lname, "seq": "1", "msg": {"k": [b"v", None]}})
    await pub.send_bytes(frame)
    assert await sub.frame() == frame
    await pub.send_bytes(frame)
    assert await sub.frame() == frame
    await sub.expect_silence(0.3)  # one copy each, whatever the subscriptions overlap


@pytest.mark.trio
async def test_rules_across_brokers(two_brokers):
    a, b = two_brokers
    async with (
        SkanClient.connect(*a.skan) as pub,
        SkanClient.connect(*b.skan) as normal,
        SkanClient.connect(*b.skan) as meonly,
        SkanClient.connect(*a.skan) as promisc,
        SkanClient.connect(*b.skan) as other,
    ):
        await normal.subscribe("r", "1")
        await meonly.subscribe("r", "1", subtype="meonly")
        await promisc.subscribe("r", "*", subtype="promisc")
        await settle()
        meonly_name = await meonly.getlname()
        await pub.send("r", "broadcast", instance="1")
        assert (await normal.receive()).msg == b"broadcast"
        assert (await promisc.receive()).msg == b"broadcast"
        await pub.send("r", "direct", instance="1", to=meonly_name)
        got = await meonly.receive()
        assert got.msg == b"direct" and got.sender == await pub.getlname()
        assert (await promisc.receive()).msg == b"direct"  # promisc sees directed traffic
        # instance "*" reaches every instance's subscribers, on every broker
        await pub.send("r", "all", instance="*")
        assert (await normal.receive()).msg == b"all"
        # request/reply across brokers: the reply needs no subscription
        await other.send("r", "req", instance="1", to=meonly_name)
        request = await meonly.receive()
        await meonly.reply(request, "answer")
        reply = await other.receive()
        assert reply.msg == b"answer"
        await trio.sleep(0.3)
        for c in (pub, meonly, other):
            with pytest.raises(trio.WouldBlock):
                c._inbox.receive_nowait()


@pytest.mark.trio
async def test_duplicate_server_id_refused(nats1):
    url = nats1.nodes[0].url
    with cluster_broker(1, url):
        second = cluster_broker(1, url)
        with pytest.raises(RuntimeError, match="already in use"):
            second.start()


@pytest.mark.trio
async def test_nats_down_local_routing_goes_on_then_recovers(nats1):
    url = nats1.nodes[0].url
    with cluster_broker(1, url) as a, cluster_broker(2, url) as b:
        async with (
            SkanClient.connect(*a.skan) as pub,
            SkanClient.connect(*a.skan) as local,
            SkanClient.connect(*b.skan) as remote,
        ):
            await local.subscribe("d")
            await remote.subscribe("d")
            await settle()
            nats1.nodes[0].stop()
            await pub.send("d", "while-down")
            assert (await local.receive()).msg == b"while-down"
            nats1.nodes[0].start()  # same port
            await trio.sleep(1.5)  # both brokers reconnect and resubscribe
            await pub.send("d", "after")
            assert (await local.receive()).msg == b"after"
            with trio.fail_after(5):
                assert (await remote.receive()).msg == b"after"


@pytest.mark.trio
async def test_failover_across_a_three_node_nats_cluster():
    with NatsCluster(3) as nc:
        urls = [n.url for n in nc.nodes]
        with (
            cluster_broker(1, urls[0], urls[1]) as a,
            cluster_broker(2, urls[2]) as b,
        ):
            async with SkanClient.connect(*a.skan) as pub, SkanClient.connect(*b.skan) as sub:
                await sub.subscribe("f")
                await settle()
                await pub.send("f", "one")
                assert (await sub.receive()).msg == b"one"
                nc.nodes[0].stop()  # broker a fails over to its second URL
                with trio.fail_after(10):
                    while True:
                        await pub.send("f", "two")
                        with trio.move_on_after(0.5):
                            if (await sub.receive()).msg == b"two":
                                break


def test_cluster_url_refused_when_malformed(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[cluster]\nurl = "http://x"\n')
    proc = subprocess.run([sys.executable, "-m", "broker", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=30,
                          env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert "cluster.url[0]" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.trio
async def test_workers_share_the_port_and_route_between_them(nats1, tmp_path):
    """``--workers 2``: two processes on one Skan port; clients on either see each other."""
    proc = BrokerProcess(f'[cluster]\nurl = "{nats1.nodes[0].url}"\nid_probe_timeout = 0.3\n',
                         args=("--workers", "2"))
    with proc:
        lnames, clients = set(), []
        try:
            # The kernel spreads connections over the workers: open a few until
            # both workers (server ids 1 and 2) hold one.
            for _ in range(40):
                c = await RawSkan.open(proc.skan)
                clients.append(c)
                lnames.add((await c.getlname()).rsplit(b"/", 1)[1])
                if len(lnames) == 2:
                    break
            assert lnames == {b"1", b"2"}
            by_worker: dict[bytes, RawSkan] = {}
            for c in clients:
                by_worker[(await c.getlname()).rsplit(b"/", 1)[1]] = c
            sub, pub = by_worker[b"1"], by_worker[b"2"]
            await sub.send({"type": "subscribe", "group": "w", "instance": "*"})
            await sub.getlname()
            await settle()
            from wire.skan import encode_frame
            frame = encode_frame({"type": "send", "group": "w", "instance": "1", "to": "*",
                                  "from": await pub.getlname(), "seq": "1", "msg": "hi"})
            await pub.send_bytes(frame)
            assert await sub.frame() == frame
        finally:
            for c in clients:
                await c.aclose()
    assert proc.proc.returncode == 0
    # Each worker has a store of its own (two processes never share one).
    opened = [line for line in proc.stderr_lines if "store" in line and "opened in" in line]
    assert len(opened) == 2 and {"/store/w0/" in line for line in opened} == {True, False}
