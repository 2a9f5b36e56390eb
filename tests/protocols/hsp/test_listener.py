"""The HSP listener over real sockets: every command and every error path (BROKER-SPEC 2)."""

from __future__ import annotations

import ssl

import pytest
import trio

from clients.hsp import HSPClient, HSPError, SkanOverHSP
from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.observability.metrics.httpc import scrape
from tests.rawhsp import RawHSP
from tests.rawskan import RawSkan
from tests.tlsfiles import server_cert
from wire.hsp import Ack, Data, DataAck, Error, Ping, Pong
from wire.hsp import encode as hsp_encode
from wire.skan import encode

pytestmark = pytest.mark.trio

MAX_FRAME = 64 * 1024

CONFIG = f"""
[broker]
max_frame = {MAX_FRAME}
"""


@pytest.fixture(scope="module")
def hsp_broker():
    with BrokerProcess(CONFIG) as proc:
        yield proc
    assert proc.proc is not None and proc.proc.returncode == 0, "".join(proc.stderr_lines[-40:])


async def named(broker) -> tuple[RawHSP, bytes]:
    raw = await RawHSP.open(broker.addr["hsp"])
    return raw, await raw.getlname()


async def counters(broker) -> tuple[int, int]:
    """(protocol_errors, dropped) from the broker's stats."""
    async with SkanClient.connect(*broker.skan) as c:
        stats = await c.stats()
        return int(stats["protocol_errors"]), int(stats["dropped"])


# ---- lifecycle and replies ------------------------------------------------------


async def test_getlname_over_data_ack_gets_ack_and_reply(hsp_broker):
    raw = await RawHSP.open(hsp_broker.addr["hsp"])
    mid = await raw.data_ack({"type": "getlname"})
    got = await raw.events_n(2)
    # ACK and reply may come in either order (BROKER-SPEC 2); the broker sends ACK first.
    assert Ack(mid) in got
    [reply] = [e for e in got if type(e) is Data]
    lname = RawHSP.skan(reply)[b"lname"]
    assert b"_" in lname and b"@" in lname
    assert await raw.getlname() == lname  # asking again (over DATA) gives the same name
    await raw.aclose()


async def test_lnames_unique_across_protocols(hsp_broker):
    a, la = await named(hsp_broker)
    b, lb = await named(hsp_broker)
    async with SkanClient.connect(*hsp_broker.skan) as s:
        assert len({la, lb, s.lname.encode()}) == 3
    await a.aclose()
    await b.aclose()


async def test_stats_over_hsp_counts_hsp_connections(hsp_broker):
    async with SkanOverHSP.connect(*hsp_broker.addr["hsp"]) as h:
        stats = await h.stats()
        assert int(stats["connections"]["hsp"]) >= 1
        await h.subscribe("stats-hsp", wait=False)
        after = await h.stats()  # ordered after the subscribe on the same connection
        assert int(after["subscriptions"]) == int(stats["subscriptions"]) + 1


async def test_data_before_getlname_gets_error_frame_and_close(hsp_broker):
    raw = await RawHSP.open(hsp_broker.addr["hsp"])
    await raw.data({"type": "subscribe", "group": "g", "instance": "*", "seq": "4"})
    got = await raw.expect_closed()
    assert [RawHSP.skan(e) for e in got] == [
        {b"type": b"error", b"error": b"the first message must be getlname", b"seq": b"4"}
    ]


async def test_data_ack_before_getlname_gets_error_4_and_close(hsp_broker):
    raw = await RawHSP.open(hsp_broker.addr["hsp"])
    mid = await raw.data_ack({"type": "stats"})
    got = await raw.expect_closed()
    assert got == [Error(mid, 4, b"the first message must be getlname")]


# ---- routing --------------------------------------------------------------------


async def test_hsp_to_skan_byte_for_byte(hsp_broker):
    raw, lname = await named(hsp_broker)
    sub = await RawSkan.open(hsp_broker.skan)
    await sub.getlname()
    await sub.send({"type": "subscribe", "group": "bfb", "instance": "*"})
    await sub.getlname()  # barrier
    # msg DATA written with a longer-than-needed (32-bit) length code: must arrive untouched.
    message = (
        encode({"type": "send", "group": "bfb", "instance": "*", "to": "*",
                "from": lname, "seq": "1"})
        + b"\x03msg" + b"\x01\x00\x00\x00\x02hi"
    )
    mid = await raw.data_ack(message)
    assert await raw.event() == Ack(mid)
    frame = await sub.frame()
    assert frame == len(message).to_bytes(4, "big") + message
    await raw.data(message)
    assert await sub.frame() == frame
    await raw.aclose()
    await sub.aclose()


async def test_skan_to_hsp_delivered_as_data_type_1(hsp_broker):
    raw, _ = await named(hsp_broker)
    mid = await raw.data_ack({"type": "subscribe", "group": "s2h", "instance": "*"})
    assert await raw.event() == Ack(mid)
    async with SkanClient.connect(*hsp_broker.skan) as pub:
        await pub.send("s2h", {"k": ["v", None]}, seq="77")
        ev = await raw.event()
        assert type(ev) is Data and ev.type == 1
        assert ev.payload == encode({"type": "send", "from": pub.lname, "to": "*",
                                     "group": "s2h", "instance": "*", "seq": "77",
                                     "msg": {"k": ["v", None]}})
    await raw.aclose()


async def test_skan_over_hsp_client_pubsub_and_request_reply(hsp_broker):
    async with (
        SkanOverHSP.connect(*hsp_broker.addr["hsp"]) as server,
        SkanClient.connect(*hsp_broker.skan) as requester,
        SkanOverHSP.connect(*hsp_broker.addr["hsp"], acked=True) as acked_pub,
    ):
        await server.subscribe("svc-hsp", subtype="meonly")

        async def serve():
            m = await server.receive()
            await server.reply(m, {"echo": m.msg})

        async with trio.open_nursery() as n:
            n.start_soon(serve)
            answer = await requester.request("svc-hsp", "ping?", to=server.lname)
        assert answer.msg == {b"echo": b"ping?"} and answer.sender == server.lname

        await requester.subscribe("acked")
        await acked_pub.send("acked", "with ack")  # returns only once the broker ACKed it
        assert (await requester.receive()).msg == b"with ack"


async def test_hsp_sender_never_receives_its_own_message(hsp_broker):
    async with SkanOverHSP.connect(*hsp_broker.addr["hsp"]) as h:
        await h.subscribe("self")
        await h.send("self", "mine")
        await h.barrier()
        await trio.sleep(0.2)
        with pytest.raises(trio.WouldBlock):
            h._inbox.receive_nowait()


# ---- error paths ------------------------------------------------------------------


async def test_malformed_inner_skan_over_data_ack_is_error_1_and_stays_open(hsp_broker):
    raw, lname = await named(hsp_broker)
    for bad in (b"Skam\x01", b"Skan\x04type\x21\x09send", b""):
        mid = await raw.data_ack(bad)
        ev = await raw.event()
        assert type(ev) is Error and (ev.message_id, ev.type) == (mid, 1)
        assert ev.reason.startswith("malformed Skan message:")
    assert await raw.getlname() == lname  # still open and usable
    await raw.aclose()


async def test_malformed_inner_skan_over_data_gets_error_frame_and_stays_open(hsp_broker):
    raw, lname = await named(hsp_broker)
    await raw.data(b"Skan\x00")
    err = RawHSP.skan(await raw.event())
    assert err[b"type"] == b"error" and err[b"error"].startswith(b"malformed Skan message:")
    assert await raw.getlname() == lname
    await raw.aclose()


async def test_semantic_reject_error_2_over_data_ack_error_frame_over_data(hsp_broker):
    raw, lname = await named(hsp_broker)
    wrong = {"type": "send", "group": "g", "instance": "*", "to": "*", "from": "someone-else",
             "seq": "12", "msg": "x"}
    mid = await raw.data_ack(wrong)
    ev = await raw.event()
    assert type(ev) is Error and (ev.message_id, ev.type) == (mid, 2)
    assert "someone-else" in ev.reason and lname.decode() in ev.reason
    await raw.data(wrong)
    err = RawHSP.skan(await raw.event())
    assert err[b"type"] == b"error" and err[b"seq"] == b"12"
    for bad, words in (({"type": "bogus"}, "unknown message type"),
                       ({"type": "subscribe", "group": "g", "instance": "*",
                         "subtype": "odd"}, "bad subtype")):
        mid = await raw.data_ack(bad)
        ev = await raw.event()
        assert type(ev) is Error and ev.type == 2 and words in ev.reason
    assert await raw.getlname() == lname
    await raw.aclose()


async def test_too_large_error_3_payload_skipped_connection_stays_open(hsp_broker):
    raw, lname = await named(hsp_broker)
    before = await counters(hsp_broker)
    big = {"type": "send", "group": "g", "instance": "*", "to": "*", "from": lname,
           "seq": "1", "msg": "x" * MAX_FRAME}
    mid = await raw.data_ack(big)
    ev = await raw.event()
    assert type(ev) is Error and (ev.message_id, ev.type) == (mid, 3)
    assert f"limit of {MAX_FRAME} bytes" in ev.reason
    await raw.data(big)
    err = RawHSP.skan(await raw.event())
    assert b"exceeds the limit" in err[b"error"]
    assert await raw.getlname() == lname
    assert await counters(hsp_broker) == (before[0] + 2, before[1])
    await raw.aclose()


async def test_unknown_type_error_on_data_ack_dropped_and_counted_on_data(hsp_broker):
    raw, lname = await named(hsp_broker)
    before = await counters(hsp_broker)
    mid = await raw.data_ack({"type": "getlname"}, type=7)
    ev = await raw.event()
    assert type(ev) is Error and (ev.message_id, ev.type) == (mid, 2)
    assert "unknown Type 7" in ev.reason
    await raw.data({"type": "getlname"}, type=0x0100)
    await raw.expect_silence()
    # Both are protocol errors; the DATA is also counted as dropped.
    assert await counters(hsp_broker) == (before[0] + 2, before[1] + 1)
    assert await raw.getlname() == lname
    await raw.aclose()


async def test_ping_gets_pong(hsp_broker):
    raw = await RawHSP.open(hsp_broker.addr["hsp"])
    await raw.send(Ping())
    await raw.send(Ping())
    assert await raw.events_n(2) == [Pong(), Pong()]
    async with HSPClient.connect(*hsp_broker.addr["hsp"]) as peer:
        assert await peer.ping(timeout=5) < 5
    await raw.aclose()


@pytest.mark.parametrize(
    ("junk", "words"),
    [
        (b"\x07", "unknown HSP command byte 0x07"),
        (b"\xff\x00\x00", "unknown HSP command byte 0xff"),
        (b"\x02\x00\x00\x00\x05", "ACK for MessageID 5"),
        (b"\x05\x00\x00\x00\x09\x00\x01\x00\x00\x00\x00", "ERROR for MessageID 9"),
        (b"\x06\x00\x00\x00\x01", "ERROR_UNDEF for MessageID 1"),
    ],
)
async def test_protocol_violation_closes_only_that_connection(hsp_broker, junk, words):
    async with SkanOverHSP.connect(*hsp_broker.addr["hsp"]) as bystander:
        await bystander.subscribe("still-here")
        raw, lname = await named(hsp_broker)
        # A valid DATA_ACK in the same chunk before the junk is still handled.
        mid = await raw.data_ack({"type": "getlname"})
        await raw.send_bytes(junk)
        got = await raw.expect_closed()
        assert got[0] == Ack(mid) and RawHSP.skan(got[1]) == {b"lname": lname}
        err = RawHSP.skan(got[-1])
        assert err[b"type"] == b"error" and words in err[b"error"].decode()
        async with SkanClient.connect(*hsp_broker.skan) as pub:
            await pub.send("still-here", "ok")
        assert (await bystander.receive()).msg == b"ok"


async def test_reused_message_id_before_answer_closes(hsp_broker):
    # The broker answers each DATA_ACK as soon as it is read, so reuse within
    # one chunk is the only way to catch it "before the answer": it must not.
    raw, lname = await named(hsp_broker)
    one = DataAck.make(5, 1, encode({"type": "getlname"}))
    await raw.send_bytes(hsp_encode(one) + hsp_encode(one))
    got = await raw.expect_closed()
    assert got[0] == Ack(5) and RawHSP.skan(got[1]) == {b"lname": lname}
    assert b"reused MessageID 5" in RawHSP.skan(got[2])[b"error"]
    await raw.aclose()


async def test_split_writes_byte_by_byte(hsp_broker):
    raw, lname = await named(hsp_broker)
    msg = DataAck.make(42, 1, encode({"type": "getlname"}))
    for b in hsp_encode(msg):
        await raw.send_bytes(bytes([b]))
    got = await raw.events_n(2)
    assert got[0] == Ack(42) and RawHSP.skan(got[1]) == {b"lname": lname}
    await raw.aclose()


async def test_data_ack_refusal_raises_hsp_error_in_client(hsp_broker):
    async with SkanOverHSP.connect(*hsp_broker.addr["hsp"]) as h:
        with pytest.raises(HSPError) as info:
            await h.send_acked({"type": "send", "group": "g", "instance": "*", "to": "*",
                                "from": "not-me", "seq": "1", "msg": None})
        assert info.value.code == 2


# ---- keep-alive -------------------------------------------------------------------


async def test_idle_peer_is_pinged_and_closed_when_silent():
    config = "[hsp]\nping_delay = 0.3\nping_timeout = 0.5\n"
    with BrokerProcess(config) as proc:
        silent = await RawHSP.open(proc.addr["hsp"])
        answering = await RawHSP.open(proc.addr["hsp"])
        assert await answering.event(timeout=3) == Ping()
        await answering.send(Pong())
        assert await silent.event(timeout=3) == Ping()
        # The silent one is closed after ping_timeout; the answering one is pinged again.
        assert await silent.expect_closed(timeout=3) == []
        assert await answering.event(timeout=3) == Ping()
        await answering.send(Pong())
        async with SkanClient.connect(*proc.skan) as c:
            stats = await c.stats()
        assert stats["connections"].get("hsp") == "1"
        await answering.aclose()


# ---- TLS ----------------------------------------------------------------------------


async def test_hsp_over_tls(tmp_path):
    cert = server_cert(tmp_path)
    ctx = ssl.create_default_context()
    cert.ca.configure_trust(ctx)
    with BrokerProcess(cert.section("hsp")) as proc:
        async with (
            SkanOverHSP.connect(*proc.addr["hsp"], ssl_context=ctx) as sub,
            SkanClient.connect(*proc.skan) as pub,
        ):
            await sub.subscribe("secure")
            await pub.send("secure", "over hsp and tls")
            assert (await sub.receive()).msg == b"over hsp and tls"
        # A plaintext HSP peer on the TLS port is refused (the handshake fails).
        raw = await RawHSP.open(proc.addr["hsp"])
        await raw.data({"type": "getlname"})
        with pytest.raises((EOFError, trio.BrokenResourceError)):
            await raw.event(timeout=10)


async def test_error_counts_by_reason_in_metrics(hsp_broker):
    def count(data, name, **labels):
        return data.get((name, frozenset(labels.items())), 0.0)

    before = await scrape(hsp_broker.addr["metrics"])
    raw, lname = await named(hsp_broker)
    await raw.data_ack(b"not skan")
    await raw.data_ack({"type": "send", "group": "g", "instance": "*", "to": "*",
                        "from": lname, "seq": "1", "msg": "x" * MAX_FRAME})
    await raw.data_ack({"type": "nope"})
    await raw.data(b"Skan", type=3)
    assert [type(e) for e in await raw.events_n(3)] == [Error] * 3
    await raw.getlname()  # barrier: the DATA of Type 3 has been handled too
    after = await scrape(hsp_broker.addr["metrics"])
    for name, labels in (
        ("skan_protocol_errors_total", {"reason": "malformed"}),
        ("skan_protocol_errors_total", {"reason": "too-large"}),
        ("skan_protocol_errors_total", {"reason": "rejected"}),
        ("skan_protocol_errors_total", {"reason": "unknown-type"}),
        ("skan_messages_dropped_total", {"reason": "unknown-type"}),
    ):
        delta = count(after, name, protocol="hsp", **labels) - count(
            before, name, protocol="hsp", **labels)
        assert delta == 1, (name, labels)
    await raw.aclose()


@pytest.mark.parametrize("token", [None, "t" * 400, "u" * 70000])
async def test_a_skan_client_on_the_hsp_port_is_told_in_skan(broker, token):
    raw = await RawSkan.open(broker.addr["hsp"])
    message = {"type": "getlname"} if token is None else {"type": "getlname", "token": token}
    with trio.fail_after(3):  # at once, not after the handshake timeout
        await raw.send(message)
        got = await raw.expect_closed()
    assert [m[b"type"] for m in got] == [b"error"]
    assert b"HSP port" in got[0][b"error"] and b"--protocol hsp" in got[0][b"error"]
    # The listener goes on serving HSP clients.
    async with SkanOverHSP.connect(*broker.addr["hsp"]) as client:
        assert client.lname
