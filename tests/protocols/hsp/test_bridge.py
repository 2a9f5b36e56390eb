"""The HSP bridge against a live HSP server (clients.hsp) that is stopped and restarted."""

from __future__ import annotations

import ssl
from collections.abc import Callable

import pytest
import trio
import trustme

from clients.hsp import HSPError, HSPPeer, serve_hsp
from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.observability.metrics.httpc import scrape
from tests.ports import listener_port as free_port
from wire.hsp import DataAck
from wire.skan import decode

pytestmark = pytest.mark.trio




def bridge_config(port: int, *, group: str = "bridged", instance: str = "*", type: int = 42,
                  buffer: int = 1000, extra: str = "") -> str:
    return f"""
[[bridges]]
protocol = "hsp"
address = "127.0.0.1:{port}"
group = "{group}"
instance = "{instance}"
type = {type}
buffer = {buffer}
backoff_initial = 0.05
backoff_max = 0.2
{extra}
"""


class PeerServer:
    """An HSP server on a fixed port that can be stopped and started again.

    It acknowledges every DATA_ACK after recording it, unless ``refuse``
    says otherwise (then it answers ERROR 2).  ``delay`` slows it down, so
    that many messages are in flight (read from the socket, not yet
    acknowledged) when it is stopped.
    """

    def __init__(self, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self.port = port
        self.ssl_context = ssl_context
        self.received: list[tuple[int, bytes]] = []
        self.connections = 0
        self.peer: HSPPeer | None = None
        self.refuse: Callable[[bytes], bool] = lambda payload: False
        self.delay = 0.0
        self._scope: trio.CancelScope | None = None

    async def start(self, nursery: trio.Nursery) -> None:
        await nursery.start(self._serve)

    async def _serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as self._scope:
            await serve_hsp(self._handle, self.port, auto_ack=False,
                            ssl_context=self.ssl_context, task_status=task_status)

    def stop(self) -> None:
        assert self._scope is not None
        self._scope.cancel()
        self.peer = None

    async def _handle(self, peer: HSPPeer) -> None:
        self.connections += 1
        self.peer = peer
        async for item in peer:
            if type(item) is DataAck:
                if self.delay:
                    await trio.sleep(self.delay)
                if self.refuse(item.payload):
                    await peer.error(item.message_id, 2, "refused by the test peer")
                    continue
                self.received.append((item.type, item.payload))
                await peer.ack(item.message_id)


async def until(pred: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.02)


def first_seen(items: list[bytes]) -> list[bytes]:
    """The list without repeats, in order of first occurrence (at-least-once may repeat)."""
    return list(dict.fromkeys(items))


async def bridge_up(proc: BrokerProcess) -> float:
    data = await scrape(proc.addr["metrics"])
    return sum(v for (name, _), v in data.items() if name == "skan_bridge_up")


async def test_peer_restarted_while_traffic_flows_loses_nothing():
    port = free_port()
    server = PeerServer(port)
    server.delay = 0.005
    async with trio.open_nursery() as nursery:
        await server.start(nursery)
        with BrokerProcess(bridge_config(port)) as proc:
            await until(lambda: server.connections == 1)
            async with SkanClient.connect(*proc.skan) as pub:
                sent = [f"m{i}".encode() for i in range(300)]
                for i, payload in enumerate(sent):
                    await pub.send("bridged", payload)
                    await trio.sleep(0.002)
                    if i == 100:
                        server.stop()
                    if i == 200:
                        await server.start(nursery)
                await until(lambda: len(set(server.received)) >= len(sent))
            # Every acknowledged message arrived exactly as sent, in order of first arrival.
            assert first_seen([p for _, p in server.received]) == sent
            assert {t for t, _ in server.received} == {42}
            assert server.connections == 2
        nursery.cancel_scope.cancel()


async def test_messages_sent_while_peer_down_arrive_up_to_the_buffer_bound():
    port = free_port()
    server = PeerServer(port)
    async with trio.open_nursery() as nursery:
        await server.start(nursery)
        with BrokerProcess(bridge_config(port, buffer=20)) as proc:
            await until(lambda: server.connections == 1)
            server.stop()
            with trio.fail_after(10):
                while await bridge_up(proc):
                    await trio.sleep(0.02)
            async with SkanClient.connect(*proc.skan) as pub:
                sent = [f"down-{i}".encode() for i in range(50)]
                for payload in sent:
                    await pub.send("bridged", payload)
                await pub.barrier()
                await server.start(nursery)
                await until(lambda: len(server.received) >= 20)
                await trio.sleep(0.2)
            # The 30 oldest were dropped from the full buffer, counted and logged.
            assert [p for _, p in server.received] == sent[30:]
            data = await scrape(proc.addr["metrics"])
            overflow = [v for (name, _), v in data.items()
                        if name == "skan_bridge_overflow_messages_total"]
            assert overflow == [30.0]
        assert any("buffer full" in line for line in proc.stderr_lines)
        nursery.cancel_scope.cancel()


async def test_payload_mapping_inbound_routing_and_errors():
    port = free_port()
    server = PeerServer(port)
    server.refuse = lambda payload: payload == b"refuse-me"
    config = bridge_config(port, instance="inst/1", type=7) + "[broker]\nmax_frame = 65536\n"
    async with trio.open_nursery() as nursery:
        await server.start(nursery)
        with BrokerProcess(config) as proc:
            await until(lambda: server.connections == 1)
            async with (
                SkanClient.connect(*proc.skan) as pub,
                SkanClient.connect(*proc.skan) as sub,
            ):
                await sub.subscribe("bridged")
                # Outgoing: DATA msg -> its bytes; anything else -> the whole Skan message.
                await pub.send("bridged", b"\x00raw\xff", instance="inst/1")
                await pub.send("bridged", {"k": ["v"]}, instance="*", seq="55")
                await pub.send("bridged", "not for the bridge", instance="other")
                await pub.send("bridged", "refuse-me", instance="inst/1")
                await pub.send("bridged", "after refusal", instance="inst/1")
                await until(lambda: len(server.received) >= 3)
                assert server.received[0] == (7, b"\x00raw\xff")
                whole = decode(server.received[1][1])
                assert whole == {b"type": b"send", b"from": pub.lname.encode(), b"to": b"*",
                                 b"group": b"bridged", b"instance": b"*", b"seq": b"55",
                                 b"msg": {b"k": [b"v"]}}
                assert server.received[2] == (7, b"after refusal")
                # The sub saw all five from pub; drain them.
                for _ in range(5):
                    assert (await sub.receive()).sender == pub.lname

                # Incoming: DATA and DATA_ACK from the peer enter (group, instance).
                peer = server.peer
                assert peer is not None
                await peer.send(9, b"in-data")
                await peer.send_ack(10, b"in-ack", timeout=5)  # ACKed once routed
                a, b = await sub.receive(), await sub.receive()
                assert (a.msg, b.msg) == (b"in-data", b"in-ack")
                for m, t in ((a, b"9"), (b, b"10")):
                    assert (m.group, m.instance, m.to) == ("bridged", "inst/1", "*")
                    assert m.header[b"hsp-type"] == t
                assert a.sender == b.sender != pub.lname
                stats = await sub.stats()
                assert stats["connections"]["bridge-hsp"] == "1"
                with pytest.raises(HSPError) as info:
                    await peer.send_ack(1, b"x" * 70000, timeout=5)
                assert info.value.code == 3
                await peer.send(1, b"y" * 70000)  # too large, no answer possible: dropped
                await peer.send_ack(1, b"barrier", timeout=5)
                assert (await sub.receive()).msg == b"barrier"

            data = await scrape(proc.addr["metrics"])
            refused = data[("skan_messages_dropped_total",
                            frozenset({("protocol", "bridge-hsp"),
                                       ("reason", "refused-by-peer")}))]
            assert refused == 1.0
            too_large = data[("skan_messages_dropped_total",
                              frozenset({("protocol", "bridge-hsp"), ("reason", "too-large")}))]
            assert too_large == 1.0
        nursery.cancel_scope.cancel()


async def test_silent_peer_is_pinged_and_dropped_and_other_bridges_carry_on():
    silent_port, live_port, dead_port = free_port(), free_port(), free_port()
    accepted = []

    async def silent(stream: trio.SocketStream) -> None:
        accepted.append(stream)
        while await stream.receive_some(65536):
            pass  # reads everything, answers nothing (no PONG)

    server = PeerServer(live_port)
    config = (
        "[hsp]\nping_delay = 0.2\nping_timeout = 0.3\n"
        + bridge_config(silent_port, group="to-silent")
        + bridge_config(dead_port, group="to-dead")
        + bridge_config(live_port, group="to-live")
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_tcp, silent, silent_port)
        await server.start(nursery)
        with BrokerProcess(config) as proc:
            # The silent peer is dropped after ping_delay + ping_timeout and dialled again.
            await until(lambda: len(accepted) >= 2, timeout=10)
            async with SkanClient.connect(*proc.skan) as pub:
                for i in range(5):
                    await pub.send("to-live", f"live-{i}")
                    await pub.send("to-dead", f"dead-{i}")
                await until(lambda: len(server.received) == 5)
            assert [p for _, p in server.received] == [f"live-{i}".encode() for i in range(5)]
            data = await scrape(proc.addr["metrics"])
            up = {dict(labels)["address"]: v for (name, labels), v in data.items()
                  if name == "skan_bridge_up"}
            assert up[f"127.0.0.1:{live_port}"] == 1.0
            assert up[f"127.0.0.1:{dead_port}"] == 0.0
        nursery.cancel_scope.cancel()


async def test_bridge_over_tls(tmp_path):
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    port = free_port()
    server = PeerServer(port, ssl_context=server_ctx)
    config = bridge_config(port, extra=f'tls = true\ntls_ca = "{tmp_path / "ca.pem"}"')
    async with trio.open_nursery() as nursery:
        await server.start(nursery)
        with BrokerProcess(config) as proc:
            async with SkanClient.connect(*proc.skan) as pub:
                await pub.send("bridged", "secret")
                await until(lambda: server.received == [(42, b"secret")])
        nursery.cancel_scope.cancel()


async def test_bridge_refuses_an_endpoint_with_an_untrusted_certificate(tmp_path):
    ca, other = trustme.CA(), trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    other.cert_pem.write_to_path(str(tmp_path / "other.pem"))
    port = free_port()
    server = PeerServer(port, ssl_context=server_ctx)
    config = bridge_config(port, extra=f'tls = true\ntls_ca = "{tmp_path / "other.pem"}"')
    async with trio.open_nursery() as nursery:
        await server.start(nursery)
        with BrokerProcess(config) as proc:
            async with SkanClient.connect(*proc.skan) as pub:
                await pub.send("bridged", "secret")
            await trio.sleep(1.0)
            assert server.received == []
            assert await bridge_up(proc) == 0
            # A failed handshake is a failed connect: never counted as a connection.
            data = await scrape(proc.addr["metrics"])
            assert [v for (name, _), v in data.items()
                    if name == "skan_bridge_connects_total"] == [0.0]
        assert any("CERTIFICATE_VERIFY_FAILED" in line for line in proc.stderr_lines)
        nursery.cancel_scope.cancel()


async def test_endpoint_breaking_the_protocol_is_dropped_and_redialled():
    port = free_port()
    conns: list[int] = []
    records: list[bytes] = []

    async def endpoint(stream: trio.SocketStream) -> None:
        conns.append(1)
        peer = HSPPeer(stream, auto_ack=False)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer.run)
            item = await peer.receive()
            if len(conns) == 1:
                await peer.send_bytes(b"\x02\x00\x00\x99\x99")  # ACK for an id never sent
                await trio.sleep_forever()
            records.append(item.payload)
            await peer.ack(item.message_id)
            async for item in peer:
                records.append(item.payload)
                await peer.ack(item.message_id)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_tcp, endpoint, port)
        with BrokerProcess(bridge_config(port)) as proc:
            async with SkanClient.connect(*proc.skan) as pub:
                await pub.send("bridged", "first")
                await until(lambda: records == [b"first"])
                await pub.send("bridged", "second")
                await until(lambda: records == [b"first", b"second"])
            assert len(conns) == 2
        assert any("ACK for MessageID 39321" in line for line in proc.stderr_lines)
        nursery.cancel_scope.cancel()
