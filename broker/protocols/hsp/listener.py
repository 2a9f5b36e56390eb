"""The HSP listener ("Skan over HSP", BROKER-SPEC section 2).

DATA and DATA_ACK with Type 1 carry one complete Skan message (magic
included, no length prefix) and go through the very same
:class:`~broker.core.skan_handler.SkanHandler` as native Skan connections.
HSP's framing puts the payload's 4-byte big-endian length right before it,
which is exactly a Skan frame, so the decoder hands the session a slice of
the received bytes and the router forwards it unchanged.

Answers to DATA_ACK (see docs/hsp.md for the full mapping):

- routed / applied       -> ACK, then any reply (getlname, stats) as DATA Type 1
- malformed Skan message -> ERROR 1; the connection stays open
- semantic fault         -> ERROR 2 (the Skan error text); unknown Type -> ERROR 2
- payload over the limit -> ERROR 3 (the payload is skipped, never buffered)
- anything before getlname, or refused credentials -> ERROR 4 and the connection is closed
- a send or subscribe outside the user's permissions -> ERROR 4; the connection stays open

A plain DATA has no way to be answered: its faults are reported the way
native Skan reports them, as a Skan error frame ``{"type": "error", ...}``
delivered as DATA Type 1 (with the offending ``seq``).  DATA with an unknown
Type is dropped and counted.  An unknown command byte (or an ACK for a
MessageID we never used) closes the connection.

Broker-side logic is synchronous (``on_bytes``); the trio part is the shared
:func:`broker.serving.transport.serve_protocol` (keep-alive included).  The
HSP opening is the first message: the handshake timeout ends once any
complete HSP message has arrived.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import trio

from broker.core.queue import QueuedEndpoint
from broker.core.reasons import CloseReason, DropReason, ErrorKind, Protocol
from broker.core.refusals import Refused
from broker.core.router import Routed, Router
from broker.core.skan_handler import InputSlices, SkanHandler, error_frame
from broker.serving.context import BrokerContext
from broker.serving.transport import serve_protocol
from wire.hsp import (
    DATA_ACK,
    MALFORMED,
    NOT_AUTHORISED,
    REJECTED,
    SKAN_TYPE,
    TOO_LARGE,
    Ack,
    Data,
    DataAck,
    Error,
    Event,
    HSPConnection,
    Oversized,
    Ping,
    Pong,
    ProtocolError,
    data_prefix,
)
from wire.skan import SkanError, encode_frame, looks_like_skan

log = logging.getLogger(__name__)

# Metric label (skan_protocol_errors_total reason) per ERROR code.
ERROR_REASONS = {MALFORMED: ErrorKind.MALFORMED, REJECTED: ErrorKind.REJECTED,
                 TOO_LARGE: ErrorKind.TOO_LARGE, NOT_AUTHORISED: ErrorKind.NOT_AUTHORISED}

# Every delivery is DATA Type 1: these 3 bytes, then the Skan frame as routed
# (its 4-byte length prefix is HSP's Length field).
DELIVERY_PREFIX = data_prefix(SKAN_TYPE)

# Said (as a Skan error frame) to a native Skan client on the HSP port.
WRONG_PORT = ("this is the broker's HSP port: native Skan clients use the Skan port (9912 "
              "by default); to speak HSP here use `skan --protocol hsp`")


def _skan_not_hsp(data: bytes) -> bool:
    """A connection's first bytes are a Skan frame (a length under 16 MiB, then
    the "Skan" magic), not HSP.  Read as HSP they would be a DATA whose Length
    ends in "Ska" (over 5 MiB) and whose payload begins with "n": for Type 1
    that payload would have to be a Skan frame of over 1.8 GB, and other
    Types are dropped anyway, so no HSP client's opening looks like this."""
    return looks_like_skan(data)

# What a connection over max_connections receives before it is closed: the
# Skan error frame as DATA Type 1, as every fault of a plain DATA is reported.
TOO_MANY_CONNECTIONS = DELIVERY_PREFIX + error_frame("too many connections")


class HSPEndpoint(QueuedEndpoint):
    """An HSP client of the listener: a Skan session carried in DATA/DATA_ACK Type 1."""

    protocol = Protocol.HSP

    def __init__(self, router: Router, queue_limit: int, policy: str, max_payload: int) -> None:
        super().__init__(router, queue_limit, policy)
        self.hsp = HSPConnection(max_payload)
        self.session = SkanHandler(router, self)
        self.counters = router.counters
        # While a DATA_ACK is being handled, its replies wait here so the ACK goes first.
        self._held: list[bytes] | None = None
        # Commands received but not yet handled (bounded work per slice).
        self.input: InputSlices[Event] = InputSlices()

    # ---- outgoing ---------------------------------------------------------

    def encode_delivery(self, frame: bytes, routed: Routed) -> bytes:
        return DELIVERY_PREFIX + frame

    def encode_control(self, message: dict[str, Any]) -> bytes:
        return DELIVERY_PREFIX + encode_frame(message)

    def send_control(self, message: dict[str, Any]) -> None:
        data = self.encode_control(message)
        if self._held is not None:
            self._held.append(data)
        else:
            self.enqueue(data)

    def send_ping(self) -> None:
        self.enqueue(self.hsp.send(Ping()))

    def partial_bytes(self) -> int:
        return self.hsp.buffered

    def _answer_error(self, mid: int, code: int, reason: str,
                      kind: ErrorKind | None = None) -> None:
        self.counters.protocol_error(self.protocol, kind or ERROR_REASONS[code])
        self.enqueue(self.hsp.send(Error(mid, code, reason.encode())))

    def _data_error(self, label: ErrorKind, rejected: Refused) -> None:
        """A fault in a plain DATA: the Skan error frame, delivered as DATA Type 1."""
        self.counters.protocol_error(self.protocol, label)
        self.enqueue(self.encode_control(rejected.error_message()))

    # ---- incoming ---------------------------------------------------------

    def on_bytes(self, data: bytes) -> bool:
        """Handle received bytes, at most one slice of commands; True when commands
        are left for another slice (the transport calls again with b"")."""
        inp = self.input
        if data and not self.opened and not self.hsp.buffered and _skan_not_hsp(data):
            # A Skan client dialled the HSP port (its getlname frame read as
            # HSP would announce a payload of megabytes and wait for it):
            # tell it in Skan, at once, and close.
            self.counters.protocol_error(self.protocol, ErrorKind.PROTOCOL_VIOLATION)
            self.enqueue(encode_frame({"type": "error", "error": WRONG_PORT}))
            self.closing = CloseReason.PROTOCOL_ERROR
            return False
        if data:
            try:
                inp.add(self.hsp.receive_data(data))
            except ProtocolError as exc:
                inp.clear()
                self._apply(exc.events)
                if self.closing is None:
                    self._data_error(ErrorKind.PROTOCOL_VIOLATION,
                                     Refused(f"HSP protocol error: {exc.reason}"))
                    self.closing = CloseReason.PROTOCOL_ERROR
                return False
        for events in inp.take(_event_size):
            self._apply(events)
            if self.closing is not None:
                break
        if self.closing is not None:
            inp.clear()
            return False
        return inp.pending

    def _apply(self, events: Iterable[Event]) -> None:
        handle = self.session.handle
        for ev in events:
            # The HSP opening is the first complete message.
            self.opened = True
            t = type(ev)
            if t is Data:
                if ev.type != SKAN_TYPE:
                    # A peer fault (protocol error) whose message is dropped (counted too).
                    self.counters.protocol_error(self.protocol, ErrorKind.UNKNOWN_TYPE)
                    self.counters.drop(self.protocol, DropReason.UNKNOWN_TYPE)
                    continue
                try:
                    handle(ev.framed)
                except SkanError as exc:
                    self._data_error(ErrorKind.MALFORMED,
                                     Refused(f"malformed Skan message: {exc}"))
                except Refused as rejected:
                    if rejected.close:
                        self._data_error(ErrorKind.NOT_AUTHORISED, rejected)
                        self.closing = CloseReason.PROTOCOL_ERROR
                        return
                    self._data_error(rejected.kind, rejected)
            elif t is DataAck:
                if not self._data_ack(ev, handle):
                    return
            elif t is Ping:
                self.enqueue(self.hsp.send(Pong()))
            elif t is Oversized:
                reason = (f"payload of {ev.length} bytes exceeds the limit of "
                          f"{self.hsp.max_payload} bytes")
                if ev.command == DATA_ACK:
                    self._answer_error(ev.message_id, TOO_LARGE, reason)
                else:
                    self._data_error(ErrorKind.TOO_LARGE, Refused(reason))
            # Pong: any received byte already counts as liveness (last_rx).
            # Ack/Error/ErrorUndef cannot get here: the broker never sends
            # DATA_ACK to a listener client, so the state machine refuses them.

    def _data_ack(self, ev: DataAck, handle: Any) -> bool:
        """Handle one DATA_ACK; False when the connection must close."""
        mid = ev.message_id
        if ev.type != SKAN_TYPE:
            self._answer_error(
                mid, REJECTED,
                f"unknown Type {ev.type}: this listener carries Skan messages as Type {SKAN_TYPE}",
            )
            return True
        self._held = held = []
        rejected: Refused | None = None
        try:
            handle(ev.framed)
        except SkanError as exc:
            self._answer_error(mid, MALFORMED, f"malformed Skan message: {exc}")
            return True
        except Refused as exc:
            rejected = exc
        finally:
            self._held = None
        if rejected is None:
            self.enqueue(self.hsp.send(Ack(mid)))
            for data in held:
                self.enqueue(data)
            return True
        if rejected.close:
            self._answer_error(mid, NOT_AUTHORISED, rejected.reason)
            self.closing = CloseReason.PROTOCOL_ERROR
            return False
        if rejected.denied:
            self._answer_error(mid, NOT_AUTHORISED, rejected.reason)
        else:
            self._answer_error(mid, REJECTED, rejected.reason, rejected.kind)
        return True


def _event_size(ev: Event) -> int:
    """Bytes an HSP command carries (its Skan message), for the slice budget."""
    framed = getattr(ev, "framed", None)
    return 0 if framed is None else len(framed)


async def serve_hsp(ctx: BrokerContext, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    def new_endpoint() -> HSPEndpoint:
        b = ctx.config.broker  # as reloaded (SIGHUP): limits apply to new connections
        # The payload of Type 1 is a Skan message, so Skan's frame limit bounds it.
        return HSPEndpoint(ctx.router, b.queue_limit, b.slow_consumer, b.max_frame)

    section = ctx.config.hsp
    await serve_protocol(ctx, Protocol.HSP, section, new_endpoint,
                         keep_alive=(section.ping_delay, section.ping_timeout),
                         refusal=TOO_MANY_CONNECTIONS, task_status=task_status)
