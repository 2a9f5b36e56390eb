"""Eventer connection state machines (sans-IO) for the server and the client side.

Both wrap a :class:`wire.chatter.ChatterConnection`: bytes in, events out,
bytes to send from :meth:`data_to_send`.  Any protocol fault raises
:class:`~wire.errors.RemoteProtocolError`; the caller closes the connection.

Server: the first message must be MsgInitReq; it produces :class:`InitRequest`
and the caller answers with :meth:`ServerConnection.accept` or
:meth:`ServerConnection.refuse`.  EventsNotify goes out with last=False and
each one stays *unacked* until its MsgEventsAck: :attr:`credit` says how
many more may be sent now (flow control).

Client: MsgInitReq is queued on construction; MsgInitRes must be the first
message, in the InitReq's conversation.  Notifications sent with last=False
carry the conversation to :meth:`ClientConnection.ack`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from wire.chatter import sbs
from wire.chatter.connection import (
    CONVERSATION_TIMEOUT,
    ChatterConnection,
    Conversation,
    Envelope,
    Message,
)
from wire.errors import MalformedError, RemoteProtocolError
from wire.eventer import messages as m
from wire.limits import MAX_BATCH_ITEMS, MAX_ITEMS, ItemBudget

MODULE = "HatEventer."

_T = TypeVar("_T")

# Notifications sent without their ack: the server's default flow-control
# bound.  Each notify is one routing batch; 16 in flight keep a fast client
# busy across the ack round trip while bounding what a stalled client makes
# the broker hold in its socket buffers (further batches wait in the
# connection's bounded queue, where the slow-consumer policy applies).
DEFAULT_NOTIFY_CREDIT = 16


# ---- server-side events ------------------------------------------------------------


@attrs.frozen
class InitRequest:
    conv: Conversation
    request: m.InitReq


@attrs.frozen
class RegisterRequest:
    # None when the client asked for no response (MsgRegisterReq with last=True).
    conv: Conversation | None
    events: tuple[m.RegisterEvent, ...]


@attrs.frozen
class QueryRequest:
    conv: Conversation
    params: m.QueryParams


@attrs.frozen
class EventsAcked:
    conv: Conversation


# ---- client-side events ------------------------------------------------------------


@attrs.frozen
class InitResult:
    status: m.Status | None
    error: str | None


@attrs.frozen
class EventsNotified:
    events: tuple[m.Event, ...]
    # The conversation to acknowledge, or None when sent with last=True.
    ack_conv: Conversation | None


@attrs.frozen
class StatusChanged:
    status: m.Status


@attrs.frozen
class RegisterResult:
    conv: Conversation
    events: tuple[m.Event, ...] | None


@attrs.frozen
class QueryResponse:
    conv: Conversation
    result: m.QueryResult


@attrs.frozen
class ConversationExpired:
    """A conversation we opened got no answer in time (the Chatter timeout)."""

    conv: Conversation
    # "notify", "register", "query", "init" or "ping"; "peer" for a
    # conversation the peer opened or handed back and then abandoned (a peer
    # fault to count, see wire.chatter.connection.MAX_HELD_AGE).
    kind: str


def _decode(msg: Message, budget: ItemBudget | None = None) -> Any:
    try:
        return sbs.decode(msg.type, msg.data, budget)
    except MalformedError as exc:
        raise type(exc)(f"malformed {msg.type}: {exc}") from None


def _decode_as(msg: Message, limit: int, convert: Callable[[Any, ItemBudget], _T]) -> _T:
    """``convert(value, budget)`` of ``msg``'s SBS value, with one budget of
    ``limit`` items for the whole message (its events and every JSON payload);
    a fault the conversion finds names the message."""
    budget = ItemBudget(limit)
    value = _decode(msg, budget)
    try:
        return convert(value, budget)
    except MalformedError as exc:
        raise type(exc)(f"{msg.type.removeprefix(MODULE)}: {exc}") from None


def _needs_token(msg: Message) -> None:
    """A request the server must answer has to pass it the conversation's token."""
    if not msg.token:
        raise RemoteProtocolError(
            f"{msg.type} keeps the conversation token, so it cannot be answered"
        )


class _Side:
    def __init__(self, chatter: ChatterConnection) -> None:
        self.chatter = chatter
        # Conversations we opened and wait on, with what they were for.
        self._waiting: dict[Conversation, str] = {}

    def data_to_send(self) -> bytes:
        return self.chatter.data_to_send()

    def ping(self, now: float, timeout: float | None = None) -> None:
        self._waiting[self.chatter.ping(now, timeout)] = "ping"

    def next_deadline(self) -> float | None:
        return self.chatter.next_deadline()

    def check_timeouts(self, now: float) -> list[ConversationExpired]:
        expired = []
        for conv in self.chatter.check_timeouts(now):
            kind = self._waiting.pop(conv, "peer")
            self._expired(conv, kind)
            expired.append(ConversationExpired(conv, kind))
        return expired

    def _expired(self, conv: Conversation, kind: str) -> None:
        pass

    def _receive(self, data: bytes, now: float) -> list[Message]:
        msgs = self.chatter.receive_data(data, now)
        # Pongs end ping conversations inside the chatter layer.
        for conv in [c for c, k in self._waiting.items() if k == "ping"]:
            if not self.chatter.is_open(conv):
                del self._waiting[conv]
        return msgs


class ServerConnection(_Side):
    """The broker side of one Eventer connection."""

    def __init__(
        self,
        *,
        max_message: int = 8 * 1024 * 1024,
        timeout: float = CONVERSATION_TIMEOUT,
        notify_credit: int = DEFAULT_NOTIFY_CREDIT,
    ) -> None:
        super().__init__(ChatterConnection(max_message=max_message, timeout=timeout))
        self.state = "init"  # -> "open" | "refused"
        self.notify_credit = notify_credit
        self.unacked: set[Conversation] = set()

    @property
    def credit(self) -> int:
        return self.notify_credit - len(self.unacked)

    def receive_data(self, data: bytes, now: float = 0.0) -> list[Any]:
        events: list[Any] = []
        for msg in self._receive(data, now):
            events.append(self._handle(msg))
        return events

    def _handle(self, msg: Message) -> Any:
        if self.state == "init":
            if msg.type != "HatEventer.MsgInitReq":
                raise RemoteProtocolError(f"the first message must be MsgInitReq, not {msg.type}")
            if msg.last:
                raise RemoteProtocolError(
                    "MsgInitReq must leave its conversation open for the reply"
                )
            _needs_token(msg)
            return InitRequest(msg.conv, m.init_req_from_sbs(_decode(msg)))
        if self.state != "open":
            raise RemoteProtocolError(f"{msg.type} after a refused MsgInitReq")
        if msg.type == "HatEventer.MsgEventsAck":
            _decode(msg)
            self.unacked.discard(msg.conv)
            # The ack answers the notify, whether or not it ends the conversation.
            self._waiting.pop(msg.conv, None)
            return EventsAcked(msg.conv)
        if msg.type == "HatEventer.MsgRegisterReq":
            if not msg.first:
                raise RemoteProtocolError("MsgRegisterReq must open its own conversation")
            events = _decode_as(msg, MAX_ITEMS, m.register_events_from_sbs)
            if not msg.last:
                _needs_token(msg)
            return RegisterRequest(None if msg.last else msg.conv, events)
        if msg.type == "HatEventer.MsgQueryReq":
            if not msg.first or msg.last:
                raise RemoteProtocolError(
                    "MsgQueryReq must open a conversation and leave it open"
                )
            _needs_token(msg)
            return QueryRequest(msg.conv, m.query_params_from_sbs(_decode(msg)))
        raise RemoteProtocolError(f"a client may not send {msg.type}")

    def _expired(self, conv: Conversation, kind: str) -> None:
        self.unacked.discard(conv)

    # ---- answers ---------------------------------------------------------------

    def accept(self, conv: Conversation, status: m.Status) -> None:
        self.chatter.send_value(
            "HatEventer.MsgInitRes", ("success", m.status_to_sbs(status)), conv=conv
        )
        self.state = "open"

    def refuse(self, conv: Conversation, reason: str) -> None:
        self.chatter.send_value("HatEventer.MsgInitRes", ("error", reason), conv=conv)
        self.state = "refused"

    def notify_status(self, status: m.Status) -> None:
        self.chatter.send_value("HatEventer.MsgStatusNotify", m.status_to_sbs(status))

    def notify(self, encoded_events: list[bytes], now: float) -> Conversation:
        """One MsgEventsNotify (last=False) from already-encoded events; uses one credit."""
        conv = self.chatter.send(
            "HatEventer.MsgEventsNotify", sbs.encode_array(encoded_events),
            last=False, now=now,
        )
        self.unacked.add(conv)
        self._waiting[conv] = "notify"
        return conv

    def register_result(self, conv: Conversation, encoded_events: list[bytes] | None) -> None:
        self.chatter.send(
            "HatEventer.MsgRegisterRes", m.encode_register_result(encoded_events), conv=conv
        )

    def query_result(self, conv: Conversation, encoded_events: list[bytes],
                     more_follows: bool) -> None:
        self.chatter.send(
            "HatEventer.MsgQueryRes", m.encode_query_result(encoded_events, more_follows),
            conv=conv,
        )


class ClientConnection(_Side):
    """The client side of one Eventer connection; MsgInitReq is queued at once."""

    def __init__(
        self,
        request: m.InitReq,
        *,
        envelope: Envelope = Envelope.HATCHATTER,
        max_message: int = 8 * 1024 * 1024,
        timeout: float = CONVERSATION_TIMEOUT,
        now: float = 0.0,
    ) -> None:
        super().__init__(
            ChatterConnection(envelope=envelope, max_message=max_message, timeout=timeout)
        )
        self.state = "init"  # -> "open" | "refused"
        self.status: m.Status | None = None
        self._init_conv = self.chatter.send_value(
            "HatEventer.MsgInitReq", m.init_req_to_sbs(request), last=False, now=now
        )
        self._waiting[self._init_conv] = "init"

    def receive_data(self, data: bytes, now: float = 0.0) -> list[Any]:
        return [self._handle(msg) for msg in self._receive(data, now)]

    def _handle(self, msg: Message) -> Any:
        if self.state == "init":
            if msg.type != "HatEventer.MsgInitRes" or msg.conv != self._init_conv:
                raise RemoteProtocolError(
                    f"expected MsgInitRes in the MsgInitReq's conversation, got {msg.type}"
                )
            self._waiting.pop(msg.conv, None)
            kind, value = _decode(msg)
            if kind == "success":
                self.state = "open"
                self.status = m.status_from_sbs(value)
                return InitResult(self.status, None)
            self.state = "refused"
            return InitResult(None, value)
        if self.state != "open":
            raise RemoteProtocolError(f"{msg.type} after a refused MsgInitReq")
        if msg.type == "HatEventer.MsgEventsNotify":
            # A notify carries a whole routing batch of the server's: MAX_BATCH_ITEMS.
            events = _decode_as(msg, MAX_BATCH_ITEMS, m.events_from_sbs)
            return EventsNotified(events, None if msg.last else msg.conv)
        if msg.type == "HatEventer.MsgStatusNotify":
            self.status = m.status_from_sbs(_decode(msg))
            return StatusChanged(self.status)
        if msg.type == "HatEventer.MsgRegisterRes":
            self._waiting.pop(msg.conv, None)
            events = _decode_as(msg, MAX_BATCH_ITEMS, m.register_result_from_sbs)
            return RegisterResult(msg.conv, events)
        if msg.type == "HatEventer.MsgQueryRes":
            self._waiting.pop(msg.conv, None)
            result = _decode_as(msg, MAX_BATCH_ITEMS, m.query_result_from_sbs)
            return QueryResponse(msg.conv, result)
        raise RemoteProtocolError(f"a server may not send {msg.type}")

    def ack(self, conv: Conversation) -> None:
        if self.chatter.is_open(conv):
            self.chatter.send_value("HatEventer.MsgEventsAck", None, conv=conv)

    def register(self, events: list[m.RegisterEvent], *, with_response: bool,
                 now: float = 0.0) -> Conversation | None:
        conv = self.chatter.send_value(
            "HatEventer.MsgRegisterReq", [m.register_event_to_sbs(e) for e in events],
            last=not with_response, now=now,
        )
        if not with_response:
            return None
        self._waiting[conv] = "register"
        return conv

    def query(self, params: m.QueryParams, *, now: float = 0.0) -> Conversation:
        conv = self.chatter.send_value(
            "HatEventer.MsgQueryReq", m.query_params_to_sbs(params), last=False, now=now
        )
        self._waiting[conv] = "query"
        return conv
