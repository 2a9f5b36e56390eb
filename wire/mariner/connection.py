"""The Mariner conversation rules for one connection, for either side (sans-IO).

    conn = MarinerConnection(SERVER, max_message=8 << 20)
    for msg in conn.receive_data(data):   # raises RemoteProtocolError
        ...
    sock.send(conn.send(Pong()))

Rules (specs/mariner.txt): the client's first message is ``init`` and it is
sent exactly once; only the server sends ``events``; both sides send
``ping`` and answer it with ``pong``.  After a :class:`ProtocolError` the
connection is dead and every further call raises it again.  Errors are
those of :mod:`wire.errors`.
"""

from __future__ import annotations

import enum

from wire.errors import LocalProtocolError, MalformedError, RemoteProtocolError
from wire.limits import MAX_BATCH_ITEMS, MAX_ITEMS
from wire.mariner.framing import FrameSplitter, encode_frame
from wire.mariner.messages import (
    Error,
    Events,
    Init,
    Message,
    decode_message,
    encode_message,
)


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


CLIENT = Role.CLIENT
SERVER = Role.SERVER


class MarinerConnection:
    def __init__(self, role: Role, max_message: int, max_items: int | None = None) -> None:
        self.role = role
        self._splitter = FrameSplitter(max_message)
        # JSON values per message.  A server receives only init, ping and
        # pong; a client receives ``events`` messages, each a whole routing
        # batch of the server's (wire/limits.py).
        if max_items is None:
            max_items = MAX_ITEMS if role is Role.SERVER else MAX_BATCH_ITEMS
        self.max_items = max_items
        # Server: has the client's init arrived?  Client: have we sent ours?
        self.initialised = False
        self.error: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received of a message that is not complete yet."""
        return self._splitter.buffered

    def receive_data(self, data: bytes) -> list[Message]:
        """Bytes from the peer -> the complete messages they finish, in order."""
        if self.error is not None:
            raise self.error
        try:
            bodies = self._splitter.receive_data(data)
        except RemoteProtocolError as exc:
            self.error = exc
            raise
        out: list[Message] = []
        for body in bodies:
            try:
                msg = decode_message(body, self.max_items)
            except MalformedError as exc:
                self.error = type(exc)(f"invalid Mariner message: {exc}")
                raise self.error from None
            self._check_received(msg)
            out.append(msg)
        return out

    def _check_received(self, msg: Message) -> None:
        if self.role is SERVER:
            if not self.initialised:
                if not isinstance(msg, Init):
                    raise self._fail(f"the first message must be init, not {_name(msg)}")
                self.initialised = True
                return
            if isinstance(msg, Init):
                raise self._fail("init may be sent only once")
            if isinstance(msg, Events):
                raise self._fail("Mariner clients only receive: a client may not send events")
            if isinstance(msg, Error):
                raise self._fail("unknown message type 'error' (expected ping, pong or init)")
        elif isinstance(msg, Init):
            raise self._fail("a server may not send init")

    def _fail(self, reason: str) -> RemoteProtocolError:
        self.error = RemoteProtocolError(reason)
        return self.error

    def send(self, msg: Message) -> bytes:
        """The framed bytes of one message this side sends."""
        return self.send_body(encode_message(msg), msg)

    def send_body(self, body: bytes, msg: Message | None = None) -> bytes:
        """Frame an already encoded body (``msg`` None means an events body)."""
        if self.role is CLIENT:
            if isinstance(msg, Init):
                if self.initialised:
                    raise LocalProtocolError("init may be sent only once")
                self.initialised = True
            elif not self.initialised:
                raise LocalProtocolError("a client must send init first")
            if msg is None or isinstance(msg, Events | Error):
                raise LocalProtocolError("a Mariner client may send only init, ping and pong")
        elif isinstance(msg, Init):
            raise LocalProtocolError("a server may not send init")
        return encode_frame(body)


def _name(msg: Message) -> str:
    return type(msg).__name__.lower()
