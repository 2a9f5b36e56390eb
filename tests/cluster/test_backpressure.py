"""Back-pressure across brokers: a subscriber on broker B that stops reading for
less than the slow-consumer grace loses nothing, although far more than B's
queue_limit is published meanwhile on broker A (B stops reading NATS, as a
publisher's connection is paused, and NATS holds the rest)."""

from __future__ import annotations

import socket

import pytest
import trio

from bench.skan_load import barrier, raw_connect, send_frame
from tests.cluster.natsproc import NatsCluster, cluster_broker
from wire.skan import FrameSplitter, decode, encode_frame

QUEUE_LIMIT = 1 << 20  # the smallest the broker accepts (broker.core.queue.MIN_QUEUE_LIMIT)
MESSAGES = 2000
PAYLOAD = 10_000  # 20 MB in all: 20 queue limits, several times what loopback buffers hold
PAUSE = 1.0  # the subscriber reads nothing for this long (the grace below is 5 s)


@pytest.mark.trio
async def test_a_paused_subscriber_on_another_broker_loses_nothing():
    extra = f"queue_limit = {QUEUE_LIMIT}\nmax_frame = 65536\nslow_consumer_grace = 5.0\n"
    with NatsCluster(1) as cluster:
        url = cluster.nodes[0].url
        with cluster_broker(1, url, extra=extra) as a, cluster_broker(2, url, extra=extra) as b:
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            await sock.connect(b.skan)
            sub = trio.SocketStream(sock)
            await sub.send_all(encode_frame({"type": "getlname"})
                               + encode_frame({"type": "subscribe", "group": "bp",
                                               "instance": "*"}))
            await barrier(sub)
            await trio.sleep(0.3)  # the subscription reaches NATS
            pub, lname = await raw_connect(a.skan)
            frames = b"".join(send_frame(lname, "bp", b"%09d" % i + b"x" * (PAYLOAD - 9), i)
                              for i in range(MESSAGES))
            await pub.send_all(frames)
            await trio.sleep(PAUSE)
            splitter = FrameSplitter(1 << 20)
            got = []
            with trio.fail_after(30):
                while len(got) < MESSAGES:
                    data = await sub.receive_some(1 << 20)
                    assert data, "broker B closed the paused subscriber"
                    got += splitter.receive_data(data)
            seqs = [int(decode(f[4:])[b"msg"][:9]) for f in got]
            assert seqs == list(range(MESSAGES))
            await pub.aclose()
            await sub.aclose()
