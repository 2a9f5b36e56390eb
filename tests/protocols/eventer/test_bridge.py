"""The Eventer bridge against a REAL hat-event 0.9.44 server (hat.event.eventer.listen)."""

from __future__ import annotations

import json
import ssl

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.hatpeer import PeerProcess
from tests.peerenv import EVENTER09_PEER
from tests.ports import listener_port as free_port
from tests.tlsfiles import server_cert
from toolkit.eventer_client import EventerClient
from wire.eventer import Status

pytestmark = [pytest.mark.trio, pytest.mark.peers]


def bridge_config(port: int, **extra: str) -> str:
    lines = [
        "[[bridges]]",
        'protocol = "eventer"',
        f'address = "127.0.0.1:{port}"',
        'group = "plant"',
        'client_name = "skan/bridge"',
        'token = "tok"',
        "backoff_initial = 0.2",
        "backoff_max = 0.5",
        *[f"{k} = {v}" for k, v in extra.items()],
    ]
    return "\n".join(lines) + "\n"


async def test_bridge_both_directions_without_echo():
    server = await PeerProcess.start(EVENTER09_PEER, "eventer09_server.py")
    async with server:
        port = (await server.line())["port"]
        with BrokerProcess(bridge_config(port)) as b:
            clients = await server.call("clients", count=1)
            assert clients["clients"] == [{"name": "skan/bridge", "token": "tok",
                                           "subscriptions": [["plant", "*"]]}]
            async with SkanClient.connect(*b.skan) as local, \
                    SkanClient.connect(*b.skan) as other:
                await local.subscribe("plant")
                await other.subscribe("elsewhere")
                # remote -> local: events enter the groups their types map to
                notified = await server.call("notify", events=[
                    {"type": ["plant", "pump", "1"], "payload": {"json": {"on": True}}},
                    {"type": ["plant"], "payload": {"binary": ["raw", "0102"]}},
                ])
                assert len(notified["notified"]) == 2
                m1, m2 = await local.receive(), await local.receive()
                assert (m1.group, m1.instance, m1.msg) == ("plant", "pump/1", {b"on": b"true"})
                assert m1.event_json == {"on": True}  # the exact payload beside the view
                assert (m2.instance, m2.msg, m2.header[b"payload-type"]) == ("*", b"\x01\x02",
                                                                            b"raw")
                assert m1.sender == m2.sender  # the bridge endpoint's lname
                # local -> remote: messages on the group are registered
                await other.send("plant", {"level": "3"}, instance="tank")
                await other.send("elsewhere", "not bridged")
                reg = await server.call("registered", count=1)
                assert [(e["type"], e["payload"]) for e in reg["events"]] == [
                    (["plant", "tank"], {"json": {"level": "3"}})]
                # the server notified the registered event back (it matches the
                # bridge's subscription): the bridge must not route it in again
                assert (await local.receive()).msg == {b"level": b"3"}  # other's send
                await trio.sleep(0.5)
                with pytest.raises(trio.WouldBlock):
                    local._inbox.receive_nowait()
                # and what the bridge routed in is not registered back
                reg = await server.call("registered")
                assert len(reg["events"]) == 1




async def test_bridge_buffers_while_down_and_reconnects():
    port = free_port()
    # The broker starts first: the bridge retries with backoff, local messages wait.
    with BrokerProcess(bridge_config(port)) as b:
        async with SkanClient.connect(*b.skan) as pub:
            await pub.send("plant", "while-down-1", instance="a")
            await pub.send("plant", "while-down-2", instance="b")
            await pub.stats()
            server = await PeerProcess.start(EVENTER09_PEER, "eventer09_server.py", str(port))
            async with server:
                assert (await server.line())["port"] == port
                reg = await server.call("registered", count=2)
                assert [e["payload"] for e in reg["events"]] == [
                    {"json": "while-down-1"}, {"json": "while-down-2"}]
                await server.call("close")
            # the server is gone; a new one on the same port gets the bridge back
            await pub.send("plant", "after-restart")
            server = await PeerProcess.start(EVENTER09_PEER, "eventer09_server.py", str(port))
            async with server:
                await server.line()
                assert (await server.call("clients", count=1))["connected"] == 1
                reg = await server.call("registered", count=1)
                assert [e["payload"] for e in reg["events"]] == [{"json": "after-restart"}]


async def test_refused_token_keeps_retrying_without_harm():
    # The upstream refuses the bridge's token at init (MsgInitRes error); the
    # bridge keeps retrying and its broker keeps running.  (A pattern with a
    # middle '*', which hat's server refuses too, no longer loads at all:
    # tests/protocols/test_star_last.py.)
    with BrokerProcess('[eventer]\ntoken = "another"\n') as up, \
            BrokerProcess(bridge_config(up.addr["eventer"][1])) as b:
        await trio.sleep(1.0)
        async with SkanClient.connect(*b.skan) as c:
            assert "uptime" in await c.stats()
        assert any("EventerInitError" in line and "token" in line
                   for line in b.stderr_lines), b.stderr_lines[-5:]


async def test_broker_to_broker_over_tls(tmp_path):
    cert = server_cert(tmp_path, "b")
    with BrokerProcess(cert.section("eventer") + 'token = "tok"\n') as up:
        port = up.addr["eventer"][1]
        down_cfg = bridge_config(port, tls="true", tls_ca=json.dumps(str(cert.ca_pem)))
        with BrokerProcess(down_cfg) as down:
            async with SkanClient.connect(*up.skan) as up_c, \
                    SkanClient.connect(*down.skan) as down_c:
                await up_c.subscribe("plant")
                await down_c.subscribe("plant")
                # downstream -> upstream (registered over TLS); retried until the bridge is up
                with trio.fail_after(15):
                    while True:
                        await down_c.send("plant", "down->up", instance="x")
                        with trio.move_on_after(0.3):
                            m = await up_c.receive()
                            break
                assert (m.instance, m.msg) == ("x", b"down->up")
                # upstream -> downstream (notified over TLS); no echo either way
                await up_c.send("plant", "up->down", instance="y")
                got = await down_c.receive()
                while got.msg == b"down->up":  # retries that crossed the bridge setup
                    got = await down_c.receive()
                assert (got.instance, got.msg) == ("y", b"up->down")
                await trio.sleep(0.5)
                for c in (up_c, down_c):
                    while True:
                        try:
                            extra = c._inbox.receive_nowait()
                        except trio.WouldBlock:
                            break
                        assert extra.msg == b"down->up"
            # a client over TLS with the CA
            ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
            async with EventerClient.connect(*up.addr["eventer"], "tls/client", token="tok",
                                             ssl_context=ctx) as client:
                assert client.status is Status.OPERATIONAL
