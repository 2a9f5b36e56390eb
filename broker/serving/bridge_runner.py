"""What every bridge shares: status, endpoint buffer, dialler, reconnect loop.

A bridge is a routing endpoint (so routed messages reach it like any
client) whose deliveries go into a bounded buffer that the bridge's own
tasks drain towards the remote peer.  A protocol's bridge is a
:class:`Bridge` whose specific part is one
``attempt(status)`` coroutine (one connection attempt) that dials with :func:`open_bridge_stream`
(the one TCP/TLS dialler of every bridge), runs until the connection fails,
and returns or raises; :func:`run_bridge` keeps the endpoint attached for
the bridge's lifetime and reconnects with capped exponential
backoff, keeping the status that metrics export.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable

import attrs
import trio

from broker.core.backoff import Backoff
from broker.core.inject import Injected, route_injected
from broker.core.reasons import CloseReason
from broker.core.refusals import FrameTooLarge, Refused
from broker.core.router import NORMAL, Endpoint, Routed, Router
from broker.core.tally import counter
from broker.serving.config import BridgeSection
from broker.serving.tls import client_ssl_context
from broker.store.spool import BridgeSpool
from wire.errors import ProtocolError

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class BridgeStatus:
    """A bridge's state and counters; the metrics export each declared counter
    with the labels ``bridge`` (name) and ``protocol``."""

    name: str
    protocol: str
    address: str
    up: bool = False
    connects: int = counter("skan_bridge_connects", "Successful bridge connections.")
    reconnects: int = counter("skan_bridge_reconnects",
                              "Reconnection attempts after a bridge went down.")
    # Messages dropped because the bounded buffer was full (counted and logged).
    overflow: int = counter("skan_bridge_overflow_messages",
                            "Messages dropped from a full bridge buffer.")
    sent: int = counter("skan_bridge_sent_messages", "Messages a bridge sent to its peer.")
    received: int = counter("skan_bridge_received_messages",
                            "Messages a bridge received from its peer.")
    last_error: str = ""
    # Set once a refusal by the bridge's user's permissions has been logged.
    denied_logged: bool = False
    # Set once a received message refused for passing max_frame has been logged.
    too_large_logged: bool = False


def bridge_route(router: Router, ep: Endpoint, message: Injected, status: BridgeStatus) -> None:
    """Route a message the bridge received (counted in ``status.received``).

    A refusal is logged here, once per bridge and kind, then only counted,
    and raised for the bridge to answer (or drop):
    :class:`~broker.core.refusals.NotPermitted` when the bridge's ``user``
    may not send it (counted in skan_permission_denied_total),
    :class:`~broker.core.refusals.FrameTooLarge` when its Skan message would
    pass ``max_frame`` (counted as a too-large protocol error)."""
    try:
        route_injected(router, ep, message)
    except FrameTooLarge as exc:
        status.last_error = f"a received message was refused: {exc}"
        if not status.too_large_logged:
            status.too_large_logged = True
            log.warning("bridge %s: %s (further ones are only counted)",
                        status.name, status.last_error)
        raise
    except Refused as exc:
        _denied(status, exc)
        raise
    status.received += 1


def _denied(status: BridgeStatus, exc: Refused) -> None:
    status.last_error = exc.reason
    if not status.denied_logged:
        status.denied_logged = True
        log.warning("bridge %s: %s (further refusals are only counted)", status.name, exc.reason)


class BufferedBridgeEndpoint(Endpoint):
    """Routed messages for the remote side wait here, bounded, until the bridge sends them."""

    batched = False

    def __init__(self, protocol: str, status: BridgeStatus, limit: int,
                 spool: BridgeSpool | None = None) -> None:
        super().__init__()
        self.protocol = protocol
        self.status = status
        self.limit = limit
        # The durable copy of the buffer (broker/store/spool.py): messages
        # are spooled on delivery and unspooled once acknowledged or dropped.
        self.spool = spool or BridgeSpool(None, status.name)
        self.pending: deque[Routed] = deque(self.spool.restore())
        self._ready = trio.Event()
        if self.pending:
            log.info("bridge %s: %d unacknowledged messages restored from the store",
                     status.name, len(self.pending))

    def deliver(self, frame: bytes, routed: Routed) -> None:
        gone = self.spool.added(routed)
        if gone:
            self._push_out(gone)
        if len(self.pending) >= self.limit:
            dropped = self.pending.popleft()
            self.spool.removed(dropped)
            self.status.overflow += 1
            self.dropped += 1
            log.warning(
                "bridge %s buffer full (%d): dropped the oldest message (session %d, instance %d)",
                self.status.name, self.limit, dropped.session, dropped.instance,
            )
        self.pending.append(routed)
        self.msgs_out += 1
        self.bytes_out += len(frame)
        self._ready.set()

    def _push_out(self, gone: list[tuple[int, int]]) -> None:
        """Drop from the buffer what the spool's byte bound pushed out (``[store]
        spool_max_bytes``): the oldest, so normally at its left.  Messages
        already handed to the peer (HSP in flight) are not here: their
        acknowledgement simply finds nothing left to unspool."""
        ids = set(gone)
        pending = self.pending
        dropped = 0
        while pending and (pending[0].session, pending[0].instance) in ids:
            ids.discard((pending[0].session, pending[0].instance))
            pending.popleft()
            dropped += 1
        if ids:  # not at the left (restored out of order): remove in place
            for r in [r for r in pending if (r.session, r.instance) in ids]:
                pending.remove(r)
                dropped += 1
        self.status.overflow += dropped
        self.dropped += dropped

    async def wait_pending(self) -> None:
        while not self.pending:
            self._ready = trio.Event()
            await self._ready.wait()


# Seconds to establish TCP (and TLS) before a bridge's attempt counts as failed.
CONNECT_TIMEOUT = 10.0


async def open_bridge_stream(cfg: BridgeSection) -> trio.abc.Stream:
    """Dial a bridge's peer: TCP, or TLS verified against ``tls_ca`` (system CAs if unset).

    Everything (TCP connect and TLS handshake) happens within CONNECT_TIMEOUT;
    failures are OSErrors (ConnectionError, TimeoutError) that run_bridge retries.
    """
    host, port = cfg.host_port()
    with trio.move_on_after(CONNECT_TIMEOUT):
        if not cfg.tls:
            return await trio.open_tcp_stream(host, port)
        # A client certificate for peers that require one (e.g. another
        # broker with tls_client_auth = "require").
        ctx = client_ssl_context(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
        stream = await trio.open_ssl_over_tcp_stream(host, port, ssl_context=ctx)
        try:
            # Handshake now: a bad certificate is then a failed connect, so the
            # bridge is never reported up and its backoff is not reset.
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            await trio.aclose_forcefully(stream)
            raise ConnectionError(
                f"TLS handshake with {cfg.address} failed: {exc.__cause__ or exc}"
            ) from exc
        return stream
    raise TimeoutError(f"no connection to {cfg.address} within {CONNECT_TIMEOUT}s")


def bridge_name(index: int, cfg: BridgeSection) -> str:
    return f"{cfg.protocol}-{index}-{cfg.address}"


class Bridge:
    """A bridge's state across its connections: the router, its ``[[bridges]]``
    entry and its status.  A protocol's subclass sets ``ep`` (the routing
    endpoint, attached while the bridge runs) and defines :meth:`attempt`
    (one connection); :meth:`run` is :func:`run_bridge` for it."""

    # Whether ``ep`` subscribes to the bridge's group and instance (a
    # Mariner bridge only receives).
    subscribes = True
    ep: Endpoint

    def __init__(self, router: Router, cfg: BridgeSection, status: BridgeStatus) -> None:
        self.router = router
        self.cfg = cfg
        self.status = status

    async def attempt(self, status: BridgeStatus) -> None:
        """One connection: dial, run until it fails, return or raise."""
        raise NotImplementedError

    async def run(self) -> None:
        """Attach the endpoint and connect, reconnecting, for as long as the bridge runs."""
        await run_bridge(self.router, self.ep, self.status, self.cfg, self.attempt,
                         subscribe=self.subscribes)


async def run_bridge(
    router: Router,
    ep: Endpoint,
    status: BridgeStatus,
    cfg: BridgeSection,
    attempt: Callable[[BridgeStatus], Awaitable[None]],
    *,
    subscribe: bool = True,
) -> None:
    """Attach ``ep`` (subscribed to the bridge's group and instance unless
    ``subscribe`` is false) for as long as the bridge runs, and run
    ``attempt`` forever, reconnecting with capped exponential backoff plus jitter.

    The endpoint lives as long as the broker, so messages for the peer are
    buffered even while it is unreachable.
    """
    ep.remote = cfg.address
    router.attach(ep)
    # Section 7: the bridge acts as its configured user (default: full rights).
    router.enforcer.login_bridge(ep, cfg.user)
    if subscribe:
        try:
            router.subscribe(ep, cfg.group.encode(), cfg.instance.encode(), NORMAL)
        except Refused as exc:
            _denied(status, exc)
    try:
        await _reconnect_forever(status, cfg, attempt)
    finally:
        router.detach(ep, CloseReason.BRIDGE_STOPPED)


async def _reconnect_forever(
    status: BridgeStatus,
    cfg: BridgeSection,
    attempt: Callable[[BridgeStatus], Awaitable[None]],
) -> None:
    backoff = Backoff(cfg.backoff_initial, cfg.backoff_max)
    while True:
        try:
            await attempt(status)
            status.last_error = "connection closed"
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, EOFError,
                ProtocolError) as exc:
            status.last_error = f"{type(exc).__name__}: {exc}"
        was_up = status.up
        status.up = False
        if was_up:
            # The connection worked: start the backoff from the beginning.
            backoff.reset()
        log.warning("bridge %s down (%s); retrying in %.1fs", status.name, status.last_error,
                    backoff.delay)
        await trio.sleep(backoff.wait())
        status.reconnects += 1
