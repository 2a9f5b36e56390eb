"""Trio HSP peer (client or server side) and Skan-over-HSP client.

Plain HSP::

    async with HSPClient.connect("127.0.0.1", 9913) as peer:
        await peer.send(7, b"fire and forget")          # DATA
        await peer.send_ack(7, b"please confirm")       # DATA_ACK, waits for ACK
        rtt = await peer.ping()
        async for data in peer:                          # wire.hsp.Data / DataAck
            print(data.type, data.payload)

A server for tests and for the broker's HSP bridges to dial::

    async def handler(peer: HSPPeer) -> None:
        async for data in peer: ...
    listeners = await nursery.start(serve_hsp, handler, 0)

Skan over HSP: :class:`SkanOverHSP` is :class:`clients.skan.SkanClient`
running over a stream adapter that carries each Skan frame as DATA Type 1,
so every SkanClient method (subscribe, send, request, stats, iteration)
works unchanged; :meth:`SkanOverHSP.send_acked` uses DATA_ACK instead.
"""

from __future__ import annotations

import contextlib
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Self

import trio

from clients.skan import SkanClient
from toolkit.streams import AnswersHTTP, Dialling, ReceiveIterator
from wire import hsp
from wire.skan import FrameSplitter, encode

DEFAULT_PORT = 9913


class HSPError(Exception):
    """The peer answered a DATA_ACK with ERROR (``code`` set) or ERROR_UNDEF (``code`` None)."""

    def __init__(self, code: int | None, payload: bytes = b"") -> None:
        self.code = code
        self.payload = bytes(payload)
        self.reason = self.payload.decode("utf-8", errors="replace")
        super().__init__(f"ERROR {code}: {self.reason}" if code is not None else "ERROR_UNDEF")


class HSPClosed(Exception):
    """The connection ended before the answer arrived."""


Received = hsp.Data | hsp.DataAck


class HSPPeer(ReceiveIterator):
    """One HSP connection, either side.

    Sending never needs a background task; receiving does: either run
    :meth:`run` in a nursery (it fills the inbox that :meth:`receive` and
    ``async for`` read), or pull with :meth:`read_data`.  PINGs are answered
    and ACK/ERROR/PONG are matched to the waiting sender on the way.  With
    ``auto_ack`` a received DATA_ACK is ACKed as soon as it is read;
    without, answer it with :meth:`ack` / :meth:`error`.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        max_payload: int = hsp.DEFAULT_MAX_PAYLOAD,
        auto_ack: bool = True,
        inbox: int = 10_000,
        target: str = "the peer",
    ) -> None:
        self.stream = stream
        # Who the peer is, in HSPClosed's reasons.
        self.target = target
        self.conn = hsp.HSPConnection(max_payload)
        # Nothing received yet (an HTTP answer is recognised on the first bytes).
        self._first = True
        self.auto_ack = auto_ack
        self._send_lock = trio.Lock()
        self._waiters: dict[int, trio.MemorySendChannel] = {}
        # One [event, answered] per PING awaiting its PONG, in order.
        self._pings: deque[list[Any]] = deque()
        # Received data waits here until read; when full, run() stops
        # reading and TCP pushes back on the sender.
        self._inbox_send, self._inbox = trio.open_memory_channel[Received](inbox)
        # Oversized DATA that was skipped (DATA_ACKs get ERROR 3 instead).
        self.oversized_dropped = 0
        self.closed = False
        # Why the peer's input was refused (it broke HSP), if it was.
        self.failure: hsp.ProtocolError | None = None

    # ---- sending ------------------------------------------------------------

    async def _write(self, event: hsp.Event) -> None:
        data = self.conn.send(event)
        async with self._send_lock:
            await self.stream.send_all(data)

    async def _request(self, event: hsp.Event, waiter: Any) -> None:
        """Send a command that expects an answer; HSPClosed if the connection is gone."""
        if self.closed:
            raise HSPClosed(f"the connection to {self.target} is closed")
        try:
            await self._write(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise HSPClosed(f"the connection to {self.target} is closed") from exc

    async def send_bytes(self, data: bytes) -> None:
        """Raw bytes, bypassing the state machine (tests of malformed input)."""
        async with self._send_lock:
            await self.stream.send_all(data)

    async def send(self, type: int, payload: bytes) -> None:
        """DATA: fire and forget."""
        await self._write(hsp.Data.make(type, payload))

    async def send_ack(self, type: int, payload: bytes, *, timeout: float | None = None) -> None:
        """DATA_ACK, then wait for ACK; raises :class:`HSPError` on ERROR/ERROR_UNDEF."""
        mid = self.conn.next_message_id()
        send, recv = trio.open_memory_channel[HSPError | None](1)
        self._waiters[mid] = send
        try:
            await self._request(hsp.DataAck.make(mid, type, payload), send)
            with trio.fail_after(timeout) if timeout else contextlib.nullcontext():
                try:
                    result = await recv.receive()
                except trio.EndOfChannel:
                    raise HSPClosed(f"the connection to {self.target} closed before "
                                    "the answer") from None
        finally:
            self._waiters.pop(mid, None)
        if result is not None:
            raise result

    async def ping(self, *, timeout: float | None = None) -> float:
        """PING and wait for PONG; returns the round-trip time in seconds."""
        waiter = [trio.Event(), False]
        self._pings.append(waiter)
        start = trio.current_time()
        await self._request(hsp.Ping(), waiter)
        with trio.fail_after(timeout) if timeout else contextlib.nullcontext():
            await waiter[0].wait()
        if not waiter[1]:
            raise HSPClosed(f"the connection to {self.target} closed before PONG")
        return trio.current_time() - start

    async def ack(self, message_id: int) -> None:
        await self._write(hsp.Ack(message_id))

    async def error(self, message_id: int, code: int | None = None, reason: str = "") -> None:
        """ERROR with ``code`` and a UTF-8 reason, or ERROR_UNDEF when ``code`` is None."""
        if code is None:
            await self._write(hsp.ErrorUndef(message_id))
        else:
            await self._write(hsp.Error(message_id, code, reason.encode()))

    # ---- receiving ----------------------------------------------------------

    async def read_data(self, max_bytes: int = 65536) -> list[Received] | None:
        """Read one chunk; handle control commands; return its DATA/DATA_ACKs (None at EOF)."""
        try:
            chunk = await self.stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            chunk = b""
        if not chunk:
            self._close()
            return None
        first, self._first = self._first, False
        try:
            events = self.conn.receive_data(chunk)
        except hsp.ProtocolError as exc:
            self._close()
            if first and chunk.startswith(b"HTTP/"):
                raise AnswersHTTP("HSP", DEFAULT_PORT) from exc
            raise
        out: list[Received] = []
        for ev in events:
            t = type(ev)
            if t is hsp.Data:
                out.append(ev)
            elif t is hsp.DataAck:
                out.append(ev)
                if self.auto_ack:
                    await self._write(hsp.Ack(ev.message_id))
            elif t is hsp.Ack:
                self._resolve(ev.message_id, None)
            elif t is hsp.Error:
                self._resolve(ev.message_id, HSPError(ev.type, ev.payload))
            elif t is hsp.ErrorUndef:
                self._resolve(ev.message_id, HSPError(None))
            elif t is hsp.Ping:
                await self._write(hsp.Pong())
            elif t is hsp.Pong:
                if self._pings:
                    waiter = self._pings.popleft()
                    waiter[1] = True
                    waiter[0].set()
            elif t is hsp.Oversized:
                if ev.command == hsp.DATA_ACK:
                    await self._write(hsp.Error(ev.message_id, hsp.TOO_LARGE,
                                            f"payload of {ev.length} bytes is too large".encode()))
                elif ev.message_id is not None:
                    self._resolve(ev.message_id, HSPError(ev.type, b"(oversized error payload)"))
                else:
                    self.oversized_dropped += 1
        return out

    def _resolve(self, mid: int, result: HSPError | None) -> None:
        waiter = self._waiters.pop(mid, None)
        if waiter is not None:
            waiter.send_nowait(result)

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for waiter in self._waiters.values():
            waiter.close()
        self._waiters.clear()
        while self._pings:
            self._pings.popleft()[0].set()

    async def run(self) -> None:
        """Receive until EOF, filling the inbox.

        A peer that breaks HSP ends the connection like EOF does; the reason
        is kept in ``failure``.
        """
        try:
            while True:
                try:
                    items = await self.read_data()
                except hsp.ProtocolError as exc:
                    self.failure = exc
                    return
                if items is None:
                    return
                for item in items:
                    await self._inbox_send.send(item)
        finally:
            self._close()
            self._inbox_send.close()

    async def receive(self) -> Received:
        return await self._inbox.receive()

    async def aclose(self) -> None:
        self._close()
        await trio.aclose_forcefully(self.stream)

    @classmethod
    @asynccontextmanager
    async def over(cls, stream: trio.abc.Stream, **kwargs: Any) -> AsyncIterator[Self]:
        """Run a peer over ``stream`` with its reader (:meth:`run`) going until
        the block exits; the stream is closed then.  Keyword arguments: those
        of the class."""
        peer = cls(stream, **kwargs)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peer.run)
                yield peer
                nursery.cancel_scope.cancel()
        finally:
            await peer.aclose()


class HSPClient(HSPPeer, Dialling):
    """An :class:`HSPPeer` that dials out.  Use :meth:`connect` (keyword
    arguments: those of :class:`HSPPeer`)."""

    default_port = DEFAULT_PORT


async def serve_hsp(
    handler: Callable[[HSPPeer], Awaitable[None]],
    port: int = 0,
    host: str = "127.0.0.1",
    *,
    auto_ack: bool = True,
    max_payload: int = hsp.DEFAULT_MAX_PAYLOAD,
    ssl_context: ssl.SSLContext | None = None,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept HSP connections; ``handler(peer)`` runs with the peer's reader already going.

    With ``ssl_context`` (a server context) every connection is TLS.
    """

    async def one(stream: trio.abc.Stream) -> None:
        if ssl_context is not None:
            stream = trio.SSLStream(stream, ssl_context, server_side=True)
        try:
            async with HSPPeer.over(stream, auto_ack=auto_ack, max_payload=max_payload) as peer:
                await handler(peer)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, HSPClosed):
            pass  # a peer gone (or a failed TLS handshake) ends only its own connection

    await trio.serve_tcp(one, port, host=host, task_status=task_status)


# ---- Skan over HSP --------------------------------------------------------------


class SkanFramesOverHSP(trio.abc.Stream):
    """A stream of Skan frames carried over HSP as DATA Type 1.

    What is written is split into Skan frames, each sent as DATA Type 1
    (HSP's Length field is the frame's length prefix, so the frame goes out
    unchanged after 3 bytes).  What is read is the Type 1 payloads, framed
    again.  PINGs are answered while reading; other Types are ignored.
    """

    def __init__(self, stream: trio.abc.Stream, max_frame: int = hsp.DEFAULT_MAX_PAYLOAD) -> None:
        self.peer = HSPPeer(stream, max_payload=max_frame)
        self._out_splitter = FrameSplitter(max_frame)
        self._rx = bytearray()
        self._prefix = hsp.data_prefix(hsp.SKAN_TYPE)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        frames = self._out_splitter.receive_data(bytes(data))
        if frames:
            prefix = self._prefix
            await self.peer.send_bytes(b"".join(prefix + f for f in frames))

    async def wait_send_all_might_not_block(self) -> None:
        await self.peer.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while not self._rx:
            items = await self.peer.read_data()
            if items is None:
                return b""
            for item in items:
                if item.type == hsp.SKAN_TYPE:
                    self._rx += item.framed
        n = len(self._rx) if max_bytes is None else min(max_bytes, len(self._rx))
        data = bytes(self._rx[:n])
        del self._rx[:n]
        return data

    async def send_eof(self) -> None:
        raise trio.ClosedResourceError("HSP has no half-close")

    async def aclose(self) -> None:
        await self.peer.aclose()


class SkanOverHSP(SkanClient):
    """:class:`clients.skan.SkanClient` speaking to the broker's HSP listener.

    ``connect`` defaults to the HSP port.  Messages go as DATA (errors come
    back as Skan error frames, exactly as on native Skan); with
    ``acked=True`` every message goes as DATA_ACK and each send waits for
    the broker's ACK, raising :class:`HSPError` on refusal.
    """

    default_port = DEFAULT_PORT

    def __init__(self, stream: trio.abc.Stream, *, acked: bool = False,
                 max_frame: int = 8 << 20, **kwargs: Any) -> None:
        self.hsp_stream = SkanFramesOverHSP(stream, max_frame)
        super().__init__(self.hsp_stream, max_frame=max_frame, **kwargs)
        self.acked = acked

    async def send_raw(self, message: dict[str, Any]) -> None:
        if self.acked:
            await self.send_acked(message)
        else:
            await super().send_raw(message)

    async def send_acked(self, message: dict[str, Any], *, timeout: float | None = None) -> None:
        """Send one Skan message as DATA_ACK Type 1 and wait for the broker's ACK."""
        await self.hsp_stream.peer.send_ack(hsp.SKAN_TYPE, encode(message), timeout=timeout)


__all__ = [
    "DEFAULT_PORT",
    "HSPClient",
    "HSPClosed",
    "HSPError",
    "HSPPeer",
    "Received",
    "SkanFramesOverHSP",
    "SkanOverHSP",
    "serve_hsp",
]
