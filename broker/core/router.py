"""The routing core: endpoints, the send rules, routing batches and observers.

Pure and synchronous: no trio, no I/O.  Every connection of every protocol
(and every bridge) is an :class:`Endpoint` with an lname.  Adapters decode
their protocol, turn it into a Skan frame plus decoded routing header, and
call :meth:`Router.route`; the router picks the recipients and calls
``endpoint.deliver(frame, routed)`` on each, which must never block (it
queues, or applies the slow-consumer policy).

Who receives what is the subscription index's (broker/core/sublist.py, with
its recipient cache); the counters are broker/core/counters.py's, the lnames
broker/core/lnames.py's, permission enforcement broker/core/enforcement.py's
(``Router.enforcer``).  The router asks the enforcer and applies the
subscription limit before it changes the index, routes and batches, and
hands batches to observers.  Refusals are raised, one family
(broker/core/refusals.py).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any

import attrs

from broker.core.auth import Authenticator, Permissions, Principal
from broker.core.counters import Counters
from broker.core.enforcement import Enforcer
from broker.core.eventtypes import STAR
from broker.core.lnames import LnameFactory
from broker.core.reasons import CloseReason
from broker.core.refusals import TooManySubscriptions
from broker.core.sublist import (
    MEONLY,
    NORMAL,
    PROMISC,
    SUBTYPES,
    RouteKey,
    SubscriptionIndex,
)

# Names other modules import from here (defined in sublist, counters, eventtypes).
__all__ = ["MEONLY", "NORMAL", "PROMISC", "STAR", "SUBTYPES", "Counters", "RouteKey"]

# Default of ``[broker] max_subscriptions``: subscriptions (instance
# subscriptions plus Hat patterns) one connection may hold.  Every one is
# state the broker keeps and, for patterns, work on every cache miss, so one
# client must not be able to create them without bound; real clients use a
# handful, so this only stops runaway or hostile ones.
DEFAULT_MAX_SUBSCRIPTIONS = 10_000

class Endpoint:
    """A routing endpoint: one connection of any protocol, or one bridge.

    Subclasses implement :meth:`deliver` (queue the frame or apply the
    slow-consumer policy) and :meth:`flush` (end of a routing batch, for
    adapters that group deliveries, like Eventer's EventsNotify).  The
    counters are plain ints, read by ``stats`` and the metrics collector.
    """

    protocol: str = "skan"
    # True for endpoints that buffer deliveries until the batch ends.
    batched: bool = False

    def __init__(self) -> None:
        self.lname: bytes = b""
        self.msgs_in = 0
        self.bytes_in = 0
        self.msgs_out = 0
        self.bytes_out = 0
        self.dropped = 0
        self.closed = False
        # Who this connection is (section 7): set by Enforcer.login.  ``perms``
        # None means full rights (the hot path tests only that).
        self.principal: Principal | None = None
        self.perms: Permissions | None = None
        # ``perms.publish_allowed`` (None with full rights), for the hot path.
        self.publish_allowed: set[bytes] | None = None
        # Subject CN of a verified TLS client certificate (set by the transport).
        self.cert_name: str | None = None
        # For the connection listing (set once per connection, never per
        # message): the peer's "host:port" (the transport, or a bridge's
        # address) and when Router.attach admitted it (the router's clock).
        self.remote: str | None = None
        self.since = 0.0

    def deliver(self, frame: bytes, routed: Routed) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def flush(self) -> None:
        """Called once at the end of a routing batch in which ``deliver`` was called."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.lname.decode(errors='replace')}>"


@attrs.define(slots=True, eq=False)
class Routed:
    """One routed message, as every protocol, the retention store and the log see it.

    ``frame`` is the complete Skan frame (4-byte length prefix included), the
    bytes forwarded to Skan recipients.  ``header`` is its decoded top-level
    hash with ``msg`` left opaque (see :func:`wire.skan.decode_header`;
    offsets in it are relative to ``frame``).  ``session``/``instance`` form
    the Hat EventId together with the server id.
    """

    frame: bytes
    header: dict[bytes, Any]
    sender: Endpoint
    recipients: tuple[Endpoint, ...]
    delivered: int
    session: int
    instance: int
    timestamp: float
    # Server id of the broker the message entered (EventId's first part).
    server: int = 0


class Router:
    """Endpoints and the send rules of BROKER-SPEC section 1: routing, batches,
    observers; who receives is the index's (``index``), what a connection may
    do the enforcer's (``enforcer``)."""

    def __init__(
        self,
        *,
        hostname: str | None = None,
        clock: Callable[[], float] = time.time,
        max_subscriptions: int = DEFAULT_MAX_SUBSCRIPTIONS,
        max_frame: int | None = None,
        server_id: int = 0,
    ):
        self.clock = clock
        self.server_id = server_id
        # Per connection (instance subscriptions plus patterns); past it a
        # subscribe is refused (counted), see subscribe().
        self.max_subscriptions = max_subscriptions
        # Bound on frames the broker builds itself (None: unchecked), see
        # broker.core.inject.check_injected().
        self.max_frame = max_frame
        self.started = clock()
        self.counters = Counters()
        # lnames carry HOST/SERVER_ID (section 7): the broker owning one is known.
        self._new_lname = LnameFactory(
            hostname or f"{socket.gethostname() or 'localhost'}/{server_id}")
        self.endpoints: dict[bytes, Endpoint] = {}
        # Who subscribes to what, and the cached recipient sets (sublist.py);
        # ``_cache`` is its cache, looked up directly on the hot path.
        self.index = SubscriptionIndex(self.endpoints)
        self._cache = self.index.cache
        # Live connections per protocol, kept current so ``stats`` never walks
        # every endpoint (a burst of stats requests must stay cheap).
        self.live: dict[str, int] = {}
        # Sessions must increase strictly across restarts: start from the
        # clock in microseconds (a broker opens far fewer than 10^6 batches/s).
        self.session = int(clock() * 1_000_000)
        self._instance = 0
        self._in_batch = False
        self._dirty: list[Endpoint] = []
        # Endpoints whose outgoing queue passed its high-water mark during
        # routing; the trio layer pauses the publishing reader on them.
        self.congested: list[Endpoint] = []
        # Observers see what a batch routed, once per batch, in routing order
        # (hand_over(), called by end_batch()): one call per received chunk,
        # not per message, so an observer does its per-message work in one
        # loop (or in C-level calls over the list) with its state in locals.
        # ``observers`` get every Routed message, delivered or not (the log);
        # ``local_observers`` then get those that entered this broker, not
        # those a cluster backplane brought in: what a broker of a cluster
        # keeps for Eventer queries and Mariner replay, and what its backplane
        # publishes (BROKER-SPEC 8).
        self.observers: list[Callable[[list[Routed]], None]] = []
        self.local_observers: list[Callable[[list[Routed]], None]] = []
        self._routed: list[Routed] = []
        self._routed_remote = 0  # how many of _routed came from a backplane
        # Set by the transport while a reader routes one slice: parked
        # writers of the slice's recipients register here and are sent to
        # right after it (broker.serving.transport.write_loop); None outside.
        self.slice_writes: list[Callable[[], None]] | None = None
        # Called with each endpoint on detach (adapters, metrics).
        self.on_detach: list[Callable[[Endpoint], None]] = []
        # Interest changes of the index (the cluster backplane appends here).
        self.interest = self.index.interest
        # Set by the metrics service (None = metrics off, no per-message cost):
        # group -> [messages routed, deliveries], and the routing-latency
        # buckets the transport fills per received chunk.
        self.group_stats: dict[bytes, list[int]] | None = None
        self.latency: Any = None
        # Section 7: users, credentials and the permission checks
        # (enforcement.py); its ``auth`` is replaced on reload (reload_auth).
        self.enforcer = Enforcer(self.counters)
        # Extra sections of the ``stats`` reply, by name (e.g. "cluster"): each
        # returns a small dict when asked, so ``stats`` walks nothing for them.
        self.stats_sections: dict[str, Callable[[], dict[str, Any]]] = {}

    # ---- permissions (section 7): the enforcer's, applied here -----------

    def reload_auth(self, auth: Authenticator) -> list[Endpoint]:
        """Switch to a reloaded configuration of users and permissions.

        Live connections keep their principal with the new permissions;
        subscriptions no longer permitted are removed.  Returns the endpoints
        whose credential no longer authenticates: the caller closes them.
        """
        revoked = self.enforcer.reload(auth, list(self.endpoints.values()))
        closing = set(revoked)
        index = self.index
        for ep in list(self.endpoints.values()):
            if ep in closing or ep.perms is None:
                continue  # closing keeps what it had; full rights refuse nothing
            instances, patterns = self.enforcer.refused_subscriptions(
                ep,
                [(g, i, st == PROMISC) for g, i, st in index.instance_subscriptions(ep)],
                [(p, st == PROMISC) for p, st in index.pattern_subscriptions(ep)])
            for group, instance in instances:
                self.unsubscribe(ep, group, instance)
            for pattern in patterns:
                self.unsubscribe_pattern(ep, pattern)
        # Permissions decide reply eligibility in every group: drop every cached set.
        index.invalidate_group(None)
        return revoked  # type: ignore[return-value]

    # ---- endpoints -------------------------------------------------------

    def attach(self, endpoint: Endpoint) -> bytes:
        """Register a new connection; gives it its lname (unique, never reused)."""
        lname = self._new_lname()
        endpoint.lname = lname
        endpoint.since = self.clock()
        self.endpoints[lname] = endpoint
        acc = self.counters.accepted
        proto = endpoint.protocol
        acc[proto] = acc.get(proto, 0) + 1
        self.live[proto] = self.live.get(proto, 0) + 1
        # Directed messages to this lname may have been cached (as undeliverable).
        self.index.invalidate_target(lname)
        return lname

    def detach(self, endpoint: Endpoint, reason: str = CloseReason.CLOSED) -> None:
        """Remove a connection and every subscription it holds.  Idempotent."""
        if self.endpoints.get(endpoint.lname) is not endpoint:
            return
        endpoint.closed = True
        del self.endpoints[endpoint.lname]
        self.live[endpoint.protocol] -= 1
        self.enforcer.release(endpoint)
        self.index.remove(endpoint)
        self.counters.endpoint_gone(endpoint.protocol, reason, endpoint.msgs_in,
                                    endpoint.bytes_in, endpoint.msgs_out, endpoint.bytes_out,
                                    endpoint.dropped)
        for callback in self.on_detach:
            callback(endpoint)

    # ---- subscriptions ---------------------------------------------------

    @property
    def subscription_count(self) -> int:
        return self.index.count

    @property
    def generation(self) -> int:
        """Bumped on every subscription or connection change (the routing log's caches)."""
        return self.index.generation

    def subscription_total(self, endpoint: Endpoint) -> int:
        """Subscriptions ``endpoint`` holds: instance subscriptions plus patterns."""
        return self.index.total(endpoint)

    def check_room(self, endpoint: Endpoint, n: int) -> None:
        """Raise :class:`TooManySubscriptions` (counted in ``subscriptions_refused``)
        unless ``n`` more subscriptions stay within ``max_subscriptions``: what
        an adapter asks before it subscribes a batch of patterns (an Eventer
        or Mariner init)."""
        if self.subscription_total(endpoint) + n > self.max_subscriptions:
            self.counters.subscriptions_refused += 1
            raise TooManySubscriptions(
                f"too many subscriptions: {n} (at most {self.max_subscriptions} per connection)")

    def _check_one_more(self, endpoint: Endpoint) -> None:
        if self.subscription_total(endpoint) >= self.max_subscriptions:
            self.counters.subscriptions_refused += 1
            raise TooManySubscriptions(
                f"too many subscriptions: this connection already holds "
                f"{self.max_subscriptions} (max_subscriptions)")

    def subscribe(self, endpoint: Endpoint, group: bytes, instance: bytes, subtype: int) -> None:
        """Keyed (group, instance, endpoint): re-subscribing replaces the subtype.

        Raises, nothing subscribed: :class:`~broker.core.refusals.NotPermitted`
        (counted) outside the endpoint's subscribe permissions,
        :class:`~broker.core.refusals.TooManySubscriptions` (counted) when a new
        subscription would pass ``max_subscriptions`` (replacing a subtype
        is always allowed).
        """
        self.enforcer.check_subscribe(endpoint, group, subtype == PROMISC)
        index = self.index
        if index.subtype(endpoint, group, instance) is None:
            self._check_one_more(endpoint)
        index.subscribe(endpoint, group, instance, subtype)

    def unsubscribe(self, endpoint: Endpoint, group: bytes, instance: bytes) -> None:
        """No-op when the subscription does not exist."""
        self.index.unsubscribe(endpoint, group, instance)

    def subscribe_pattern(
        self, endpoint: Endpoint, pattern: Iterable[bytes], subtype: int = NORMAL
    ) -> None:
        """Subscribe to every message whose event type matches a Hat pattern.

        Raises, nothing subscribed: :class:`~broker.core.refusals.NotPermitted`
        (counted) when the pattern reaches a group outside the endpoint's
        subscribe permissions, :class:`~broker.core.refusals.TooManySubscriptions`
        (counted) when it would pass ``max_subscriptions``.
        """
        pattern = tuple(pattern)
        self.enforcer.check_pattern(endpoint, pattern, subtype == PROMISC)
        index = self.index
        if not index.holds_pattern(endpoint, pattern):
            self._check_one_more(endpoint)
        index.subscribe_pattern(endpoint, pattern, subtype)

    def unsubscribe_pattern(self, endpoint: Endpoint, pattern: Iterable[bytes]) -> None:
        self.index.unsubscribe_pattern(endpoint, pattern)

    # ---- read-only views for the connection listing (the index's) ------------

    def subscriptions_of(
        self, endpoint: Endpoint, limit: int | None = None
    ) -> list[tuple[bytes, bytes | None, tuple[bytes, ...] | None, int]]:
        """What ``endpoint`` subscribes (see :meth:`SubscriptionIndex.subscriptions_of`)."""
        return self.index.subscriptions_of(endpoint, limit)

    def group_holders(self, group: bytes) -> set[Endpoint]:
        """Endpoints whose subscriptions may take messages of ``group``."""
        return self.index.group_holders(group)  # type: ignore[return-value]

    def iter_subscriptions(self, group: bytes | None = None):
        """Every subscription as ``(endpoint, group, instance, pattern, subtype)``."""
        return self.index.iter_subscriptions(group)

    @property
    def group_count(self) -> int:
        return self.index.group_count

    def group_subscriptions(self, group: bytes) -> int:
        """Instance subscriptions currently held on ``group`` (patterns not included)."""
        return self.index.group_subscriptions(group)

    def groups(self) -> list[bytes]:
        return self.index.groups()

    # ---- routing ---------------------------------------------------------

    def recipients(
        self, group: bytes, instance: bytes, to: bytes, reply: bool
    ) -> tuple[Endpoint, ...]:
        """The cached recipient set (the sender is excluded at delivery time)."""
        return self.index.recipients(group, instance, to, reply)  # type: ignore[return-value]

    def pattern_receives(
        self, endpoint: Endpoint, group: bytes, instance: bytes, to: bytes
    ) -> bool:
        """Would ``endpoint``'s pattern subscriptions take this message?

        The live rule of the index, for adapters that replay retained messages
        (Mariner ``last_event_id``) to a subscriber.
        """
        return self.index.pattern_receives(endpoint, group, instance, to)

    def route(
        self,
        sender: Endpoint,
        frame: bytes,
        header: dict[bytes, Any],
        origin: tuple[int, int, int, float] | None = None,
        key: RouteKey | None = None,
    ) -> Routed:
        """Route one validated ``send``: deliver to every recipient except the sender.

        Raises :class:`~broker.core.refusals.NotPermitted` (counted, nothing
        routed) when the sender may not send to the group (replies included:
        a reply is a send).

        ``header`` must hold DATA values for group, instance and to (the
        caller validated them).  Never blocks and never raises for a slow
        recipient: ``deliver`` applies the policy.  ``origin`` (server,
        session, instance, timestamp) keeps the EventId and timestamp a
        message got on the broker it entered (cluster backplane).  ``key`` is
        ``(group, instance, to, is_reply)`` when the caller already has it
        (the Skan session's decoder builds it in C).
        """
        if key is None:
            key = (header[b"group"], header[b"instance"], header[b"to"],
                   b"repl" in header or b"reply" in header)
        # Section 7, hot path: a group already known to be allowed costs one
        # set membership test, no call; full rights cost an ``is None``.  A
        # miss asks the enforcer (which fills ``allowed`` or raises).
        allowed = sender.publish_allowed
        if allowed is not None and key[0] not in allowed:
            self.enforcer.check_publish(sender, key[0])
        recips = self._cache.get(key)
        if recips is None:
            recips = self.index.recipients(*key)
        if not self._in_batch:
            self._in_batch = True
            self.session += 1
            self._instance = 0
        self._instance = instance = self._instance + 1
        size = len(frame)
        c = self.counters
        c.msgs_in += 1
        c.bytes_in += size
        sender.msgs_in += 1
        sender.bytes_in += size
        if origin is None:
            routed = Routed(frame, header, sender, recips, 0, self.session, instance,
                            self.clock(), self.server_id)
        else:
            routed = Routed(frame, header, sender, recips, 0, origin[1], origin[2],
                            origin[3], origin[0])
        delivered = 0
        for ep in recips:
            if ep is not sender:
                ep.deliver(frame, routed)
                delivered += 1
                if ep.batched:
                    self._dirty.append(ep)
        routed.delivered = delivered
        if delivered:
            c.msgs_out += delivered
            c.bytes_out += delivered * size
        else:
            c.undeliverable += 1
        gstats = self.group_stats
        if gstats is not None:
            gs = gstats.get(key[0])
            if gs is None:
                gs = gstats[key[0]] = [0, 0]
            gs[0] += 1
            gs[1] += delivered
        self._routed.append(routed)
        if origin is not None:
            self._routed_remote += 1
        return routed

    def route_run(
        self,
        sender: Endpoint,
        frames: list[bytes],
        headers: list[dict[bytes, Any]],
        key: RouteKey,
        origin: tuple[int, int, int],
        stamps: Sequence[float],
    ) -> list[Routed]:
        """Route a run another broker routed first (the cluster backplane,
        :mod:`broker.cluster.inbound` decodes it): ``frames`` of one routing
        ``key`` with their decoded ``headers``, EventIds (server, session,
        first + i) from ``origin`` = (server, session, first) and the origin's
        timestamps.

        What :meth:`route` does for each message with an origin, once per
        run: one recipient lookup, C-level maps for the ``Routed`` messages
        and the deliveries, the counters and per-group statistics once.  The
        messages join the batch like routed ones (observers get them at
        :meth:`hand_over`, ``local_observers`` not: they did not enter here).
        """
        self.enforcer.check_publish(sender, key[0])  # once per run
        recips = self.recipients(*key)
        n = len(frames)
        server, session, first = origin
        delivered = len(recips) - (sender in recips)
        routed = list(map(Routed, frames, headers, repeat(sender, n), repeat(recips, n),
                          repeat(delivered, n), repeat(session, n), range(first, first + n),
                          stamps, repeat(server, n)))
        for ep in recips:
            if ep is not sender:
                list(map(ep.deliver, frames, routed))
                if ep.batched:
                    self._dirty.append(ep)
        size = sum(map(len, frames))
        c = self.counters
        c.msgs_in += n
        c.bytes_in += size
        sender.msgs_in += n
        sender.bytes_in += size
        if delivered:
            c.msgs_out += n * delivered
            c.bytes_out += size * delivered
        else:
            c.undeliverable += n
        gstats = self.group_stats
        if gstats is not None:
            gs = gstats.get(key[0])
            if gs is None:
                gs = gstats[key[0]] = [0, 0]
            gs[0] += n
            gs[1] += n * delivered
        self._routed += routed
        self._routed_remote += n
        return routed

    def new_session(self) -> None:
        """End the open session, if any, so the next route opens a new one.

        hat-event-server makes each registration request one session (one
        EventId session, one notification); the Eventer
        listener calls this around each MsgRegisterReq (BROKER-SPEC 11).
        """
        if self._in_batch:
            self.end_batch()

    def deliver_own(self, sender: Endpoint, routed: list[Routed]) -> None:
        """Deliver ``routed`` to their own ``sender`` where its subscriptions take them.

        Skan never gives a sender its own message; a Hat client subscribed to
        the types it registers is notified of them by hat-event-server, so
        the Eventer listener asks for them here (BROKER-SPEC 11).
        """
        got = False
        c = self.counters
        for r in routed:
            if sender in r.recipients and not sender.closed:
                sender.deliver(r.frame, r)
                if not r.delivered:
                    c.undeliverable -= 1  # route() counted it so
                r.delivered += 1
                c.msgs_out += 1
                c.bytes_out += len(r.frame)
                got = True
        if got and sender.batched:
            self._dirty.append(sender)

    def hand_over(self) -> None:
        """Give the observers what the current batch has routed so far.

        end_batch() calls it; so does anything that reads what observers keep
        (a query must see every message routed before it, even earlier in the
        same batch).
        """
        batch = self._routed
        if not batch:
            return
        self._routed = []
        for observer in self.observers:
            observer(batch)
        if self.local_observers:
            if self._routed_remote:
                own = self.server_id
                batch = [r for r in batch if r.server == own]
            if batch:
                for observer in self.local_observers:
                    observer(batch)
        self._routed_remote = 0

    def end_batch(self) -> None:
        """Close the current routing batch: flush batched endpoints, hand the
        batch to the observers; the next route opens a new session."""
        self.close_batch()
        self.hand_over()

    def close_batch(self) -> None:
        """Close the current routing batch and flush batched endpoints, but
        leave the observers to a hand_over() after the caller's writes.

        A reader's slice delivers first and observes after (close_slice): the
        store's row, the routing log's lines and the metrics then cost no
        latency.  Nothing may route between this and that hand_over().
        """
        self._in_batch = False
        if self._dirty:
            dirty, self._dirty = self._dirty, []
            for ep in dict.fromkeys(dirty):
                if not ep.closed:
                    ep.flush()

    # ---- stats -----------------------------------------------------------

    def per_protocol(self) -> dict[str, dict[str, int]]:
        """Live plus departed totals per protocol: connections, msgs/bytes in and out."""
        c = self.counters
        result: dict[str, dict[str, int]] = {}
        for proto in sorted(set(c.accepted) | {ep.protocol for ep in self.endpoints.values()}):
            gin = c.gone_in.get(proto, [0, 0])
            gout = c.gone_out.get(proto, [0, 0, 0])
            result[proto] = {
                "connections": 0,
                "accepted": c.accepted.get(proto, 0),
                "msgs_in": gin[0],
                "bytes_in": gin[1],
                "msgs_out": gout[0],
                "bytes_out": gout[1],
                "dropped": gout[2],
            }
        for ep in self.endpoints.values():
            r = result[ep.protocol]
            r["connections"] += 1
            r["msgs_in"] += ep.msgs_in
            r["bytes_in"] += ep.bytes_in
            r["msgs_out"] += ep.msgs_out
            r["bytes_out"] += ep.bytes_out
            r["dropped"] += ep.dropped
        return result

    def stats(self) -> dict[str, Any]:
        """The body of the Skan ``stats`` reply (ints are sent as decimal strings)."""
        self.hand_over()  # observers' counters include what this batch routed so far
        c = self.counters
        # Kept current by attach/detach: no walk over the endpoints, so a
        # burst of stats requests costs the same with 10 or 10,000 connections.
        connections = {p: self.live.get(p, 0) for p in sorted(set(c.accepted) | set(self.live))}
        return {
            "uptime": int(self.clock() - self.started),
            "connections": connections,
            "messages_in": c.msgs_in,
            "bytes_in": c.bytes_in,
            "messages_out": c.msgs_out,
            "bytes_out": c.bytes_out,
            "undeliverable": c.undeliverable,
            "dropped": c.dropped,
            "slow_consumer_disconnects": c.slow_consumer_disconnects,
            "protocol_errors": c.protocol_errors,
            "subscriptions_refused": c.subscriptions_refused,
            "groups": self.group_count,
            "subscriptions": self.subscription_count,
        } | {name: section() for name, section in self.stats_sections.items()}
