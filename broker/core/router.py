"""The routing core: endpoints, the subscription index and the send rules.

Pure and synchronous: no trio, no I/O.  Every connection of every protocol
(and every bridge) is an :class:`Endpoint` with an lname.  Adapters decode
their protocol, turn it into a Skan frame plus decoded routing header, and
call :meth:`Router.route`; the router picks the recipients and calls
``endpoint.deliver(frame, routed)`` on each, which must never block (it
queues, or applies the slow-consumer policy).

Recipient sets are cached per (group, instance, to, is-reply) and the whole
cache is dropped on any subscription or connection change, so steady-state
routing is one dict lookup plus one ``deliver`` per recipient.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Iterable
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
        # Subject CN of a verified TLS client certificate (set by the transport).
        self.cert_name: str | None = None

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
        server_id: int = 0,
    ):
        self.clock = clock
        self.server_id = server_id
        self.started = clock()
        self.counters = Counters()
        self._new_lname = _LnameFactory(hostname)
        self.endpoints: dict[bytes, Endpoint] = {}
        # group -> instance -> {endpoint: subtype}
        self._subs: dict[bytes, dict[bytes, dict[Endpoint, int]]] = {}
        # endpoint -> {(group, instance)} for removal on disconnect
        self._owned: dict[Endpoint, set[tuple[bytes, bytes]]] = {}
        # endpoint -> {pattern: subtype}; Hat event-type patterns (Eventer, Mariner, bridges)
        self._patterns: dict[Endpoint, dict[tuple[bytes, ...], int]] = {}
        self.subscription_count = 0
        self._cache: dict[tuple[bytes, bytes, bytes, bool], tuple[Endpoint, ...]] = {}
        self.generation = 0
        # Sessions must increase strictly across restarts: start from the
        # clock in microseconds (a broker opens far fewer than 10^6 batches/s).
        self.session = int(clock() * 1_000_000)
        self._instance = 0
        self._in_batch = False
        self._dirty: list[Endpoint] = []
        # Endpoints whose outgoing queue passed its high-water mark during
        # routing; the trio layer pauses the publishing reader on them.
        self.congested: list[Endpoint] = []
        # Called with every Routed message, delivered or not (retention, log).
        self.observers: list[Callable[[Routed], None]] = []
        # Called after ``observers`` with messages that entered this broker
        # (not with those a cluster backplane brought in): what a broker of a
        # cluster keeps for Eventer queries and Mariner replay (BROKER-SPEC 8).
        self.local_observers: list[Callable[[Routed], None]] = []
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
        endpoint.principal = principal
        endpoint.perms = principal.perms

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
            ep.principal = new
            ep.perms = new.perms
            if new.perms is not None:
                self._prune(ep, new.perms)
        self._changed()
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
        self.endpoints[lname] = endpoint
        acc = self.counters.accepted
        acc[endpoint.protocol] = acc.get(endpoint.protocol, 0) + 1
        return lname

    def detach(self, endpoint: Endpoint, reason: str = CloseReason.CLOSED) -> None:
        """Remove a connection and every subscription it holds.  Idempotent."""
        if self.endpoints.get(endpoint.lname) is not endpoint:
            return
        endpoint.closed = True
        del self.endpoints[endpoint.lname]
        if endpoint.principal is not None:
            self.auth.release(endpoint.principal)
        for group, instance in self._owned.pop(endpoint, ()):
            self._remove(endpoint, group, instance)
        pats = self._patterns.pop(endpoint, None)
        if pats:
            self.subscription_count -= len(pats)
            for callback in self.interest:
                for pat in pats:
                    callback(pat, False)
        self._changed()
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

    def _changed(self) -> None:
        self.generation += 1
        self._cache.clear()

    def subscribe(self, endpoint: Endpoint, group: bytes, instance: bytes, subtype: int) -> None:
        """Keyed (group, instance, endpoint): re-subscribing replaces the subtype.

        Raises :class:`NotPermitted` (counted; nothing subscribed) outside the
        endpoint's subscribe permissions.
        """
        perms = endpoint.perms
        if perms is not None:
            problem = perms.subscribe_problem(group, subtype == PROMISC)
            if problem is not None:
                raise self._denied(endpoint, SUBSCRIBE, problem)
        gmap = self._subs.get(group)
        if gmap is None:
            gmap = self._subs[group] = {}
            for callback in self.interest:
                callback(group, True)
        inst_map = gmap.setdefault(instance, {})
        if endpoint not in inst_map:
            self.subscription_count += 1
            self._owned.setdefault(endpoint, set()).add((group, instance))
        inst_map[endpoint] = subtype
        self._changed()

    def _remove(self, endpoint: Endpoint, group: bytes, instance: bytes) -> bool:
        gmap = self._subs.get(group)
        if gmap is None:
            return False
        inst_map = gmap.get(instance)
        if inst_map is None or endpoint not in inst_map:
            return False
        del inst_map[endpoint]
        self.subscription_count -= 1
        if not inst_map:
            del gmap[instance]
            if not gmap:
                del self._subs[group]
                for callback in self.interest:
                    callback(group, False)
        return True

    def unsubscribe(self, endpoint: Endpoint, group: bytes, instance: bytes) -> None:
        """No-op when the subscription does not exist."""
        if self._remove(endpoint, group, instance):
            self._owned[endpoint].discard((group, instance))
            self._changed()

    def subscribe_pattern(
        self, endpoint: Endpoint, pattern: Iterable[bytes], subtype: int = NORMAL
    ) -> None:
        """Subscribe to every message whose event type matches a Hat pattern.

        Raises :class:`NotPermitted` (counted) when the pattern reaches a group
        outside the endpoint's subscribe permissions.
        """
        pattern = tuple(pattern)
        perms = endpoint.perms
        if perms is not None:
            problem = perms.pattern_problem(pattern, subtype == PROMISC)
            if problem is not None:
                raise self._denied(endpoint, SUBSCRIBE, problem)
        pats = self._patterns.setdefault(endpoint, {})
        if pattern not in pats:
            self.subscription_count += 1
            for callback in self.interest:
                callback(pattern, True)
        pats[pattern] = subtype
        self._changed()

    def unsubscribe_pattern(self, endpoint: Endpoint, pattern: Iterable[bytes]) -> None:
        pats = self._patterns.get(endpoint)
        pattern = tuple(pattern)
        if pats and pats.pop(pattern, None) is not None:
            self.subscription_count -= 1
            for callback in self.interest:
                callback(pattern, False)
            self._changed()

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
        gmap = self._subs.get(group, {})
        if instance == STAR:
            inst_maps = list(gmap.values())
        else:
            inst_maps = [m for m in (gmap.get(instance), gmap.get(STAR)) if m]
        if to == STAR:
            for inst_map in inst_maps:
                for ep, st in inst_map.items():
                    if st != MEONLY:
                        out[ep] = None
        else:
            target = self.endpoints.get(to)
            if target is not None and (
                (reply and (target.perms is None or target.perms.may_subscribe(group)))
                or any(inst_map.get(target, PROMISC) != PROMISC for inst_map in inst_maps)
            ):
                # A reply reaches its requester regardless of subscriptions, but
                # only in a group the requester may subscribe to (as NATS asks
                # for subscribe permission on reply subjects).
                out[target] = None
            for inst_map in inst_maps:
                for ep, st in inst_map.items():
                    if st == PROMISC:
                        out[ep] = None
        if self._patterns:
            etype = event_type(group, instance)
            for ep, pats in self._patterns.items():
                if _patterns_take(pats, etype, to, ep.lname):
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
            self._cache[key] = recips
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
        perms = sender.perms
        # Hot path: a cached "allowed" verdict costs one dict lookup, no call.
        if perms is not None and perms.publish_verdicts.get(key[0]) is not True:
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
        for observer in self.observers:
            observer(routed)
        if origin is None:
            for observer in self.local_observers:
                observer(routed)
        return routed

    def end_batch(self) -> None:
        """Close the current routing batch: flush batched endpoints, open a new session."""
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
        c = self.counters
        per = self.per_protocol()
        return {
            "uptime": int(self.clock() - self.started),
            "connections": {p: v["connections"] for p, v in per.items()},
            "messages_in": c.msgs_in,
            "bytes_in": c.bytes_in,
            "messages_out": c.msgs_out,
            "bytes_out": c.bytes_out,
            "undeliverable": c.undeliverable,
            "dropped": c.dropped,
            "slow_consumer_disconnects": c.slow_consumer_disconnects,
            "protocol_errors": c.protocol_errors,
            "groups": self.group_count,
            "subscriptions": self.subscription_count,
        } | {name: section() for name, section in self.stats_sections.items()}
