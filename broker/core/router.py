"""The routing core: endpoints, the subscription index and the send rules.

Pure and synchronous: no trio, no I/O.  Every connection of every protocol
(and every bridge) is an :class:`Endpoint` with an lname.  Adapters decode
their protocol, turn it into a Skan frame plus decoded routing header, and
call :meth:`Router.route`; the router picks the recipients and calls
``endpoint.deliver(frame, routed)`` on each, which must never block (it
queues, or applies the slow-consumer policy).

Recipient sets are cached per (group, instance, to, is-reply), so
steady-state routing is one dict lookup plus one ``deliver`` per recipient.
A subscription change drops only the cached sets of its own group (a Hat
pattern with a wildcard first segment, which may match any group, drops
them all), and a connection's arrival or departure only those of its
groups and of messages addressed to it: one client churning subscriptions
does not make every other client's traffic miss the cache.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any

import attrs

from broker.core.auth import (
    PUBLISH,
    SUBSCRIBE,
    Authenticator,
    Permissions,
    Principal,
    Refusal,
)
from broker.core.reasons import CloseReason

NORMAL = 0
MEONLY = 1
PROMISC = 2
SUBTYPES = {b"normal": NORMAL, b"meonly": MEONLY, b"promisc": PROMISC}

STAR = b"*"

# (group, instance, to, is_reply): what a message's recipients depend on.
RouteKey = tuple[bytes, bytes, bytes, bool]

# Recipient-set cache bound: directed traffic to many distinct lnames (or
# many distinct instances) would otherwise grow the cache without limit.
# When full it is simply cleared; rebuilding an entry is one index walk.
CACHE_LIMIT = 65_536

# Default of ``[broker] max_subscriptions``: subscriptions (instance
# subscriptions plus Hat patterns) one connection may hold.  Every one is
# state the broker keeps and, for patterns, work on every cache miss, so one
# client must not be able to create them without bound; real clients use a
# handful, so this only stops runaway or hostile ones.
DEFAULT_MAX_SUBSCRIPTIONS = 10_000

# Cache key: (group, instance, to, is-reply).
CacheKey = tuple[bytes, bytes, bytes, bool]


class _GroupMembers:
    """Per group: which endpoints hold a subscription of each kind, on any instance.

    Counts per endpoint (an endpoint may subscribe several instances), so a
    message sent with instance "*" finds its recipients without walking every
    instance map of the group.
    """

    __slots__ = ("broadcast", "directed", "promisc")

    def __init__(self) -> None:
        # normal or promisc: take to="*" messages
        self.broadcast: dict[Endpoint, int] = {}
        # normal or meonly: make a directed message's target eligible
        self.directed: dict[Endpoint, int] = {}
        # promisc: see every message of the group
        self.promisc: dict[Endpoint, int] = {}

    def add(self, ep: Endpoint, subtype: int, delta: int) -> None:
        for table, takes in (
            (self.broadcast, subtype != MEONLY),
            (self.directed, subtype != PROMISC),
            (self.promisc, subtype == PROMISC),
        ):
            if takes:
                n = table.get(ep, 0) + delta
                if n:
                    table[ep] = n
                else:
                    del table[ep]


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
        # Who this connection is (section 7): set by Router.login.  ``perms``
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


class NotPermitted(Exception):
    """A send or subscription outside the connection's permissions (already counted)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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


@attrs.define
class Counters:
    """Broker-wide counters.  Plain ints: they are on the per-message path."""

    msgs_in: int = 0
    bytes_in: int = 0
    msgs_out: int = 0
    bytes_out: int = 0
    undeliverable: int = 0
    dropped: int = 0
    slow_consumer_disconnects: int = 0
    protocol_errors: int = 0
    # Subscribes refused by max_subscriptions (also counted as protocol errors
    # by the adapter that answered them).
    subscriptions_refused: int = 0
    accepted: dict[str, int] = attrs.Factory(dict)
    closed: dict[str, int] = attrs.Factory(dict)
    # Totals of endpoints that have gone, so per-protocol sums survive disconnects.
    gone_in: dict[str, list[int]] = attrs.Factory(dict)
    gone_out: dict[str, list[int]] = attrs.Factory(dict)
    # "protocol:reason" -> count; see protocol_error() and drop().
    errors: dict[str, int] = attrs.Factory(dict)
    drops: dict[str, int] = attrs.Factory(dict)
    # "protocol:reason" -> connections refused at accept (max_connections).
    refused: dict[str, int] = attrs.Factory(dict)
    # accept() calls that failed for lack of descriptors or memory (EMFILE, ...).
    accept_errors: int = 0
    # Section 7: protocol -> refused credentials; "protocol:action" -> refusals.
    auth_failures: dict[str, int] = attrs.Factory(dict)
    permission_denied: dict[str, int] = attrs.Factory(dict)

    def auth_failure(self, protocol: str) -> None:
        self.auth_failures[protocol] = self.auth_failures.get(protocol, 0) + 1

    def denied(self, protocol: str, action: str) -> None:
        key = f"{protocol}:{action}"
        self.permission_denied[key] = self.permission_denied.get(key, 0) + 1

    def protocol_error(self, protocol: str, reason: str) -> None:
        """Count one protocol error.  ``reason`` is a short fixed label
        ("malformed", "rejected", ...), never free text: it becomes a metric label."""
        self.protocol_errors += 1
        key = f"{protocol}:{reason}"
        self.errors[key] = self.errors.get(key, 0) + 1

    def refuse(self, protocol: str, reason: str) -> None:
        """Count one connection refused at accept (a RefusalReason label)."""
        key = f"{protocol}:{reason}"
        self.refused[key] = self.refused.get(key, 0) + 1

    def drop(self, protocol: str, reason: str) -> None:
        """Count one message dropped for a reason other than a full outgoing queue
        (which endpoints count themselves), e.g. an HSP DATA of an unknown Type."""
        self.dropped += 1
        key = f"{protocol}:{reason}"
        self.drops[key] = self.drops.get(key, 0) + 1


def event_type(group: bytes, instance: bytes) -> tuple[bytes, ...]:
    """Skan (group, instance) -> Hat event type: ``(G, *I.split("/"))``; "*" -> ``(G,)``."""
    if instance == STAR:
        return (group,)
    return (group, *instance.split(b"/"))


def matches(pattern: tuple[bytes, ...], etype: tuple[bytes, ...]) -> bool:
    """Hat event-type pattern match: ``*`` (last) matches any rest, ``?`` one segment."""
    n = len(etype)
    for i, seg in enumerate(pattern):
        if seg == STAR:
            return True
        if i >= n:
            return False
        if seg != b"?" and seg != etype[i]:
            return False
    return len(pattern) == n


def _patterns_take(
    pats: dict[tuple[bytes, ...], int], etype: tuple[bytes, ...], to: bytes, lname: bytes
) -> bool:
    """Pattern subscriptions take a message on a matching type: broadcasts unless
    meonly, directed ones when addressed to the subscriber or when promisc."""
    for pat, st in pats.items():
        if matches(pat, etype) and (
            st == PROMISC or (st == NORMAL and to == STAR) or to == lname
        ):
            return True
    return False


# Random bits in every lname (BROKER-SPEC section 7): 64 bits make guessing
# another connection's lname (to forge a reply to it) hopeless.
LNAME_RANDOM_BYTES = 8


def _may_get_reply(target: Endpoint, group: bytes) -> bool:
    """A reply reaches its requester regardless of subscriptions, but only in a
    group the requester may subscribe to (as NATS asks for subscribe permission
    on reply subjects)."""
    return target.perms is None or target.perms.may_subscribe(group)


class _LnameFactory:
    """lnames in the msgq format ``%x_%x@%s``: hex time, then the hex counter
    followed by 16 hex digits from :mod:`secrets`, then the host.

    The counter alone makes every lname unique for the broker's lifetime; the
    random suffix makes it unguessable.
    """

    def __init__(self, host: str | None = None) -> None:
        self._host = host or socket.gethostname() or "localhost"
        self._counter = 0

    def __call__(self) -> bytes:
        self._counter += 1
        rand = secrets.token_hex(LNAME_RANDOM_BYTES)
        return f"{int(time.time()):x}_{self._counter:x}{rand}@{self._host}".encode()


class Router:
    """Subscription index plus the send rules of BROKER-SPEC section 1."""

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
        self._new_lname = _LnameFactory(
            hostname or f"{socket.gethostname() or 'localhost'}/{server_id}")
        self.endpoints: dict[bytes, Endpoint] = {}
        # group -> instance -> {endpoint: subtype}
        self._subs: dict[bytes, dict[bytes, dict[Endpoint, int]]] = {}
        # group -> who subscribes what kind on any instance (instance "*" sends)
        self._members: dict[bytes, _GroupMembers] = {}
        # endpoint -> {(group, instance)} for removal on disconnect
        self._owned: dict[Endpoint, set[tuple[bytes, bytes]]] = {}
        # endpoint -> {pattern: subtype}; Hat event-type patterns (Eventer, Mariner, bridges)
        self._patterns: dict[Endpoint, dict[tuple[bytes, ...], int]] = {}
        # Pattern holders by the pattern's first segment (None: a wildcard
        # first segment, which may match any group), with pattern counts.
        self._pattern_groups: dict[bytes | None, dict[Endpoint, int]] = {}
        self.subscription_count = 0
        self._cache: dict[CacheKey, tuple[Endpoint, ...]] = {}
        # Which cached keys to drop on a change: per group, and per directed
        # target lname (an endpoint arriving or leaving changes those).
        self._cache_by_group: dict[bytes, set[CacheKey]] = {}
        self._cache_by_target: dict[bytes, set[CacheKey]] = {}
        # Bumped on every subscription or connection change (the routing log
        # keys its own caches on it).
        self.generation = 0
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
        # Called with (group, True/False) when a group gains its first or
        # loses its last instance subscription, and with (pattern, ...) for
        # each Hat pattern subscription made or removed (the cluster backplane).
        self.interest: list[Callable[[bytes | tuple[bytes, ...], bool], None]] = []
        # Set by the metrics service (None = metrics off, no per-message cost):
        # group -> [messages routed, deliveries], and the routing-latency
        # buckets the transport fills per received chunk.
        self.group_stats: dict[bytes, list[int]] | None = None
        self.latency: Any = None
        # Users and credentials (section 7); replaced on reload (reload_auth).
        self.auth = Authenticator()
        # Extra sections of the ``stats`` reply, by name (e.g. "cluster"): each
        # returns a small dict when asked, so ``stats`` walks nothing for them.
        self.stats_sections: dict[str, Callable[[], dict[str, Any]]] = {}

    # ---- authentication and permissions (section 7) ----------------------
    #
    # The one place permissions are enforced, for every protocol: route()
    # checks sends (replies included), subscribe() and subscribe_pattern()
    # check subscriptions, _recipients() checks who may receive a reply.

    def login(self, endpoint: Endpoint, token: str | bytes | None) -> str | None:
        """Authenticate a connection from its token and/or certificate name.

        Returns None when accepted (the endpoint then carries its principal and
        permissions), else the refusal reason ("not authorised: ..."), counted
        in ``auth_failures``; the adapter then refuses and closes.
        """
        result = self.auth.authenticate(endpoint.protocol, token, endpoint.cert_name)
        if isinstance(result, Principal):
            refused = self.auth.acquire(result)
            if refused is None:
                self._set_principal(endpoint, result)
                return None
            result = refused
        assert isinstance(result, Refusal)
        self.counters.auth_failure(endpoint.protocol)
        return result.reason

    def login_bridge(self, endpoint: Endpoint, user: str | None) -> None:
        """Bridges act as their configured ``user`` (None: full rights)."""
        self._set_principal(endpoint, self.auth.bridge_principal(user))

    def _set_principal(self, endpoint: Endpoint, principal: Principal) -> None:
        if endpoint.principal is not None:
            self.auth.release(endpoint.principal)  # (bridges are never counted)
        self._grant(endpoint, principal)

    @staticmethod
    def _grant(endpoint: Endpoint, principal: Principal) -> None:
        endpoint.principal = principal
        perms = endpoint.perms = principal.perms
        endpoint.publish_allowed = None if perms is None else perms.publish_allowed

    def _denied(self, endpoint: Endpoint, action: str, reason: str) -> NotPermitted:
        self.counters.denied(endpoint.protocol, action)
        return NotPermitted(reason)

    def check_publish(self, endpoint: Endpoint, group: bytes) -> None:
        """Raise :class:`NotPermitted` (counted) if ``endpoint`` may not send to ``group``."""
        perms = endpoint.perms
        if perms is not None and not perms.may_publish(group):
            raise self._denied(endpoint, PUBLISH, perms.publish_problem(group) or "")

    def may_read(self, endpoint: Endpoint, group: bytes, to: bytes) -> bool:
        """Could ``endpoint`` receive a message of ``group`` addressed ``to``
        through a subscription it is permitted?  (Eventer queries over
        retained messages use it.)  Directed messages to others need promisc."""
        perms = endpoint.perms
        if perms is None:
            return True
        if not perms.may_subscribe(group):
            return False
        return to == STAR or to == endpoint.lname or perms.promisc

    def reload_auth(self, auth: Authenticator) -> list[Endpoint]:
        """Switch to a reloaded configuration of users and permissions.

        Live connections keep their principal with the new permissions;
        subscriptions no longer permitted are removed.  Returns the endpoints
        whose credential no longer authenticates (removed user, changed token,
        anonymous access withdrawn): the caller closes them.
        """
        auth.connections = self.auth.connections
        self.auth = auth
        revoked: list[Endpoint] = []
        for ep in list(self.endpoints.values()):
            old = ep.principal
            if old is None:
                continue
            new = auth.still_valid(old)
            if new is None:
                revoked.append(ep)
                continue
            self._grant(ep, new)
            if new.perms is not None:
                self._prune(ep, new.perms)
        # Permissions decide reply eligibility in every group: drop every cached set.
        self._invalidate_group(None)
        return revoked

    def _prune(self, ep: Endpoint, perms: Permissions) -> None:
        """Remove the subscriptions of ``ep`` that ``perms`` no longer allow."""
        for group, instance in list(self._owned.get(ep, ())):
            subtype = self._subs[group][instance][ep]
            if perms.subscribe_problem(group, subtype == PROMISC) is not None:
                self.unsubscribe(ep, group, instance)
        pats = self._patterns.get(ep)
        if pats:
            for pattern, subtype in list(pats.items()):
                if perms.pattern_problem(pattern, subtype == PROMISC) is not None:
                    self.unsubscribe_pattern(ep, pattern)

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
        self._invalidate_target(lname)
        return lname

    def detach(self, endpoint: Endpoint, reason: str = CloseReason.CLOSED) -> None:
        """Remove a connection and every subscription it holds.  Idempotent."""
        if self.endpoints.get(endpoint.lname) is not endpoint:
            return
        endpoint.closed = True
        del self.endpoints[endpoint.lname]
        self.live[endpoint.protocol] -= 1
        if endpoint.principal is not None:
            self.auth.release(endpoint.principal)
        for group, instance in self._owned.pop(endpoint, ()):
            self._remove(endpoint, group, instance)
            self._invalidate_group(group)
        pats = self._patterns.pop(endpoint, None)
        if pats:
            self.subscription_count -= len(pats)
            for pattern in pats:
                self._pattern_index(endpoint, pattern, -1)
            for callback in self.interest:
                for pat in pats:
                    callback(pat, False)
        self._invalidate_target(endpoint.lname)
        self.generation += 1
        c = self.counters
        key = f"{endpoint.protocol}:{reason}"
        c.closed[key] = c.closed.get(key, 0) + 1
        gin = c.gone_in.setdefault(endpoint.protocol, [0, 0])
        gin[0] += endpoint.msgs_in
        gin[1] += endpoint.bytes_in
        gout = c.gone_out.setdefault(endpoint.protocol, [0, 0, 0])
        gout[0] += endpoint.msgs_out
        gout[1] += endpoint.bytes_out
        gout[2] += endpoint.dropped
        for callback in self.on_detach:
            callback(endpoint)

    # ---- subscriptions ---------------------------------------------------

    def _invalidate_group(self, group: bytes | None) -> None:
        """Drop the cached recipient sets of one group (None: of every group)."""
        self.generation += 1
        if group is None:
            self._cache.clear()
            self._cache_by_group.clear()
            self._cache_by_target.clear()
            return
        keys = self._cache_by_group.pop(group, None)
        if keys:
            self._drop_keys(keys, self._cache_by_target, 2)

    def _invalidate_target(self, lname: bytes) -> None:
        keys = self._cache_by_target.pop(lname, None)
        if keys:
            self._drop_keys(keys, self._cache_by_group, 0)

    def _drop_keys(
        self, keys: set[CacheKey], other: dict[bytes, set[CacheKey]], field: int
    ) -> None:
        """Forget cached keys, also from the other index (keyed by ``key[field]``)."""
        cache = self._cache
        for key in keys:
            cache.pop(key, None)
            peers = other.get(key[field])
            if peers is not None:
                peers.discard(key)
                if not peers:
                    del other[key[field]]

    def subscription_total(self, endpoint: Endpoint) -> int:
        """Subscriptions ``endpoint`` holds: instance subscriptions plus patterns."""
        return len(self._owned.get(endpoint, ())) + len(self._patterns.get(endpoint, ()))

    def subscriptions_fit(self, endpoint: Endpoint, n: int = 1) -> bool:
        """Whether ``n`` more subscriptions stay within ``max_subscriptions``.

        A refusal is counted here (``subscriptions_refused``); the adapter
        answers with its protocol's refusal and counts that as a protocol error.
        """
        if self.subscription_total(endpoint) + n <= self.max_subscriptions:
            return True
        self.counters.subscriptions_refused += 1
        return False

    def subscribe(self, endpoint: Endpoint, group: bytes, instance: bytes, subtype: int) -> bool:
        """Keyed (group, instance, endpoint): re-subscribing replaces the subtype.

        Returns False (counted, nothing changed) when a new subscription would
        pass ``max_subscriptions``; replacing a subtype is always allowed.
        Raises :class:`NotPermitted` (counted; nothing subscribed) outside the
        endpoint's subscribe permissions.
        """
        perms = endpoint.perms
        if perms is not None:
            problem = perms.subscribe_problem(group, subtype == PROMISC)
            if problem is not None:
                raise self._denied(endpoint, SUBSCRIBE, problem)
        inst_map = self._subs.get(group, {}).get(instance)
        old = None if inst_map is None else inst_map.get(endpoint)
        if old is None and not self.subscriptions_fit(endpoint):
            return False
        if inst_map is None:
            gmap = self._subs.get(group)
            if gmap is None:
                gmap = self._subs[group] = {}
                for callback in self.interest:
                    callback(group, True)
            inst_map = gmap.setdefault(instance, {})
        members = self._members.get(group)
        if members is None:
            members = self._members[group] = _GroupMembers()
        if old is None:
            self.subscription_count += 1
            self._owned.setdefault(endpoint, set()).add((group, instance))
        else:
            members.add(endpoint, old, -1)
        inst_map[endpoint] = subtype
        members.add(endpoint, subtype, 1)
        self._invalidate_group(group)
        return True

    def _remove(self, endpoint: Endpoint, group: bytes, instance: bytes) -> bool:
        gmap = self._subs.get(group)
        if gmap is None:
            return False
        inst_map = gmap.get(instance)
        if inst_map is None or endpoint not in inst_map:
            return False
        self._members[group].add(endpoint, inst_map.pop(endpoint), -1)
        self.subscription_count -= 1
        if not inst_map:
            del gmap[instance]
            if not gmap:
                del self._subs[group]
                del self._members[group]
                for callback in self.interest:
                    callback(group, False)
        return True

    def unsubscribe(self, endpoint: Endpoint, group: bytes, instance: bytes) -> None:
        """No-op when the subscription does not exist."""
        if self._remove(endpoint, group, instance):
            self._owned[endpoint].discard((group, instance))
            self._invalidate_group(group)

    @staticmethod
    def _pattern_group(pattern: tuple[bytes, ...]) -> bytes | None:
        """The one group a pattern can match, or None when its first segment is a wildcard."""
        if not pattern or pattern[0] in (STAR, b"?"):
            return None
        return pattern[0]

    def _pattern_index(self, endpoint: Endpoint, pattern: tuple[bytes, ...], delta: int) -> None:
        group = self._pattern_group(pattern)
        holders = self._pattern_groups.setdefault(group, {})
        n = holders.get(endpoint, 0) + delta
        if n:
            holders[endpoint] = n
        else:
            holders.pop(endpoint, None)
            if not holders:
                del self._pattern_groups[group]
        self._invalidate_group(group)

    def subscribe_pattern(
        self, endpoint: Endpoint, pattern: Iterable[bytes], subtype: int = NORMAL
    ) -> bool:
        """Subscribe to every message whose event type matches a Hat pattern.

        Returns False (counted) when it would pass ``max_subscriptions``.
        Raises :class:`NotPermitted` (counted) when the pattern reaches a group
        outside the endpoint's subscribe permissions.
        """
        pattern = tuple(pattern)
        perms = endpoint.perms
        if perms is not None:
            problem = perms.pattern_problem(pattern, subtype == PROMISC)
            if problem is not None:
                raise self._denied(endpoint, SUBSCRIBE, problem)
        pats = self._patterns.get(endpoint)
        if pats is None or pattern not in pats:
            if not self.subscriptions_fit(endpoint):
                return False
            if pats is None:
                pats = self._patterns[endpoint] = {}
            self.subscription_count += 1
            pats[pattern] = subtype
            self._pattern_index(endpoint, pattern, 1)
            for callback in self.interest:
                callback(pattern, True)
        else:
            pats[pattern] = subtype
            self._invalidate_group(self._pattern_group(pattern))
        return True

    def unsubscribe_pattern(self, endpoint: Endpoint, pattern: Iterable[bytes]) -> None:
        pats = self._patterns.get(endpoint)
        pattern = tuple(pattern)
        if pats and pats.pop(pattern, None) is not None:
            self.subscription_count -= 1
            self._pattern_index(endpoint, pattern, -1)
            for callback in self.interest:
                callback(pattern, False)

    # ---- read-only views for the connection listing ------------------------

    def subscriptions_of(
        self, endpoint: Endpoint, limit: int | None = None
    ) -> list[tuple[bytes, bytes | None, tuple[bytes, ...] | None, int]]:
        """What ``endpoint`` subscribes: ``(group, instance, None, subtype)`` for
        instance subscriptions, ``(first segment, None, pattern, subtype)`` for Hat
        patterns; at most ``limit`` of them."""
        out: list[tuple[bytes, bytes | None, tuple[bytes, ...] | None, int]] = []
        subs = self._subs
        for group, instance in self._owned.get(endpoint, ()):
            if limit is not None and len(out) >= limit:
                return out
            out.append((group, instance, None, subs[group][instance][endpoint]))
        for pattern, subtype in self._patterns.get(endpoint, {}).items():
            if limit is not None and len(out) >= limit:
                break
            out.append((pattern[0] if pattern else b"", None, pattern, subtype))
        return out

    def group_holders(self, group: bytes) -> set[Endpoint]:
        """Endpoints whose subscriptions may take messages of ``group``: instance
        subscriptions on it, and Hat patterns whose first segment is it or a
        wildcard.  Read from the indexes: no walk over every endpoint."""
        out: set[Endpoint] = set()
        for inst_map in self._subs.get(group, {}).values():
            out.update(inst_map)
        for holders in (self._pattern_groups.get(group), self._pattern_groups.get(None)):
            if holders:
                out.update(holders)
        return out

    def iter_subscriptions(self, group: bytes | None = None):
        """Every subscription as ``(endpoint, group, instance, pattern, subtype)``
        (the shapes of :meth:`subscriptions_of`); with ``group``, only those
        :meth:`group_holders` would find.  A generator: the caller bounds the walk."""
        groups = self._subs.items() if group is None else (
            ((group, self._subs[group]),) if group in self._subs else ())
        for g, gmap in groups:
            for instance, inst_map in gmap.items():
                for ep, subtype in inst_map.items():
                    yield ep, g, instance, None, subtype
        if group is None:
            for ep, pats in self._patterns.items():
                for pattern, subtype in pats.items():
                    yield ep, pattern[0] if pattern else b"", None, pattern, subtype
            return
        for key in (group, None):
            for ep in self._pattern_groups.get(key, {}):
                for pattern, subtype in self._patterns.get(ep, {}).items():
                    if self._pattern_group(pattern) == key:
                        yield ep, pattern[0] if pattern else b"", None, pattern, subtype

    @property
    def group_count(self) -> int:
        return len(self._subs)

    def group_subscriptions(self, group: bytes) -> int:
        """Instance subscriptions currently held on ``group`` (patterns not included)."""
        return sum(len(m) for m in self._subs.get(group, {}).values())

    def groups(self) -> list[bytes]:
        return list(self._subs)

    # ---- routing ---------------------------------------------------------

    def _recipients(
        self, group: bytes, instance: bytes, to: bytes, reply: bool
    ) -> tuple[Endpoint, ...]:
        out: dict[Endpoint, None] = {}
        if instance == STAR:
            # Every instance of the group: the per-group tables, not the instance maps.
            members = self._members.get(group)
            if members is not None:
                if to == STAR:
                    out.update(dict.fromkeys(members.broadcast))
                else:
                    target = self.endpoints.get(to)
                    if target is not None and (
                        (reply and _may_get_reply(target, group)) or target in members.directed
                    ):
                        out[target] = None
                    out.update(dict.fromkeys(members.promisc))
            elif to != STAR and reply:
                target = self.endpoints.get(to)
                if target is not None and _may_get_reply(target, group):
                    out[target] = None
        else:
            gmap = self._subs.get(group, {})
            inst_maps = [m for m in (gmap.get(instance), gmap.get(STAR)) if m]
            if to == STAR:
                for inst_map in inst_maps:
                    for ep, st in inst_map.items():
                        if st != MEONLY:
                            out[ep] = None
            else:
                target = self.endpoints.get(to)
                if target is not None and (
                    (reply and _may_get_reply(target, group))
                    or any(inst_map.get(target, PROMISC) != PROMISC for inst_map in inst_maps)
                ):
                    out[target] = None
                for inst_map in inst_maps:
                    for ep, st in inst_map.items():
                        if st == PROMISC:
                            out[ep] = None
        if self._pattern_groups:
            etype = event_type(group, instance)
            patterns = self._patterns
            for holders in (self._pattern_groups.get(group), self._pattern_groups.get(None)):
                if holders:
                    for ep in holders:
                        if ep not in out and _patterns_take(patterns[ep], etype, to, ep.lname):
                            out[ep] = None
        return tuple(out)

    def pattern_receives(
        self, endpoint: Endpoint, group: bytes, instance: bytes, to: bytes
    ) -> bool:
        """Would ``endpoint``'s pattern subscriptions take this message?

        The live rule of :meth:`_recipients`, for adapters that replay
        retained messages (Mariner ``last_event_id``) to a subscriber.
        """
        pats = self._patterns.get(endpoint)
        return bool(pats) and _patterns_take(
            pats, event_type(group, instance), to, endpoint.lname
        )

    def recipients(
        self, group: bytes, instance: bytes, to: bytes, reply: bool
    ) -> tuple[Endpoint, ...]:
        """The cached recipient set (the sender is excluded at delivery time)."""
        key = (group, instance, to, reply)
        recips = self._cache.get(key)
        if recips is None:
            recips = self._recipients(group, instance, to, reply)
            if len(self._cache) >= CACHE_LIMIT:
                self._cache.clear()
                self._cache_by_group.clear()
                self._cache_by_target.clear()
            self._cache[key] = recips
            keys = self._cache_by_group.get(group)
            if keys is None:
                keys = self._cache_by_group[group] = set()
            keys.add(key)
            if to != STAR:
                keys = self._cache_by_target.get(to)
                if keys is None:
                    keys = self._cache_by_target[to] = set()
                keys.add(key)
        return recips

    def route(
        self,
        sender: Endpoint,
        frame: bytes,
        header: dict[bytes, Any],
        origin: tuple[int, int, int, float] | None = None,
        key: RouteKey | None = None,
    ) -> Routed:
        """Route one validated ``send``: deliver to every recipient except the sender.

        Raises :class:`NotPermitted` (counted, nothing routed) when the sender
        may not send to the group (replies included: a reply is a send).

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
        # set membership test, no call; full rights cost an ``is None``.
        allowed = sender.publish_allowed
        if allowed is not None and key[0] not in allowed:
            self.check_publish(sender, key[0])
        recips = self._cache.get(key)
        if recips is None:
            recips = self.recipients(*key)
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
        self.check_publish(sender, key[0])  # once per run: route() inlines its fast path
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
