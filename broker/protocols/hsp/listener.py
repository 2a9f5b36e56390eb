"""The HSP listener ("Skan over HSP", BROKER-SPEC section 2).

DATA and DATA_ACK with Type 1 carry one complete Skan message (magic
included, no length prefix) and go through the very same
:class:`~broker.core.session.SkanSession` as native Skan connections.
HSP's framing puts the payload's 4-byte big-endian length right before it,
which is exactly a Skan frame, so the decoder hands the session a slice of
the received bytes and the router forwards it unchanged.

Answers to DATA_ACK (see docs/hsp.md for the full mapping):

- routed / applied       -> ACK, then any reply (getlname, stats) as DATA Type 1
- malformed Skan message -> ERROR 1; the connection stays open
- semantic fault         -> ERROR 2 (the Skan error text); unknown Type -> ERROR 2
- payload over the limit -> ERROR 3 (the payload is skipped, never buffered)
- anything before getlname -> ERROR 4 and the connection is closed

A plain DATA has no way to be answered: its faults are reported the way
native Skan reports them, as a Skan error frame ``{"type": "error", ...}``
delivered as DATA Type 1 (with the offending ``seq``).  DATA with an unknown
Type is dropped and counted.  An unknown command byte (or an ACK for a
MessageID we never used) closes the connection.

Broker-side logic is synchronous (``on_bytes``); the trio part is the shared
:func:`broker.runtime.transport.run_connection` plus the shared idle pinger.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from broker.core.queue import QueuedEndpoint
from broker.core.router import Routed, Router
from broker.core.session import InputSlices, Rejected, SkanSession
from broker.runtime.context import BrokerContext
from broker.runtime.transport import idle_pinger, listener_address, open_listeners, run_connection
from wire.hsp import (
    DATA_ACK,
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
from wire.skan import SkanError, encode_frame

log = logging.getLogger(__name__)

# The HSP Type that carries a Skan message.
SKAN_TYPE = 1

# ERROR Type codes (BROKER-SPEC section 2).
MALFORMED = 1
REJECTED = 2
TOO_LARGE = 3
NOT_AUTHORISED = 4
# Metric label (skan_protocol_errors_total reason) per ERROR code.
ERROR_REASONS = {MALFORMED: "malformed", REJECTED: "rejected", TOO_LARGE: "too-large",
                NOT_AUTHORISED: "not-authorised"}

# Every delivery is DATA Type 1: these 3 bytes, then the Skan frame as routed
# (its 4-byte length prefix is HSP's Length field).
DELIVERY_PREFIX = data_prefix(SKAN_TYPE)


class HSPClientConnection(QueuedEndpoint):
    """An HSP client of the listener: a Skan session carried in DATA/DATA_ACK Type 1."""

    protocol = "hsp"

    def __init__(self, router: Router, queue_limit: int, policy: str, max_payload: int) -> None:
        super().__init__(router, queue_limit, policy)
        self.hsp = HSPConnection(max_payload)
        self.session = SkanSession(router, self)
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

    def _answer_error(self, mid: int, code: int, reason: str) -> None:
        self.counters.protocol_error("hsp", ERROR_REASONS[code])
        self.enqueue(self.hsp.send(Error(mid, code, reason.encode())))

    def _data_error(self, label: str, rejected: Rejected) -> None:
        """A fault in a plain DATA: the Skan error frame, delivered as DATA Type 1."""
        self.counters.protocol_error("hsp", label)
        self.enqueue(self.encode_control(rejected.error_message()))

    # ---- incoming ---------------------------------------------------------

    def on_bytes(self, data: bytes) -> bool:
        """Handle received bytes, at most one slice of commands; True when commands
        are left for another slice (the transport calls again with b"")."""
        inp = self.input
        if data:
            try:
                inp.add(self.hsp.receive(data))
            except ProtocolError as exc:
                inp.clear()
                self._apply(exc.events)
                if self.closing is None:
                    self._data_error("protocol-violation",
                                     Rejected(f"HSP protocol error: {exc.reason}"))
                    self.closing = "protocol-error"
                return False
        self._apply(inp.take(_event_size))
        if self.closing is not None:
            inp.clear()
            return False
        return inp.pending

    def _apply(self, events: list[Event]) -> None:
        handle = self.session.handle
        for ev in events:
            t = type(ev)
            if t is Data:
                if ev.type != SKAN_TYPE:
                    # A peer fault (protocol error) whose message is dropped (counted too).
                    self.counters.protocol_error("hsp", "unknown-type")
                    self.counters.drop("hsp", "unknown-type")
                    continue
                try:
                    rejected = handle(ev.framed)
                except SkanError as exc:
                    self._data_error("malformed", Rejected(f"malformed Skan message: {exc}"))
                    continue
                if rejected is not None:
                    if rejected.close:
                        self._data_error("not-authorised", rejected)
                        self.closing = "protocol-error"
                        return
                    self._data_error("rejected", rejected)
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
                    self._data_error("too-large", Rejected(reason))
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
        try:
            rejected = handle(ev.framed)
        except SkanError as exc:
            self._answer_error(mid, MALFORMED, f"malformed Skan message: {exc}")
            return True
        finally:
            self._held = None
        if rejected is None:
            self.enqueue(self.hsp.send(Ack(mid)))
            for data in held:
                self.enqueue(data)
            return True
        if rejected.close:
            self._answer_error(mid, NOT_AUTHORISED, rejected.reason)
            self.closing = "protocol-error"
            return False
        self._answer_error(mid, REJECTED, rejected.reason)
        return True


def _event_size(ev: Event) -> int:
    """Bytes an HSP command carries (its Skan message), for the slice budget."""
    framed = getattr(ev, "framed", None)
    return 0 if framed is None else len(framed)


async def serve_hsp(ctx: BrokerContext, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    cfg = ctx.config
    listeners = await open_listeners(
        cfg.broker.host, cfg.hsp.port, cfg.hsp.tls_cert, cfg.hsp.tls_key
    )
    async def handle(stream: trio.abc.Stream) -> None:
        # The payload of Type 1 is a Skan message, so Skan's frame limit bounds it.
        ep = HSPClientConnection(
            ctx.router, cfg.broker.queue_limit, cfg.broker.slow_consumer, cfg.broker.max_frame
        )
        ctx.router.attach(ep)

        def pinger(nursery: trio.Nursery) -> None:
            nursery.start_soon(
                idle_pinger, ep, ep.send_ping, cfg.hsp.ping_delay, cfg.hsp.ping_timeout
            )

        await run_connection(
            stream, ep, ep.on_bytes, ctx.router, ctx.connections,
            drain_timeout=cfg.broker.drain_timeout, grace=cfg.broker.slow_consumer_grace,
            extra_tasks=pinger,
        )

    task_status.started([("hsp", *listener_address(lst)) for lst in listeners])
    await ctx.serve(listeners, handle)
