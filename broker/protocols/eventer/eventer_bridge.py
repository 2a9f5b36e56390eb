"""The Eventer bridge (BROKER-SPEC section 3): the broker dials out to a remote Eventer server.

One bridge = one routing endpoint (lname, protocol ``bridge-eventer``) that
lives as long as the broker, subscribed to the configured (group, instance),
so local messages are buffered even while the server is down.  The remote
side is :class:`toolkit.eventer_client.EventerClient` (the same client users get)
over the stream of the shared bridge dialler, initialised with the
configured ``subscriptions`` (default ``[[group, "*"]]``).

Incoming: each notification (one remote session) is routed as one local
routing batch; every event becomes a Skan send (to "*") from the bridge's
lname into the group/instance its type maps to (broker/core/events.py).
Notifications are acknowledged by the client.

Outgoing: buffered local messages are registered remotely with a response,
up to :data:`REGISTER_BATCH` per request, one request at a time; a message
leaves the buffer (and, with the store, its on-disk spool) once the server
answered (at-least-once across reconnects and broker restarts).  A
MsgRegisterRes failure drops the batch (re-sending what the server refuses
would loop), logged and counted in the endpoint's ``dropped``.

Echo loops: messages the bridge routes in are never delivered back to it
(the router skips the sender), so remote events are not registered back.
And events the bridge registered come back in the server's notifications
when the subscriptions cover them: their EventIds, taken from
MsgRegisterRes, are filtered out.  The server may notify them before it
answers the request, so a notification waits until every register request
sent before it was taken from the inbox has been answered.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict

import trio

from broker.core import events
from broker.core.reasons import Protocol
from broker.core.refusals import Refused
from broker.core.router import Routed
from broker.protocols.eventer.warm_up import warm_up
from broker.serving.bridge_runner import (
    Bridge,
    BridgeStatus,
    BufferedBridgeEndpoint,
    bridge_route,
    open_bridge_stream,
)
from broker.serving.config import BridgeSection
from broker.serving.context import BrokerContext
from broker.store.spool import BridgeSpool
from toolkit.eventer_client import EventerClient
from wire import eventer as w

log = logging.getLogger(__name__)

# Local messages per MsgRegisterReq: large enough to keep up with a busy
# group, small enough that one request stays far below the frame limit.
REGISTER_BATCH = 1000
# EventIds of registered events still expected back as echoes.  Bounded:
# when the server's subscriptions do not cover them, echoes never come.
ECHO_LIMIT = 100_000
# Notifications the client may hold unread: the bridge holds one back while
# its register request is answered, and the reader must stay free meanwhile.
INBOX = 1024


def register_event(routed: Routed, server_id: int) -> w.RegisterEvent:
    ev = events.event_from_routed(routed, server_id)
    return w.RegisterEvent(ev.type, ev.source_timestamp, ev.payload)


def _collapse(group: BaseExceptionGroup) -> BaseException:
    """The first ordinary exception in a group, unless the group carries a cancellation."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    if any(not isinstance(leaf, Exception) for leaf in leaves):
        return group
    return leaves[0]


class EventerBridge(Bridge):
    """State that outlives connections: the endpoint, its buffer, the echo filter."""

    def __init__(self, ctx: BrokerContext, cfg: BridgeSection, status: BridgeStatus) -> None:
        super().__init__(ctx.router, cfg, status)
        self.ctx = ctx
        self.server_id = ctx.config.broker.server_id
        self.ep = BufferedBridgeEndpoint(Protocol.BRIDGE_EVENTER, status, cfg.buffer,
                                         BridgeSpool.of(ctx.retention, status.name))
        self.echo: OrderedDict[w.EventId, None] = OrderedDict()
        self._seq = itertools.count(1)
        # Register requests sent and answered on the current connection.
        self.sent = 0
        self.answered = 0
        self._answer = trio.Event()

    # ---- incoming ------------------------------------------------------------------

    def route_in(self, batch: tuple[w.Event, ...]) -> None:
        """Route one notification's events as one local routing batch."""
        for ev in batch:
            if ev.id in self.echo:
                del self.echo[ev.id]
                continue
            try:
                message = events.send_for_event(
                    ev.type, ev.payload, sender=self.ep.lname,
                    seq=next(self._seq), source_timestamp=ev.source_timestamp,
                )
            except events.MappingError as exc:
                log.warning("bridge %s: event %s skipped: %s", self.status.name, ev.id, exc)
                continue
            try:
                bridge_route(self.router, self.ep, message, self.status)
            except Refused:
                continue  # counted and logged by bridge_route
        self.router.end_batch()

    async def _notifications(self, client: EventerClient) -> None:
        while True:
            batch = await client.receive()
            target = self.sent
            while self.answered < target:
                await self._answer.wait()
            self.route_in(batch)

    # ---- outgoing ------------------------------------------------------------------

    async def _registrations(self, client: EventerClient) -> None:
        pending = self.ep.pending
        while True:
            await self.ep.wait_pending()
            batch = list(itertools.islice(pending, REGISTER_BATCH))
            self.sent += 1
            try:
                result = await client.register(
                    [register_event(r, self.server_id) for r in batch], with_response=True)
            finally:
                self.answered += 1
                self._answer.set()
                self._answer = trio.Event()
            # The buffer may have dropped its oldest meanwhile: remove by identity.
            sent = {id(r) for r in batch}
            while pending and id(pending[0]) in sent:
                self.ep.spool.removed(pending.popleft())
            if result is None:
                self.ep.dropped += len(batch)
                log.warning("bridge %s: the server refused to register %d events; dropped",
                            self.status.name, len(batch))
                continue
            self.status.sent += len(batch)
            for ev in result:
                self.echo[ev.id] = None
            while len(self.echo) > ECHO_LIMIT:
                self.echo.popitem(last=False)

    # ---- one connection --------------------------------------------------------------

    async def attempt(self, status: BridgeStatus) -> None:
        try:
            await self._attempt(status)
        except BaseExceptionGroup as group:
            raise _collapse(group) from None

    async def _attempt(self, status: BridgeStatus) -> None:
        section = self.ctx.config.eventer
        self.sent = self.answered = 0
        stream = await open_bridge_stream(self.cfg)
        async with EventerClient.over(
            stream, self.cfg.client_name,
            subscriptions=self.cfg.effective_subscriptions(), token=self.cfg.token,
            ping_delay=section.ping_delay, ping_timeout=section.ping_timeout,
            max_message=self.ctx.config.broker.max_frame, inbox=INBOX,
        ) as client:
            status.up = True
            status.connects += 1
            log.info("bridge %s connected (server status %s)", status.name,
                     client.status.value if client.status else "?")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._notifications, client)
                nursery.start_soon(self._registrations, client)


async def run_eventer_bridge(ctx: BrokerContext, cfg: BridgeSection,
                             status: BridgeStatus) -> None:
    """Runner for ``[[bridges]] protocol = "eventer"`` (see broker.app.configured_bridges)."""
    warm_up(ctx)
    await EventerBridge(ctx, cfg, status).run()
