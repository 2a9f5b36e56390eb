"""The Eventer listener against REAL hat-event 0.9.44 and hat-chatter 0.5.11 clients.

Every peer runs from its own virtualenv (tests/peerenv.py) as a subprocess
driven over JSON lines (tests/peers/).  Error paths use raw sockets.
"""

from __future__ import annotations

import signal

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.hatpeer import PeerProcess
from tests.peerenv import EVENTER09_PEER, HAT08_PEER
from tests.rawskan import RawSkan
from wire.chatter import encode_frame, sbs
from wire.eventer import ClientConnection, InitReq, InitResult, Status
from wire.skan import encode_frame as encode_skan

pytestmark = [pytest.mark.trio, pytest.mark.peers]

CONFIG = """
[eventer]
ping_delay = 0.5
ping_timeout = 1.0
"""


@pytest.fixture(scope="module")
def ebroker():
    with BrokerProcess(CONFIG) as proc:
        yield proc
    assert proc.proc is not None and proc.proc.returncode == 0, "".join(proc.stderr_lines[-40:])


async def hat_client(broker, **kw) -> tuple[PeerProcess, dict]:
    peer = await PeerProcess.start(EVENTER09_PEER, "eventer09_client.py")
    res = await peer.call("connect", port=broker.addr["eventer"][1], **kw)
    return peer, res


# ---- notifications ------------------------------------------------------------------


async def test_skan_sends_reach_hat_subscriber_as_events(ebroker):
    peer, res = await hat_client(ebroker, subscriptions=[["n1", "*"], ["n2", "?", "b"]])
    async with peer, SkanClient.connect(*ebroker.skan) as pub:
        assert res == {"status": "operational"}
        await pub.send("n1", {"k": "1", "list": ["a", None]}, instance="x/y")
        await pub.send("n1", "hello")
        await pub.send("n2", "no", instance="a")  # pattern needs three segments
        await pub.send("n2", "yes", instance="a/b")
        await pub.send("other", "no")
        await pub.send("n1", b"\xff\x00")  # not UTF-8: a binary payload
        await pub.stats()
        got = (await peer.call("events", count=4))["events"]
        assert [e["type"] for e in got] == [["n1", "x", "y"], ["n1"], ["n2", "a", "b"], ["n1"]]
        assert [e["payload"] for e in got] == [
            {"json": {"k": "1", "list": ["a", None]}}, {"json": "hello"}, {"json": "yes"},
            {"binary": ["", "ff00"]}]
        ids = [tuple(e["id"]) for e in got]
        assert all(i[0] == 1 for i in ids) and ids == sorted(ids)
        assert all(e["timestamp"] > 1e9 and e["source_timestamp"] is None for e in got)
        assert (await peer.call("events", count=1, timeout=0.3))["events"] == []


async def test_events_of_one_routing_batch_share_one_session(ebroker):
    peer, _ = await hat_client(ebroker, subscriptions=[["batch", "*"]])
    async with peer:
        # a register request of 3 events is one routing batch: one session, one notify
        other, _ = await hat_client(ebroker)
        async with other:
            reg = await other.call("register", events=[{"type": ["batch", str(i)]}
                                                       for i in range(3)])
        got = (await peer.call("events", count=3))["events"]
        assert len({e["id"][1] for e in got}) == 1
        assert [e["id"][2] for e in got] == [1, 2, 3]
        assert [e["id"] for e in got] == [e["id"] for e in reg["events"]]
        # so is one chunk of Skan sends
        raw = await RawSkan.open(ebroker.skan)
        lname = await raw.getlname()
        await raw.send_bytes(b"".join(encode_skan({
            "type": "send", "group": "batch", "instance": "skan", "to": "*", "from": lname,
            "seq": str(i), "msg": str(i)}) for i in range(4)))
        got = (await peer.call("events", count=4))["events"]
        assert len({e["id"][1] for e in got}) == 1 and len(got) == 4
        assert got[0]["id"][1] > reg["events"][0]["id"][1]
        await raw.aclose()


# ---- registration ---------------------------------------------------------------------


async def test_register_reaches_skan_subscribers(ebroker):
    peer, _ = await hat_client(ebroker)
    async with peer, SkanClient.connect(*ebroker.skan) as sub:
        await sub.subscribe("reg")
        res = await peer.call("register", with_response=True, events=[
            {"type": ["reg", "a", "b"], "source_timestamp": 1700000000.25,
             "payload": {"json": {"n": 1, "ok": True, "l": [None, 2.5]}}},
            {"type": ["reg"], "payload": {"binary": ["blob", "00ff"]}},
            {"type": ["reg", "empty"]},
        ])
        evs = res["events"]
        assert [e["type"] for e in evs] == [["reg", "a", "b"], ["reg"], ["reg", "empty"]]
        assert evs[0]["source_timestamp"] == 1700000000.25
        # Hat clients get the payload exactly (BROKER-SPEC section 3, payload fidelity)
        assert evs[0]["payload"] == {"json": {"n": 1, "ok": True, "l": [None, 2.5]}}
        assert type(evs[0]["payload"]["json"]["n"]) is int
        assert evs[1]["payload"] == {"binary": ["blob", "00ff"]}
        assert evs[2]["payload"] is None
        m1, m2, m3 = [await sub.receive() for _ in range(3)]
        # ...while numbers and booleans reach Skan subscribers as DATA strings
        assert (m1.instance, m1.msg) == ("a/b", {b"n": b"1", b"ok": b"true",
                                                 b"l": [None, b"2.5"]})
        assert m1.event_json == {"n": 1, "ok": True, "l": [None, 2.5]}
        assert (m2.instance, m2.msg) == ("*", b"\x00\xff")
        assert m3.msg is None
        assert m1.sender == m2.sender and m1.to == "*"
        raw = await peer.call("register", with_response=False,
                              events=[{"type": ["reg", "quiet"], "payload": {"json": "q"}}])
        assert raw == {"sent": 1}
        m4 = await sub.receive()
        assert (m4.instance, m4.msg, m4.sender) == ("quiet", b"q", m1.sender)


async def test_register_with_unmappable_event_fails_cleanly(ebroker):
    peer, _ = await hat_client(ebroker)
    async with peer:
        res = await peer.call("register", events=[{"type": ["", "x"]}])
        assert res == {"events": None}
        # A key no Skan tag can hold is not a fault any more: the Skan view is
        # the JSON text, the Hat payload exact (payload-json).
        res = await peer.call("register", events=[{"type": ["ok"], "payload": {
            "json": {"k" * 300: 1}}}])
        assert [e["payload"] for e in res["events"]] == [{"json": {"k" * 300: 1}}]
        assert (await peer.call("state"))["is_open"]


# ---- queries --------------------------------------------------------------------------


async def test_queries_latest_timeseries_server(fresh_eventer):
    b = fresh_eventer
    peer, _ = await hat_client(b)
    async with peer:
        reg = (await peer.call("register", events=[
            {"type": ["q", "a"], "payload": {"json": 1}, "source_timestamp": 30.0},
            {"type": ["q", "b"], "payload": {"json": 2}, "source_timestamp": 10.0},
            {"type": ["q", "a"], "payload": {"json": 3}, "source_timestamp": 20.0},
            {"type": ["z"], "payload": {"json": 4}},
        ]))["events"]
        ids = [e["id"] for e in reg]
        latest = await peer.call("query", kind="latest", event_types=[["q", "*"]])
        assert sorted(e["payload"]["json"] for e in latest["events"]) == [2, 3]
        assert latest["more_follows"] is False
        everything = await peer.call("query", kind="latest")
        assert len(everything["events"]) == 3

        # timeseries, newest first, paged two at a time with lastEventId
        page1 = await peer.call("query", kind="timeseries", event_types=[["q", "*"]],
                                max_results=2)
        assert [e["id"] for e in page1["events"]] == [ids[2], ids[1]]
        assert page1["more_follows"] is True
        page2 = await peer.call("query", kind="timeseries", event_types=[["q", "*"]],
                                max_results=2, last_event_id=ids[1])
        assert [e["id"] for e in page2["events"]] == [ids[0]]
        assert page2["more_follows"] is False
        asc = await peer.call("query", kind="timeseries", order="ascending",
                              order_by="sourceTimestamp", event_types=[["?", "?"]])
        assert [e["id"] for e in asc["events"]] == [ids[1], ids[2], ids[0]]
        window = await peer.call("query", kind="timeseries", source_t_from=15.0,
                                 source_t_to=25.0)
        assert [e["id"] for e in window["events"]] == [ids[2]]
        t0 = reg[0]["timestamp"]
        timed = await peer.call("query", kind="timeseries", t_from=t0, t_to=t0)
        assert ids[0] in [e["id"] for e in timed["events"]]

        # server query: ascending EventId order, paged after lastEventId
        s1 = await peer.call("query", kind="server", server_id=1, max_results=3)
        assert [e["id"] for e in s1["events"]] == ids[:3] and s1["more_follows"]
        s2 = await peer.call("query", kind="server", server_id=1, last_event_id=ids[2])
        assert [e["id"] for e in s2["events"]] == ids[3:] and not s2["more_follows"]
        other = await peer.call("query", kind="server", server_id=99)
        assert other == {"events": [], "more_follows": False}


@pytest.fixture
def fresh_eventer():
    with BrokerProcess(CONFIG) as proc:
        yield proc


# ---- init ------------------------------------------------------------------------------


async def test_token_is_checked():
    with BrokerProcess('[eventer]\ntoken = "s3cret"\n') as b:
        for kw, ok in [({}, False), ({"token": "wrong"}, False), ({"token": "s3cret"}, True)]:
            peer, res = await hat_client(b, subscriptions=[["t", "*"]], **kw)
            async with peer:
                if ok:
                    assert res == {"status": "operational"}
                else:
                    assert "token" in res["init_error"]
        async with SkanClient.connect(*b.skan) as c:
            stats = await c.stats()
        assert int(stats["connections"].get("eventer", 0)) == 0


async def test_bad_subscription_pattern_is_refused(ebroker):
    peer, res = await hat_client(ebroker, subscriptions=[["a", "*", "b"]])
    async with peer:
        assert "'*' may only be the last segment" in res["init_error"]


# ---- keep-alive, stopping ------------------------------------------------------------------


async def test_pings_both_ways_keep_a_hat_client_connected(ebroker):
    # The client pings after 0.2 s idle and closes when a pong is 1.5 s late;
    # the broker pings after 0.5 s idle.  Several rounds each way:
    peer, _ = await hat_client(ebroker, ping_delay=0.2, ping_timeout=1.5)
    async with peer:
        await peer.call("sleep", seconds=3.0)
        assert (await peer.call("state"))["is_open"]


async def test_silent_peer_is_closed_after_ping_timeout(ebroker):
    stream = await trio.open_tcp_stream(*ebroker.addr["eventer"])
    client = ClientConnection(InitReq("silent"))
    await stream.send_all(client.data_to_send())
    got = b""
    with trio.fail_after(5):
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            got += chunk
    # MsgInitRes, then the broker's ping (after 0.5 s idle), then close (1 s later)
    assert client.receive_data(got) == [InitResult(Status.OPERATIONAL, None)]
    assert client.chatter.pings_answered == 1  # the pong was never sent
    await stream.aclose()


async def test_graceful_stop_notifies_stopping():
    with BrokerProcess(CONFIG) as b:
        peer, _ = await hat_client(b, subscriptions=[["s", "*"]])
        async with peer:
            b.proc.send_signal(signal.SIGTERM)
            res = await peer.call("wait_closed", timeout=10)
            assert res["closed"] and res["statuses"] == ["stopping"]
        assert b.proc.wait(10) == 0


# ---- the Chatter-spec envelope (hat-chatter 0.5.11) -------------------------------------


async def test_hat_chatter_05_envelope(ebroker):
    peer = await PeerProcess.start(HAT08_PEER, "seed_chatter_client.py",
                                   str(ebroker.addr["eventer"][1]))
    async with SkanClient.connect(*ebroker.skan) as c:
        await c.subscribe("seed")
        init = await peer.line()
        assert init == {"init": ["success", ["operational", None]], "same_conv": True,
                        "module": "HatEventer", "type": "MsgInitRes"}
        await c.send("seed", {"v": "42"}, instance="i")
        note = await peer.line()
        assert note == {"notify_type": "MsgEventsNotify", "last": False,
                        "event_type": ["seed", "i"], "payload": ["json", '{"v": "42"}']}
        assert await peer.line() == {"own_notify_type": "MsgEventsNotify",
                                     "event_type": ["seed", "from-chatter"]}
        reg = await peer.line()
        assert reg == {"register": "events", "same_conv": True, "type": "MsgRegisterRes",
                       "registered_type": ["seed", "from-chatter"]}
        m = await c.receive()
        assert (m.instance, m.msg) == ("from-chatter", {b"x": b"y"})
        assert await peer.line() == {"open": True}
    await peer.process.wait()


# ---- error paths (raw sockets) ----------------------------------------------------------------


async def read_until_closed(stream, timeout=5.0) -> bytes:
    got = b""
    with trio.fail_after(timeout):
        while chunk := await stream.receive_some(65536):
            got += chunk
    return got


@pytest.mark.parametrize("payload", [
    encode_frame(b"\x00\x01garbage"),
    b"\x08" + (2**50).to_bytes(8, "big"),
    encode_frame(sbs.encode("HatChatter.Msg", {
        "id": 1, "first": 1, "owner": True, "token": True, "last": False,
        "data": {"type": "HatEventer.MsgQueryReq",
                 "data": sbs.encode("HatEventer.MsgQueryReq",
                                    ("latest", {"eventTypes": ("none", None)}))}})),
    encode_frame(sbs.encode("HatChatter.Msg", {
        "id": 1, "first": 1, "owner": True, "token": True, "last": False,
        "data": {"type": "HatEventer.MsgInitReq", "data": b"\x85\x00"}})),
], ids=["garbage", "oversized", "query-before-init", "malformed-init"])
async def test_bad_input_closes_only_that_connection(ebroker, payload):
    peer, _ = await hat_client(ebroker, subscriptions=[["bad", "*"]])
    async with peer, SkanClient.connect(*ebroker.skan) as pub:
        stream = await trio.open_tcp_stream(*ebroker.addr["eventer"])
        await stream.send_all(payload)
        assert await read_until_closed(stream) == b""
        await pub.send("bad", "still here")
        got = await peer.call("events", count=1)
        assert [e["payload"] for e in got["events"]] == [{"json": "still here"}]


async def test_unacked_notifications_hit_the_conversation_timeout(ebroker):
    stream = await trio.open_tcp_stream(*ebroker.addr["eventer"])
    client = ClientConnection(InitReq("no-acks", subscriptions=(("noack", "*"),)))
    await stream.send_all(client.data_to_send())
    first = await stream.receive_some(65536)
    assert client.receive_data(first)[0] == InitResult(Status.OPERATIONAL, None)
    async with SkanClient.connect(*ebroker.skan) as pub:
        await pub.send("noack", "x")
        start = trio.current_time()
        # never ack, but keep answering pings so only the notify conversation expires
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                client.receive_data(chunk)
                await stream.send_all(client.data_to_send())
        assert 4.5 < trio.current_time() - start < 8


async def test_late_acks_pause_publishers_instead_of_disconnecting():
    # The backlog of notifications waiting for credit counts as queued bytes:
    # a consumer that acks late (within the grace period) slows the publisher
    # down instead of hitting the slow-consumer policy.
    config = ("[broker]\nmax_frame = 65536\nqueue_limit = 1048576\nslow_consumer_grace = 3.0\n"
              + CONFIG)
    total = 20000
    with BrokerProcess(config) as b:
        stream = await trio.open_tcp_stream(*b.addr["eventer"])
        client = ClientConnection(InitReq("late", subscriptions=(("late", "*"),)))
        await stream.send_all(client.data_to_send())
        assert client.receive_data(await stream.receive_some(65536)) == [
            InitResult(Status.OPERATIONAL, None)]
        raw = await RawSkan.open(b.skan)
        lname = await raw.getlname()
        frames = [encode_skan({
            "type": "send", "group": "late", "instance": "*", "to": "*", "from": lname,
            "seq": str(i), "msg": "x" * 100}) for i in range(total)]

        async def publish() -> None:
            # small paced writes: many routing batches, so most of them must
            # wait for notify credit in the backlog
            for i in range(0, total, 20):
                await raw.send_bytes(b"".join(frames[i:i + 20]))
                await trio.sleep(0.001)

        got = 0
        held = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish)
            start = trio.current_time()
            with trio.fail_after(20):
                while got < total:
                    data = await stream.receive_some(1 << 20)
                    assert data, "the broker closed the late-acking consumer"
                    for ev in client.receive_data(data):
                        got += len(ev.events)
                        held.append(ev.ack_conv)
                    if trio.current_time() - start > 1.0:  # late, but within the grace
                        for conv in held:
                            client.ack(conv)
                        held = []
                    await stream.send_all(client.data_to_send())
        async with SkanClient.connect(*b.skan) as c:
            stats = await c.stats()
        assert int(stats["slow_consumer_disconnects"]) == 0
        await raw.aclose()
        await stream.aclose()
