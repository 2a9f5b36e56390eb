"""The Mariner bridge against the REAL hat-event 0.8.17 Mariner server, and broker to broker."""

from __future__ import annotations

import base64
import json

import pytest
import trio
import trustme

from clients.skan import Message, SkanClient
from tests.brokerproc import BrokerProcess
from tests.observability.metrics.httpc import scrape, value
from tests.peerenv import HAT08_PEER
from tests.peerproc import PeerProcess
from tests.ports import listener_port as free_port

pytestmark = pytest.mark.trio


def bridge_config(port: int, **extra: str) -> str:
    lines = [
        "[[bridges]]",
        'protocol = "mariner"',
        f'address = "127.0.0.1:{port}"',
        'group = "remote"',
        "backoff_initial = 0.1",
        "backoff_max = 0.5",
        *(f"{k} = {v}" for k, v in extra.items()),
    ]
    return "\n".join(lines) + "\n"


async def receive(client: SkanClient, timeout: float = 10.0) -> Message:
    with trio.fail_after(timeout):
        return await client.receive()


async def quiet(client: SkanClient, wait: float = 0.3) -> None:
    await trio.sleep(wait)
    await client.barrier()
    with pytest.raises(trio.WouldBlock):
        client._inbox.receive_nowait()


def ev(eid: list[int], etype: list[str], payload: object = None) -> dict:
    return {"id": eid, "type": etype, "payload": payload}


# ---- the real Hat server -------------------------------------------------------------


@pytest.mark.peers
async def test_bridge_from_hat_server_routes_events_and_resumes():
    async with await PeerProcess.start(HAT08_PEER, "hat08_mariner_server.py") as server:
        port = await server.line_with("listening", timeout=30)
        config = bridge_config(port, token='"bridge-token"', client_name='"skan-bridge-1"')
        with BrokerProcess(config) as b:
            conn = await server.line_with("connection")
            assert conn == {"client_id": "skan-bridge-1", "client_token": "bridge-token",
                            "last_event_id": None, "subscriptions": [["remote", "*"]]}
            async with (
                SkanClient.connect(*b.skan) as sub,
                SkanClient.connect(*b.skan) as other,
            ):
                await sub.subscribe("remote")
                await other.subscribe("elsewhere")
                await server.send({"events": [
                    ev([7, 1, 1], ["remote", "a", "b"], {"type": "json", "data": {"v": 1}}),
                    ev([7, 1, 2], ["remote"], {"type": "binary",
                                               "b64": base64.b64encode(b"\x00\xff").decode()}),
                    ev([7, 1, 3], ["remote", "s"], {"type": "sbs", "module": "M", "name": "T",
                                                    "b64": base64.b64encode(b"\x01").decode()}),
                    {**ev([7, 1, 4], ["remote", "n"], None), "source": [1700000000, 250000]},
                    ev([7, 1, 5], ["elsewhere"], {"type": "json", "data": "filtered"}),
                ]})
                assert await server.line_with("sent") == 1
                got = [await receive(sub) for _ in range(4)]
                assert [(m.group, m.instance, m.to) for m in got] == [
                    ("remote", "a/b", "*"), ("remote", "*", "*"), ("remote", "s", "*"),
                    ("remote", "n", "*"),
                ]
                assert [m.msg for m in got] == [{b"v": b"1"}, b"\x00\xff", b"\x01", None]
                # the exact JSON payload rides beside the Skan view (BROKER-SPEC 3)
                assert [m.event_json for m in got] == [{"v": 1}, None, None, None]
                assert [m.header.get(b"payload-type") for m in got] == [
                    None, b"", b"sbs:M.T", None,
                ]
                assert [m.header.get(b"source-timestamp") for m in got] == [
                    None, None, None, b"1700000000.250000",
                ]
                senders = {m.sender for m in got}
                assert len(senders) == 1 and sub.lname not in senders
                bridge_lname = senders.pop()
                await quiet(other)
                # Mariner is one-way: a reply directed at the bridge is counted as dropped.
                before = int((await sub.stats())["dropped"])
                await sub.send("remote", "to the bridge", to=bridge_lname, repl="1")
                assert int((await sub.stats())["dropped"]) == before + 1

                # The server drops the connection: the bridge reconnects and resumes.
                await server.send({"close": True})
                assert await server.line_with("closed") == 1
                conn = await server.line_with("connection")
                assert conn["last_event_id"] == [7, 1, 4]
                await server.send({"events": [
                    ev([7, 1, 4], ["remote"], {"type": "json", "data": "duplicate"}),
                    ev([7, 2, 1], ["remote"], {"type": "json", "data": "new"}),
                ]})
                assert await server.line_with("sent") == 1
                m = await receive(sub)
                assert m.msg == b"new" and m.sender == bridge_lname  # one lname for life
                await quiet(sub)

            data = await scrape(b.addr["metrics"])
            labels = {"bridge": f"mariner-0-127.0.0.1:{port}", "protocol": "mariner"}
            assert value(data, "skan_bridge_connects_total", **labels) == 2
            assert value(data, "skan_bridge_received_messages_total", **labels) == 5
            assert value(data, "skan_bridge_up", address=f"127.0.0.1:{port}", **labels) == 1


@pytest.mark.peers
async def test_bridge_custom_subscriptions_and_keys_no_tag_can_hold():
    async with await PeerProcess.start(HAT08_PEER, "hat08_mariner_server.py") as server:
        port = await server.line_with("listening", timeout=30)
        config = bridge_config(port, subscriptions='[["x", "?"], ["y", "*"]]')
        with BrokerProcess(config) as b:
            conn = await server.line_with("connection")
            assert sorted(conn["subscriptions"]) == [["x", "?"], ["y", "*"]]
            assert conn["client_id"] == "skan-broker" and conn["client_token"] is None
            async with SkanClient.connect(*b.skan) as sub:
                await sub.subscribe("x")
                await sub.subscribe("y")
                await server.send({"events": [
                    ev([7, 1, 1], ["x", "one"], {"type": "json", "data": "ok-x"}),
                    # A JSON key no Skan tag can hold: the Skan view is the JSON text,
                    # the payload-json tag keeps it exact for Hat consumers.
                    ev([7, 1, 2], ["y"], {"type": "json", "data": {"": 1}}),
                    ev([7, 1, 3], ["y", "deep", "er"], {"type": "json", "data": "ok-y"}),
                ]})
                got = [await receive(sub) for _ in range(3)]
                assert [(m.instance, m.msg) for m in got] == [
                    ("one", b"ok-x"), ("*", b'{"":1}'), ("deep/er", b"ok-y")]
                assert got[1].event_json == {"": 1}
                await quiet(sub)


# ---- broker to broker ---------------------------------------------------------------




async def until_bridged(pub: SkanClient, sub: SkanClient, text: str, timeout: float = 15) -> None:
    """Publish ``text`` upstream until it arrives downstream (the bridge's init is applied
    upstream at some point after it connects), then take every copy still in flight."""
    with trio.fail_after(timeout):
        while True:
            await pub.send("remote", text)
            try:
                with trio.fail_after(0.3):
                    assert (await sub.receive()).msg == text.encode()
                break
            except trio.TooSlowError:
                pass
    await pub.send("remote", "end of probes")
    while (await receive(sub)).msg != b"end of probes":
        pass


async def test_broker_to_broker_and_reconnect_after_upstream_restart():
    port = free_port()
    up_args = ("--mariner-port", str(port))
    upstream = BrokerProcess('[mariner]\ntoken = "up"\n', up_args).start()
    try:
        with BrokerProcess(bridge_config(port, token='"up"')) as down:
            async with (
                SkanClient.connect(*upstream.skan) as pub,
                SkanClient.connect(*down.skan) as sub,
            ):
                await sub.subscribe("remote")
                await until_bridged(pub, sub, "probe")
                await pub.send("remote", {"k": "v"}, instance="i/j")
                m = await receive(sub)
                assert (m.instance, m.msg) == ("i/j", {b"k": b"v"})
            # The upstream broker restarts (same port, fresh retention, higher
            # sessions): the bridge reconnects, and its resume point from the old
            # run does not hide the new run's events.
            upstream.stop()
            upstream = BrokerProcess('[mariner]\ntoken = "up"\n', up_args).start()
            async with (
                SkanClient.connect(*upstream.skan) as pub,
                SkanClient.connect(*down.skan) as sub,
            ):
                await sub.subscribe("remote")
                await until_bridged(pub, sub, "after restart")
                await pub.send("remote", "live")
                assert (await receive(sub)).msg == b"live"
                await quiet(sub)
    finally:
        upstream.stop()


async def test_bridge_with_wrong_token_stays_down_and_retries():
    with BrokerProcess('[mariner]\ntoken = "right"\n') as upstream:
        port = upstream.addr["mariner"][1]
        with BrokerProcess(bridge_config(port, token='"wrong"')) as down:
            labels = {"bridge": f"mariner-0-127.0.0.1:{port}", "protocol": "mariner"}
            with trio.fail_after(10):
                while True:
                    data = await scrape(down.addr["metrics"])
                    if value(data, "skan_bridge_reconnects_total", **labels) >= 3:
                        break
                    await trio.sleep(0.1)
            assert value(data, "skan_bridge_up", address=f"127.0.0.1:{port}", **labels) == 0
    assert any("client_token does not match" in line for line in down.stderr_lines)


async def test_bridge_over_tls(tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "up.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "up.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    up_config = (f'[mariner]\ntls_cert = "{tmp_path / "up.pem"}"\n'
                 f'tls_key = "{tmp_path / "up.key"}"\n')
    with BrokerProcess(up_config) as upstream:
        port = upstream.addr["mariner"][1]
        config = bridge_config(port, tls="true", tls_ca=json.dumps(str(tmp_path / "ca.pem")))
        with BrokerProcess(config) as down:
            async with (
                SkanClient.connect(*upstream.skan) as pub,
                SkanClient.connect(*down.skan) as sub,
            ):
                await sub.subscribe("remote")
                await until_bridged(pub, sub, "secure")
