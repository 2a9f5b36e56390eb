"""The Eventer bridge against a REAL hat-event 0.9.44 server (hat.event.eventer.listen)."""

from __future__ import annotations

import socket

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.hatpeer import PeerProcess
from tests.peerenv import EVENTER09_PEER

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    server = await PeerProcess.start(EVENTER09_PEER, "eventer09_server.py")
    async with server:
        port = (await server.line())["port"]
        with BrokerProcess(bridge_config(port, subscriptions='[["plant", "*", "x"]]')) as b:
            # hat's server refuses the invalid subscription at init; the broker keeps running
            await trio.sleep(1.0)
            async with SkanClient.connect(*b.skan) as c:
                assert "uptime" in await c.stats()
            assert any("EventerInitError: invalid query event type" in line
                       for line in b.stderr_lines)
