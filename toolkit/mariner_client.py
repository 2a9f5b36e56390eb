"""Trio client for Mariner (hat-event's JSON event feed), used by people and by the broker's bridge.

    async with MarinerClient.connect("127.0.0.1", 23014, client_id="me",
                                     subscriptions=[("sensors", "*")]) as client:
        async for batch in client:          # one Hat session per batch
            for event in batch:
                print(event.id, event.type, event.payload)

The client sends ``init`` on connect, answers pings, pings a silent server
after ``ping_delay`` seconds and gives up after ``ping_timeout`` more.  The
conversation rules and the codec are the sans-IO :mod:`wire.mariner`.
Iteration ends when the server closes the connection; it raises
:class:`MarinerClosed` when the connection ended on an error (protocol
violation, ping timeout, or the broker's ``error`` message, e.g. a wrong
token).  ``last_event_id`` is the id of the newest event handed out, for
resuming with ``connect(..., last_event_id=...)``.

Command line: ``skan-mariner --port 23014 'sensors/*'`` prints every event
as a JSON line.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import trio

from toolkit.streams import Dialling, ReceiveIterator, idle_pinger
from wire import mariner as mw

DEFAULT_PORT = 23014
PROG = "skan-mariner"
CLI_CLIENT_ID = "skan-mariner-cli"
# Bytes asked of the socket per receive.
RECV_SIZE = 65536


class MarinerClosed(ConnectionError):
    """The connection ended on an error; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MarinerClient(ReceiveIterator, Dialling):
    """One connection to a Mariner server.  Use :meth:`connect` (keyword
    arguments: those of :meth:`over`), then ``async with``."""

    default_port = DEFAULT_PORT

    def __init__(self, stream: trio.abc.Stream, *, ping_delay: float, ping_timeout: float,
                 max_message: int = 8 << 20, inbox: int = 1000,
                 target: str = "the server") -> None:
        self._stream = stream
        # Who the server is, in the reasons the connection ends with.
        self._target = target
        self._conn = mw.MarinerConnection(mw.CLIENT, max_message)
        self._ping_delay = ping_delay
        self._ping_timeout = ping_timeout
        self._send_lock = trio.Lock()
        # Event batches wait here until iterated; when full, the reader stops
        # reading, TCP pushes back and the server's slow-consumer policy decides.
        self._inbox_send, self._inbox = trio.open_memory_channel[tuple[mw.Event, ...]](inbox)
        self._last_rx = trio.current_time()
        # One event per ping sent, set by its pong (pongs come back in order).
        self._pongs: deque[trio.Event] = deque()
        self.last_event_id: mw.EventId | None = None
        # Why the connection ended (None while open, "" after a clean close by the server).
        self.close_reason: str | None = None
        self._failed = False

    @classmethod
    @asynccontextmanager
    async def over(
        cls,
        stream: trio.abc.Stream,
        *,
        client_id: str,
        client_token: str | None = None,
        last_event_id: mw.EventId | None = None,
        subscriptions: Iterable[Iterable[str]] = (),
        ping_delay: float = 30.0,
        ping_timeout: float = 10.0,
        **kwargs: Any,
    ) -> AsyncIterator[MarinerClient]:
        """Send init, then run the reader and pinger until the block exits; the
        stream is closed then.  Other keyword arguments: those of the class."""
        try:
            client = cls(stream, ping_delay=ping_delay, ping_timeout=ping_timeout, **kwargs)
            client.last_event_id = last_event_id
            await client._send(mw.Init(
                client_id=client_id,
                client_token=client_token,
                last_event_id=last_event_id,
                subscriptions=tuple(tuple(s) for s in subscriptions),
            ))
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(client._reader)
                    nursery.start_soon(client._pinger)
                    yield client
                    nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                # The background tasks handle their own errors: an exception here
                # comes from the caller's block; give it back unwrapped.
                if len(group.exceptions) == 1:
                    raise group.exceptions[0] from None
                raise
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    async def _send(self, msg: mw.Message) -> None:
        data = self._conn.send(msg)
        async with self._send_lock:
            await self._stream.send_all(data)

    async def ping(self) -> trio.Event:
        """Send a ping; the returned event is set when its pong arrives (or the connection ends)."""
        pong = trio.Event()
        self._pongs.append(pong)
        await self._send(mw.Ping())
        return pong

    async def barrier(self) -> None:
        """Return once the server has handled everything sent before (ping, then its pong)."""
        await (await self.ping()).wait()
        if self.close_reason is not None:
            raise MarinerClosed(self.close_reason or "closed by the server")

    # ---- receiving -------------------------------------------------------

    async def receive(self) -> tuple[mw.Event, ...]:
        """The next batch of events (one Hat session); raises at the end of the connection."""
        try:
            batch = await self._inbox.receive()
        except trio.EndOfChannel:
            if self._failed:
                raise MarinerClosed(self.close_reason or "closed") from None
            raise
        if batch:
            self.last_event_id = batch[-1].id
        return batch

    def _end(self, reason: str, failed: bool) -> None:
        if self.close_reason is None:
            self.close_reason = reason
            self._failed = failed
        self._inbox_send.close()
        while self._pongs:
            self._pongs.popleft().set()

    async def _reader(self) -> None:
        try:
            while True:
                data = await self._stream.receive_some(RECV_SIZE)
                if not data:
                    self._end("", failed=False)
                    return
                self._last_rx = trio.current_time()
                for msg in self._conn.receive_data(data):
                    if isinstance(msg, mw.Events):
                        await self._inbox_send.send(msg.events)
                    elif isinstance(msg, mw.Ping):
                        await self._send(mw.Pong())
                    elif isinstance(msg, mw.Pong):
                        if self._pongs:
                            self._pongs.popleft().set()
                    elif isinstance(msg, mw.Error):
                        self._end(f"server error: {msg.error}", failed=True)
                        return
        except mw.ProtocolError as exc:
            self._end(f"protocol error: {exc}", failed=True)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._end(f"connection lost: {exc or type(exc).__name__}", failed=True)
        finally:
            self._end("closed", failed=False)

    async def _pinger(self) -> None:
        try:
            await idle_pinger(lambda: self._last_rx, self.ping, self._ping_delay,
                              self._ping_timeout)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        self._end(f"ping timeout: {self._target} did not answer", failed=True)
        await trio.aclose_forcefully(self._stream)
