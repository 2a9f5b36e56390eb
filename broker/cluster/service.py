"""The ``cluster`` service: one NATS connection per broker, driven by trio.

Start-up (before any listener accepts): connect to the first reachable URL
of ``[cluster] url``, refuse to start when another broker answers for this
broker's ``server_id``, then subscribe to the interest the backplane keeps.
While running: a reader routes every message from NATS to local endpoints
(one routing batch per received chunk; paused while local consumers are
congested, as a publisher's connection is); a writer sends what the backplane
queued (all of it in one write); a heartbeat announces this broker, so
``stats`` and ``/metrics`` can show the brokers seen.  When NATS goes away
the broker keeps routing locally, counts what it cannot forward, and
reconnects with capped exponential backoff, re-sending its subscriptions.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import attrs
import trio

from broker.cluster import interest
from broker.cluster import query as cq
from broker.cluster.backplane import Backplane
from broker.cluster.ratelog import RateLimitedLog
from broker.core.queue import OutQueue
from broker.runtime.config import ClusterSection, nats_address
from broker.runtime.context import BrokerContext
from broker.runtime.tls import client_ssl_context
from broker.runtime.transport import (
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
ID_SUBJECT = b"skc.id.%d"
HEARTBEAT_SUBJECT = b"skc.hb"
# Eventer queries asked of every broker; answers come to the asker's inbox.
QUERY_SUBJECT = b"skc.query"
# Control subscriptions use sids outside the backplane's numeric range.
SID_ID, SID_HB, SID_INBOX = b"id", b"hb", b"inbox"
SID_QUERY, SID_ANSWERS = b"query", b"answers"
SID_INTEREST = b"interest"
# Seconds a cluster query waits for the brokers seen to answer; then it
# answers with what it has (a broker that died since its last heartbeat
# must not stall every query).  A NATS round trip on a LAN takes well
# under a millisecond, a 10,000-event answer a few tens of milliseconds.
QUERY_TIMEOUT = 2.0
# Seconds between two log lines about malformed messages from NATS: anyone
# who can publish on the cluster's subjects can send them at will, so the
# log gets the first of each interval and the counter gets every one.
MALFORMED_LOG_INTERVAL = 10.0
# NATS servers default to this max_payload when INFO does not say.
DEFAULT_MAX_PAYLOAD = 1024 * 1024


# What ends one NATS connection (then the broker reconnects); anything else is a bug.
LINK_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError)


class ClusterStartError(Exception):
    """The broker must not start (duplicate server id, no NATS reachable)."""


@attrs.define(eq=False)
class ClusterStatus:
    """What ``stats`` and the metrics export about the backplane."""

    server_id: int
    up: bool = False
    url: str = ""
    connects: int = 0
    # server id -> trio time of its last heartbeat
    seen: dict[int, float] = attrs.Factory(dict)

    def brokers_seen(self, now: float, heartbeat: float) -> list[int]:
        return sorted([self.server_id, *(s for s, t in self.seen.items()
                                         if now - t < 3 * heartbeat)])


@attrs.define(eq=False)
class ClusterLink:
    """The backplane and its status, for ``stats`` and the metrics."""

    backplane: Backplane
    status: ClusterStatus
    # Seconds between heartbeats ([cluster] heartbeat): a broker counts as
    # seen while its last heartbeat is younger than three of them.
    heartbeat: float = 1.0
    # Set by the service: where cluster queries run, and the NATS queue.
    nursery: trio.Nursery | None = None
    queue: OutQueue | None = None
    max_payload: int = DEFAULT_MAX_PAYLOAD
    inbox: bytes = attrs.Factory(lambda: b"_INBOX." + secrets.token_hex(8).encode() + b".")
    # reply subject -> [answers still expected, answers, done]
    pending: dict[bytes, list[Any]] = attrs.Factory(dict)
    queries: int = 0
    query_timeouts: int = 0

    def up(self) -> bool:
        return self.status.up

    def query(self, params: Any, local: cq.LocalQuery,
              done: Callable[[list[tuple], bool], None]) -> None:
        """Answer an Eventer query from every broker: ``done(entries, more_follows)``
        is called once, with entries carrying their server id (broker.cluster.query)."""
        own = cq.local_answer(params, local, self.status.server_id)
        assert self.nursery is not None
        self.nursery.start_soon(self._answer_when_gathered, params, own, done)

    async def _answer_when_gathered(self, params: Any, own: cq.Gathered,
                                    done: Callable[[list[tuple], bool], None]) -> None:
        merged = await self._gather(params, own)
        done(merged.entries, merged.more_follows)

    async def gather(self, params: Any, local: cq.LocalQuery) -> cq.Gathered:
        """Every broker's answer to an Eventer query, merged (broker.cluster.query)."""
        return await self._gather(params, cq.local_answer(params, local,
                                                          self.status.server_id))

    async def replay(self, last: Any, timestamp: float,
                     patterns: tuple[tuple[str, ...], ...],
                     local: cq.LocalQuery) -> AsyncIterator[list[tuple]]:
        """The events of a cluster-wide Mariner replay after ``last`` (whose
        timestamp is ``timestamp``), page by page from every broker, each page
        in (timestamp, EventId) order, with no cap (broker.cluster.query.ReplayPager).
        Ends early, logged, when the paging cannot move on."""
        pager = cq.ReplayPager(patterns, (timestamp, last.server, last.session, last.instance))
        while not pager.done:
            params = pager.params()
            answers = await self._answers(params, cq.local_answer(
                params, local, self.status.server_id))
            yield pager.take(answers)
        if pager.gap:
            log.warning("cluster: replay after %r stopped at %r: a broker keeps more than "
                        "%d events with one timestamp, or one too large for NATS",
                        last, pager.cursor, cq.QUERY_LIMIT)

    async def _gather(self, params: Any, own: cq.Gathered) -> cq.Gathered:
        return cq.merge(params, await self._answers(params, own))

    async def _answers(self, params: Any, own: cq.Gathered) -> list[cq.Gathered]:
        """Every broker's answer to ``params``: ours, then those that came in time."""
        answers = [own]
        expected = len(self.brokers()) - 1
        if expected > 0 and self.status.up and self.queue is not None:
            self.queries += 1
            reply = self.inbox + b"%d" % self.queries
            state: list[Any] = [expected, answers, trio.Event()]
            self.pending[reply] = state
            try:
                self.queue.push(nats.pub(QUERY_SUBJECT, cq.encode_request(params), reply))
                with trio.move_on_after(QUERY_TIMEOUT) as scope:
                    await state[2].wait()
                if scope.cancelled_caught:
                    self.query_timeouts += 1
                    log.warning("cluster: query answered by %d of %d brokers within %.1f s",
                                len(answers) - 1, expected, QUERY_TIMEOUT)
            finally:
                del self.pending[reply]
        return answers

    def answered(self, msg: nats.Msg) -> None:
        """An answer to one of our queries arrived (reader task)."""
        state = self.pending.get(msg.subject)
        if state is None:
            return  # too late: that query has answered already
        try:
            state[1].append(cq.decode_answer(msg.payload))
        except ValueError as exc:
            self.backplane.count_malformed(
                f"bad query answer on {msg.subject.decode(errors='replace')}: {exc}")
        state[0] -= 1
        if state[0] <= 0:
            state[2].set()

    def answer(self, ctx: BrokerContext, msg: nats.Msg) -> None:
        """Another broker asks a query: answer from our own store (reader task)."""
        if not msg.reply or self.queue is None:
            return
        try:
            params = cq.decode_request(msg.payload)
        except ValueError as exc:
            self.backplane.count_malformed(f"bad query request: {exc}")
            return
        if ctx.retention is None:
            found = cq.Gathered([], False)
        else:
            local = (ctx.eventer.query if ctx.eventer is not None
                     else cq.local_query(ctx.retention, ctx.latest, self.status.server_id))
            found = cq.local_answer(params, local, self.status.server_id)
        self.queue.push(nats.pub(msg.reply, cq.encode_answer(
            found, self.max_payload - cq.PAYLOAD_MARGIN)))

    def brokers(self) -> list[int]:
        """Server ids of the brokers seen, this one included."""
        return self.status.brokers_seen(trio.current_time(), self.heartbeat)

    def stats(self) -> dict[str, Any]:
        """The ``cluster`` HASH of the Skan ``stats`` reply."""
        bp, status = self.backplane, self.status
        # The backplane counts when the router hands a batch over: a stats
        # request must count what its own batch routed before it.
        bp.router.hand_over()
        brokers = self.brokers()
        return {
            "server_id": status.server_id,
            "up": int(status.up),
            "url": status.url,
            "connects": status.connects,
            "brokers_seen": len(brokers),
            "brokers": [b"%d" % b for b in brokers],
            "backplane_out": bp.sent,
            "backplane_in": bp.received,
            "backplane_drops": bp.drops,
            "backplane_withheld": bp.withheld,
            "interest": bp.remote.state,
            "duplicates": bp.duplicates,
            "malformed": bp.malformed,
        }


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
        nats.sub(inbox, SID_INBOX) + nats.pub(ID_SUBJECT % server_id, b"", inbox) + nats.PING
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
    backoff = cfg.backoff_initial
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
            await trio.sleep(backoff * (0.5 + secrets.randbelow(1000) / 1000))
            backoff = min(backoff * 2, cfg.backoff_max)
            try:
                link = await _open_link(cfg, server_id)
                break
            except (OSError, ClusterStartError) as exc:
                log.warning("cluster: reconnect failed: %s", exc)
        backoff = cfg.backoff_initial
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
        nats.sub(ID_SUBJECT % server_id, SID_ID)
        + nats.sub(HEARTBEAT_SUBJECT, SID_HB)
        + nats.sub(QUERY_SUBJECT, SID_QUERY)
        + nats.sub(state.inbox + b"*", SID_ANSWERS)
        + nats.sub(interest.SUBJECT, SID_INTEREST)
        + b"".join(backplane.resubscribe())
    )
    status.up = True
    status.url = link.url
    status.connects += 1
    # What the other brokers wanted may have changed unseen: publish everything
    # until they have announced again, and ask them to (hello).
    backplane.connected(trio.current_time())

    async def heartbeat() -> None:
        body = json.dumps({"server": server_id}).encode()
        while True:
            queue.push(nats.pub(HEARTBEAT_SUBJECT, body))
            await trio.sleep(cfg.heartbeat)
            backplane.remote.tick(trio.current_time())
            backplane.announce()  # the full set, with each heartbeat (before it)

    async with trio.open_nursery() as nursery:
        # With the router: what a routing slice queues for NATS (the backplane
        # observes in end_batch) is written by that slice's task right after
        # it, when the writer is parked: no task switch per routing batch.
        nursery.start_soon(partial(write_loop, link.stream, queue, done_when_empty=_never,
                                   router=router))
        nursery.start_soon(heartbeat)
        while True:
            events = await link.events()
            # Routed like a client's read: one batch, direct writes after it.
            writes = open_slice(router)
            try:
                for ev in events:
                    if isinstance(ev, nats.Msg):
                        sid = ev.sid
                        if sid == SID_HB:
                            _heard(status, backplane, ev.payload)
                        elif sid == SID_INTEREST:
                            backplane.interest_received(ev.payload, trio.current_time())
                        elif sid == SID_ANSWERS:
                            state.answered(ev)
                        elif sid == SID_QUERY:
                            state.answer(ctx, ev)
                        elif sid == SID_ID:
                            if ev.reply:
                                queue.push(nats.pub(ev.reply, b"%d" % server_id))
                        else:
                            backplane.receive(ev)
                    elif isinstance(ev, nats.Ping):
                        queue.push(nats.PONG)
                    elif isinstance(ev, nats.Err):
                        log.warning("cluster: NATS error: %s", ev.message)
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


def _heard(status: ClusterStatus, backplane: Backplane, payload: bytes) -> None:
    try:
        server = int(json.loads(payload)["server"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return
    if server != status.server_id:
        now = trio.current_time()
        status.seen[server] = now
        backplane.remote.heard(server, now)
