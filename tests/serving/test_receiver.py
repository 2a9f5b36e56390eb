"""The reader's Receiver (broker/serving/transport.py) on real TCP sockets.

After a short read it waits for readiness before reading (no doomed
``recvfrom``); it must still return every byte in order, report EOF as b"",
a reset as trio.BrokenResourceError and a socket closed by another task as
trio.ClosedResourceError, and stay cancellable while it waits.
"""

from __future__ import annotations

import socket
import struct

import pytest
import trio
import trio.testing

from broker.serving.transport import Receiver


async def _pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        accepted: list[trio.SocketStream] = []

        async def accept() -> None:
            accepted.append(await listener.accept())

        nursery.start_soon(accept)
        client = await trio.open_tcp_stream("127.0.0.1", port)
    await listener.aclose()
    return accepted[0], client


async def _after_a_short_read() -> tuple[trio.SocketStream, trio.SocketStream, Receiver]:
    """A connected pair whose server side has read one short message: its
    next receive waits for readiness before it reads."""
    server, client = await _pair()
    receiver = Receiver(server)
    await client.send_all(b"x")
    assert await receiver.receive(1024) == b"x"
    assert receiver.short
    return server, client, receiver


async def test_short_reads_then_later_data_arrive_whole_and_in_order() -> None:
    server, client = await _pair()
    receiver = Receiver(server)
    await client.send_all(b"first")
    assert await receiver.receive(1 << 16) == b"first"
    assert receiver.short  # the next receive waits before it reads

    async def later() -> None:
        await trio.sleep(0.05)
        await client.send_all(b"second")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(later)
        assert await receiver.receive(1 << 16) == b"second"
    await client.aclose()
    await server.aclose()


async def test_a_full_read_goes_through_receive_some_and_the_rest_follows() -> None:
    server, client = await _pair()
    receiver = Receiver(server)
    data = bytes(range(256)) * 64  # 16 KiB
    await client.send_all(data)
    with trio.fail_after(5):
        # The kernel holds 16 KiB: the first read fills the buffer, so the
        # next one reads at once (receive_some) rather than waiting first.
        got = await receiver.receive(4096)
        assert len(got) == 4096 and not receiver.short
        while len(got) < len(data):
            got += await receiver.receive(4096)
    assert got == data
    await client.aclose()
    await server.aclose()


async def test_eof_after_a_short_read_is_empty_bytes() -> None:
    server, client, receiver = await _after_a_short_read()
    await client.aclose()
    with trio.fail_after(5):
        assert await receiver.receive(1024) == b""
    await server.aclose()


async def test_a_reset_after_a_short_read_is_broken_resource() -> None:
    server, client, receiver = await _after_a_short_read()
    # SO_LINGER 0: close() sends RST instead of FIN.
    client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.socket.close()
    with trio.fail_after(5), pytest.raises(trio.BrokenResourceError):
        await receiver.receive(1024)
    await server.aclose()


async def test_closing_the_stream_wakes_a_waiting_receive_with_closed_resource() -> None:
    server, client, receiver = await _after_a_short_read()
    errors: list[BaseException] = []

    async def reader() -> None:
        try:
            await receiver.receive(1024)
        except trio.ClosedResourceError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        await server.aclose()
    assert len(errors) == 1
    with pytest.raises(trio.ClosedResourceError):
        await receiver.receive(1024)
    await client.aclose()


async def test_a_waiting_receive_is_cancellable() -> None:
    server, client, receiver = await _after_a_short_read()
    with trio.move_on_after(0.05) as scope:
        await receiver.receive(1024)
    assert scope.cancelled_caught
    await client.send_all(b"after")
    assert await receiver.receive(1024) == b"after"
    await client.aclose()
    await server.aclose()


async def test_a_stream_that_is_not_a_plain_socket_uses_receive_some() -> None:
    left, right = trio.testing.memory_stream_pair()
    receiver = Receiver(right)
    assert receiver.fd_of is None
    await left.send_all(b"abc")
    assert await receiver.receive(1024) == b"abc"
    assert receiver.short
    await left.send_all(b"def")
    assert await receiver.receive(1024) == b"def"
