"""Trio Eventer client (hat-event compatible), shared by users and the broker's Eventer bridge.

    async with EventerClient.connect("127.0.0.1", 23012, "my/client",
                                     subscriptions=[("plant", "*")]) as client:
        events = await client.register([RegisterEvent(("plant", "pump1"),
                                                       payload=JsonPayload({"on": True}))])
        result = await client.query(QueryLatestParams([("plant", "*")]))
        async for batch in client:          # one tuple of events per notification
            ...

The protocol lives in the pure :class:`wire.eventer.ClientConnection`; this
module is its trio driver: a reader task, an idle pinger, a conversation
timer and a bounded inbox of notifications.  A notification sent with
last=False is acknowledged (MsgEventsAck) once it is in the inbox, so a
consumer that stops reading stops acknowledging: the server's flow control
then holds further notifications.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import trio

from toolkit.streams import Dialling, idle_pinger, tidy_reason
from wire.chatter import Conversation, Envelope
from wire.errors import ProtocolError
from wire.eventer import (
    ClientConnection,
    ConversationExpired,
    Event,
    EventsNotified,
    EventType,
    InitReq,
    InitResult,
    QueryParams,
    QueryResponse,
    QueryResult,
    RegisterEvent,
    RegisterResult,
    Status,
    StatusChanged,
)

DEFAULT_PORT = 23012
PROG = "skan-eventer"
CLI_CLIENT_NAME = "skan-eventer-cli"
RECV_SIZE = 256 * 1024


class EventerError(ConnectionError):
    """The connection failed or the server broke the protocol."""


class EventerInitError(EventerError):
    """The server refused MsgInitReq (the reason is the server's text)."""


class NotEventer(EventerError):
    """The server did not answer MsgInitReq like an Eventer server (another protocol?)."""


class EventerTimeout(EventerError):
    """No answer within the conversation timeout."""


class EventerClient(Dialling):
    """One Eventer connection.  Use :meth:`connect` (``client_name`` may follow
    host and port; keyword arguments: those of :meth:`over`), then ``async with``."""

    default_port = DEFAULT_PORT

    def __init__(self, stream: trio.abc.Stream, proto: ClientConnection, *,
                 inbox: int, ping_delay: float, ping_timeout: float) -> None:
        self._stream = stream
        self._proto = proto
        self._send_lock = trio.Lock()
        self._waiters: dict[Conversation, trio.MemorySendChannel] = {}
        # Notifications wait here until read; when full the reader stops, so
        # acks stop and the server's notify credit runs out (back-pressure).
        self._inbox_send, self._inbox = trio.open_memory_channel[tuple[Event, ...]](inbox)
        self._ping_delay = ping_delay
        self._ping_timeout = ping_timeout
        self._last_rx = trio.current_time()
        self._failure: EventerError | None = None
        self._closed = False
        self.status_changed = trio.Event()

    # ---- lifecycle ---------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def over(
        cls,
        stream: trio.abc.Stream,
        client_name: str = "skan/eventer-client",
        *,
        subscriptions: Iterable[EventType] = (),
        token: str | None = None,
        server_id: int | None = None,
        persisted: bool = False,
        envelope: Envelope = Envelope.HATCHATTER,
        ping_delay: float = 30.0,
        ping_timeout: float = 10.0,
        timeout: float = 5.0,
        max_message: int = 64 * 1024 * 1024,
        inbox: int = 64,
        target: str = "the server",
    ) -> AsyncIterator[EventerClient]:
        """Send MsgInitReq, wait for MsgInitRes (:class:`EventerInitError` if
        refused), then serve until the block exits; the stream is closed then.

        ``timeout`` is the Chatter conversation timeout (requests, MsgInitRes).
        ``target`` names the peer in errors (:class:`NotEventer` when it does
        not answer MsgInitReq like an Eventer server).
        """
        request = InitReq(client_name, token, tuple(tuple(s) for s in subscriptions),
                          server_id, persisted)
        proto = ClientConnection(request, envelope=envelope, max_message=max_message,
                                 timeout=timeout, now=trio.current_time())
        client = cls(stream, proto, inbox=inbox, ping_delay=ping_delay,
                     ping_timeout=ping_timeout)
        try:
            try:
                with trio.fail_after(timeout):
                    await client._handshake()
            except EventerInitError:
                raise
            except EventerError as exc:
                reason = tidy_reason(f"{target} is not an Eventer server: {exc}")
                raise NotEventer(reason) from None
            except trio.TooSlowError:
                raise EventerTimeout(f"{target} is not an Eventer server: no MsgInitRes within "
                                     f"{timeout:g}s") from None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client._reader)
                nursery.start_soon(client._timer)
                nursery.start_soon(client._pinger)
                yield client
                nursery.cancel_scope.cancel()
        finally:
            client._closed = True
            await trio.aclose_forcefully(stream)

    async def _handshake(self) -> None:
        await self._flush()
        while True:
            data = await self._receive()
            events = self._decode(data)
            if events:
                break
        result = events[0]
        assert isinstance(result, InitResult)
        if result.error is not None:
            raise EventerInitError(result.error)
        # Whatever followed MsgInitRes in the same bytes (notifications...).
        pending = events[1:]
        for ev in pending:
            await self._dispatch(ev)
        await self._flush()

    async def aclose(self) -> None:
        """Close the connection now (the ``connect`` block still has to exit)."""
        if not self._closed:
            self._closed = True
            self._fail(EventerError("closed by the client"))
            await trio.aclose_forcefully(self._stream)

    @property
    def status(self) -> Status | None:
        return self._proto.status

    @property
    def is_open(self) -> bool:
        return not self._closed and self._failure is None

    # ---- requests ------------------------------------------------------------------

    async def register(self, events: Iterable[RegisterEvent], *, with_response: bool = True
                       ) -> tuple[Event, ...] | None:
        """Register events; with a response, the created events (None: the server failed)."""
        self._check()
        conv = self._proto.register(list(events), with_response=with_response,
                                    now=trio.current_time())
        if conv is None:
            await self._flush()
            return None
        result = await self._request(conv)
        assert isinstance(result, RegisterResult)
        return result.events

    async def query(self, params: QueryParams) -> QueryResult:
        self._check()
        conv = self._proto.query(params, now=trio.current_time())
        result = await self._request(conv)
        assert isinstance(result, QueryResponse)
        return result.result

    async def receive(self) -> tuple[Event, ...]:
        """The events of the next notification (one Hat session)."""
        try:
            return await self._inbox.receive()
        except trio.EndOfChannel:
            raise self._failure or EventerError("connection closed") from None

    def __aiter__(self) -> EventerClient:
        return self

    async def __anext__(self) -> tuple[Event, ...]:
        try:
            return await self._inbox.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    # ---- internals ---------------------------------------------------------------------

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise EventerError("connection closed")

    async def _request(self, conv: Conversation) -> Any:
        send, receive = trio.open_memory_channel[Any](1)
        self._waiters[conv] = send
        await self._flush()
        result = await receive.receive()
        if isinstance(result, EventerError):
            raise result
        return result

    async def _flush(self) -> None:
        async with self._send_lock:
            data = self._proto.data_to_send()
            if data:
                try:
                    await self._stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self._fail(EventerError(f"connection lost: {exc!r}"))
                    raise self._failure from None  # type: ignore[misc]

    def _fail(self, exc: EventerError) -> None:
        if self._failure is None:
            self._failure = exc
        for waiter in self._waiters.values():
            waiter.send_nowait(exc)
        self._waiters.clear()
        self._inbox_send.close()

    async def _receive(self) -> bytes:
        try:
            data = await self._stream.receive_some(RECV_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise EventerError(f"connection lost: {exc!r}") from None
        if not data:
            raise EventerError("connection closed by the server")
        self._last_rx = trio.current_time()
        return data

    def _decode(self, data: bytes) -> list[Any]:
        try:
            return self._proto.receive_data(data, self._last_rx)
        except ProtocolError as exc:
            raise EventerError(f"protocol error: {exc}") from None

    async def _reader(self) -> None:
        try:
            while True:
                for ev in self._decode(await self._receive()):
                    await self._dispatch(ev)
                await self._flush()
        except EventerError as exc:
            self._fail(exc)

    async def _dispatch(self, ev: Any) -> None:
        if isinstance(ev, EventsNotified):
            await self._inbox_send.send(ev.events)
            if ev.ack_conv is not None:
                self._proto.ack(ev.ack_conv)
        elif isinstance(ev, RegisterResult | QueryResponse):
            waiter = self._waiters.pop(ev.conv, None)
            if waiter is not None:
                waiter.send_nowait(ev)
        elif isinstance(ev, StatusChanged):
            self.status_changed.set()
            self.status_changed = trio.Event()

    async def _timer(self) -> None:
        # Conversation deadlines: checked at least twice a second.
        while True:
            deadline = self._proto.next_deadline()
            now = trio.current_time()
            wait = 0.5 if deadline is None else min(deadline - now, 0.5)
            if wait > 0:
                await trio.sleep(wait)
            for expired in self._proto.check_timeouts(trio.current_time()):
                if not self._expired(expired):
                    # A dead connection: closing the stream ends the reader too.
                    await trio.aclose_forcefully(self._stream)
                    return

    def _expired(self, expired: ConversationExpired) -> bool:
        """Handle one expiry; False when the connection must be considered dead."""
        error = EventerTimeout(f"no answer to {expired.kind} in time")
        if expired.kind == "ping":
            self._fail(error)
            return False
        waiter = self._waiters.pop(expired.conv, None)
        if waiter is not None:
            waiter.send_nowait(error)
        return True

    async def _pinger(self) -> None:
        async def ping() -> None:
            self._proto.ping(trio.current_time(), timeout=self._ping_timeout)
            await self._flush()

        await idle_pinger(lambda: self._last_rx, ping, self._ping_delay, self._ping_timeout)
        # Nothing at all arrived since the ping: the connection is dead.
        self._fail(EventerTimeout("no answer to ping in time"))
        await trio.aclose_forcefully(self._stream)
