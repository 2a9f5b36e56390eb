"""What a broker does with messages on the cluster's subjects that it cannot use:
counted in ``stats`` (cluster.malformed), logged at most once per interval, and
the rest of a run still delivered.  A raw NATS client publishes them to a real
nats-server; a well-formed run from the same client is the control that shows
its messages reach the broker."""

from __future__ import annotations

import struct

import pytest
import trio

from broker.cluster.cluster_service import MALFORMED_LOG_INTERVAL
from clients.skan import SkanClient
from tests.cluster.natsproc import NatsCluster, cluster_broker
from wire import nats
from wire.skan import encode_frame

LOG_LINE = "malformed message from NATS"
# A broadcast on group g: the subscriber's group interest is the broker's only
# NATS subscription matching it (its own "sk.*.*.*.b1" would match a directed
# one too, and NATS would deliver two copies).  Server 99 publishes it.
SUBJECT = b"sk.99.g.i._"


def frame(i: int) -> bytes:
    return encode_frame({"type": "send", "from": "t_c@elsewhere/99", "to": "*",
                         "group": "g", "instance": "i", "seq": str(i), "msg": f"m{i}"})


def run(session: int, frames: list[bytes], count: int | None = None) -> bytes:
    """One HPUB of a run from server 99 (``count`` may lie about its length)."""
    n = len(frames) if count is None else count
    block = b"NATS/1.0\r\nSkan-Run: 99 %d 1 %d *\r\n\r\n" % (session, n)
    stamps = struct.pack(f"<{len(frames)}d", *(1.5e9 + i for i in range(len(frames))))
    return nats.hpub(SUBJECT, block, stamps + b"".join(frames))


async def publish(url: str, data: bytes) -> None:
    """Publish ``data`` (commands) from a client of our own; return once NATS has them."""
    host, port = url.removeprefix("nats://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    conn = nats.NatsConnection()
    with trio.fail_after(5):
        await stream.receive_some(4096)  # INFO
        await stream.send_all(nats.connect({"verbose": False, "headers": True})
                              + data + nats.PING)
        while not any(isinstance(e, nats.Pong) for e in conn.receive_data(
                await stream.receive_some(4096))):
            pass
    await stream.aclose()


async def malformed_count(client: SkanClient, at_least: int) -> int:
    with trio.fail_after(5):
        while True:
            count = int((await client.stats())["cluster"]["malformed"])
            if count >= at_least:
                return count
            await trio.sleep(0.05)


@pytest.mark.trio
async def test_malformed_messages_are_counted_logged_once_and_skipped():
    bad = [
        nats.pub(SUBJECT, b"no header at all"),
        nats.hpub(SUBJECT, b"NATS/1.0\r\nOther: 1\r\n\r\n", b"x"),  # no Skan-Run
        nats.hpub(SUBJECT, b"NATS/1.0\r\nSkan-Run: 99 x 1 1 *\r\n\r\n", b"x" * 8),
        run(1, [frame(1)], count=2),  # says two messages, holds one
        # a well-formed NATS message whose payload ends inside the Skan frame
        nats.hpub(SUBJECT, b"NATS/1.0\r\nSkan-Run: 99 2 1 1 *\r\n\r\n",
                  struct.pack("<d", 1.5e9) + frame(1)[:-5]),
    ]
    with NatsCluster(1) as cluster:
        url = cluster.nodes[0].url
        with cluster_broker(1, url) as broker:
            async with SkanClient.connect(*broker.skan) as sub:
                await sub.subscribe("g", "i")
                await trio.sleep(0.3)  # the subscription reaches NATS
                await publish(url, b"".join(bad))
                assert await malformed_count(sub, len(bad)) == len(bad)
                # A run whose middle frame is not a Skan message: the other
                # two are delivered, in order, and the middle one counted.
                middle = encode_frame({"type": "send", "group": "g"})  # no instance/to/from
                broken = b"\x00\x00\x00\x08Skan\xff\xff\xff\xff"
                await publish(url, run(3, [frame(10), middle, frame(11)])
                              + run(4, [broken, frame(12)]))
                with trio.fail_after(5):
                    got = [(await sub.receive()).msg for _ in range(3)]
                assert got == [b"m10", b"m11", b"m12"]
                assert await malformed_count(sub, len(bad) + 2) == len(bad) + 2
                stats = (await sub.stats())["cluster"]
                assert stats["backplane_in"] == "3"
    # Seven malformed messages within the interval: one log line.
    assert MALFORMED_LOG_INTERVAL >= 10
    lines = [line for line in broker.stderr_lines if LOG_LINE in line]
    assert len(lines) == 1, lines
    assert "sk.99.g.i._" in lines[0]
