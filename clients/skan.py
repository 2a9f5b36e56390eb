"""Trio client for the native Skan protocol.

    async with SkanClient.connect("127.0.0.1", 9912) as client:
        await client.subscribe("chat")
        await client.send("chat", {"text": "hello"})
        # a Hat JSON payload with its types, for Eventer/Mariner consumers:
        await client.send_event_json("plant", {"value": 1234, "on": True}, instance="pump1")
        async for message in client:
            print(message.sender, message.msg, message.event_json)

The client sends getlname on connect, keeps a background reader that sorts
incoming frames into replies to pending requests (matched by ``seq``),
control replies (lname, stats), error frames and ordinary messages.
"""

from __future__ import annotations

import itertools
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from toolkit.streams import (
    CONNECT_TIMEOUT,
    AnswersHTTP,
    Dialling,
    ReceiveIterator,
    tidy_reason,
)
from wire.errors import ProtocolError, RemoteProtocolError
from wire.skan import FrameSplitter, decode, encode_frame
from wire.skan.eventjson import PAYLOAD_JSON_TAG, loads_exact, skan_view

DEFAULT_PORT = 9912
CLOSED = "the server closed the connection"


class SkanClosed(Exception):
    """The connection ended (``reason`` says how) before the answer arrived."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NotSkanBroker(SkanClosed):
    """The server did not answer getlname like a Skan broker (another protocol, or none)."""


# How a broker's listener for another protocol begins the error it sends a
# Skan client that dialled it (broker/protocols/hsp/listener.py WRONG_PORT).
WRONG_PORT = "this is the broker's "


class SkanClientError(Exception):
    """The broker answered with an error frame."""

    def __init__(self, reason: str, seq: bytes | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.seq = seq


def _text(value: Any) -> str | None:
    return value.decode(errors="replace") if isinstance(value, bytes) else None


@attrs.frozen
class Message:
    """A routed message as a client receives it (DATA values are bytes)."""

    group: str
    instance: str
    to: str
    sender: str
    seq: str | None
    msg: Any
    repl: str | None
    header: dict[bytes, Any] = attrs.field(repr=False)

    @property
    def text(self) -> str | None:
        """``msg`` as text when it is UTF-8 DATA, else None (a HASH, a LIST, NULL, binary)."""
        if isinstance(self.msg, bytes):
            try:
                return self.msg.decode()
            except UnicodeDecodeError:
                return None
        return None

    @property
    def value(self) -> Any:
        """``msg`` with str tags and UTF-8 DATA as str (binary DATA stays bytes).

        Skan has no number type: a number sent as 1 arrives as "1".
        """
        return strkeys(self.msg)

    @property
    def event_json_text(self) -> str | None:
        """The ``payload-json`` tag's text (the exact Hat JSON payload), or None."""
        raw = self.header.get(PAYLOAD_JSON_TAG)
        return raw.decode(errors="replace") if isinstance(raw, bytes) else None

    @property
    def event_json(self) -> Any:
        """The exact Hat JSON payload of the ``payload-json`` tag, parsed (with its
        numbers, booleans and nulls); None without the tag (or if it is not JSON:
        the broker refuses such sends, so only a foreign peer could send one)."""
        raw = self.header.get(PAYLOAD_JSON_TAG)
        if not isinstance(raw, bytes):
            return None
        try:
            return loads_exact(raw)
        except ProtocolError:
            return None

    @classmethod
    def from_header(cls, header: dict[bytes, Any]) -> Message:
        repl = header.get(b"repl", header.get(b"reply"))
        return cls(
            group=_text(header.get(b"group")) or "",
            instance=_text(header.get(b"instance")) or "",
            to=_text(header.get(b"to")) or "",
            sender=_text(header.get(b"from")) or "",
            seq=_text(header.get(b"seq")),
            msg=header.get(b"msg"),
            repl=_text(repl),
            header=header,
        )


def event_json_send(value: Any) -> tuple[Any, dict[str, bytes]]:
    """(``msg``, extra tags) of a send carrying the JSON value ``value`` exactly.

    ``msg`` is the Skan view (what Skan subscribers read: numbers and
    booleans as decimal DATA); the ``payload-json`` tag holds the JSON text
    when that view alone would lose a type, so Hat consumers (Eventer,
    Mariner) get ``value`` itself.  Raises
    :class:`wire.skan.jsonvalue.JsonValueError` for what is not JSON.
    """
    msg, exact = skan_view(value, "message")
    return msg, ({} if exact is None else {PAYLOAD_JSON_TAG.decode(): exact})


def strkeys(value: Any) -> Any:
    """Decoded Skan value with str tags and str DATA (for display and JSON)."""
    if isinstance(value, dict):
        return {k.decode(errors="replace"): strkeys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strkeys(v) for v in value]
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value
    return value


class SkanClient(ReceiveIterator, Dialling):
    """One connection to a broker.  Use :meth:`connect` (keyword arguments:
    those of :meth:`over`), then ``async with``."""

    default_port = DEFAULT_PORT

    def __init__(self, stream: trio.abc.Stream, *, max_frame: int = 8 << 20,
                 inbox: int = 10_000) -> None:
        self._stream = stream
        self._splitter = FrameSplitter(max_frame)
        self._seq = itertools.count(1)
        self._send_lock = trio.Lock()
        self._lname_waiters: deque[trio.MemorySendChannel] = deque()
        self._stats_waiters: deque[trio.MemorySendChannel] = deque()
        self._requests: dict[bytes, trio.MemorySendChannel] = {}
        # Messages wait here until iterated; when it is full the reader stops
        # reading, TCP pushes back and the broker's slow-consumer policy decides.
        self._inbox_send, self._inbox = trio.open_memory_channel[Message](inbox)
        self.errors: list[SkanClientError] = []
        # Why the connection ended: None while open, "" when the broker closed it
        # cleanly, else what went wrong (the broker's bytes were not Skan...).
        self.close_reason: str | None = None
        # The transport error that ended the connection (a reset, a refused TLS handshake).
        self._broken: trio.BrokenResourceError | None = None
        self.lname = ""
        self._nursery: trio.Nursery | None = None
        self._closed = False

    # ---- lifecycle -------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def over(
        cls,
        stream: trio.abc.Stream,
        *,
        target: str = "the server",
        timeout: float = CONNECT_TIMEOUT,
        token: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[SkanClient]:
        """Ask for the lname, and run the reader until the block exits; the
        stream is closed then.  Other keyword arguments: those of the class.

        Raises :class:`NotSkanBroker` (naming ``target``) when the server does
        not answer getlname like a Skan broker within ``timeout`` seconds (a
        port speaking HTTP, HSP or Chatter is reported instead of hanging).
        ``token`` is sent in the getlname (the broker's ``[[users]]``); a
        client certificate goes in :meth:`connect`'s ``ssl_context`` (see
        :func:`ssl_client_context`).  A refused credential raises
        :class:`SkanClientError` ("not authorised: ...").
        """
        client = cls(stream, **kwargs)
        refused: Exception | None = None
        try:
            async with trio.open_nursery() as nursery:
                client._nursery = nursery
                nursery.start_soon(client._reader)
                try:
                    client.lname = await client._handshake(target, timeout, token)
                except (SkanClientError, NotSkanBroker, trio.BrokenResourceError) as exc:
                    refused = exc
                else:
                    yield client
                nursery.cancel_scope.cancel()
            if refused is not None:
                raise refused
        finally:
            client._closed = True
            await trio.aclose_forcefully(stream)

    async def _handshake(self, target: str, timeout: float, token: str | None) -> str:
        with trio.move_on_after(timeout):
            try:
                return await self.getlname(token)
            except SkanClosed as exc:
                if self.errors:
                    reason = self.errors[-1].reason
                    if reason.startswith(WRONG_PORT):
                        # The broker's HSP listener saw a Skan frame and said so.
                        raise NotSkanBroker(f"{target} is {reason.removeprefix('this is ')}"
                                            ) from None
                    # A Skan broker that refused us (a credential): its reason.
                    raise SkanClientError(reason) from None
                if self._broken is not None:
                    # Reset or TLS refused (a client certificate...): not a protocol question.
                    raise self._broken from self._broken.__cause__
                what = exc.reason
                if what == CLOSED:
                    what = "it closed the connection without answering getlname"
                raise NotSkanBroker(f"{target} is not a Skan broker: {what}") from None
        raise NotSkanBroker(
            f"{target} is not a Skan broker: no answer to getlname within {timeout:g}s")

    async def aclose(self) -> None:
        """Close the connection now (the ``connect`` block still has to exit)."""
        if not self._closed:
            self._closed = True
            await trio.aclose_forcefully(self._stream)

    # ---- sending ---------------------------------------------------------

    async def send_raw(self, message: dict[str, Any]) -> None:
        data = encode_frame(message)
        async with self._send_lock:
            await self._stream.send_all(data)

    async def _control(self, message: dict[str, Any], waiters: deque) -> Any:
        send, recv = trio.open_memory_channel(1)
        waiters.append(send)
        await self.send_raw(message)
        try:
            return await recv.receive()
        except trio.EndOfChannel:
            raise SkanClosed(self.close_reason or CLOSED) from None

    async def getlname(self, token: str | None = None) -> str:
        message = {"type": "getlname"}
        if token is not None:
            message["token"] = token
        reply = await self._control(message, self._lname_waiters)
        return reply.decode()

    async def barrier(self) -> None:
        """Return once the broker has handled everything sent before."""
        await self.getlname()

    async def stats(self) -> dict[str, Any]:
        return strkeys(await self._control({"type": "stats"}, self._stats_waiters))

    async def subscribe(self, group: str, instance: str = "*", subtype: str = "normal",
                        *, wait: bool = True) -> None:
        await self.send_raw(
            {"type": "subscribe", "group": group, "instance": instance, "subtype": subtype}
        )
        if wait:
            await self.barrier()

    async def unsubscribe(self, group: str, instance: str = "*", *, wait: bool = True) -> None:
        await self.send_raw({"type": "unsubscribe", "group": group, "instance": instance})
        if wait:
            await self.barrier()

    def next_seq(self) -> str:
        return str(next(self._seq))

    async def send(self, group: str, msg: Any = None, *, instance: str = "*", to: str = "*",
                   seq: str | None = None, repl: str | None = None,
                   tags: Mapping[str, Any] | None = None) -> str:
        """Send ``msg``; ``tags`` are extra routing tags (``payload-json``, ...)."""
        seq = seq or self.next_seq()
        message: dict[str, Any] = {
            "type": "send", "from": self.lname, "to": to, "group": group,
            "instance": instance, "seq": seq,
        }
        if repl is not None:
            message["repl"] = repl
        if tags:
            message.update(tags)
        message["msg"] = msg
        await self.send_raw(message)
        return seq

    async def send_event_json(self, group: str, value: Any, *, instance: str = "*",
                              to: str = "*", seq: str | None = None) -> str:
        """Send a Hat JSON payload with its types (see :func:`event_json_send`)."""
        msg, tags = event_json_send(value)
        return await self.send(group, msg, instance=instance, to=to, seq=seq, tags=tags)

    async def request(self, group: str, msg: Any = None, *, to: str = "*", instance: str = "*",
                      timeout: float = 5.0) -> Message:
        """Send and wait for the first reply whose ``repl`` equals our ``seq``."""
        seq = self.next_seq()
        send, recv = trio.open_memory_channel(1)
        self._requests[seq.encode()] = send
        try:
            await self.send(group, msg, instance=instance, to=to, seq=seq)
            with trio.fail_after(timeout):
                try:
                    result = await recv.receive()
                except trio.EndOfChannel:
                    raise SkanClosed(self.close_reason or CLOSED) from None
        finally:
            self._requests.pop(seq.encode(), None)
        if isinstance(result, SkanClientError):
            raise result
        return result

    async def reply(self, request: Message, msg: Any = None) -> str:
        """Answer ``request``: directed to its sender, ``repl`` = its seq."""
        return await self.send(request.group, msg, instance=request.instance,
                               to=request.sender, repl=request.seq or "")

    # ---- receiving -------------------------------------------------------

    async def receive(self) -> Message:
        return await self._inbox.receive()

    async def _reader(self) -> None:
        head = b""
        try:
            while True:
                data = await self._stream.receive_some(65536)
                if not data:
                    self._ended("")
                    break
                if len(head) < 5:
                    head += data[:5]
                for frame in self._splitter.receive_data(data):
                    await self._dispatch(decode(frame[4:]))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if isinstance(exc, trio.BrokenResourceError):
                self._broken = exc
            self._ended("" if self._closed else f"lost the connection ({exc})")
        except RemoteProtocolError as exc:
            # The bytes are not Skan (or, over HSP, not HSP): the stream
            # cannot be trusted any more.
            if isinstance(exc, AnswersHTTP):  # over HSP: the adapter recognised it
                self._ended(str(exc))
            elif head.startswith(b"HTTP/"):
                # "HTTP" read as a length is a frame of 1213486160 bytes: say what it is.
                self._ended(str(AnswersHTTP("Skan", DEFAULT_PORT)))
            else:
                self._ended(tidy_reason(f"its answer is not Skan ({exc})"))
            await trio.aclose_forcefully(self._stream)
        finally:
            self._inbox_send.close()
            for waiters in (self._lname_waiters, self._stats_waiters):
                for w in waiters:
                    w.close()
            for w in self._requests.values():
                w.close()

    def _ended(self, reason: str) -> None:
        if self.close_reason is None:
            self.close_reason = reason

    async def _dispatch(self, header: dict[bytes, Any]) -> None:
        mtype = header.get(b"type")
        if mtype == b"send":
            repl = header.get(b"repl", header.get(b"reply"))
            waiter = self._requests.pop(repl, None) if repl is not None else None
            if waiter is not None:
                waiter.send_nowait(Message.from_header(header))
            else:
                await self._inbox_send.send(Message.from_header(header))
        elif b"lname" in header and self._lname_waiters:
            self._lname_waiters.popleft().send_nowait(header[b"lname"])
        elif b"stats" in header and self._stats_waiters:
            self._stats_waiters.popleft().send_nowait(header[b"stats"])
        elif mtype == b"error":
            error = SkanClientError(_text(header.get(b"error")) or "", header.get(b"seq"))
            waiter = self._requests.pop(error.seq, None) if error.seq else None
            if waiter is not None:
                waiter.send_nowait(error)
            else:
                self.errors.append(error)


def ssl_client_context(ca: str | None = None, insecure: bool = False,
                       cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """TLS for a client: verify the broker with ``ca`` (system CAs by default)
    and present the client certificate ``cert`` (with its ``key``) if given."""
    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


__all__ = [
    "Message",
    "NotSkanBroker",
    "SkanClient",
    "SkanClientError",
    "SkanClosed",
    "event_json_send",
    "ssl_client_context",
    "strkeys",
]
