"""The Chatter connection state machine (sans-IO, either side of a connection).

Bytes in, :class:`Message` events out; messages to send go into an outgoing
buffer read with :meth:`ChatterConnection.data_to_send`.  What it keeps:

- message ids: ours count up from 1; the peer's must strictly increase;
- conversations ``(first, owner)`` with the token and last flags of the
  Chatter text: we may only send in a conversation while we hold its token,
  and so may the peer; ``last`` ends it;
- the envelope: ``Hat.Msg`` (Chatter text; Data carries an Optional module)
  or ``HatChatter.Msg`` (hat-drivers, used by hat-event 0.9.x; the type is
  qualified).  A server detects it from the first message and answers in
  kind; a client chooses it;
- the Ping service of that envelope: pings are answered at once, pongs end
  our ping conversation;
- conversation timeouts: a conversation in which the peer holds the token
  (we passed it, or the peer kept it) expires ``timeout`` seconds later
  unless the peer continues it (:meth:`check_timeouts`; the caller decides
  what expiry means);
- bounded peer state: a conversation the peer left with us (it passed us the
  token and we have not used it) expires after :data:`MAX_HELD_AGE`, and
  more than :data:`MAX_OPEN_CONVERSATIONS` such conversations (or
  conversations the peer opened and keeps) when new bytes arrive is a
  :class:`~wire.errors.LimitError`: a peer cannot make the table grow.

Message types are qualified SBS names (``"HatEventer.MsgInitReq"``) in both
envelopes, and message data stays SBS-encoded bytes (decode it with
:func:`wire.chatter.sbs.decode`).  Time is whatever monotonic clock the
caller passes in.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from wire.chatter import sbs
from wire.chatter.framing import FrameSplitter, encode_frame
from wire.errors import LimitError, LocalProtocolError, MalformedError, RemoteProtocolError

# The Chatter text's default conversation timeout.
CONVERSATION_TIMEOUT = 5.0

# Conversations the peer opened or handed back to us that may be open at once
# when the next bytes arrive.  Each costs a few hundred bytes; a client that
# opens conversations and never ends them (MsgEventsAck with last=false)
# added 195 MiB per million before this bound.  Requests are answered as
# they are read, so a well-behaved peer has none open between reads; the
# bound leaves room for a client pipelining many requests or a server's
# unacknowledged notifications.
MAX_OPEN_CONVERSATIONS = 1024

# Seconds we may hold the token of a conversation the peer handed us before it
# expires (as the peer's fault: the protocol expected nothing more of us).
# Every request is answered at once, so only abandoned conversations get old.
MAX_HELD_AGE = 60.0


class Envelope(enum.Enum):
    HAT = "Hat.Msg"
    HATCHATTER = "HatChatter.Msg"


PING = {Envelope.HAT: "HatPing.MsgPing", Envelope.HATCHATTER: "HatChatter.Ping"}
PONG = {Envelope.HAT: "HatPing.MsgPong", Envelope.HATCHATTER: "HatChatter.Pong"}
_PING_TYPES = frozenset(PING.values())
_PONG_TYPES = frozenset(PONG.values())


@attrs.frozen
class Conversation:
    """A conversation, seen from this side: ``owner`` is True when we started it."""

    owner: bool
    first: int


@attrs.frozen
class Message:
    """One application message received from the peer."""

    conv: Conversation
    type: str
    data: bytes
    # True for the message that opened the conversation.
    first: bool
    last: bool
    token: bool


@attrs.define
class _ConvState:
    # Whether we may send in it now.
    ours: bool
    # Monotonic time by which the peer must answer, or None.
    deadline: float | None = None
    # When the peer handed us the token (we have not used it since), or None.
    held_since: float | None = None
    # Whether the peer opened it.
    peer_opened: bool = False


class ChatterConnection:
    """One Chatter connection's protocol state."""

    def __init__(
        self,
        *,
        envelope: Envelope | None = None,
        max_message: int = 8 * 1024 * 1024,
        timeout: float = CONVERSATION_TIMEOUT,
    ) -> None:
        # None until the peer's first message tells (server side).
        self.envelope = envelope
        self.timeout = timeout
        self._splitter = FrameSplitter(max_message)
        self._out: list[bytes] = []
        self._next_id = 1
        self._peer_id = 0
        self._convs: dict[Conversation, _ConvState] = {}
        # Messages in conversations that were already over (e.g. answers
        # arriving after a timeout): dropped and counted.
        self.stray = 0
        self.pings_answered = 0

    # ---- output ------------------------------------------------------------

    def data_to_send(self) -> bytes:
        out, self._out = self._out, []
        return b"".join(out)

    @property
    def pending_output(self) -> int:
        return sum(map(len, self._out))

    def send(
        self,
        msg_type: str,
        data: bytes,
        *,
        conv: Conversation | None = None,
        last: bool = True,
        token: bool = True,
        now: float = 0.0,
        timeout: float | None = None,
    ) -> Conversation:
        """Queue one message; a new conversation unless ``conv`` is given.

        When the message passes the token without ending the conversation,
        the peer has ``timeout`` (default: the connection's) seconds to answer.
        """
        if self.envelope is None:
            raise LocalProtocolError("the envelope is not known before the peer's first message")
        msg_id = self._next_id
        self._next_id += 1
        if conv is None:
            conv = Conversation(owner=True, first=msg_id)
            state = _ConvState(ours=True)
        else:
            state = self._convs.get(conv)
            if state is None:
                raise LocalProtocolError(f"conversation {conv} is over")
            if not state.ours:
                raise LocalProtocolError(f"the peer holds the token of conversation {conv}")
            state.held_since = None
        self._out.append(self._encode(msg_id, conv, msg_type, data, last, token))
        if last:
            self._convs.pop(conv, None)
        else:
            state.ours = not token
            state.deadline = None if state.ours else now + (
                self.timeout if timeout is None else timeout
            )
            self._convs[conv] = state
        return conv

    def send_value(self, msg_type: str, value: Any, **kwargs: Any) -> Conversation:
        """:meth:`send` with the data encoded from a hat-sbs value."""
        return self.send(msg_type, sbs.encode(msg_type, value), **kwargs)

    def ping(self, now: float, timeout: float | None = None) -> Conversation:
        """Open a ping conversation; it expires unless the pong comes in time."""
        assert self.envelope is not None
        return self.send(PING[self.envelope], b"", last=False, now=now, timeout=timeout)

    def _encode(
        self, msg_id: int, conv: Conversation, msg_type: str, data: bytes, last: bool,
        token: bool,
    ) -> bytes:
        if self.envelope is Envelope.HATCHATTER:
            payload: dict[str, Any] = {"type": msg_type, "data": data}
        else:
            module, _, name = msg_type.partition(".")
            payload = {"module": ("value", module), "type": name, "data": data}
        body = sbs.encode(self.envelope.value, {
            "id": msg_id, "first": conv.first, "owner": conv.owner, "token": token,
            "last": last, "data": payload,
        })
        return encode_frame(body)

    # ---- input -------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes received of a message that is not complete yet."""
        return self._splitter.buffered

    def receive_data(self, data: bytes, now: float = 0.0) -> list[Message]:
        """Feed received bytes; returns the application messages they complete.

        Raises :class:`~wire.errors.RemoteProtocolError` when the peer broke the
        protocol (:class:`~wire.errors.FramingError` when the stream is lost,
        :class:`~wire.errors.LimitError` when it keeps too many conversations open).
        """
        if len(self._convs) > MAX_OPEN_CONVERSATIONS:
            kept = sum(1 for st in self._convs.values()
                       if st.held_since is not None or (st.peer_opened and not st.ours))
            if kept > MAX_OPEN_CONVERSATIONS:
                raise LimitError(
                    f"the peer keeps {kept} conversations open "
                    f"(the limit is {MAX_OPEN_CONVERSATIONS})"
                )
        bodies = self._splitter.receive_data(data)
        messages = []
        for body in bodies:
            msg = self._receive(body, now)
            if msg is not None:
                messages.append(msg)
        return messages

    def _decode_envelope(self, body: bytes) -> tuple[dict[str, Any], str]:
        if self.envelope is not None:
            try:
                raw = sbs.decode(self.envelope.value, body)
            except MalformedError as exc:
                raise MalformedError(f"malformed {self.envelope.value}: {exc}") from None
            return raw, self._type_of(self.envelope, raw)
        # Detect: the first message must decode as exactly one envelope and
        # name a known type in it (e.g. "HatEventer.MsgInitReq" is a 21-byte
        # String in HatChatter.Msg but an invalid Choice index in Hat.Msg).
        for envelope in (Envelope.HATCHATTER, Envelope.HAT):
            try:
                raw = sbs.decode(envelope.value, body)
            except MalformedError:
                continue
            msg_type = self._type_of(envelope, raw)
            if sbs.known(msg_type):
                self.envelope = envelope
                return raw, msg_type
        raise MalformedError(
            "the first message is neither a Hat.Msg nor a HatChatter.Msg of a known type"
        )

    @staticmethod
    def _type_of(envelope: Envelope, raw: dict[str, Any]) -> str:
        data = raw["data"]
        if envelope is Envelope.HATCHATTER:
            return data["type"]
        module = data["module"]
        if module[0] != "value":
            return data["type"]
        return f"{module[1]}.{data['type']}"

    def _receive(self, body: bytes, now: float) -> Message | None:
        raw, msg_type = self._decode_envelope(body)
        if not sbs.known(msg_type) or msg_type.startswith(("Hat.", "HatChatter.Msg",
                                                            "HatChatter.Data")):
            raise MalformedError(f"unknown message type {msg_type!r}")
        msg_id = raw["id"]
        if msg_id <= self._peer_id:
            raise RemoteProtocolError(
                f"message id {msg_id} does not increase (previous {self._peer_id})"
            )
        self._peer_id = msg_id
        owner_is_peer = raw["owner"]
        conv = Conversation(owner=not owner_is_peer, first=raw["first"])
        last = raw["last"]
        token = raw["token"]
        opening = owner_is_peer and raw["first"] == msg_id
        if opening:
            if conv in self._convs:
                raise RemoteProtocolError(f"conversation {raw['first']} opened twice")
            if not last:
                self._convs[conv] = _ConvState(
                    ours=token,
                    deadline=None if token else now + self.timeout,
                    held_since=now if token else None,
                    peer_opened=True,
                )
        else:
            state = self._convs.get(conv)
            if state is None:
                # Over already (ended, or expired on our side): not an error
                # of the peer's, which cannot know about our timeout.
                self.stray += 1
                return None
            if state.ours:
                raise RemoteProtocolError(
                    f"message {msg_id} in conversation {conv.first} while we hold its token"
                )
            if last:
                del self._convs[conv]
            else:
                state.ours = token
                state.deadline = None if token else now + self.timeout
                state.held_since = now if token else None
        data = bytes(raw["data"]["data"])
        if msg_type in _PING_TYPES:
            if last:
                return None
            if not token:
                raise RemoteProtocolError(
                    f"ping {msg_id} keeps the conversation token, so it cannot be answered"
                )
            self.pings_answered += 1
            assert self.envelope is not None
            self.send(PONG[self.envelope], b"", conv=conv, last=True)
            return None
        if msg_type in _PONG_TYPES:
            return None
        return Message(conv, msg_type, data, opening, last, token)

    # ---- timeouts ----------------------------------------------------------

    @staticmethod
    def _due(state: _ConvState) -> float | None:
        if state.held_since is not None:
            return state.held_since + MAX_HELD_AGE
        return state.deadline

    def next_deadline(self) -> float | None:
        due = self._due
        deadlines = [d for d in map(due, self._convs.values()) if d is not None]
        return min(deadlines) if deadlines else None

    def check_timeouts(self, now: float) -> list[Conversation]:
        """Conversations whose answer is overdue, or that the peer left with us
        for longer than MAX_HELD_AGE; they are over from now on."""
        due = self._due
        expired = [c for c, s in self._convs.items() if (d := due(s)) is not None and d <= now]
        for conv in expired:
            del self._convs[conv]
        return expired

    def is_open(self, conv: Conversation) -> bool:
        return conv in self._convs

    @property
    def open_conversations(self) -> int:
        return len(self._convs)
