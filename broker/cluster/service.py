"""The ``cluster`` service: one NATS connection per broker, driven by trio.

Start-up (before any listener accepts): connect to the first reachable URL
of ``[cluster] url``, refuse to start when another broker answers for this
broker's ``server_id``, then subscribe to the interest the backplane keeps.
While running: a reader routes every message from NATS to local endpoints
(one routing batch per received chunk); a writer sends what the backplane
queued (all of it in one write); a heartbeat announces this broker, so
``stats`` and ``/metrics`` can show the brokers seen.  When NATS goes away
the broker keeps routing locally, counts what it cannot forward, and
reconnects with capped exponential backoff, re-sending its subscriptions.
"""

from __future__ import annotations

import json
import logging
import secrets
from functools import partial
from typing import Any

import attrs
import trio

from broker.cluster.backplane import Backplane
from broker.core.queue import OutQueue
from broker.runtime.config import ClusterSection, nats_address
from broker.runtime.context import BrokerContext
from broker.runtime.transport import write_loop
from wire import nats
from wire.errors import ProtocolError

log = logging.getLogger(__name__)

RECV_SIZE = 256 * 1024
# Seconds to open TCP and complete CONNECT/PING/PONG with one NATS server.
CONNECT_TIMEOUT = 5.0
ID_SUBJECT = b"skc.id.%d"
HEARTBEAT_SUBJECT = b"skc.hb"
# Control subscriptions use sids outside the backplane's numeric range.
SID_ID, SID_HB, SID_INBOX = b"id", b"hb", b"inbox"


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

    def brokers(self) -> list[int]:
        """Server ids of the brokers seen, this one included."""
        return self.status.brokers_seen(trio.current_time(), self.heartbeat)

    def stats(self) -> dict[str, Any]:
        """The ``cluster`` HASH of the Skan ``stats`` reply."""
        bp, status = self.backplane, self.status
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


async def _open_link(cfg: ClusterSection, server_id: int) -> _Link:
    errors = []
    for url in cfg.url:
        host, port = nats_address(url)
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                stream = await trio.open_tcp_stream(host, port)
                link = _Link(stream, url)
                while not link.info:
                    for ev in await link.events():
                        if isinstance(ev, nats.Info):
                            link.info = ev.fields
                if not link.info.get("headers", False):
                    raise ClusterStartError(f"NATS at {url} does not support headers (need 2.2+)")
                await stream.send_all(nats.connect({
                    "verbose": False, "pedantic": False, "echo": False, "headers": True,
                    "no_responders": True, "protocol": 1, "lang": "python-trio",
                    "version": "skan", "name": f"skan-broker/{server_id}",
                }) + nats.PING)
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
    backplane = Backplane(ctx.router, server_id)
    queue = OutQueue(cfg.queue_limit)
    ctx.cluster = ClusterLink(backplane, status, cfg.heartbeat)
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
    backoff = cfg.backoff_initial
    while True:
        try:
            await _run_link(ctx, link, backplane, queue, status, cfg)
        except* LINK_ERRORS as group:
            log.warning("cluster: NATS connection to %s lost: %s", link.url, group.exceptions[0])
        status.up = False
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


async def _run_link(ctx: BrokerContext, link: _Link, backplane: Backplane, queue: OutQueue,
                    status: ClusterStatus, cfg: ClusterSection) -> None:
    router = ctx.router
    server_id = status.server_id
    queue.take_all()  # what was queued for the previous connection is gone with it
    await link.stream.send_all(
        nats.sub(ID_SUBJECT % server_id, SID_ID)
        + nats.sub(HEARTBEAT_SUBJECT, SID_HB)
        + b"".join(backplane.resubscribe())
    )
    status.up = True
    status.url = link.url
    status.connects += 1

    async def heartbeat() -> None:
        body = json.dumps({"server": server_id}).encode()
        while True:
            queue.push(nats.pub(HEARTBEAT_SUBJECT, body))
            await trio.sleep(cfg.heartbeat)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(write_loop, link.stream, queue, done_when_empty=_never))
        nursery.start_soon(heartbeat)
        while True:
            events = await link.events()
            for ev in events:
                if isinstance(ev, nats.Msg):
                    sid = ev.sid
                    if sid == SID_HB:
                        _heard(status, ev.payload)
                    elif sid == SID_ID:
                        if ev.reply:
                            queue.push(nats.pub(ev.reply, b"%d" % server_id))
                    else:
                        backplane.receive(ev)
                elif isinstance(ev, nats.Ping):
                    queue.push(nats.PONG)
                elif isinstance(ev, nats.Err):
                    log.warning("cluster: NATS error: %s", ev.message)
            router.end_batch()


def _never() -> bool:
    return False


def _heard(status: ClusterStatus, payload: bytes) -> None:
    try:
        server = int(json.loads(payload)["server"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return
    if server != status.server_id:
        status.seen[server] = trio.current_time()
