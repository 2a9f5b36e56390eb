"""Every routing rule and error path of BROKER-SPEC section 1, over real sockets."""

from __future__ import annotations

import pytest
import trio

from clients.skan import SkanClient, SkanClientError
from tests.rawskan import RawSkan
from wire.skan import decode, encode, encode_frame, frame

pytestmark = pytest.mark.trio


async def clients(broker, n):
    return [SkanClient.connect(*broker.skan) for _ in range(n)]


# ---- lifecycle ----------------------------------------------------------------


async def test_getlname_first_and_unique(broker):
    a = await RawSkan.open(broker.skan)
    b = await RawSkan.open(broker.skan)
    la, lb = await a.getlname(), await b.getlname()
    assert la != lb
    assert await a.getlname() == la  # asking again returns the same name
    await a.aclose()
    await b.aclose()


async def test_other_type_before_getlname_is_refused_and_closed(broker):
    raw = await RawSkan.open(broker.skan)
    await raw.send({"type": "subscribe", "group": "g", "instance": "*", "seq": "9"})
    got = await raw.expect_closed()
    assert got == [{b"type": b"error", b"error": b"the first message must be getlname",
                    b"seq": b"9"}]


async def test_stats_reply_reflects_earlier_messages(broker):
    async with SkanClient.connect(*broker.skan) as c:
        before = await c.stats()
        await c.subscribe("stats-group", wait=False)
        after = await c.stats()  # no barrier needed: stats is ordered after subscribe
        assert int(after["subscriptions"]) == int(before["subscriptions"]) + 1
        for key in ("uptime", "connections", "messages_in", "bytes_in", "messages_out",
                    "bytes_out", "undeliverable", "dropped", "groups", "subscriptions"):
            assert key in after
        assert int(after["connections"]["skan"]) >= 1


# ---- routing rules ------------------------------------------------------------


async def test_broadcast_normal_promisc_not_meonly_nor_sender(broker):
    async with (
        SkanClient.connect(*broker.skan) as pub,
        SkanClient.connect(*broker.skan) as normal,
        SkanClient.connect(*broker.skan) as meonly,
        SkanClient.connect(*broker.skan) as promisc,
    ):
        await pub.subscribe("b1")
        await normal.subscribe("b1")
        await meonly.subscribe("b1", subtype="meonly")
        await promisc.subscribe("b1", subtype="promisc")
        await pub.send("b1", "hello")
        assert (await normal.receive()).msg == b"hello"
        assert (await promisc.receive()).msg == b"hello"
        await trio.sleep(0.2)
        for c in (pub, meonly):
            with pytest.raises(trio.WouldBlock):
                c._inbox.receive_nowait()


async def test_instance_rules(broker):
    async with (
        SkanClient.connect(*broker.skan) as pub,
        SkanClient.connect(*broker.skan) as a,
        SkanClient.connect(*broker.skan) as b,
    ):
        await a.subscribe("inst", "a")
        await b.subscribe("inst", "b")
        await pub.send("inst", "to-a", instance="a")
        await pub.send("inst", "to-all", instance="*")
        assert [(await a.receive()).msg for _ in range(2)] == [b"to-a", b"to-all"]
        assert (await b.receive()).msg == b"to-all"


async def test_directed_meonly_and_reply_routing(broker):
    async with (
        SkanClient.connect(*broker.skan) as req,
        SkanClient.connect(*broker.skan) as server,
        SkanClient.connect(*broker.skan) as bystander,
        SkanClient.connect(*broker.skan) as spy,
    ):
        await server.subscribe("svc", "*", "meonly")
        await bystander.subscribe("svc")
        await spy.subscribe("svc", subtype="promisc")

        async def serve():
            m = await server.receive()
            await server.reply(m, {"answer": "42"})

        async with trio.open_nursery() as n:
            n.start_soon(serve)
            # req has no subscription at all: the reply reaches it through 'repl'
            answer = await req.request("svc", {"q": "?"}, to=server.lname)
        assert answer.msg == {b"answer": b"42"} and answer.sender == server.lname
        seen = [await spy.receive(), await spy.receive()]
        assert [m.to for m in seen] == [server.lname, req.lname]
        await trio.sleep(0.2)
        with pytest.raises(trio.WouldBlock):
            bystander._inbox.receive_nowait()


async def test_directed_without_matching_subscription_is_undeliverable(broker):
    async with (
        SkanClient.connect(*broker.skan) as pub,
        SkanClient.connect(*broker.skan) as target,
    ):
        await target.subscribe("dx", "only-this")
        before = int((await pub.stats())["undeliverable"])
        await pub.send("dx", "x", instance="other", to=target.lname)
        await pub.send("dx", "x", to="no-such-lname@nowhere")
        after = int((await pub.stats())["undeliverable"])
        assert after - before == 2


async def test_reply_tag_reply_also_routes(broker):
    raw = await RawSkan.open(broker.skan)
    lname = await raw.getlname()
    async with SkanClient.connect(*broker.skan) as other:
        await raw.send({"type": "send", "from": lname, "to": other.lname, "group": "nobody",
                        "instance": "*", "seq": "1", "reply": "5", "msg": "r"})
        got = await other.receive()
        assert got.repl == "5" and got.msg == b"r"
    await raw.aclose()


async def test_forwarded_byte_for_byte(broker):
    """A non-canonical but valid frame reaches the subscriber exactly as sent."""
    raw = await RawSkan.open(broker.skan)
    lname = await raw.getlname()
    async with SkanClient.connect(*broker.skan) as sub:
        await sub.subscribe("bytes")
        body = (
            b"Skan" + b"\x04type\x21\x04send" + b"\x04from" + bytes([0x21, len(lname)]) + lname
            + b"\x02to\x11\x00\x01*" + b"\x05group\x01\x00\x00\x00\x05bytes"
            + b"\x08instance\x21\x01*" + b"\x03seq\x21\x013"
            + b"\x05extra\x24" + b"\x03msg\x22\x05\x01k\x21\x01v"
        )
        await raw.send_bytes(frame(body))
        m = await sub.receive()
        assert m.header[b"extra"] is None
        assert encode({k: v for k, v in m.header.items()}) != body  # really non-canonical
    # and the raw frame itself, via a raw subscriber
    rsub = await RawSkan.open(broker.skan)
    await rsub.getlname()
    await rsub.send({"type": "subscribe", "group": "bytes", "instance": "*"})
    await rsub.getlname()
    await raw.send_bytes(frame(body))
    assert await rsub.frame() == frame(body)
    await raw.aclose()
    await rsub.aclose()


async def test_unsubscribe_and_resubscribe_replaces(broker):
    async with SkanClient.connect(*broker.skan) as pub, SkanClient.connect(*broker.skan) as s:
        await s.subscribe("un")
        await s.subscribe("un", subtype="meonly")  # replaces normal
        await pub.send("un", "1")
        await s.unsubscribe("un")
        await s.unsubscribe("never-subscribed")  # no-op, no error
        await s.subscribe("un")
        await pub.send("un", "2")
        assert (await s.receive()).msg == b"2"
        assert s.errors == []


# ---- semantic errors: error frame with seq, connection stays open ------------


@pytest.mark.parametrize(
    ("message", "reason_part"),
    [
        ({"type": "send", "to": "*", "group": "g", "instance": "*", "seq": "41", "msg": None},
         "needs the field 'from'"),
        ({"type": "send", "from": "someone-else", "to": "*", "group": "g", "instance": "*",
          "seq": "42", "msg": None}, "'from' is 'someone-else'"),
        ({"type": "send", "from": "LNAME", "to": "*", "instance": "*", "seq": "43", "msg": None},
         "needs the field 'group'"),
        ({"type": "send", "from": "LNAME", "to": "*", "group": "g", "instance": "*", "seq": "44"},
         "needs the field 'msg'"),
        ({"type": "send", "from": "LNAME", "to": {"x": "y"}, "group": "g", "instance": "*",
          "seq": "45", "msg": None}, "'to' of a send must be DATA"),
        ({"type": "bogus", "seq": "46"}, "unknown message type 'bogus'"),
        ({"seq": "47"}, "no 'type' field"),
        ({"type": "subscribe", "group": "g", "instance": "*", "subtype": "weird", "seq": "48"},
         "bad subtype 'weird'"),
        ({"type": "subscribe", "instance": "*", "seq": "49"}, "needs the field 'group'"),
        ({"type": "unsubscribe", "group": "g", "seq": "50"}, "needs the field 'instance'"),
    ],
)
async def test_semantic_fault_error_frame_connection_stays(broker, message, reason_part):
    raw = await RawSkan.open(broker.skan)
    lname = await raw.getlname()
    message = {k: (lname if v == "LNAME" else v) for k, v in message.items()}
    await raw.send(message)
    err = await raw.message()
    assert err[b"type"] == b"error"
    assert reason_part.encode() in err[b"error"], err
    assert err[b"seq"] == message["seq"].encode()
    assert await raw.getlname() == lname  # still open, still in order
    await raw.aclose()


async def test_rejected_subscribe_creates_no_subscription(broker):
    async with SkanClient.connect(*broker.skan) as pub, SkanClient.connect(*broker.skan) as s:
        before = int((await s.stats())["subscriptions"])
        await s.send_raw({"type": "subscribe", "group": "rej", "instance": "*",
                          "subtype": "nope", "seq": "1"})
        await s.barrier()
        assert int((await s.stats())["subscriptions"]) == before
        assert s.errors and "bad subtype" in s.errors[0].reason
        await pub.send("rej", "x")
        await trio.sleep(0.2)
        with pytest.raises(trio.WouldBlock):
            s._inbox.receive_nowait()


async def test_request_error_raised_to_requester(broker):
    async with SkanClient.connect(*broker.skan) as c:
        c.lname = "not-my-name"  # the broker enforces 'from'
        with pytest.raises(SkanClientError, match="lname"):
            await c.request("g", "x", timeout=5)


# ---- malformed input: error frame, connection closed, nobody else disturbed ---


MALFORMED_BODIES = [
    ("bad magic", b"Skab\x04type\x21\x05stats"),
    ("zero tag length", b"Skan\x00\x21\x01a"),
    ("item overruns", b"Skan\x04type\x21\x09stats"),
    ("unknown item type", b"Skan\x04type\x25\x01x"),
    ("length code 0x30", b"Skan\x04type\x31\x01x"),
    ("duplicate tag", b"Skan\x01a\x21\x011\x01a\x21\x012"),
    ("trailing bytes", b"Skan\x04type\x21\x05stats\x01"),
]


@pytest.mark.parametrize(("desc", "body"), MALFORMED_BODIES, ids=[d for d, _ in MALFORMED_BODIES])
async def test_malformed_frame_error_and_close(broker, desc, body):
    async with SkanClient.connect(*broker.skan) as bystander:
        await bystander.subscribe("calm")
        raw = await RawSkan.open(broker.skan)
        await raw.getlname()
        await raw.send_bytes(frame(body))
        got = await raw.expect_closed()
        assert len(got) == 1 and got[0][b"type"] == b"error"
        assert got[0][b"error"].startswith(b"malformed message: ")
        # the bystander is unaffected
        async with SkanClient.connect(*broker.skan) as pub:
            await pub.send("calm", "still here")
        assert (await bystander.receive()).msg == b"still here"


@pytest.mark.parametrize("prefix", [b"\x00\x00\x00\x00", b"\x00\x00\x00\x03Ska",
                                    b"\xff\xff\xff\xffSkan", b"\x7f\xff\xff\xff"])
async def test_bad_length_prefix_error_and_close(broker, prefix):
    raw = await RawSkan.open(broker.skan)
    await raw.send_bytes(prefix)
    got = await raw.expect_closed()
    assert len(got) == 1 and got[0][b"type"] == b"error"


async def test_frame_over_max_frame(tmp_path):
    from tests.brokerproc import BrokerProcess

    with BrokerProcess("[broker]\nmax_frame = 1024\nqueue_limit = 1048576\n") as b:
        async with SkanClient.connect(*b.skan) as ok, SkanClient.connect(*b.skan) as sub:
            await sub.subscribe("mf")
            await ok.send("mf", "x" * 900)
            assert len((await sub.receive()).msg) == 900
            raw = await RawSkan.open(b.skan)
            lname = await raw.getlname()
            await raw.send({"type": "send", "from": lname, "to": "*", "group": "mf",
                            "instance": "*", "seq": "1", "msg": "x" * 2000})
            got = await raw.expect_closed()
            assert b"exceeds the limit of 1024 bytes" in got[0][b"error"]


async def test_client_dying_mid_frame(broker):
    async with SkanClient.connect(*broker.skan) as watcher:
        before = int((await watcher.stats())["connections"]["skan"])
        for cut in (2, 7, 30):
            raw = await RawSkan.open(broker.skan)
            lname = await raw.getlname()
            data = encode_frame({"type": "send", "from": lname, "to": "*", "group": "g",
                                 "instance": "*", "seq": "1", "msg": "y" * 100})
            await raw.send_bytes(data[:cut])
            await raw.aclose()
        # Each close is seen when the broker next reads that socket: wait for it.
        with trio.fail_after(10):
            while int((await watcher.stats())["connections"]["skan"]) != before:
                await trio.sleep(0.05)


# ---- load and slow consumers --------------------------------------------------


async def test_many_clients_at_once(broker):
    n = 60
    received = []
    async with trio.open_nursery() as nursery:
        ready = trio.Semaphore(0)
        done = trio.Event()

        async def subscriber(i):
            async with SkanClient.connect(*broker.skan) as c:
                await c.subscribe("crowd")
                ready.release()
                msgs = [await c.receive() for _ in range(5)]
                received.append([m.msg for m in msgs])
                await done.wait()

        for i in range(n):
            nursery.start_soon(subscriber, i)
        for _ in range(n):
            await ready.acquire()
        async with SkanClient.connect(*broker.skan) as pub:
            for k in range(5):
                await pub.send("crowd", str(k))
            with trio.fail_after(10):
                while len(received) < n:
                    await trio.sleep(0.05)
        done.set()
    assert received == [[str(k).encode() for k in range(5)]] * n


async def test_slow_consumer_disconnected_by_default():
    from tests.brokerproc import BrokerProcess

    config = "[broker]\nmax_frame = 65536\nqueue_limit = 1048576\n"
    with BrokerProcess(config) as b:
        slow = await RawSkan.open(b.skan)
        await slow.getlname()
        await slow.send({"type": "subscribe", "group": "flood", "instance": "*"})
        await slow.getlname()
        async with SkanClient.connect(*b.skan) as pub, SkanClient.connect(*b.skan) as fast:
            await fast.subscribe("flood")
            got = [0]

            async def drain_fast():
                async for _ in fast:
                    got[0] += 1

            async with trio.open_nursery() as n:
                n.start_soon(drain_fast)
                sent = 0
                # Bursts smaller than the queue limit, each followed by a
                # barrier: a reading consumer keeps up, the silent one cannot.
                with trio.fail_after(30):
                    while True:
                        for _ in range(3):
                            await pub.send("flood", "z" * 60_000)
                            sent += 1
                        stats = await pub.stats()
                        if int(stats["slow_consumer_disconnects"]) > 0:
                            break
                    while got[0] < sent:
                        await trio.sleep(0.02)
                n.cancel_scope.cancel()
            stats = await pub.stats()
            assert int(stats["slow_consumer_disconnects"]) == 1
            assert int(stats["connections"]["skan"]) == 2  # slow one is gone, others stay
        # the slow connection is closed: after what was already written, EOF
        with trio.fail_after(20):
            while True:
                try:
                    await slow.frame(timeout=20)
                except (EOFError, trio.BrokenResourceError):
                    break


async def test_slow_consumer_drop_policy_counts_and_keeps_connection():
    from tests.brokerproc import BrokerProcess

    config = ('[broker]\nmax_frame = 65536\nqueue_limit = 1048576\n'
              'slow_consumer = "drop"\n')
    with BrokerProcess(config) as b:
        slow = await RawSkan.open(b.skan)
        await slow.getlname()
        await slow.send({"type": "subscribe", "group": "flood", "instance": "*"})
        await slow.getlname()
        async with SkanClient.connect(*b.skan) as pub:
            async def dropped():
                return int((await pub.stats())["dropped"])

            with trio.fail_after(20):
                while await dropped() == 0:
                    for _ in range(20):
                        await pub.send("flood", "z" * 60_000)
            stats = await pub.stats()
            assert int(stats["slow_consumer_disconnects"]) == 0
            assert int(stats["connections"]["skan"]) == 2
        # the slow reader can still read everything that was queued, then more
        n = 0
        with trio.move_on_after(3):
            while True:
                f = await slow.frame()
                n += 1
                assert decode(f[4:])[b"group"] == b"flood"
        assert n > 0


async def test_backpressure_pauses_publisher_for_a_reading_consumer():
    """A consumer that reads slower than the publisher writes is paced, not dropped."""
    from tests.brokerproc import BrokerProcess

    config = "[broker]\nmax_frame = 65536\nqueue_limit = 1048576\nslow_consumer_grace = 5.0\n"
    with BrokerProcess(config) as b:
        reader = await RawSkan.open(b.skan)
        await reader.getlname()
        await reader.send({"type": "subscribe", "group": "paced", "instance": "*"})
        await reader.getlname()
        total = 300  # 300 x 30 kB = 9 MB, far more than the 1 MB queue plus socket buffers
        async with SkanClient.connect(*b.skan) as pub:
            async def publish():
                for i in range(total):
                    await pub.send("paced", f"{i:06d}" + "p" * 30_000)

            got = []
            async with trio.open_nursery() as n:
                n.start_soon(publish)
                while len(got) < total:
                    got.append(decode((await reader.frame(timeout=20))[4:])[b"msg"][:6])
                    if len(got) % 10 == 0:
                        await trio.sleep(0.02)  # a steady but slow reader
            assert got == [f"{i:06d}".encode() for i in range(total)]
            stats = await pub.stats()
            assert stats["slow_consumer_disconnects"] == "0" and stats["dropped"] == "0"
