"""Slow-consumer disconnects are logged, and what they discard is not counted as sent.

A real broker process; three subscribers that never read, one that does.
"""

from __future__ import annotations

import re

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.rawskan import RawSkan
from wire.skan import decode

pytestmark = [pytest.mark.trio]

QUEUE_LIMIT = 8 * 1024 * 1024
PAYLOAD = "z" * 1000
# Frames a disconnected consumer's count may still be off by: its writer's
# chunk in flight when it was cut off (at most COALESCE_BYTES, 1 MiB, of
# 1 KB frames), counted as sent.  Its discarded queue (8 MiB: about 8,000
# frames) is what used to be counted.
TOLERANCE = 1100


async def frames_until_eof(raw: RawSkan) -> int:
    n = 0
    with trio.fail_after(30):
        while True:
            try:
                frame = await raw.frame(timeout=30)
            except (EOFError, trio.BrokenResourceError):
                return n
            if decode(frame[4:]).get(b"group") == b"flood":
                n += 1


async def test_slow_consumer_disconnects_are_logged_and_their_queue_not_counted_out():
    config = f"[broker]\nmax_frame = 65536\nqueue_limit = {QUEUE_LIMIT}\n"
    with BrokerProcess(config) as b:
        slow = []
        for _ in range(3):
            raw = await RawSkan.open(b.skan)
            lname = await raw.getlname()
            await raw.send({"type": "subscribe", "group": "flood", "instance": "*"})
            await raw.getlname()  # the subscription is in place
            slow.append((raw, lname.decode()))
        async with SkanClient.connect(*b.skan) as pub, SkanClient.connect(*b.skan) as fast:
            await fast.subscribe("flood")
            got = [0]

            async def drain_fast() -> None:
                async for _ in fast:
                    got[0] += 1

            async with trio.open_nursery() as n:
                n.start_soon(drain_fast)
                sent = 0
                with trio.fail_after(60):
                    while True:
                        for _ in range(500):
                            await pub.send("flood", PAYLOAD)
                            sent += 1
                        stats = await pub.stats()
                        if int(stats["slow_consumer_disconnects"]) == 3:
                            break
                    while got[0] < sent:
                        await trio.sleep(0.02)
                n.cancel_scope.cancel()
            stats = await pub.stats()
        received = [await frames_until_eof(raw) for raw, _ in slow]
        for raw, _ in slow:
            await raw.aclose()
    # messages_out: what reached the fast reader and the slow ones' sockets.
    out = int(stats["messages_out"])
    expected = sent + sum(received)
    assert expected <= out <= expected + 3 * TOLERANCE, (out, sent, received)
    # One line each, naming the connection and what was discarded.
    lines = [line for line in b.stderr_lines if "disconnected as a slow consumer" in line]
    assert len(lines) == 3, lines
    for _, lname in slow:
        [line] = [line for line in lines if lname in line]
        m = re.search(r"skan \S+: disconnected as a slow consumer: its queue held (\d+) frames "
                      rf"\((\d+) bytes; queue_limit {QUEUE_LIMIT}\), discarded unsent", line)
        assert m, line
        assert int(m[1]) > 0 and int(m[2]) > QUEUE_LIMIT // 2
