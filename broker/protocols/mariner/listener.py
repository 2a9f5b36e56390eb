"""The Mariner listener: Hat Mariner clients receive routed messages as events.

One connection = one :class:`MarinerEndpoint`.  The client's ``init`` must
come first; with a configured token the client's must match.  Each
subscription (a Hat event-type pattern) becomes a router pattern
subscription; every routing batch (one Hat session) that delivers to the
client goes out as one ``events`` message when the batch ends.

``last_event_id`` replays retained messages after that id, then live ones,
with no gap and no duplicate at the seam: the subscriptions are made first
(live deliveries from then on are held back), the newest retained id at
that moment is the seam, the replay streams retained messages up to the
seam page by page (pausing while the queue is above its high-water mark,
so a long replay never fills it), and the held live messages, all newer than the seam, follow.

Mariner clients only receive.  Anything but ping/pong after init (a second
init, an ``events`` message, an unknown type, invalid JSON or framing)
closes the connection, as the Hat reference server does; the broker first
sends ``{"type": "error", "error": REASON}`` (an extension outside the
Mariner schema) so the peer can tell why.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from broker.cluster import cluster_query as cq
from broker.core.events import pattern_bytes
from broker.core.eventtypes import pattern_problem
from broker.core.queue import QueuedEndpoint
from broker.core.reasons import CloseReason, DropReason, ErrorKind, Protocol
from broker.core.refusals import NotPermitted, Refused
from broker.core.retention import RetentionStore, view
from broker.core.router import Routed, Router
from broker.protocols.mariner.mapping import EncodedEvents
from broker.serving.context import BrokerContext
from broker.serving.transport import serve_protocol
from wire import eventer as w
from wire import mariner as mw
from wire.errors import LocalProtocolError

if TYPE_CHECKING:
    from broker.cluster.link import ClusterLink

log = logging.getLogger(__name__)

# Retained messages looked at per replay step.  Bounds the time the replay
# holds the event loop and the bytes it queues before waiting for the
# writer (a page of ~1000 small events is a few hundred KiB).
REPLAY_PAGE = 1000

PING_FRAME = mw.encode_frame(mw.encode_message(mw.Ping()))
PONG_FRAME = mw.encode_frame(mw.encode_message(mw.Pong()))
# What a connection over max_connections receives before it is closed (the
# same error extension as every other refusal of this listener).
TOO_MANY_CONNECTIONS = mw.encode_frame(mw.encode_message(mw.Error("too many connections")))


class MarinerEndpoint(QueuedEndpoint):
    """One Mariner client connection."""

    protocol = Protocol.MARINER
    batched = True

    def __init__(
        self,
        router: Router,
        queue_limit: int,
        policy: str,
        *,
        max_message: int,
        server_id: int,
        retention: RetentionStore | None,
        encoded: EncodedEvents,
    ) -> None:
        super().__init__(router, queue_limit, policy)
        self.conn = mw.MarinerConnection(mw.SERVER, max_message)
        self.server_id = server_id
        self.retention = retention
        # The cluster backplane (None: a lone broker); set by serve_mariner.
        self.cluster: ClusterLink | None = None
        self.encoded = encoded
        self.client_id = ""
        self.nursery: trio.Nursery | None = None
        # Events of the current routing batch (JSON texts), sent on flush.
        self._batch: list[str] = []
        # While a replay runs: live events messages held back until it ends.
        self._held: list[tuple[bytes, int]] | None = None
        self._held_size = 0
        # Set once retained messages were evicted before the replay reached them.
        self.replay_gap = False

    # ---- lifetime ----------------------------------------------------------

    def start(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery

    def send_ping(self) -> None:
        self.enqueue(PING_FRAME)

    def partial_bytes(self) -> int:
        return self.conn.buffered

    # ---- incoming ----------------------------------------------------------

    def on_bytes(self, data: bytes) -> None:
        try:
            messages = self.conn.receive_data(data)
        except mw.ProtocolError as exc:
            self._fatal(str(exc))
            return
        for msg in messages:
            if isinstance(msg, mw.Ping):
                self.enqueue(PONG_FRAME)
            elif isinstance(msg, mw.Init):
                self._init(msg)
                if self.closing is not None:
                    return
            # Pong: the transport has already noted the peer is alive.

    def _fatal(self, reason: str) -> None:
        log.info("mariner %s (%s): closing: %s", self.lname.decode(), self.client_id, reason)
        self.router.counters.protocol_error(self.protocol, ErrorKind.BAD_MESSAGE)
        self.enqueue(mw.encode_frame(mw.encode_message(mw.Error(reason))))
        self.closing = CloseReason.PROTOCOL_ERROR

    def _unauthorised(self, reason: str) -> None:
        log.warning("mariner %s: client %r refused: %s", self.lname.decode(), self.client_id,
                    reason)
        self.router.counters.protocol_error(self.protocol, ErrorKind.NOT_AUTHORISED)
        self.enqueue(mw.encode_frame(mw.encode_message(mw.Error(reason))))
        self.closing = CloseReason.UNAUTHORISED

    def _init(self, init: mw.Init) -> None:
        self.client_id = init.client_id
        self.opened = True
        # Section 7: client_token (or a client certificate) identifies the user;
        # a refusal closes the connection (after an error message, see above).
        try:
            self.router.enforcer.login(self, init.client_token)
        except Refused as exc:
            self._unauthorised(exc.reason)
            return
        # [broker] max_subscriptions bounds the patterns of one connection.
        try:
            self.router.check_room(self, len(init.subscriptions))
        except Refused as exc:
            self._fatal(exc.reason)
            return
        for pattern in init.subscriptions:
            problem = pattern_problem(pattern)
            if problem is not None:
                self._fatal(problem)
                return
        for pattern in init.subscriptions:
            try:
                self.router.subscribe_pattern(self, pattern_bytes(pattern))
            except NotPermitted as exc:
                self._unauthorised(exc.reason)
                return
        last = init.last_event_id
        if last is None or self.retention is None or not init.subscriptions:
            return
        if self.cluster is not None and self.cluster.up():
            # BROKER-SPEC 8: replay what every broker of the cluster kept.
            self._held = []
            assert self.nursery is not None
            self.nursery.start_soon(self._cluster_replay, last,
                                    tuple(tuple(p) for p in init.subscriptions))
            return
        if last.server != self.server_id:
            log.info(
                "mariner %s: last_event_id is from server %d, this broker is %d: no replay",
                self.lname.decode(), last.server, self.server_id,
            )
            return
        self.router.hand_over()  # the seam includes what this batch routed so far
        newest = self.retention.newest()
        if newest is None or (newest.session, newest.instance) <= (last.session, last.instance):
            return
        # From here on live events are held back until the replay reaches the seam.
        self._held = []
        assert self.nursery is not None
        self.nursery.start_soon(
            self._replay, (last.session, last.instance), (newest.session, newest.instance)
        )

    # ---- outgoing ----------------------------------------------------------

    def deliver(self, frame: bytes, routed: Routed) -> None:
        try:
            self._batch.append(self.encoded(routed))
        except (ValueError, TypeError, LocalProtocolError):  # pragma: no cover - every msg maps
            # Never let one message's encoding disturb the sender's connection.
            log.exception("mariner: cannot encode session %d instance %d as an event",
                          routed.session, routed.instance)
            self.router.counters.drop(self.protocol, DropReason.UNENCODABLE)

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if batch:
            self._send_events(batch, live=True)

    def _send_events(self, batch: list[str], *, live: bool) -> None:
        data = mw.encode_frame(mw.encode_events_body(batch))
        n = len(batch)
        if live and self._held is not None:
            if self._held_size + len(data) <= self.queue.limit:
                self._held.append((data, n))
                self._held_size += len(data)
                return
            # Held-back live events are bounded like the queue: the policy applies.
            self.overflow(n)
            return
        if self.queue.size + len(data) > self.queue.limit:
            self.overflow(n)
            return
        # Live: enqueue flags congestion, so the publishing reader pauses.
        # Replay: no publisher is behind it, so nobody else is asked to wait;
        # the replay task itself waits for the writer.
        ok = self.enqueue(data) if live else not self.closed and self.queue.push(data)
        if ok:
            self.msgs_out += n
            self.bytes_out += len(data)

    # ---- replay --------------------------------------------------------------

    async def _replay(self, cursor: tuple[int, int], seam: tuple[int, int]) -> None:
        try:
            done = False
            while not done and not self.closed:
                cursor, done = self._replay_step(cursor, seam)
                await self._writer_caught_up()
        finally:
            self._release_held()

    def _release_held(self) -> None:
        """Queue the live events held back during a replay, and stop holding back.

        Synchronous: no live delivery can slip in between."""
        held, self._held = self._held or [], None
        self._held_size = 0
        for data, n in held:
            if self.enqueue(data):
                self.msgs_out += n
                self.bytes_out += len(data)

    def _replay_step(
        self, cursor: tuple[int, int], seam: tuple[int, int]
    ) -> tuple[tuple[int, int], bool]:
        """Queue replayed events after ``cursor``: at most a page, and no more once the
        queue is past its high-water mark.

        Returns the last id looked at and whether the seam was reached.
        """
        retention = self.retention
        assert retention is not None
        gone = retention.evicted_upto
        if gone is not None and gone > cursor and not self.replay_gap:
            self.replay_gap = True
            log.warning(
                "mariner %s (%s): replay gap: retained messages up to (session %d, "
                "instance %d) were evicted before they could be replayed",
                self.lname.decode(), self.client_id, *gone,
            )
        takes = self.router.pattern_receives
        q = self.queue
        batch: list[str] = []
        session = None
        looked = 0
        for routed in retention.after(*cursor, REPLAY_PAGE):
            rid = (routed.session, routed.instance)
            if rid > seam:
                break
            if routed.session != session:
                if batch:
                    # One events message per Hat session.
                    self._send_events(batch, live=False)
                    batch = []
                    if q.size > q.high:
                        return cursor, False
                session = routed.session
            cursor = rid
            looked += 1
            header = routed.header
            if takes(self, header[b"group"], header[b"instance"], header[b"to"]):
                batch.append(self.encoded(routed))
        if batch:
            self._send_events(batch, live=False)
        return cursor, cursor >= seam or looked < REPLAY_PAGE

    async def _cluster_replay(self, last: Any, patterns: tuple[tuple[str, ...], ...]) -> None:
        """Replay from every broker, page by page, until every broker's events
        after ``last`` have been sent.

        Live events are held back meanwhile, as for a local replay; an event
        crossing between brokers at the very moment of subscribing may come
        both in the replay and live (docs/cluster.md).
        """
        cluster, retention = self.cluster, self.retention
        assert cluster is not None and retention is not None
        try:
            first = cq.sentinel_query(w.EventId(last.server, last.session, last.instance))
            local = cq.local_query(retention, None, self.server_id)
            found = await cluster.gather(first, local, self.principal, self.lname)
            sentinel = [e for e in found.entries
                        if (e[cq.SERVER], e[0], e[1]) == (last.server, last.session,
                                                          last.instance)]
            if not sentinel:
                log.info("mariner %s (%s): last_event_id %r is not retained by any broker: "
                         "no replay", self.lname.decode(), self.client_id, last)
                return
            takes = self.router.pattern_receives
            batch: list[str] = []
            key = None
            # Page by page from every broker (ClusterLink.replay): no cap; a
            # page that cannot move on is logged there as a replay gap.
            async for page in cluster.replay(last, sentinel[0][2], patterns, local,
                                             self.principal, self.lname):
                for e in page:
                    if self.closed:
                        return
                    routed = view(cq.as_entry(e))
                    routed.server = e[cq.SERVER]
                    header = routed.header
                    if not takes(self, header[b"group"], header[b"instance"], header[b"to"]):
                        continue
                    if (routed.server, routed.session) != key and batch:
                        # One events message per Hat session.
                        self._send_events(batch, live=False)
                        batch = []
                        await self._writer_caught_up()
                    key = (routed.server, routed.session)
                    batch.append(self.encoded(routed))
            if batch:
                self._send_events(batch, live=False)
        finally:
            self._release_held()

    async def _writer_caught_up(self) -> None:
        """Checkpoint between replay steps; wait while the queue is above its high-water mark."""
        await trio.sleep(0)
        q = self.queue
        while q.size > q.high and not self.closed:
            if self.drained is None:
                self.drained = trio.Event()
            await self.drained.wait()


async def serve_mariner(ctx: BrokerContext, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    b = ctx.config.broker
    section = ctx.config.mariner
    encoded = EncodedEvents(b.server_id)

    def new_endpoint() -> MarinerEndpoint:
        b = ctx.config.broker  # as reloaded (SIGHUP): limits apply to new connections
        endpoint = MarinerEndpoint(
            ctx.router, b.queue_limit, b.slow_consumer, max_message=b.max_frame,
            server_id=b.server_id, retention=ctx.retention,
            encoded=encoded,
        )
        endpoint.cluster = ctx.cluster
        return endpoint

    await serve_protocol(ctx, Protocol.MARINER, section, new_endpoint,
                         keep_alive=(section.ping_delay, section.ping_timeout),
                         refusal=TOO_MANY_CONNECTIONS, task_status=task_status)
