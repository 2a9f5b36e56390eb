"""The HSP bridge (BROKER-SPEC section 2): the broker dials out to an HSP endpoint.

One bridge = one routing endpoint (lname, protocol ``bridge-hsp``) that
lives as long as the broker, subscribed to the configured (group,
instance), so messages are buffered even while the peer is down.

Outgoing: each routed message becomes a DATA_ACK of the configured Type
whose payload is the ``msg`` bytes when ``msg`` is DATA, else the complete
routed Skan message (magic included).  A message leaves the buffer when the
peer ACKs it; on ERROR/ERROR_UNDEF it is dropped (re-sending a refused
message would loop forever), logged and counted as dropped (reason
``refused-by-peer``).  At most :data:`WINDOW` messages are in flight; when the
connection fails they go back to the front of the buffer, in order, and are
re-sent after the reconnect (at-least-once).  With the store, the buffer
is also spooled on disk until the ACK (docs/store.md), so a restart re-sends
what was not acknowledged.  The buffer holds at most
``buffer`` messages; beyond that the oldest is dropped, logged and counted
in ``BridgeStatus.overflow``.

Incoming: DATA/DATA_ACK of any Type are routed into the configured group and
instance as a Skan send with ``to`` "*", ``from`` the bridge's lname,
``msg`` DATA(payload) and the routing tag ``hsp-type`` (the Type in
decimal).  A DATA_ACK is ACKed once routed; one over the payload limit gets
ERROR 3.  PINGs are answered; an idle peer is pinged (``hsp.ping_delay``)
and the connection is dropped when no byte arrives within
``hsp.ping_timeout``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import trio

from broker.core.inject import build_send
from broker.core.queue import OutQueue
from broker.core.reasons import DropReason, Protocol
from broker.core.refusals import FrameTooLarge, NotPermitted
from broker.core.router import Routed
from broker.serving.bridge_runner import (
    Bridge,
    BridgeStatus,
    BufferedBridgeEndpoint,
    bridge_route,
    open_bridge_stream,
)
from broker.serving.config import BridgeSection
from broker.serving.context import BrokerContext
from broker.serving.transport import RECV_SIZE, write_loop
from broker.store.spool import BridgeSpool
from toolkit.streams import idle_pinger
from wire.errors import ProtocolError
from wire.hsp import (
    DATA_ACK,
    ERROR,
    TOO_LARGE,
    Ack,
    Data,
    DataAck,
    Error,
    ErrorUndef,
    HSPConnection,
    Oversized,
    Ping,
    Pong,
    frame_payload,
)

log = logging.getLogger(__name__)

# Messages sent and not yet acknowledged.  Bounds what a reconnect re-sends
# and the bytes queued towards a slow peer; large enough to keep a LAN link
# busy while ACKs travel back.
WINDOW = 1000
# Outgoing bytes queued before the sender waits for the socket: DATA_ACKs
# stop being produced above this, ACKs/PONGs are small and always queued.
HIGH_WATER = 1 << 20
HSP_TYPE_TAG = b"hsp-type"


def outgoing_payload(routed: Routed) -> bytes:
    """Framed payload (4-byte length + bytes) for a routed message.

    ``msg`` DATA -> its bytes; anything else -> the whole Skan message, whose
    Skan frame already is "length + message".
    """
    msg = routed.header.get(b"msg")
    if type(msg) is bytes:
        return frame_payload(msg)
    return routed.frame


class HSPBridge(Bridge):
    """State that outlives connections: the endpoint, its buffer and what is in flight."""

    def __init__(self, ctx: BrokerContext, cfg: BridgeSection, status: BridgeStatus) -> None:
        super().__init__(ctx.router, cfg, status)
        # The largest DATA payload taken from the peer: a Skan message of max_frame.
        self.max_payload = ctx.config.broker.max_frame
        # Keep-alive: the [hsp] section's ping_delay and ping_timeout.
        self.keepalive = ctx.config.hsp
        self.ep = BufferedBridgeEndpoint(Protocol.BRIDGE_HSP, status, cfg.buffer,
                                         BridgeSpool.of(ctx.retention, status.name))
        self.group = cfg.group.encode()
        self.instance = cfg.instance.encode()
        self.window = min(WINDOW, cfg.buffer)
        # MessageID -> message, in send order, for the current connection.
        self.inflight: OrderedDict[int, Routed] = OrderedDict()
        self._seq = 0

    # ---- buffer ---------------------------------------------------------------

    def requeue_inflight(self) -> None:
        """Put unacknowledged messages back at the front, oldest first; trim to the bound."""
        if not self.inflight:
            return
        pending = self.ep.pending
        pending.extendleft(reversed(self.inflight.values()))
        self.inflight.clear()
        excess = len(pending) - self.cfg.buffer
        if excess > 0:
            for _ in range(excess):
                self.ep.spool.removed(pending.popleft())
            self.status.overflow += excess
            self.ep.dropped += excess
            log.warning("bridge %s buffer full (%d): dropped the %d oldest unacknowledged "
                        "messages", self.status.name, self.cfg.buffer, excess)

    def unspool(self, message_id: int) -> None:
        """The peer refused a message: it leaves the buffer (and the spool) for good."""
        refused = self.inflight.pop(message_id, None)
        if refused is not None:
            self.ep.spool.removed(refused)

    # ---- incoming -------------------------------------------------------------

    def route_in(self, hsp_type: int, payload: bytes) -> str | None:
        """Route a payload from the peer into the configured group and instance.

        Returns why it was refused when its Skan message would pass
        ``max_frame`` (counted; a DATA_ACK is answered ERROR 3), else None
        (routed, or refused by the bridge user's permissions: counted and
        logged by bridge_route).
        """
        self._seq += 1
        message = build_send(self.ep.lname, self.group, self.instance, self._seq, payload,
                             {HSP_TYPE_TAG: str(hsp_type).encode()})
        try:
            bridge_route(self.router, self.ep, message, self.status)
        except FrameTooLarge as exc:
            return f"payload of {len(payload)} bytes: {exc}"
        except NotPermitted:
            pass  # counted and logged by bridge_route; ACKed as before
        return None

    # ---- one connection -------------------------------------------------------

    async def attempt(self, status: BridgeStatus) -> None:
        stream = await open_bridge_stream(self.cfg)
        conn = _Link(self, stream)
        status.up = True
        status.connects += 1
        log.info("bridge %s connected", status.name)
        try:
            await conn.run()
        finally:
            self.requeue_inflight()
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)


class _Link:
    """One TCP connection of a bridge: reader, pump (buffer -> DATA_ACK), writer, pinger."""

    def __init__(self, bridge: HSPBridge, stream: trio.abc.Stream) -> None:
        self.bridge = bridge
        self.stream = stream
        self.hsp = HSPConnection(bridge.max_payload)
        self.out = OutQueue(1 << 62)  # bounded by WINDOW and HIGH_WATER, not by the queue
        self.last_rx = trio.current_time()
        self._acked = trio.Event()
        self._drained = trio.Event()
        self.failure: BaseException | None = None
        self._scope = trio.CancelScope()

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        self._scope.cancel()

    async def run(self) -> None:
        with self._scope:
            async with trio.open_nursery() as nursery:
                for task in (self._reader, self._writer, self._pump, self._pinger):
                    nursery.start_soon(self._guard, task)
        if self.failure is not None:
            raise self.failure

    async def _guard(self, task: Any) -> None:
        try:
            await task()
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, EOFError,
                ProtocolError) as exc:
            # ProtocolError (wire.errors): the peer broke HSP.
            self._fail(exc)

    def _push(self, data: bytes) -> None:
        self.out.push(data)

    def _idle(self) -> bool:
        """The writer emptied the queue: release the pump; never done on its own."""
        self._drained.set()
        return False

    async def _writer(self) -> None:
        await write_loop(self.stream, self.out, done_when_empty=self._idle)

    async def _pump(self) -> None:
        bridge = self.bridge
        ep = bridge.ep
        inflight = bridge.inflight
        hsp_type = bridge.cfg.type
        while True:
            await ep.wait_pending()
            while ep.pending and len(inflight) < bridge.window:
                routed = ep.pending.popleft()
                mid = self.hsp.next_message_id()
                inflight[mid] = routed
                self._push(self.hsp.send(DataAck(mid, hsp_type, outgoing_payload(routed))))
                if self.out.size > HIGH_WATER:
                    self._drained = trio.Event()
                    await self._drained.wait()
            if len(inflight) >= bridge.window:
                self._acked = trio.Event()
                await self._acked.wait()

    async def _pinger(self) -> None:
        bridge = self.bridge

        async def ping() -> None:
            self._push(self.hsp.send(Ping()))

        keepalive = bridge.keepalive
        await idle_pinger(lambda: self.last_rx, ping, keepalive.ping_delay, keepalive.ping_timeout)
        raise TimeoutError(f"no answer to PING within {keepalive.ping_timeout}s")

    async def _reader(self) -> None:
        bridge = self.bridge
        router = bridge.router
        while True:
            data = await self.stream.receive_some(RECV_SIZE)
            if not data:
                raise EOFError("the HSP peer closed the connection")
            self.last_rx = trio.current_time()
            events = self.hsp.receive_data(data)
            try:
                for ev in events:
                    self._handle(ev)
            finally:
                router.end_batch()

    def _handle(self, ev: Any) -> None:
        bridge = self.bridge
        t = type(ev)
        if t is Ack:
            acked = bridge.inflight.pop(ev.message_id, None)
            if acked is not None:
                bridge.ep.spool.removed(acked)
                bridge.status.sent += 1
            self._acked.set()
        elif t is Error or t is ErrorUndef:
            bridge.unspool(ev.message_id)
            bridge.router.counters.drop(Protocol.BRIDGE_HSP, DropReason.REFUSED_BY_PEER)
            detail = f"ERROR {ev.type}: {ev.reason}" if t is Error else "ERROR_UNDEF"
            bridge.status.last_error = f"peer refused a message ({detail})"
            log.warning("bridge %s: peer refused message id %d (%s); dropped",
                        bridge.status.name, ev.message_id, detail)
            self._acked.set()
        elif t is Data:
            # A refused DATA cannot be answered: counted (and logged) by route_in.
            bridge.route_in(ev.type, ev.payload)
        elif t is DataAck:
            refused = bridge.route_in(ev.type, ev.payload)
            if refused is None:
                self._push(self.hsp.send(Ack(ev.message_id)))
            else:
                self._push(self.hsp.send(Error(ev.message_id, TOO_LARGE, refused.encode())))
        elif t is Ping:
            self._push(self.hsp.send(Pong()))
        elif t is Oversized:
            reason = f"payload of {ev.length} bytes exceeds the limit of {bridge.max_payload}"
            if ev.command == DATA_ACK:
                self._push(self.hsp.send(Error(ev.message_id, TOO_LARGE, reason.encode())))
            elif ev.command == ERROR:
                bridge.unspool(ev.message_id)
                bridge.router.counters.drop(Protocol.BRIDGE_HSP, DropReason.REFUSED_BY_PEER)
                self._acked.set()
            else:
                bridge.router.counters.drop(Protocol.BRIDGE_HSP, DropReason.TOO_LARGE)
            log.warning("bridge %s: %s", bridge.status.name, reason)
        # Pong: liveness is last_rx.


async def run_hsp_bridge(ctx: BrokerContext, cfg: BridgeSection, status: BridgeStatus) -> None:
    """Runner for ``[[bridges]] protocol = "hsp"`` (see broker.app.configured_bridges)."""
    await HSPBridge(ctx, cfg, status).run()
