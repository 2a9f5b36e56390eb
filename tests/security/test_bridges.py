"""Bridges act as their configured ``user`` (section 7), against a live HSP peer."""

from __future__ import annotations

import pytest
import trio

from broker.serving import config as cfgmod
from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.observability.metrics.httpc import scrape
from tests.protocols.hsp.test_bridge import PeerServer, bridge_config, free_port, until
from tests.security.common import OP_TOKEN, USERS

READ_ONLY_BRIDGE = """
[[users]]
name = "bridge-ro"
subscribe = ["bridged"]
"""


async def test_bridge_user_may_forward_but_not_inject():
    port = free_port()
    server = PeerServer(port)
    config = USERS + READ_ONLY_BRIDGE + bridge_config(port, extra='user = "bridge-ro"')
    async with trio.open_nursery() as nursery:
        await server.start(nursery)
        with BrokerProcess(config) as proc:
            await until(lambda: server.connections == 1 and server.peer is not None)
            async with SkanClient.connect(*proc.skan, token=OP_TOKEN) as op:
                await op.subscribe("bridged")
                # Local -> peer: the bridge's subscription to its group is permitted.
                await op.send("bridged", "to the peer")
                await until(lambda: server.received == [(42, b"to the peer")])
                # Peer -> local: the bridge user may not publish, so nothing arrives.
                assert server.peer is not None
                await server.peer.send(42, b"from the peer")
                data = {}
                with trio.fail_after(10):
                    while not data.get(("skan_permission_denied_total", frozenset(
                            {"protocol": "bridge-hsp", "action": "publish"}.items()))):
                        await trio.sleep(0.05)
                        data = await scrape(proc.addr["metrics"])
                with trio.move_on_after(0.3):
                    raise AssertionError(f"injected: {await op.receive()}")
            assert any("bridge-ro" in line and "may not send" in line
                       for line in proc.stderr_lines)
        nursery.cancel_scope.cancel()


async def test_bridge_without_user_has_full_rights():
    port = free_port()
    server = PeerServer(port)
    async with trio.open_nursery() as nursery:
        await server.start(nursery)
        with BrokerProcess(USERS + bridge_config(port)) as proc:
            await until(lambda: server.connections == 1 and server.peer is not None)
            async with SkanClient.connect(*proc.skan, token=OP_TOKEN) as op:
                await op.subscribe("bridged")
                assert server.peer is not None
                await server.peer.send(42, b"from the peer")
                assert (await op.receive()).msg == b"from the peer"
        nursery.cancel_scope.cancel()


def test_bridge_user_must_exist():
    data = {"users": [{"name": "a", "token": "t"}],
            "bridges": [{"protocol": "hsp", "address": "127.0.0.1:1", "group": "g",
                         "user": "nobody"}]}
    with pytest.raises(cfgmod.ConfigError) as info:
        cfgmod.from_mapping(data)
    assert info.value.key == "bridges[0].user"
