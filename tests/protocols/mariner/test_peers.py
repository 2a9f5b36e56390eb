"""The Mariner listener against the REAL hat-event 0.8.17 Mariner client (its own venv)."""

from __future__ import annotations

import base64
import json

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.peerenv import HAT08_PEER
from tests.peerproc import PeerProcess
from toolkit.mariner_client import MarinerClient

pytestmark = [pytest.mark.trio, pytest.mark.peers]


async def hat_client(broker, *args: str) -> PeerProcess:
    peer = await PeerProcess.start(
        HAT08_PEER, "hat08_mariner_client.py", str(broker.addr["mariner"][1]), *args
    )
    assert await peer.line_with("connected", timeout=30)
    return peer


async def subscriptions(skan: SkanClient) -> int:
    return int((await skan.stats())["subscriptions"])


async def wait_subscriptions(skan: SkanClient, n: int) -> None:
    """The broker has applied the peer's init once its pattern subscriptions count."""
    with trio.fail_after(10):
        while await subscriptions(skan) < n:
            await trio.sleep(0.02)


async def test_hat_client_receives_skan_traffic(broker):
    async with SkanClient.connect(*broker.skan) as pub:
        base = await subscriptions(pub)
        async with await hat_client(
            broker, "--subscriptions", json.dumps([["hat", "*"]]), "--ping-delay", "0.3"
        ) as peer:
            await wait_subscriptions(pub, base + 1)
            await pub.send("hat", {"value": "42"}, instance="dev/1")
            await pub.send("hat", b"\x00\xffraw")
            await pub.send("hat", None, instance="n")
            await pub.send("elsewhere", "not subscribed")
            # Beyond the peer's ping_delay: its pings are answered, it stays.
            await trio.sleep(1.0)
            await pub.send("hat", "after pings")
            events = [await peer.line_with("event") for _ in range(4)]
    assert [e["type"] for e in events] == [["hat", "dev", "1"], ["hat"], ["hat", "n"], ["hat"]]
    assert [e["payload"] for e in events] == [
        {"type": "json", "data": {"value": "42"}},
        {"type": "binary", "data": base64.b64encode(b"\x00\xffraw").decode()},
        None,
        {"type": "json", "data": "after pings"},
    ]
    ids = [tuple(e["id"]) for e in events]
    assert ids == sorted(ids) and ids[0][0] == 1
    assert all(e["source_timestamp"] is None for e in events)


async def test_hat_client_replays_from_last_event_id(broker):
    async with (
        SkanClient.connect(*broker.skan) as pub,
        MarinerClient.connect(*broker.addr["mariner"], client_id="watch",
                              subscriptions=[("hatrp", "*")]) as watcher,
    ):
        await watcher.barrier()
        for i in range(5):
            await pub.send("hatrp", str(i))
        seen = []
        while len(seen) < 5:
            seen += await watcher.receive()
        last = seen[1].id
        base = await subscriptions(pub)
        async with await hat_client(
            broker, "--subscriptions", json.dumps([["hatrp", "*"]]),
            "--last-event-id", f"{last.server},{last.session},{last.instance}",
        ) as peer:
            replayed = [await peer.line_with("event") for _ in range(3)]
            await wait_subscriptions(pub, base + 1)
            await pub.send("hatrp", "live")
            live = await peer.line_with("event")
    assert [e["payload"]["data"] for e in replayed] == ["2", "3", "4"]
    assert [tuple(e["id"]) for e in replayed] == [
        (e.id.server, e.id.session, e.id.instance) for e in seen[2:]
    ]
    assert live["payload"]["data"] == "live"


@pytest.fixture(scope="module")
def token_broker():
    with BrokerProcess('[mariner]\ntoken = "hat-secret"\n') as b:
        yield b


async def test_hat_client_wrong_token_is_closed(token_broker):
    async with await hat_client(token_broker, "--token", "nope") as peer:
        assert await peer.line_with("closed") is True


async def test_hat_client_right_token_receives(token_broker):
    async with SkanClient.connect(*token_broker.skan) as pub:
        base = await subscriptions(pub)
        async with await hat_client(
            token_broker, "--token", "hat-secret", "--subscriptions", json.dumps([["tok"]])
        ) as peer:
            await wait_subscriptions(pub, base + 1)
            await pub.send("tok", "welcome")
            event = await peer.line_with("event")
    assert event["payload"] == {"type": "json", "data": "welcome"}
