"""The Mariner bridge (BROKER-SPEC section 4): the broker dials a remote Mariner server.

One bridge = one routing endpoint (lname, protocol ``bridge-mariner``) that
lives as long as the broker.  It connects as a Mariner client
(:class:`toolkit.mariner_client.MarinerClient`, the same client people use) with
the configured ``subscriptions`` (default ``[[group, "*"]]``), ``token``
and ``client_name``; every received event becomes a Skan send (``to`` "*",
``from`` the bridge's lname) into the group and instance its type maps to
(:func:`broker.core.events.send_for_event`, the shared mapping; a source
timestamp travels in the ``source-timestamp`` tag).  One
``events`` message (one remote session) is one local routing batch.

Resuming: the bridge remembers the id of the last event it routed and sends
it as ``last_event_id`` on every reconnect, so a server that keeps history
(Hat's own, or another Skan broker) replays what was missed.  Events at or
before that id (same server) are dropped, so a server that resends
overlapping history creates no duplicates.  With the store the id is also
kept on disk (written behind, once per events message), so after a broker
restart the bridge resumes where it was; without it the bridge starts with
new events only.

Mariner clients only receive, so nothing flows from this broker to the
remote server; a message directed at the bridge's lname is counted as
dropped.  Keep-alive uses the ``[mariner]`` ping_delay/ping_timeout.
"""

from __future__ import annotations

import contextlib
import logging

from broker.core.events import MappingError, send_for_event
from broker.core.reasons import DropReason, ErrorKind, Protocol
from broker.core.refusals import Refused
from broker.core.router import Endpoint, Routed, Router
from broker.serving.bridge_runner import Bridge, BridgeStatus, bridge_route, open_bridge_stream
from broker.serving.config import BridgeSection
from broker.serving.context import BrokerContext
from broker.serving.transport import relieve_congestion
from broker.store.spool import BridgeSpool
from toolkit.mariner_client import MarinerClient
from wire import mariner as mw
from wire.errors import ProtocolError

log = logging.getLogger(__name__)


class MarinerBridgeEndpoint(Endpoint):
    """The bridge as a routing endpoint: a source of events, never a destination."""

    protocol = Protocol.BRIDGE_MARINER

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router

    def deliver(self, frame: bytes, routed: Routed) -> None:
        # A Mariner server accepts nothing from its clients.
        self.router.counters.drop(self.protocol, DropReason.ONE_WAY)


class MarinerBridge(Bridge):
    """State that outlives connections: the endpoint and the resume point."""

    # Mariner clients only receive: the bridge subscribes to nothing locally.
    subscribes = False

    def __init__(self, ctx: BrokerContext, cfg: BridgeSection, status: BridgeStatus) -> None:
        super().__init__(ctx.router, cfg, status)
        self.max_frame = ctx.config.broker.max_frame
        # Keep-alive: the [mariner] section's ping_delay and ping_timeout.
        self.keepalive = ctx.config.mariner
        # How long a congested local consumer may hold the bridge's reading.
        self.grace = ctx.config.broker.slow_consumer_grace
        self.ep = MarinerBridgeEndpoint(self.router)
        self.spool = BridgeSpool.of(ctx.retention, status.name)
        resume = self.spool.resume_point()
        self.last_event_id: mw.EventId | None = None if resume is None else mw.EventId(*resume)
        self.skipped = 0
        self._seq = 0

    # ---- incoming -------------------------------------------------------------

    def route_in(self, events: tuple[mw.Event, ...]) -> None:
        """Route one events message (one remote session) as one local routing batch."""
        before = self.last_event_id
        try:
            for event in events:
                self._route_event(event)
        finally:
            self.router.end_batch()
            last = self.last_event_id
            if last is not None and last != before:
                self.spool.set_resume(last.server, last.session, last.instance)

    def _route_event(self, event: mw.Event) -> None:
        last = self.last_event_id
        if last is not None and event.id.server == last.server and event.id <= last:
            self.skipped += 1
            return
        self.last_event_id = event.id
        self._seq += 1
        try:
            message = send_for_event(
                event.type, event.payload, sender=self.ep.lname, seq=self._seq,
                source_timestamp=event.source_timestamp,
            )
        except (MappingError, ProtocolError) as exc:
            self._refuse(event, str(exc))
            return
        # A refusal (permissions, max_frame) is counted and logged by bridge_route.
        with contextlib.suppress(Refused):
            bridge_route(self.router, self.ep, message, self.status)

    def _refuse(self, event: mw.Event, reason: str) -> None:
        self.router.counters.protocol_error(self.ep.protocol, ErrorKind.UNROUTABLE_EVENT)
        self.status.last_error = f"event {event.id} not routed: {reason}"
        log.warning("bridge %s: event %s (type %s) not routed: %s",
                    self.status.name, event.id, list(event.type), reason)

    # ---- one connection -------------------------------------------------------

    async def attempt(self, status: BridgeStatus) -> None:
        stream = await open_bridge_stream(self.cfg)
        async with MarinerClient.over(
            stream,
            client_id=self.cfg.client_name,
            client_token=self.cfg.token,
            last_event_id=self.last_event_id,
            subscriptions=self.cfg.effective_subscriptions(),
            ping_delay=self.keepalive.ping_delay,
            ping_timeout=self.keepalive.ping_timeout,
            max_message=self.max_frame,
        ) as client:
            # Mariner has no answer to init: a pong after it means the server kept
            # the connection (a wrong token gets an error or a close instead).
            await client.barrier()
            status.up = True
            status.connects += 1
            log.info("bridge %s connected (resuming after %s)", status.name, self.last_event_id)
            async for batch in client:
                self.route_in(batch)
                if self.router.congested:
                    # Back-pressure: stop reading from the server while local
                    # consumers catch up (as every listener does).
                    await relieve_congestion(self.router, self.grace)


async def run_mariner_bridge(ctx: BrokerContext, cfg: BridgeSection,
                             status: BridgeStatus) -> None:
    """Runner for ``[[bridges]] protocol = "mariner"`` (see broker.app.configured_bridges)."""
    await MarinerBridge(ctx, cfg, status).run()
