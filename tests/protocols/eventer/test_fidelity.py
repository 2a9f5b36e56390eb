"""Payload fidelity (BROKER-SPEC 3, issue 24): every Hat consumer gets a Hat payload exactly
as it was registered, against REAL hat-event 0.9.44 Eventer and hat-event 0.8.17 Mariner
clients, a real broker process and its durable store (restart included).

Payloads are compared as JSON text (``json.dumps``), which tells ``true`` from ``1``,
``1`` from ``1.0``, ``-0.0`` from ``0`` and keeps key order.
"""

from __future__ import annotations

import json

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.hatpeer import PeerProcess
from tests.peerenv import EVENTER09_PEER, HAT08_PEER
from tests.peerproc import PeerProcess as LinePeer
from tests.rawskan import RawSkan
from tests.store.test_restart import workdir
from wire.skan import encode_frame

pytestmark = [pytest.mark.trio, pytest.mark.peers]

# What real Hat components register: booleans (hat-gateway's enable), numbers
# (write commands, hat-gui's session timestamps), null, nesting with key order,
# strings that look like numbers, big integers, floats that are whole numbers.
PAYLOADS = [
    True, False, 1234, 1.5, 0, -0.0, 1.0, 2**70, -(2**63), 1e-7, 1700000000.123456, None,
    {"request_id": "w", "value": 1234},
    {"z": 1, "a": True, "m": {"y": [1, 2.5, None, "3", {"deep": False}], "b": None}},
    [1, "1", True, "true", None, [], {}],
    "1234", "true", "null", "plain text", {"s": "only strings", "l": ["a", None]},
    {"": 1, "k" * 300: [True]},
]
GROUP = "fid"


def same(a, b) -> bool:
    return json.dumps(a) == json.dumps(b)


def registrations() -> list[dict]:
    return [{"type": [GROUP, str(i)], "payload": {"json": p},
             "source_timestamp": 1700000000 + i + 0.000001 * (i * 37 % 1000000)}
            for i, p in enumerate(PAYLOADS)]


def check_exact(events: list[dict], what: str) -> None:
    """Each event of ``events`` (any order) carries exactly the payload and source
    timestamp registered for its type."""
    regs = {tuple(r["type"]): r for r in registrations()}
    assert len(events) == len(regs), (what, len(events))
    for e in events:
        reg = regs[tuple(e["type"])]
        assert same(e["payload"], reg["payload"]), (what, e["payload"], reg["payload"])
        # to the microsecond (the client prints s + us * 1e-6)
        assert round(e["source_timestamp"] * 1e6) == round(reg["source_timestamp"] * 1e6), what


def check_mariner(events: list[dict], what: str) -> None:
    regs = {tuple(r["type"]): r for r in registrations()}
    assert len(events) == len(regs), (what, len(events))
    for e in events:
        reg = regs[tuple(e["type"])]
        assert e["payload"]["type"] == "json", (what, e)
        assert same(e["payload"]["data"], reg["payload"]["json"]), (what, e["payload"], reg)
        s, us = e["source_timestamp"]
        assert s * 1_000_000 + us == round(reg["source_timestamp"] * 1e6), what


async def hat_client(broker, **kw) -> PeerProcess:
    peer = await PeerProcess.start(EVENTER09_PEER, "eventer09_client.py")
    res = await peer.call("connect", port=broker.addr["eventer"][1], **kw)
    assert res == {"status": "operational"}, res
    return peer


async def mariner_client(broker, last_event_id=None) -> LinePeer:
    args = [str(broker.addr["mariner"][1]), "--subscriptions", json.dumps([[GROUP, "*"]])]
    if last_event_id is not None:
        args += ["--last-event-id", ",".join(map(str, last_event_id))]
    peer = await LinePeer.start(HAT08_PEER, "hat08_mariner_client.py", *args)
    assert await peer.line_with("connected", timeout=60)
    return peer


async def mariner_events(peer: LinePeer, n: int) -> list[dict]:
    return [await peer.line_with("event", timeout=15) for _ in range(n)]


async def queried(peer: PeerProcess) -> tuple[list[dict], list[dict]]:
    latest = await peer.call("query", kind="latest", event_types=[[GROUP, "*"]])
    series = await peer.call("query", kind="timeseries", event_types=[[GROUP, "*"]],
                             max_results=len(PAYLOADS) + 5)
    assert series["more_follows"] is False
    return latest["events"], series["events"]


async def test_hat_payloads_arrive_exactly_everywhere_and_after_a_restart():
    wd = workdir()
    n = len(PAYLOADS)
    with BrokerProcess(workdir=wd) as broker:
        listener = await hat_client(broker, subscriptions=[[GROUP, "*"]])
        producer = await hat_client(broker)
        live = await mariner_client(broker)
        async with listener, producer, live, SkanClient.connect(*broker.skan) as skan:
            await skan.subscribe(GROUP)
            res = await producer.call("register", events=registrations())
            registered = res["events"]
            check_exact(registered, "MsgRegisterRes")
            check_exact((await listener.call("events", count=n))["events"], "MsgEventsNotify")
            check_mariner(await mariner_events(live, n), "Mariner events")
            latest, series = await queried(listener)
            check_exact(latest, "latest")
            check_exact(series, "timeseries")
            server = await listener.call("query", kind="server", server_id=1)
            check_exact([e for e in server["events"] if e["type"][0] == GROUP], "server query")
            # Skan subscribers keep the Skan view; the exact JSON rides beside it
            got = {}
            for _ in range(n):
                m = await skan.receive()
                got[m.instance] = m
            assert got["0"].msg == b"true" and got["0"].event_json is True
            assert got["2"].msg == b"1234" and got["2"].header[b"payload-json"] == b"1234"
            assert got["11"].msg is None and got["11"].header[b"payload-json"] == b"null"
            assert got["12"].msg == {b"request_id": b"w", b"value": b"1234"}
            assert got["15"].msg == b"1234" and b"payload-json" not in got["15"].header
            assert got["19"].msg == {b"s": b"only strings", b"l": [b"a", None]}
            assert b"payload-json" not in got["19"].header
            assert got["20"].msg == json.dumps(PAYLOADS[20], separators=(",", ":")).encode()
        first = registered[0]["id"]
        replay_from = [first[0], first[1], first[2] - 1]
        assert broker.stop() == 0

    # A new broker process on the same store: queries and replay from disk.
    with BrokerProcess(workdir=wd) as broker:
        reader = await hat_client(broker)
        replay = await mariner_client(broker, last_event_id=replay_from)
        async with reader, replay:
            latest, series = await queried(reader)
            check_exact(latest, "latest after restart")
            check_exact(series, "timeseries after restart")
            check_mariner(await mariner_events(replay, n), "Mariner replay after restart")


async def test_skan_client_sends_typed_hat_payloads():
    with BrokerProcess() as broker:
        listener = await hat_client(broker, subscriptions=[["plant", "*"]])
        async with listener, SkanClient.connect(*broker.skan) as pub, \
                SkanClient.connect(*broker.skan) as sub:
            await sub.subscribe("plant")
            command = {"request_id": "w", "value": 1234, "on": True, "f": 1.0, "n": None}
            await pub.send_event_json("plant", command, instance="dev1/write")
            await pub.send_event_json("plant", True, instance="dev1/enable")
            await pub.send_event_json("plant", None, instance="dev1/null")
            await pub.send_event_json("plant", "text", instance="dev1/text")
            # the tag wins for Hat, msg for Skan, when a client sends both and they differ
            await pub.send("plant", b"skan view", instance="dev1/both",
                           tags={"payload-json": b'{"hat": [1, 2.0]}'})
            events = (await listener.call("events", count=5))["events"]
            assert [e["type"] for e in events] == [
                ["plant", "dev1", "write"], ["plant", "dev1", "enable"],
                ["plant", "dev1", "null"], ["plant", "dev1", "text"], ["plant", "dev1", "both"]]
            assert same([e["payload"] for e in events], [
                {"json": command}, {"json": True}, {"json": None}, {"json": "text"},
                {"json": {"hat": [1, 2.0]}}])
            msgs = [await sub.receive() for _ in range(5)]
            assert msgs[0].msg == {b"request_id": b"w", b"value": b"1234", b"on": b"true",
                                   b"f": b"1.0", b"n": None}
            assert same(msgs[0].event_json, command)
            assert (msgs[1].msg, msgs[2].msg, msgs[3].msg) == (b"true", None, b"text")
            assert msgs[3].event_json is None  # lossless: no tag
            assert msgs[4].msg == b"skan view"
            latest = await listener.call("query", kind="latest",
                                         event_types=[["plant", "dev1", "write"]])
            assert same(latest["events"][0]["payload"], {"json": command})


@pytest.mark.parametrize(("tag", "needle"), [
    (b"{nope", "is not a JSON payload"),
    (b"\xff", "not UTF-8"),
    (None, "must be DATA"),
    ({"a": b"1"}, "must be DATA"),
    (b"[" * 150 + b"]" * 150, "nested too deeply"),
    (b"1" * 500, "digits"),
])
async def test_bad_payload_json_gets_an_error_frame_and_the_connection_stays(tag, needle):
    with BrokerProcess() as broker:
        listener = await hat_client(broker, subscriptions=[["bad", "*"]])
        async with listener:
            raw = await RawSkan.open(broker.skan)
            lname = await raw.getlname()
            await raw.send_bytes(encode_frame({
                "type": "send", "group": "bad", "instance": "*", "to": "*", "from": lname,
                "seq": "77", "payload-json": tag, "msg": b"x"}))
            err = await raw.message()
            assert err[b"type"] == b"error" and err[b"seq"] == b"77"
            assert needle in err[b"error"].decode(), err
            # the connection stays open and works; nothing bad reached the Hat client
            await raw.send_bytes(encode_frame({
                "type": "send", "group": "bad", "instance": "*", "to": "*", "from": lname,
                "seq": "78", "payload-json": b"[1]", "msg": [b"1"]}))
            assert await raw.getlname() == lname
            events = (await listener.call("events", count=1))["events"]
            assert [e["payload"] for e in events] == [{"json": [1]}]
            await raw.aclose()
        with trio.fail_after(5):
            async with SkanClient.connect(*broker.skan) as c:
                assert "uptime" in await c.stats()


# ---- bridges ------------------------------------------------------------------------------


async def test_eventer_bridge_carries_exact_payloads_both_ways():
    from tests.protocols.eventer.test_bridge import bridge_config

    n = len(PAYLOADS)
    server = await PeerProcess.start(EVENTER09_PEER, "eventer09_server.py")
    async with server:
        port = (await server.line())["port"]
        with BrokerProcess(bridge_config(port, subscriptions=f'[["{GROUP}", "*"]]')) as b:
            await server.call("clients", count=1)
            local = await hat_client(b, subscriptions=[[GROUP, "*"]])
            producer = await hat_client(b)
            async with local, producer, SkanClient.connect(*b.skan) as skan:
                await skan.subscribe(GROUP)
                # remote -> local: the remote server's events reach local Hat clients exactly
                notified = await server.call("notify", events=[
                    {"type": r["type"], "payload": r["payload"]} for r in registrations()])
                assert len(notified["notified"]) == n
                got = (await local.call("events", count=n))["events"]
                regs = {tuple(r["type"]): r["payload"] for r in registrations()}
                assert len(got) == n
                for e in got:
                    assert same(e["payload"], regs[tuple(e["type"])]), e
                first = await skan.receive()  # and Skan subscribers the Skan view
                assert (first.instance, first.msg, first.event_json) == ("0", b"true", True)
                # local -> remote: a local Hat client's typed registration on the
                # bridged group is registered remotely exactly, source timestamp included
                out = [{"type": ["plant", str(i)], "payload": {"json": p},
                        "source_timestamp": 1700000000.000001 + i}
                       for i, p in enumerate(PAYLOADS)]
                await producer.call("register", events=out)
                reg = await server.call("registered", count=n, timeout=10)
                assert len(reg["events"]) == n
                for sent, e in zip(out, reg["events"], strict=True):
                    assert e["type"] == sent["type"]
                    assert same(e["payload"], sent["payload"]), e
                    assert round(e["source_timestamp"] * 1e6) == round(
                        sent["source_timestamp"] * 1e6)


async def test_mariner_bridge_carries_exact_payloads():
    """Broker to broker over Mariner: Hat registrations on the upstream broker reach a
    Hat client of the downstream broker exactly (Mariner events out, bridge in)."""
    from tests.protocols.eventer.test_bridge import free_port
    from tests.protocols.mariner.test_bridge import bridge_config

    n = len(PAYLOADS)
    port = free_port()
    with BrokerProcess(args=("--mariner-port", str(port))) as upstream, \
            BrokerProcess(bridge_config(port, subscriptions=f'[["{GROUP}", "*"]]')) as down:
        local = await hat_client(down, subscriptions=[[GROUP, "*"]])
        producer = await hat_client(upstream)
        async with local, producer:
            # until the bridge is up: a probe registered upstream arrives downstream
            with trio.fail_after(20):
                while True:
                    await producer.call("register", events=[{"type": [GROUP, "probe"]}])
                    if (await local.call("events", count=1, timeout=0.5))["events"]:
                        break
            await trio.sleep(0.3)
            await local.call("events", count=100, timeout=0.3)  # late probes
            await producer.call("register", events=registrations())
            check_exact((await local.call("events", count=n))["events"], "Mariner bridge")
