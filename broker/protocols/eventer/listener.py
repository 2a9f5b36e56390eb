"""The Eventer listener: hat-event clients (both Chatter envelopes) as routing endpoints.

One :class:`EventerEndpoint` per client drives the pure
:class:`wire.eventer.ServerConnection`: init with the token check,
subscriptions as router patterns, MsgRegisterReq turned into Skan sends,
queries answered from the retained messages, notifications grouped per
routing batch (one Hat session) and paced by MsgEventsAck credit.  The trio
part is the shared :func:`broker.serving.transport.serve_protocol` (keep-alive
included) plus a conversation timer.  The opening is MsgInitReq.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from broker.core import events
from broker.core.eventtypes import pattern_problem
from broker.core.inject import check_injected, route_injected
from broker.core.queue import QueuedEndpoint
from broker.core.reasons import CloseReason, DropReason, ErrorKind, Protocol
from broker.core.refusals import FrameTooLarge, NotPermitted, Refused
from broker.core.retention import Entry, RetentionStore, view
from broker.core.router import Routed, Router
from broker.core.skan_handler import InputSlices
from broker.protocols.eventer.mapping import fast_encode_routed
from broker.protocols.eventer.warm_up import warm_up
from broker.serving.context import BrokerContext
from broker.serving.transport import serve_protocol
from broker.store import Store
from broker.store.retained_query import (
    Answer,
    LatestTable,
    Visible,
    run_query,
    run_store_query,
)
from wire import eventer as w
from wire.errors import ProtocolError

log = logging.getLogger(__name__)

class EventerService:
    """What all Eventer connections of one broker share."""

    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx
        self.router = ctx.router
        self.server_id = ctx.config.broker.server_id
        self.status = w.Status.OPERATIONAL
        assert ctx.retention is not None, "the retention store starts before the listeners"
        self.store: RetentionStore | Store = ctx.retention
        # Durable: queries from the store, persisted notifications after commit.
        # In memory: the ring plus a latest table, and nothing is persisted.
        self.durable = isinstance(self.store, Store)
        self.latest = LatestTable(0 if self.durable else self.store.size)
        self.latest.attach(self.router)
        ctx.latest = self.latest
        self.connections: set[EventerEndpoint] = set()
        # Connections that asked for persisted notifications (MsgInitReq persisted).
        self.persisted: set[EventerEndpoint] = set()
        if isinstance(self.store, Store):
            self.store.on_report.append(self.on_persisted)
            self.store.reports_wanted = lambda: bool(self.persisted)
        # Every Eventer recipient of a message gets the same bytes: the last
        # encoding is kept (deliveries of one message are consecutive).
        self._last_routed: Routed | None = None
        self._last_encoded = b""

    def encode(self, routed: Routed) -> bytes:
        if routed is not self._last_routed:
            self._last_encoded = fast_encode_routed(routed, self.server_id)
            self._last_routed = routed
        return self._last_encoded

    def encode_entry(self, entry: Entry) -> bytes:
        routed = view(entry)
        if len(entry) > 7:  # gathered from a cluster: the origin's server id follows
            routed.server = entry[7]
        return fast_encode_routed(routed, self.server_id)

    def on_persisted(self, upto: tuple[int, int], ok: bool) -> None:
        """The store committed (or failed to commit) every message up to EventId ``upto``."""
        for conn in list(self.persisted):
            conn.persisted_upto(upto, ok)

    def query(self, params: w.QueryParams, visible: Visible = None) -> Answer:
        """From the store (or the ring); ``visible`` leaves out what the client may not read."""
        self.router.hand_over()  # what this batch routed before the query counts too
        if isinstance(self.store, Store):
            return run_store_query(params, self.store, self.server_id, visible)
        return run_query(params, self.store, self.latest, self.server_id, visible)

    def stopping(self) -> None:
        """Graceful stop began: tell every client (MsgStatusNotify stopping)."""
        self.status = w.Status.STOPPING
        for conn in list(self.connections):
            conn.notify_status(w.Status.STOPPING)


class EventerEndpoint(QueuedEndpoint):
    """One Eventer client."""

    protocol = Protocol.EVENTER
    batched = True

    def __init__(self, service: EventerService, router: Router, queue_limit: int, policy: str,
                 max_frame: int, notify_credit: int = w.DEFAULT_NOTIFY_CREDIT) -> None:
        super().__init__(router, queue_limit, policy)
        self.service = service
        self.proto = w.ServerConnection(max_message=max_frame, notify_credit=notify_credit)
        self.client_name = ""
        # Encoded events of the routing batch in progress.
        self.batch: list[bytes] = []
        # Whole batches waiting for notify credit, and their size in bytes
        # (bounded by the queue limit, beyond which the slow-consumer policy acts).
        self.backlog: deque[list[bytes]] = deque()
        self.backlog_bytes = 0
        self.seq = 0
        # Requests received but not yet handled (bounded work per slice).
        self.input: InputSlices[object] = InputSlices()
        # MsgInitReq persisted: batches wait in ``unpersisted`` (with the
        # EventId of their last message) until the store has committed them.
        self.persisted = False
        self.unpersisted: deque[tuple[tuple[int, int], list[bytes]]] = deque()
        self._batch_last = (0, 0)
        # Set by the trio layer to its clock; any monotonic clock works.
        self.now: Callable[[], float] = time.monotonic
        # Set by the trio layer: called when a conversation deadline was added.
        self.on_deadline: Callable[[], None] = _nothing

    # ---- routing side ------------------------------------------------------------

    def deliver(self, frame: bytes, routed: Routed) -> None:
        if self.closed:
            self.not_sent(len(frame))
            return
        self.batch.append(self.service.encode(routed))
        self._batch_last = (routed.session, routed.instance)
        self.msgs_out += 1

    def flush(self) -> None:
        batch, self.batch = self.batch, []
        if not batch or self.closed:
            return
        if self.persisted:
            size = sum(map(len, batch))
            if self.backlog_bytes + size > self.queue.limit:
                self._overflow(batch)
                return
            self.unpersisted.append((self._batch_last, batch))
            self.backlog_bytes += size
            return
        self._send_batch(batch)

    def persisted_upto(self, upto: tuple[int, int], ok: bool) -> None:
        """Notify (``ok``) or forget (not persisted) the batches committed up to ``upto``."""
        held = self.unpersisted
        while held and held[0][0] <= upto and not self.closed:
            _, batch = held.popleft()
            self.backlog_bytes -= sum(map(len, batch))
            if ok:
                self._send_batch(batch)
                continue
            self.dropped += len(batch)
            for _ in batch:
                self.router.counters.drop(Protocol.EVENTER, DropReason.NOT_PERSISTED)

    def _send_batch(self, batch: list[bytes]) -> None:
        if self.proto.credit > 0 and not self.backlog:
            self._notify(batch)
            return
        size = sum(map(len, batch))
        if self.backlog_bytes + size > self.queue.limit:
            self._overflow(batch)
            return
        self.backlog.append(batch)
        self.backlog_bytes += size
        if self.pending_bytes() > self.queue.high:
            # Back-pressure, as for a full socket queue: publishers pause
            # (up to the grace period) until acks drain the backlog.
            self.mark_congested()

    def pending_bytes(self) -> int:
        return self.queue.size + self.backlog_bytes

    def held_messages(self) -> int:
        # Events waiting for credit or for their commit: a disconnect discards them.
        return (sum(map(len, self.backlog)) + sum(len(b) for _, b in self.unpersisted)
                + len(self.batch))

    def _overflow(self, batch: list[bytes]) -> None:
        """A batch that did not fit: never sent, so out of messages_out (then the policy)."""
        n = len(batch)
        self.msgs_out -= n
        self.router.counters.msgs_out -= n
        self.overflow(n)

    def _notify(self, batch: list[bytes]) -> None:
        self.proto.notify(batch, self.now())
        self.on_deadline()
        self._write()

    def _drain_backlog(self) -> None:
        while self.backlog and self.proto.credit > 0:
            batch = self.backlog.popleft()
            self.backlog_bytes -= sum(map(len, batch))
            self.proto.notify(batch, self.now())
            self.on_deadline()
        self._write()
        self.notify_drained()

    def _write(self) -> None:
        data = self.proto.data_to_send()
        if data and self.enqueue(data):
            self.bytes_out += len(data)

    def notify_status(self, status: w.Status) -> None:
        if self.proto.state == "open" and not self.closed:
            self.proto.notify_status(status)
            self._write()

    # ---- client side ---------------------------------------------------------------

    def on_bytes(self, data: bytes) -> bool:
        """Handle received bytes, at most one slice of requests (a burst of
        queries or registrations); True when requests are left for another
        slice (the transport calls again with b"")."""
        inp = self.input
        try:
            if data:
                inp.add(self.proto.receive_data(data, self.now()))
            for requests in inp.take(_no_bytes):
                for req in requests:
                    if isinstance(req, w.EventsAcked):
                        continue
                    if isinstance(req, w.InitRequest):
                        self._init(req)
                    elif isinstance(req, w.RegisterRequest):
                        self._register(req)
                    elif isinstance(req, w.QueryRequest):
                        self._query(req)
                    if self.closing is not None:
                        break
                if self.closing is not None:
                    break
            if self.backlog and self.proto.credit > 0:
                self._drain_backlog()
        except ProtocolError as exc:
            self._fatal(str(exc))
        self._write()
        if self.closing is not None:
            inp.clear()
            return False
        return inp.pending

    def partial_bytes(self) -> int:
        return self.proto.chatter.buffered

    def _fatal(self, reason: str) -> None:
        self.router.counters.protocol_error(self.protocol, ErrorKind.BAD_MESSAGE)
        log.warning("eventer %s (%s): closing: %s", self.lname.decode(), self.client_name,
                    reason)
        self.closing = CloseReason.PROTOCOL_ERROR

    def _init(self, req: w.InitRequest) -> None:
        r = req.request
        self.opened = True
        self.client_name = r.client_name
        # Section 7: clientToken (or a client certificate) identifies the user.
        try:
            self.router.enforcer.login(self, r.client_token)
        except Refused as exc:
            self._refuse(req, exc.reason, ErrorKind.NOT_AUTHORISED)
            return
        reason = None
        # [broker] max_subscriptions bounds the patterns of one connection.
        try:
            self.router.check_room(self, len(r.subscriptions))
        except Refused as exc:
            reason = exc.reason
        for pattern in r.subscriptions:
            reason = reason or pattern_problem(pattern)
        if reason is not None:
            self._refuse(req, reason, ErrorKind.INIT_REFUSED)
            return
        self.persisted = r.persisted
        if r.persisted and not self.service.durable:
            # Without the store nothing is persisted: no persisted notifications.
            log.info("eventer %s (%s): persisted notifications asked for, but the store is "
                     "disabled: none will come", self.lname.decode(), r.client_name)
        elif r.server_id is None or r.server_id == self.service.server_id:
            if r.persisted:
                self.service.persisted.add(self)
            for pattern in r.subscriptions:
                try:
                    self.router.subscribe_pattern(self, events.pattern_bytes(pattern))
                except Refused as exc:
                    # A pattern reaching outside 'subscribe' refuses the init.
                    self._refuse(req, exc.reason, exc.kind)
                    return
        self.proto.accept(req.conv, self.service.status)
        self.service.connections.add(self)

    def _refuse(self, req: w.InitRequest, reason: str, kind: ErrorKind) -> None:
        self.router.counters.protocol_error(self.protocol, kind)
        log.info("eventer %s (%s): init refused: %s", self.lname.decode(), self.client_name,
                 reason)
        self.proto.refuse(req.conv, reason)
        self.closing = CloseReason.INIT_REFUSED

    def _register(self, req: w.RegisterRequest) -> None:
        sends = []
        failure = None
        if self.service.status is not w.Status.OPERATIONAL:
            failure = f"server is {self.service.status.value}"
        else:
            try:
                for ev in req.events:
                    self.seq += 1
                    sends.append(events.send_for_event(
                        ev.type, ev.payload, sender=self.lname,
                        seq=self.seq, source_timestamp=ev.source_timestamp,
                    ))
            except events.MappingError as exc:
                failure = str(exc)
        if failure is None:
            try:
                # All or nothing: every event's group is checked before any is routed.
                for message in sends:
                    self.router.enforcer.check_publish(self, message.header[b"group"])
            except NotPermitted as exc:
                failure = exc.reason
        if failure is None:
            # Every event must fit max_frame before any is routed (the
            # registration succeeds or fails as a whole); counted once.
            for i, message in enumerate(sends, 1):
                try:
                    check_injected(self.router, self, message)
                except FrameTooLarge as exc:
                    failure = f"event {i}: {exc}"
                    break
        if failure is not None:
            log.info("eventer %s (%s): registration failed: %s", self.lname.decode(),
                     self.client_name, failure)
            if req.conv is not None:
                self.proto.register_result(req.conv, None)
            return
        # BROKER-SPEC 11, as hat-event-server: one request is one session
        # (EventId session, timestamp, notification), its own subscriber is
        # notified too, and notifications go out before the response.
        router = self.router
        router.new_session()
        routed = [route_injected(router, self, m) for m in sends]
        router.deliver_own(self, routed)
        router.new_session()
        if req.conv is not None:
            encode = self.service.encode
            self.proto.register_result(req.conv, [encode(r) for r in routed])

    def _query(self, req: w.QueryRequest) -> None:
        svc = self.service
        types = getattr(req.params, "event_types", None) or ()
        problem = next(filter(None, map(pattern_problem, types)), None)
        if problem is not None:
            # Eventer has no query error: the answer is empty, the fault counted and logged.
            self.router.counters.protocol_error(self.protocol, ErrorKind.REJECTED)
            log.info("eventer %s (%s): query refused: %s", self.lname.decode(),
                     self.client_name, problem)
            self._answer(req.conv, None, [], False)
            return
        # Section 7: a query returns only what this client could have subscribed to.
        visible = None
        if self.perms is not None:
            may_read = self.router.enforcer.may_read

            def visible(entry: Entry) -> bool:
                header = view(entry).header
                return may_read(self, header[b"group"], header[b"to"])

        cluster = svc.ctx.cluster
        if cluster is not None and cluster.up():
            # BROKER-SPEC 8: every broker's events, merged; answered when gathered.
            cluster.query(req.params, svc.query, partial(self._answer, req.conv, visible),
                          self.principal, self.lname)
            return
        answer = svc.query(req.params, visible)
        self._answer(req.conv, None, answer.entries, answer.more_follows)

    def _answer(self, conv: Any, visible: Callable[[Entry], bool] | None,
                entries: list, more_follows: bool) -> None:
        if self.closed or self.proto.state != "open":
            return
        if visible is not None:
            entries = [e for e in entries if visible(e)]
        encode = self.service.encode_entry
        self.proto.query_result(conv, [encode(e) for e in entries], more_follows)
        self._write()

    # ---- timers and lifetime ------------------------------------------------------------

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(_conversation_timer, self)

    def on_closed(self) -> None:
        self.service.connections.discard(self)
        self.service.persisted.discard(self)

    def send_ping(self) -> None:
        if self.proto.chatter.envelope is not None:
            self.proto.ping(self.now(), timeout=None)
            self.on_deadline()
            self._write()

    def check_timeouts(self) -> None:
        for expired in self.proto.check_timeouts(self.now()):
            if expired.kind == "ping":
                continue  # the idle pinger judges liveness from any received bytes
            if expired.kind == "peer":
                # A conversation the client opened or handed back and abandoned:
                # forgotten (bounded state), counted, the connection stays.
                self.router.counters.protocol_error(self.protocol,
                                                    ErrorKind.ABANDONED_CONVERSATION)
                log.info("eventer %s (%s): expired a conversation the client left open",
                         self.lname.decode(), self.client_name)
                continue
            log.warning("eventer %s (%s): no answer to %s within %.1fs; closing",
                        self.lname.decode(), self.client_name, expired.kind,
                        self.proto.chatter.timeout)
            self.kill(CloseReason.CONVERSATION_TIMEOUT)
            return
        if self.backlog and self.proto.credit > 0:
            self._drain_backlog()


def _no_bytes(request: object) -> int:
    """Eventer requests are sliced by time only (the Chatter limits bound their size)."""
    return 0


def _nothing() -> None:
    pass


async def _conversation_timer(ep: EventerEndpoint) -> None:
    """Sleep until the next conversation deadline (or a new one), then check expiries."""
    wake = [trio.Event()]
    ep.on_deadline = lambda: wake[0].set()
    while not ep.closed:
        deadline = ep.proto.next_deadline()
        with trio.move_on_at(math.inf if deadline is None else deadline):
            await wake[0].wait()
        wake[0] = trio.Event()
        ep.check_timeouts()


async def serve_eventer(ctx: BrokerContext, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    service = EventerService(ctx)
    warm_up(ctx)
    ctx.eventer_query = service.query
    ctx.on_stopping.append(service.stopping)

    def new_endpoint() -> EventerEndpoint:
        b = ctx.config.broker  # as reloaded (SIGHUP): limits apply to new connections
        ep = EventerEndpoint(service, ctx.router, b.queue_limit, b.slow_consumer, b.max_frame)
        ep.now = trio.current_time
        return ep

    # No refusal message: Eventer can only refuse in MsgInitRes, an answer to
    # an init the connection has not sent yet; it is simply closed.
    section = ctx.config.eventer
    await serve_protocol(ctx, Protocol.EVENTER, section, new_endpoint,
                         keep_alive=(section.ping_delay, section.ping_timeout),
                         task_status=task_status)
