"""Section 7 with the REAL hat-event clients: Eventer clientToken (hat-event 0.9.44) and
Mariner client_token (hat-event 0.8.17), each run from its own virtualenv."""

from __future__ import annotations

import json

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.hatpeer import PeerProcess as HatPeer
from tests.observability.metrics.httpc import scrape
from tests.peerenv import EVENTER09_PEER, HAT08_PEER
from tests.peerproc import PeerProcess
from tests.security.common import DASH_TOKEN, OP_TOKEN, SENSOR_TOKEN, USERS

pytestmark = pytest.mark.peers


@pytest.fixture(scope="module")
def ubroker():
    with BrokerProcess(USERS) as b:
        yield b
    assert b.proc is not None and b.proc.returncode == 0, "".join(b.stderr_lines[-40:])
    # Every refusal is one log line, never a traceback.
    assert not any("Traceback" in line for line in b.stderr_lines), "".join(b.stderr_lines)


async def eventer_client(broker, **kw) -> tuple[HatPeer, dict]:
    peer = await HatPeer.start(EVENTER09_PEER, "eventer09_client.py")
    return peer, await peer.call("connect", port=broker.addr["eventer"][1], **kw)


async def mariner_client(broker, token: str | None, subscriptions) -> PeerProcess:
    args = ["--subscriptions", json.dumps(subscriptions)]
    if token is not None:
        args += ["--token", token]
    peer = await PeerProcess.start(HAT08_PEER, "hat08_mariner_client.py",
                                   str(broker.addr["mariner"][1]), *args)
    assert await peer.line_with("connected", timeout=30)
    return peer


def counter(data, name: str, **labels: str) -> float:
    return data.get((name, frozenset(labels.items())), 0.0)


# ---- Eventer -------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"token": "wrong"}])
async def test_eventer_init_refused_without_a_valid_token(ubroker, kw):
    peer, res = await eventer_client(ubroker, subscriptions=[["telemetry", "*"]], **kw)
    async with peer:
        assert res["init_error"].startswith("not authorised: ")


async def test_eventer_token_user_receives_and_registers_within_permissions(ubroker):
    peer, res = await eventer_client(ubroker, token=SENSOR_TOKEN,
                                     subscriptions=[["commands.sensor", "*"]])
    async with peer, SkanClient.connect(*ubroker.skan, token=OP_TOKEN) as op:
        assert res == {"status": "operational"}
        await op.subscribe("telemetry")
        await op.send("commands.sensor", "calibrate", instance="now")
        got = (await peer.call("events", count=1))["events"]
        assert [e["type"] for e in got] == [["commands.sensor", "now"]]
        ok = await peer.call("register", events=[{"type": ["telemetry", "t1"],
                                                  "payload": {"json": 21.5}}])
        assert ok["events"] is not None and len(ok["events"]) == 1
        assert (await op.receive()).instance == "t1"
        # Outside 'publish': MsgRegisterRes failure, and nothing of the batch is routed.
        refused = await peer.call("register", events=[
            {"type": ["telemetry", "t2"], "payload": {"json": 1}},
            {"type": ["commands.sensor"], "payload": {"json": "forged"}},
        ])
        assert refused == {"events": None}
        with trio.move_on_after(0.3):
            raise AssertionError(f"part of a refused registration routed: {await op.receive()}")


@pytest.mark.parametrize("pattern", [["commands.sensor", "*"], ["*"], ["?", "x"]])
async def test_eventer_subscription_outside_permissions_refuses_init(ubroker, pattern):
    peer, res = await eventer_client(ubroker, token=DASH_TOKEN, subscriptions=[pattern])
    async with peer:
        assert "not authorised: subscription" in res["init_error"], res
        assert repr(pattern[0]) in res["init_error"]  # the pattern is named


# ---- Mariner -------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong"])
async def test_mariner_without_a_valid_token_is_closed(ubroker, token):
    async with await mariner_client(ubroker, token, [["telemetry", "*"]]) as peer:
        assert await peer.line_with("closed", timeout=10)


async def test_mariner_subscription_outside_permissions_is_closed(ubroker):
    async with await mariner_client(ubroker, DASH_TOKEN, [["commands.sensor", "*"]]) as peer:
        assert await peer.line_with("closed", timeout=10)


async def test_mariner_token_user_receives(ubroker):
    async with SkanClient.connect(*ubroker.skan, token=SENSOR_TOKEN) as sensor:
        base = int((await sensor.stats())["subscriptions"])
        async with await mariner_client(ubroker, DASH_TOKEN, [["telemetry", "*"]]) as peer:
            with trio.fail_after(10):
                while int((await sensor.stats())["subscriptions"]) <= base:
                    await trio.sleep(0.05)
            await sensor.send("telemetry", {"celsius": "21.5"}, instance="t1")
            event = await peer.line_with("event")
            assert event["type"] == ["telemetry", "t1"]


async def test_hat_refusals_are_counted(ubroker):
    before = await scrape(ubroker.addr["metrics"])
    peer, _ = await eventer_client(ubroker, token="wrong")
    async with peer:
        pass
    peer, _ = await eventer_client(ubroker, token=DASH_TOKEN, subscriptions=[["commands.x"]])
    async with peer:
        pass
    async with await mariner_client(ubroker, "wrong", [["telemetry"]]) as m:
        await m.line_with("closed")
    after = await scrape(ubroker.addr["metrics"])

    def delta(name: str, **labels: str) -> float:
        return counter(after, name, **labels) - counter(before, name, **labels)

    assert delta("skan_auth_failures_total", protocol="eventer") == 1
    assert delta("skan_auth_failures_total", protocol="mariner") == 1
    assert delta("skan_permission_denied_total", protocol="eventer", action="subscribe") == 1


async def test_eventer_queries_return_only_what_the_user_may_read(ubroker):
    peer, res = await eventer_client(ubroker, token=DASH_TOKEN)
    async with (
        peer,
        SkanClient.connect(*ubroker.skan, token=OP_TOKEN) as op,
        SkanClient.connect(*ubroker.skan, token=SENSOR_TOKEN) as sensor,
    ):
        assert res == {"status": "operational"}
        await op.send("commands.sensor", "secret command", instance="q")
        await op.send("telemetry", "directed to the sensor", instance="q", to=sensor.lname)
        await op.send("telemetry", "for everyone", instance="q")
        await op.barrier()
        for kind in ("timeseries", "latest"):
            got = await peer.call("query", kind=kind, event_types=[["commands.sensor", "*"],
                                                                   ["telemetry", "q"]])
            assert [e["payload"] for e in got["events"]] == [{"json": "for everyone"}], kind
        got = await peer.call("query", kind="server", server_id=1)
        assert all(e["type"][0] in ("telemetry", "alarms.fire", "alarms.smoke")
                   for e in got["events"]), got
        assert {"json": "for everyone"} in [e["payload"] for e in got["events"]]
