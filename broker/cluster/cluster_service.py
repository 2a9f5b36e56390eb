"""The ``cluster`` service: one NATS connection per broker, driven by trio.

Start-up (before any listener accepts): connect to the first reachable URL
of ``[cluster] url``, refuse to start when another broker answers for this
broker's ``server_id``, then subscribe to the interest the backplane keeps.
While running: a reader routes every message from NATS to local endpoints
(one routing batch per received chunk; paused while local consumers are
congested, as a publisher's connection is); a writer sends what the backplane
queued (all of it in one write); a heartbeat announces this broker, so
``stats`` and ``/metrics`` can show the brokers seen; interest messages
are applied by a task of their own (bounded backlog, one message per
turn), off the reader that routes; queries from other brokers are answered
at most QUERY_BURST per read (bounded backlog).  Every subject a broker publishes on
names it (:mod:`broker.cluster.subjects`), and everything read from NATS
is checked as untrusted input (BROKER-SPEC section 8).  When NATS goes away
the broker keeps routing locally, counts what it cannot forward, and
reconnects with capped exponential backoff, re-sending its subscriptions.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from functools import partial

import trio

from broker.cluster import cluster_query as cq
from broker.cluster import peers, subjects
from broker.cluster.backplane import Backplane
from broker.cluster.link import (
    DEFAULT_MAX_PAYLOAD,
    ClusterLink,
    ClusterStatus,
)
from broker.cluster.ratelog import RateLimitedLog
from broker.core.backoff import Backoff
from broker.core.queue import OutQueue
from broker.serving.config import ClusterSection, nats_address
from broker.serving.context import BrokerContext
from broker.serving.tls import client_ssl_context
from broker.serving.transport import (
    close_slice,
    open_slice,
    relieve_congestion,
    write_loop,
)
from wire import nats
from wire.errors import ProtocolError

log = logging.getLogger(__name__)

RECV_SIZE = 256 * 1024
# Seconds to open TCP and complete CONNECT/PING/PONG with one NATS server.
CONNECT_TIMEOUT = 5.0
# Control subscriptions use sids outside the backplane's numeric range.
SID_ID, SID_HB, SID_INBOX = b"id", b"hb", b"inbox"
SID_QUERY, SID_ANSWERS = b"query", b"answers"
SID_INTEREST, SID_PING = b"interest", b"ping"
# Interest messages waiting for the interest task.  Past it the oldest
# sender's interest is forgotten (counted as malformed; everything is then
# published to it until its next full set): a flood of them must never
# hold memory or the reader.
INTEREST_BACKLOG = 256
# Queries from other brokers waiting to be answered (an answer reads the
# store: milliseconds each).  Past it a query is answered empty at once and
# counted (queries_refused).
QUERY_BACKLOG = 32
# Queries answered per read from NATS at most (the rest wait for the next
# reads): a flood of queries costs each read a bounded amount of work.
QUERY_BURST = 4
# Seconds between two log lines about malformed messages from NATS: anyone
# who can publish on the cluster's subjects can send them at will, so the
# log gets the first of each interval and the counter gets every one.
MALFORMED_LOG_INTERVAL = 10.0


# What ends one NATS connection (then the broker reconnects); anything else is a bug.
LINK_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError)


class ClusterStartError(Exception):
    """The broker must not start (duplicate server id, no NATS reachable)."""


class _Link:
    """One open NATS connection: stream plus codec."""

    def __init__(self, stream: trio.abc.Stream, url: str) -> None:
        self.stream = stream
        self.url = url
        self.conn = nats.NatsConnection()
        self.info: dict = {}

    async def events(self) -> list[nats.Event]:
        data = await self.stream.receive_some(RECV_SIZE)
        if not data:
            raise trio.BrokenResourceError("NATS closed the connection")
        return self.conn.receive_data(data)


def connect_options(cfg: ClusterSection, server_id: int, tls: bool) -> dict[str, object]:
    """The CONNECT fields: no echo (our own messages never come back), headers
    (the run's origin), and the credentials of [cluster]."""
    options: dict[str, object] = {
        "verbose": False, "pedantic": False, "echo": False, "headers": True,
        "no_responders": True, "protocol": 1, "lang": "python-trio",
        "version": "skan", "name": f"skan-broker/{server_id}", "tls_required": tls,
    }
    if cfg.token is not None:
        options["auth_token"] = cfg.token
    if cfg.user is not None:
        options["user"] = cfg.user
        options["pass"] = cfg.password
    return options


async def _open_link(cfg: ClusterSection, server_id: int) -> _Link:
    errors = []
    for url in cfg.url:
        host, port = nats_address(url)
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
                link = _Link(stream, url)
                while not link.info:
                    for ev in await link.events():
                        if isinstance(ev, nats.Info):
                            link.info = ev.fields
                # NATS upgrades to TLS after its INFO, before CONNECT.
                tls = cfg.tls or url.startswith("tls://") or bool(link.info.get("tls_required"))
                if tls:
                    if not link.info.get("tls_available", link.info.get("tls_required")):
                        await trio.aclose_forcefully(stream)
                        raise ClusterStartError(f"NATS at {url} does not offer TLS")
                    ctx = client_ssl_context(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
                    stream = link.stream = trio.SSLStream(stream, ctx, server_hostname=host)
                    try:
                        await stream.do_handshake()
                    except trio.BrokenResourceError as exc:
                        raise OSError(f"TLS handshake failed: {exc.__cause__ or exc}") from None
                if not link.info.get("headers", False):
                    raise ClusterStartError(f"NATS at {url} does not support headers (need 2.2+)")
                await stream.send_all(
                    nats.connect(connect_options(cfg, server_id, tls)) + nats.PING)
                while True:
                    evs = await link.events()
                    if any(isinstance(e, nats.Err) for e in evs):
                        err = next(e for e in evs if isinstance(e, nats.Err))
                        raise ClusterStartError(f"NATS at {url} refused CONNECT: {err.message}")
                    if any(isinstance(e, nats.Pong) for e in evs):
                        return link
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, ProtocolError) as exc:
            errors.append(f"{url}: {exc or type(exc).__name__}")
    raise OSError("no NATS server reachable (" + "; ".join(errors) + ")")


async def _id_in_use(link: _Link, server_id: int, timeout: float) -> bool:
    """Ask the cluster whether a broker already answers for ``server_id``."""
    inbox = b"_INBOX." + secrets.token_hex(8).encode()
    await link.stream.send_all(
        nats.sub(inbox, SID_INBOX)
        + nats.pub(subjects.control(subjects.ID_PROBE, server_id), b"", inbox) + nats.PING
    )
    with trio.move_on_after(timeout):
        while True:
            for ev in await link.events():
                if isinstance(ev, nats.Msg) and ev.sid == SID_INBOX:
                    return not (ev.headers and b"503" in ev.headers[:16])  # 503: no responders
    return False


async def serve_cluster(ctx: BrokerContext, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    cfg = ctx.config.cluster
    server_id = ctx.config.broker.server_id
    status = ClusterStatus(server_id)
    backplane = Backplane(ctx.router, server_id, cfg.heartbeat)
    backplane.on_malformed = RateLimitedLog(
        log, "cluster: malformed message from NATS (counted in stats cluster.malformed): %s",
        MALFORMED_LOG_INTERVAL)
    queue = OutQueue(cfg.queue_limit)
    link_state = ctx.cluster = ClusterLink(backplane, status, cfg.heartbeat, queue=queue)
    link_state.auth = lambda: ctx.router.enforcer.auth
    ctx.router.stats_sections["cluster"] = ctx.cluster.stats

    def forward(data: bytes) -> bool:
        return status.up and queue.push(data)

    backplane.send = forward
    link = await _open_link(cfg, server_id)
    if await _id_in_use(link, server_id, cfg.id_probe_timeout):
        await link.stream.aclose()
        raise ClusterStartError(
            f"server_id {server_id} is already in use by another broker of the cluster "
            f"(NATS at {link.url}); give every broker its own [broker] server_id"
        )
    task_status.started([])
    log.info("cluster: connected to NATS at %s as server %d", link.url, server_id)
    async with trio.open_nursery() as nursery:
        link_state.nursery = nursery
        await _serve(ctx, link, link_state, cfg)


async def _serve(ctx: BrokerContext, link: _Link, state: ClusterLink,
                 cfg: ClusterSection) -> None:
    status = state.status
    server_id = status.server_id
    backoff = Backoff(cfg.backoff_initial, cfg.backoff_max)
    while True:
        try:
            state.max_payload = int(link.info.get("max_payload", DEFAULT_MAX_PAYLOAD))
            state.backplane.max_payload = state.max_payload
            await _run_link(ctx, link, state, cfg)
        except* LINK_ERRORS as group:
            log.warning("cluster: NATS connection to %s lost: %s", link.url, group.exceptions[0])
        status.up = False
        state.backplane.remote.disconnected()
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(link.stream)
        while True:
            await trio.sleep(backoff.wait())
            try:
                link = await _open_link(cfg, server_id)
                break
            except (OSError, ClusterStartError) as exc:
                log.warning("cluster: reconnect failed: %s", exc)
        backoff.reset()
        log.info("cluster: reconnected to NATS at %s", link.url)


async def _run_link(ctx: BrokerContext, link: _Link, state: ClusterLink,
                    cfg: ClusterSection) -> None:
    router = ctx.router
    backplane, status, queue = state.backplane, state.status, state.queue
    assert queue is not None
    server_id = status.server_id
    grace = ctx.config.broker.slow_consumer_grace
    queue.take_all()  # what was queued for the previous connection is gone with it
    await link.stream.send_all(
        nats.sub(subjects.control(subjects.ID_PROBE, server_id), SID_ID)
        + nats.sub(subjects.HEARTBEAT + b"*", SID_HB)
        + nats.sub(subjects.QUERY + b"*", SID_QUERY)
        + nats.sub(subjects.PING + b"*", SID_PING)
        + nats.sub(state.inbox + b"*", SID_ANSWERS)
        + nats.sub(subjects.INTEREST + b"*", SID_INTEREST)
        + b"".join(backplane.resubscribe())
    )
    status.up = True
    status.url = link.url
    status.connects += 1
    # What the other brokers wanted may have changed unseen: publish everything
    # until they have announced again, and ask them to (hello).
    backplane.connected(trio.current_time())

    async def heartbeat() -> None:
        body = peers.encode_hello(server_id, status.boot)
        subject = subjects.control(subjects.HEARTBEAT, server_id)
        while True:
            queue.push(nats.pub(subject, body))
            await trio.sleep(cfg.heartbeat)
            now = trio.current_time()
            backplane.remote.tick(now)
            status.peers.forget(now, 3 * cfg.heartbeat)
            if backplane.remote.busy:
                arrived.set()  # a forgotten broker's counts to undo
            backplane.announce()  # the full set, with each heartbeat (before it)

    # Interest messages, applied one per turn by their own task.
    remote = backplane.remote
    backlog: deque[nats.Msg] = deque()
    arrived = trio.Event()

    async def apply_interest() -> None:
        nonlocal arrived
        while True:
            await arrived.wait()
            arrived = trio.Event()
            while backlog or remote.busy:
                if backlog:
                    msg = backlog.popleft()
                    backplane.interest_received(msg.payload, trio.current_time(), msg.subject)
                remote.work()  # bounded steps, other tasks in between
                await trio.sleep(0)

    queries: deque[nats.Msg] = deque()

    def query_arrived(msg: nats.Msg) -> None:
        if len(queries) >= QUERY_BACKLOG:
            state.answer(None, msg, refused=True)
            return
        queries.append(msg)

    def interest_arrived(msg: nats.Msg) -> None:
        if len(backlog) >= INTEREST_BACKLOG:
            lost = backlog.popleft()
            backplane.interest_lost(lost.subject, trio.current_time())
        backlog.append(msg)
        arrived.set()

    async with trio.open_nursery() as nursery:
        # With the router: what a routing slice queues for NATS (the backplane
        # observes in end_batch) is written by that slice's task right after
        # it, when the writer is parked: no task switch per routing batch.
        nursery.start_soon(partial(write_loop, link.stream, queue, done_when_empty=_never,
                                   router=router))
        nursery.start_soon(heartbeat)
        nursery.start_soon(apply_interest)
        while True:
            events = await link.events()
            # Routed like a client's read: one batch, direct writes after it.
            writes = open_slice(router)
            try:
                for ev in events:
                    if isinstance(ev, nats.Msg):
                        sid = ev.sid
                        if sid == SID_HB:
                            state.heard(ev.subject, ev.payload)
                        elif sid == SID_INTEREST:
                            interest_arrived(ev)
                        elif sid == SID_ANSWERS:
                            state.answered(ev)
                        elif sid == SID_QUERY:
                            query_arrived(ev)
                        elif sid == SID_PING:
                            state.pinged(ev)
                        elif sid == SID_ID:
                            if ev.reply:
                                queue.push(nats.pub(ev.reply, b"%d" % server_id))
                        else:
                            backplane.receive(ev)
                    elif isinstance(ev, nats.Ping):
                        queue.push(nats.PONG)
                    elif isinstance(ev, nats.Err):
                        log.warning("cluster: NATS error: %s", ev.message)
                # Queries from other brokers: at most QUERY_BURST per read
                # (each reads the store); the rest wait, bounded, for the
                # next reads (a heartbeat brings one at least every
                # heartbeat).  Answered inside the routing slice, as the
                # store's view must include this batch.
                for _ in range(min(len(queries), QUERY_BURST)):
                    state.answer(_local_query(ctx), queries.popleft())
            finally:
                close_slice(router, writes)
            if router.congested:
                # Back-pressure, as on a publisher's connection: stop reading
                # NATS while local consumers catch up (at most the grace per
                # consumer; then their slow-consumer policy applies).  NATS
                # buffers meanwhile, and past its own limit (max_pending, 64
                # MiB by default) drops this broker as a slow consumer: it
                # reconnects, and what NATS dropped is lost (at-most-once).
                await relieve_congestion(router, grace)


def _never() -> bool:
    return False


def _local_query(ctx: BrokerContext) -> cq.LocalQuery | None:
    """How this broker answers an Eventer query from its own store (None: it retains nothing)."""
    if ctx.retention is None:
        return None
    if ctx.eventer_query is not None:
        return ctx.eventer_query
    return cq.local_query(ctx.retention, ctx.latest, ctx.config.broker.server_id)
