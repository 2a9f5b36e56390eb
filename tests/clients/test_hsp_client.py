"""clients.hsp over real sockets, peer to peer: answers, refusals, limits, closed connections."""

from __future__ import annotations

import pytest
import trio

from clients.hsp import HSPClient, HSPClosed, HSPError, HSPPeer, serve_hsp
from wire.hsp import Data, DataAck

pytestmark = pytest.mark.trio


async def test_data_data_ack_ping_and_answers_both_ways():
    got = []

    async def handler(peer: HSPPeer) -> None:
        async for item in peer:
            got.append(item)
            if type(item) is DataAck:
                if item.payload == b"undef":
                    await peer.error(item.message_id)
                elif item.payload == b"refuse":
                    await peer.error(item.message_id, 9, "nope é")
                else:
                    await peer.ack(item.message_id)
            if item.payload == b"your turn":
                await peer.send(3, b"from server")
                await peer.send_ack(4, b"server asks", timeout=5)
                got.append("server got ACK")

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(lambda task_status: serve_hsp(
            handler, 0, auto_ack=False, task_status=task_status))
        port = listeners[0].socket.getsockname()[1]
        async with HSPClient.connect("127.0.0.1", port) as client:
            assert await client.ping(timeout=5) >= 0
            await client.send(1, b"plain")
            await client.send_ack(2, b"confirm me", timeout=5)
            with pytest.raises(HSPError) as undef:
                await client.send_ack(2, b"undef", timeout=5)
            assert undef.value.code is None and str(undef.value) == "ERROR_UNDEF"
            with pytest.raises(HSPError) as refused:
                await client.send_ack(2, b"refuse", timeout=5)
            assert (refused.value.code, refused.value.reason) == (9, "nope é")
            await client.send(1, b"your turn")
            first, second = await client.receive(), await client.receive()
            assert first == Data.make(3, b"from server")
            assert type(second) is DataAck and second.payload == b"server asks"
            with trio.fail_after(5):
                while "server got ACK" not in got:  # the client auto-ACKed it
                    await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert [(i.type, i.payload) for i in got[:5]] == [
        (1, b"plain"), (2, b"confirm me"), (2, b"undef"), (2, b"refuse"), (1, b"your turn")]


async def test_oversized_payloads_to_a_small_peer():
    async def handler(peer: HSPPeer) -> None:
        async for _ in peer:
            pass

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(lambda task_status: serve_hsp(
            handler, 0, max_payload=100, task_status=task_status))
        port = listeners[0].socket.getsockname()[1]
        async with HSPClient.connect("127.0.0.1", port) as client:
            with pytest.raises(HSPError) as info:
                await client.send_ack(1, b"x" * 101, timeout=5)
            assert info.value.code == 3 and "101 bytes is too large" in info.value.reason
            await client.send_ack(1, b"x" * 100, timeout=5)  # at the limit: fine
        nursery.cancel_scope.cancel()


async def test_pending_answers_fail_when_the_peer_goes_away():
    async def handler(peer: HSPPeer) -> None:
        await peer.receive()  # read one message, answer nothing, hang up
        await peer.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(lambda task_status: serve_hsp(
            handler, 0, auto_ack=False, task_status=task_status))
        port = listeners[0].socket.getsockname()[1]
        async with HSPClient.connect("127.0.0.1", port) as client:
            with pytest.raises(HSPClosed):
                await client.send_ack(1, b"never answered", timeout=5)
            with pytest.raises(HSPClosed):
                await client.ping(timeout=5)
        nursery.cancel_scope.cancel()


async def test_server_survives_a_peer_that_breaks_the_protocol():
    async def handler(peer: HSPPeer) -> None:
        async for _ in peer:
            pass

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(lambda task_status: serve_hsp(
            handler, 0, task_status=task_status))
        port = listeners[0].socket.getsockname()[1]
        bad = await trio.open_tcp_stream("127.0.0.1", port)
        await bad.send_all(b"\x03")  # PING
        assert await bad.receive_some(10) == b"\x04"
        await bad.send_all(b"\x09")  # an unknown command
        with trio.fail_after(5):
            assert await bad.receive_some(10) == b""  # closed by the server
        async with HSPClient.connect("127.0.0.1", port) as good:
            await good.ping(timeout=5)
        nursery.cancel_scope.cancel()


async def test_client_input_ends_when_the_server_breaks_the_protocol():
    async def handler(peer: HSPPeer) -> None:
        await peer.send(1, b"fine")
        await peer.send_bytes(b"\x09")
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(lambda task_status: serve_hsp(
            handler, 0, task_status=task_status))
        port = listeners[0].socket.getsockname()[1]
        async with HSPClient.connect("127.0.0.1", port) as client:
            with trio.fail_after(5):
                got = [item async for item in client]
            assert got == [Data.make(1, b"fine")]
            assert client.failure is not None and "0x09" in str(client.failure)
            with pytest.raises(HSPClosed):
                await client.send_ack(1, b"too late")
        nursery.cancel_scope.cancel()
