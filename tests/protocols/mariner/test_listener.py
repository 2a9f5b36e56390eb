"""The Mariner listener over real sockets: events, sessions, replay, token, pings, errors."""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import sys
import time

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import ROOT, BrokerProcess
from tests.rawmariner import RawMariner
from tests.rawskan import RawSkan
from tests.tlsfiles import server_cert
from toolkit.mariner_client import MarinerClient, MarinerClosed
from wire import mariner as mw
from wire.skan import encode_frame

pytestmark = pytest.mark.trio


def mariner(broker, **kwargs):
    kwargs.setdefault("client_id", "test")
    return MarinerClient.connect(*broker.addr["mariner"], **kwargs)


async def receive_events(client: MarinerClient, n: int, timeout: float = 10.0) -> list[mw.Event]:
    got: list[mw.Event] = []
    with trio.fail_after(timeout):
        while len(got) < n:
            got += await client.receive()
    assert len(got) == n, got
    return got


async def nothing_more(client: MarinerClient, wait: float = 0.3) -> None:
    await client.barrier()
    await trio.sleep(wait)
    await client.barrier()
    with pytest.raises(trio.WouldBlock):
        client._inbox.receive_nowait()


# ---- events from Skan traffic ------------------------------------------------------


async def test_skan_sends_arrive_as_events(broker):
    async with (
        mariner(broker, subscriptions=[("ev1", "*")]) as m,
        SkanClient.connect(*broker.skan) as pub,
    ):
        await m.barrier()
        await pub.send("ev1", {"value": "42", "list": ["a", None]}, instance="dev/7")
        await pub.send("ev1", "text")
        await pub.send("ev1", None, instance="x")
        await pub.send("ev1", b"\xff\x00binary")
        await pub.send("other", "not subscribed")
        await pub.send_raw({"type": "send", "from": pub.lname, "to": "*", "group": "ev1",
                            "instance": "pt", "seq": "9", "payload-type": "image/png",
                            "msg": b"\x89PNG"})
        await pub.send_raw({"type": "send", "from": pub.lname, "to": "*", "group": "ev1",
                            "instance": "sbs", "seq": "10", "payload-type": "sbs:Mod.T",
                            "source-timestamp": "1700000000.000001", "msg": b"\x01\x02"})
        before = time.time()
        events = await receive_events(m, 6)
        await nothing_more(m)
    assert [e.type for e in events] == [
        ("ev1", "dev", "7"), ("ev1",), ("ev1", "x"), ("ev1",), ("ev1", "pt"), ("ev1", "sbs"),
    ]
    assert [e.payload for e in events] == [
        mw.JsonPayload({"value": "42", "list": ["a", None]}),
        mw.JsonPayload("text"),
        None,
        mw.BinaryPayload("", b"\xff\x00binary"),
        mw.BinaryPayload("", b"\x89PNG"),  # Mariner binary payloads carry no type name
        mw.SbsPayload("Mod", "T", b"\x01\x02"),
    ]
    ids = [e.id for e in events]
    assert all(i.server == 1 for i in ids)
    assert ids == sorted(ids) and len(set(ids)) == 6
    assert [e.source_timestamp for e in events] == [None] * 5 + [mw.Timestamp(1700000000, 1)]
    for e in events:
        assert abs(e.timestamp.s + e.timestamp.us / 1e6 - before) < 30
    assert m.last_event_id == ids[-1]


async def test_one_events_message_per_routing_batch(broker):
    raw = await RawMariner.open(broker.addr["mariner"])
    await raw.init(subscriptions=[["batch", "*"]])
    await raw.send({"type": "ping"})
    assert await raw.message() == {"type": "pong"}
    pub = await RawSkan.open(broker.skan)
    lname = await pub.getlname()
    frames = b"".join(
        encode_frame({"type": "send", "from": lname, "to": "*", "group": "batch",
                      "instance": str(i), "seq": str(i), "msg": str(i)})
        for i in range(3)
    )
    await pub.send_bytes(frames)  # one write: one chunk, one routing batch, one Hat session
    msg = await raw.message()
    assert msg["type"] == "events"
    events = msg["events"]
    assert [e["payload"] for e in events] == [{"type": "json", "data": str(i)} for i in range(3)]
    assert len({e["id"]["session"] for e in events}) == 1
    assert [e["id"]["instance"] for e in events] == [1, 2, 3]
    await raw.aclose()
    await pub.aclose()


async def test_binary_payload_is_base64_on_the_wire(broker):
    raw = await RawMariner.open(broker.addr["mariner"])
    await raw.init(subscriptions=[["b64"]])
    await raw.send({"type": "ping"})
    assert await raw.message() == {"type": "pong"}
    async with SkanClient.connect(*broker.skan) as pub:
        await pub.send("b64", b"\x00\x01\xfe")
        msg = await raw.message()
    assert msg["events"][0]["payload"] == {
        "type": "binary", "data": base64.b64encode(b"\x00\x01\xfe").decode()
    }
    assert msg["events"][0]["type"] == ["b64"]
    await raw.aclose()


async def test_patterns_and_directed_messages(broker):
    async with (
        mariner(broker, subscriptions=[("pat", "?", "x"), ("pat2", "*")]) as m,
        SkanClient.connect(*broker.skan) as pub,
        SkanClient.connect(*broker.skan) as peer,
    ):
        await m.barrier()
        await pub.send("pat", "1", instance="a/x")
        await pub.send("pat", "no: too long", instance="a/x/y")
        await pub.send("pat", "no: wrong last", instance="a/y")
        await pub.send("pat2", "2", instance="deep/er/still")
        # Directed messages between Skan clients are private: not events.
        await pub.send("pat2", "no: directed", to=peer.lname)
        await pub.send("pat2", "3")
        events = await receive_events(m, 3)
        await nothing_more(m)
    assert [e.payload.data for e in events] == ["1", "2", "3"]


async def test_empty_subscriptions_receive_nothing(broker):
    async with (
        mariner(broker, subscriptions=[]) as m,
        SkanClient.connect(*broker.skan) as pub,
    ):
        await m.barrier()
        await pub.send("anything", "x")
        await nothing_more(m)


# ---- replay ------------------------------------------------------------------------


async def test_replay_after_last_event_id_then_live(broker):
    async with (
        mariner(broker, subscriptions=[("rp", "*")]) as watcher,
        SkanClient.connect(*broker.skan) as pub,
    ):
        await watcher.barrier()
        for i in range(10):
            await pub.send("rp", str(i))
            await pub.send("rp-other", str(i))
        await pub.send("rp", "directed", to=pub.lname)
        seen = await receive_events(watcher, 10)
        async with mariner(broker, subscriptions=[("rp", "*")],
                           last_event_id=seen[3].id) as late:
            replayed = await receive_events(late, 6)
            assert [e.payload.data for e in replayed] == [str(i) for i in range(4, 10)]
            assert replayed == seen[4:]
            await pub.send("rp", "live")
            [live] = await receive_events(late, 1)
            assert live.payload.data == "live"
            assert live == (await receive_events(watcher, 1))[0]
            await nothing_more(late)


async def test_replay_seam_has_no_gap_and_no_duplicate(broker):
    """A publisher keeps sending while a client connects with last_event_id."""
    total = 6000
    async with (
        mariner(broker, subscriptions=[("seam", "*")]) as watcher,
        SkanClient.connect(*broker.skan) as pub,
    ):
        await watcher.barrier()
        seen: list[mw.Event] = []

        async def publish(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                await pub.send("seam", str(i))

        await publish(0, 2500)
        seen += await receive_events(watcher, 2500)
        start = seen[99].id
        got: list[mw.Event] = []
        async with trio.open_nursery() as n:
            n.start_soon(publish, 2500, total)
            async with mariner(broker, subscriptions=[("seam", "*")],
                               last_event_id=start) as late:
                got = await receive_events(late, total - 100, timeout=60)
        seen += await receive_events(watcher, total - 2500, timeout=60)
    assert [e.payload.data for e in got] == [str(i) for i in range(100, total)]
    assert got == seen[100:]


async def test_replay_with_another_server_id_gives_live_only(broker):
    async with (
        mariner(broker, subscriptions=[("rs", "*")]) as watcher,
        SkanClient.connect(*broker.skan) as pub,
    ):
        await watcher.barrier()
        await pub.send("rs", "old")
        [old] = await receive_events(watcher, 1)
        other = mw.EventId(99, 0, 0)
        async with mariner(broker, subscriptions=[("rs", "*")], last_event_id=other) as late:
            await late.barrier()
            await pub.send("rs", "new")
            [new] = await receive_events(late, 1)
            assert new.payload.data == "new" and new.id > old.id


async def test_replay_gap_when_retention_overflowed():
    with BrokerProcess("[retention]\nsize = 5\n") as b:
        async with (
            mariner(b, subscriptions=[("gap", "*")]) as watcher,
            SkanClient.connect(*b.skan) as pub,
        ):
            await watcher.barrier()
            for i in range(10):
                await pub.send("gap", str(i))
            seen = await receive_events(watcher, 10)
            async with mariner(b, subscriptions=[("gap", "*")],
                               last_event_id=seen[1].id) as late:
                got = await receive_events(late, 5)
                await nothing_more(late)
        assert [e.payload.data for e in got] == ["5", "6", "7", "8", "9"]
    assert any("replay gap" in line for line in b.stderr_lines), b.stderr_lines[-10:]


# ---- token, pings ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_broker():
    config = "[mariner]\ntoken = \"s3cret\"\nping_delay = 0.3\nping_timeout = 0.5\n"
    with BrokerProcess(config) as b:
        yield b


@pytest.mark.parametrize("token", [None, "wrong", ""])
async def test_wrong_or_missing_token_closes(token_broker, token):
    raw = await RawMariner.open(token_broker.addr["mariner"])
    await raw.init(token=token, subscriptions=[["t", "*"]])
    assert await raw.expect_closed() == [
        {"type": "error", "error": "not authorised: client_token does not match"}
    ]
    with pytest.raises(MarinerClosed, match="client_token does not match"):
        async with mariner(token_broker, client_token=token) as m:
            await m.receive()


async def test_right_token_receives(token_broker):
    async with (
        mariner(token_broker, client_token="s3cret", subscriptions=[("t", "*")]) as m,
        SkanClient.connect(*token_broker.skan) as pub,
    ):
        await m.barrier()
        await pub.send("t", "ok")
        [e] = await receive_events(m, 1)
        assert e.payload.data == "ok"


async def test_silent_peer_is_pinged_then_closed(token_broker):
    raw = await RawMariner.open(token_broker.addr["mariner"])
    await raw.init(token="s3cret")
    started = trio.current_time()
    assert await raw.message(timeout=5) == {"type": "ping"}
    assert await raw.expect_closed(timeout=5) == []
    assert trio.current_time() - started < 5


async def test_peer_that_never_sends_init_is_pinged_then_closed(token_broker):
    raw = await RawMariner.open(token_broker.addr["mariner"])
    assert await raw.message(timeout=5) == {"type": "ping"}
    assert await raw.expect_closed(timeout=5) == []


async def test_peer_answering_pings_stays(token_broker):
    raw = await RawMariner.open(token_broker.addr["mariner"])
    await raw.init(token="s3cret")
    for _ in range(4):  # 4 x (0.3 s idle + ping): well past ping_delay + ping_timeout
        assert await raw.message(timeout=5) == {"type": "ping"}
        await raw.send({"type": "pong"})
    await raw.send({"type": "ping"})
    assert await raw.message() == {"type": "pong"}
    await raw.aclose()


async def test_client_pings_keep_a_quiet_connection(token_broker):
    # Our client answers the broker's pings and pings back; nothing closes.
    async with mariner(token_broker, client_token="s3cret", ping_delay=0.2,
                       ping_timeout=1) as m:
        await trio.sleep(1.5)
        await m.barrier()
        assert m.close_reason is None


# ---- errors ---------------------------------------------------------------------------

INIT = {"type": "init", "client_id": "e", "client_token": None, "last_event_id": None,
        "subscriptions": [["err", "*"]]}


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (mw.encode_frame(b'{"type": "ping"}'), "the first message must be init, not ping"),
        (mw.encode_frame(b'{"type": "init"}'), "init needs the property 'client_id'"),
        (b"\x00\x01", "length size m=0"),
        (b"\x09" + b"\x00" * 9, "length size m=9"),
        (mw.encode_frame(b"{not json"), "not valid JSON"),
        (mw.encode_frame(b"\xff"), "not UTF-8"),
        (b"\x04\xff\xff\xff\xff", "exceeds the limit"),
    ],
)
async def test_bad_first_message_gets_error_and_close(broker, data, reason):
    raw = await RawMariner.open(broker.addr["mariner"])
    await raw.send_bytes(data)
    [error] = await raw.expect_closed()
    assert error["type"] == "error" and reason in error["error"]


@pytest.mark.parametrize(
    ("later", "reason"),
    [
        (INIT, "init may be sent only once"),
        ({"type": "events", "events": []}, "Mariner clients only receive"),
        ({"type": "register"}, "unknown message type 'register'"),
        ({"type": "events", "events": [{"id": 1}]}, "events.events[0].id must be an object"),
    ],
)
async def test_bad_later_message_gets_error_and_close(broker, later, reason):
    raw = await RawMariner.open(broker.addr["mariner"])
    await raw.send(INIT)
    await raw.send({"type": "ping"})
    assert await raw.message() == {"type": "pong"}
    await raw.send(later)
    [error] = await raw.expect_closed()
    assert error["type"] == "error" and reason in error["error"]


async def test_too_many_subscriptions_refused(broker):
    raw = await RawMariner.open(broker.addr["mariner"])
    await raw.init(subscriptions=[["many", str(i)] for i in range(10_001)])
    [error] = await raw.expect_closed()
    assert error == {"type": "error", "error": "too many subscriptions: 10001 "
                     "(at most 10000 per connection)"}


async def test_bad_peer_does_not_disturb_others(broker):
    async with (
        mariner(broker, subscriptions=[("calm", "*")]) as m,
        SkanClient.connect(*broker.skan) as pub,
    ):
        await m.barrier()
        before = int((await pub.stats())["protocol_errors"])
        for data in (b"\x00", mw.encode_frame(b"[]"), mw.encode_frame(b'{"type": "pong"}')):
            raw = await RawMariner.open(broker.addr["mariner"])
            await raw.send_bytes(data)
            assert len(await raw.expect_closed()) == 1
        await pub.send("calm", "still here")
        [e] = await receive_events(m, 1)
        assert e.payload.data == "still here"
        stats = await pub.stats()
        assert int(stats["protocol_errors"]) - before == 3
        assert int(stats["connections"]["mariner"]) >= 1


async def test_init_split_across_writes(broker):
    raw = await RawMariner.open(broker.addr["mariner"])
    data = mw.encode_frame(b'{"type": "init", "client_id": "slow", "client_token": null, '
                           b'"last_event_id": null, "subscriptions": []}')
    for i in range(len(data)):
        await raw.send_bytes(data[i : i + 1])
    await raw.send({"type": "ping"})
    assert await raw.message() == {"type": "pong"}
    await raw.aclose()


# ---- slow consumer, TLS ----------------------------------------------------------------


async def test_slow_mariner_consumer_is_disconnected_and_counted():
    config = "[broker]\nmax_frame = 65536\nqueue_limit = 1048576\n"
    with BrokerProcess(config) as b:
        raw = await RawMariner.open(b.addr["mariner"])  # never reads
        await raw.init(subscriptions=[["flood", "*"]])
        async with (
            SkanClient.connect(*b.skan) as pub,
            mariner(b, subscriptions=[("calm", "*")]) as calm,
        ):
            await calm.barrier()
            payload = "x" * 4000
            with trio.fail_after(30):
                while int((await pub.stats())["slow_consumer_disconnects"]) == 0:
                    for _ in range(200):
                        await pub.send("flood", payload)
            await pub.send("calm", "fine")
            [e] = await receive_events(calm, 1)
            assert e.payload.data == "fine"
        await raw.aclose()


async def test_tls_listener(tmp_path):
    cert = server_cert(tmp_path, "b")
    with BrokerProcess(cert.section("mariner")) as b:
        ctx = ssl.create_default_context()
        cert.ca.configure_trust(ctx)
        async with (
            mariner(b, subscriptions=[("sec", "*")], ssl_context=ctx) as m,
            SkanClient.connect(*b.skan) as pub,
        ):
            await m.barrier()
            await pub.send("sec", "over tls")
            [e] = await receive_events(m, 1)
            assert e.payload.data == "over tls"


# ---- command line -----------------------------------------------------------------------


async def test_cli_prints_events_as_json_lines(broker):

    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "clients.mariner_cli", "--port", str(broker.addr["mariner"][1]),
         "cli/*"], stdout=subprocess.PIPE, cwd=ROOT,
    )
    try:
        async with SkanClient.connect(*broker.skan) as pub:
            buf = b""
            with trio.fail_after(20):
                while b"\n" not in buf:  # publish until the CLI's init is applied
                    await pub.send("cli", {"n": "1"}, instance="x")
                    with trio.move_on_after(0.3):
                        buf += await proc.stdout.receive_some(65536)
        event = json.loads(buf.split(b"\n")[0])
        assert event["type"] == ["cli", "x"]
        assert event["payload"] == {"type": "json", "data": {"n": "1"}}
        assert event["id"]["server"] == 1
    finally:
        proc.terminate()
        await proc.wait()


async def test_cli_reports_a_refused_token(token_broker):

    result = await trio.run_process(
        [sys.executable, "-m", "clients.mariner_cli", "--port",
         str(token_broker.addr["mariner"][1]), "--token", "bad", "t/*"],
        capture_stdout=True, capture_stderr=True, check=False, cwd=ROOT,
    )
    assert result.returncode == 1
    assert b"skan-mariner: " in result.stderr and b"Traceback" not in result.stderr
    assert b"server error: not authorised: client_token does not match" in result.stderr
