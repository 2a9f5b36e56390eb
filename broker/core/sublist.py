"""The subscription index and its recipient cache, apart from delivery.

In the manner of nats-server's ``sublist.go``: who subscribes to what
(instance subscriptions by group and instance, Hat patterns by the group they
can reach) and the cached answer to "who receives a message of (group,
instance, to, is-reply)", with the invalidation that keeps the cache true.
The router (broker/core/router.py) asks it for recipients and delivers; it
checks permissions (broker/core/enforcement.py, which also says who may get
a reply) and limits before it changes anything here.

Recipient sets are cached per (group, instance, to, is-reply), so
steady-state routing is one dict lookup plus one ``deliver`` per recipient.
A subscription change drops only the cached sets of its own group (a Hat
pattern with a wildcard first segment, which may match any group, drops
them all), and a connection's arrival or departure only those of its
groups and of messages addressed to it: one client churning subscriptions
does not make every other client's traffic miss the cache.

Pure: no trio, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from broker.core.bounded import BoundedCache
from broker.core.enforcement import may_get_reply
from broker.core.eventtypes import STAR, event_type, matches, pattern_group

# Subscription kinds (Skan ``subtype``).
NORMAL = 0
MEONLY = 1
PROMISC = 2
SUBTYPES = {b"normal": NORMAL, b"meonly": MEONLY, b"promisc": PROMISC}

# (group, instance, to, is_reply): what a message's recipients depend on,
# the key of the recipient cache.
RouteKey = tuple[bytes, bytes, bytes, bool]

# Recipient-set cache bound: directed traffic to many distinct lnames (or
# many distinct instances) would otherwise grow the cache without limit.
# When full it is simply cleared; rebuilding an entry is one index walk.
CACHE_LIMIT = 65_536


class Subscriber(Protocol):
    """What the index needs of an endpoint: its lname and its permissions."""

    lname: bytes
    perms: Any


class _GroupMembers:
    """Per group: which endpoints hold a subscription of each kind, on any instance.

    Counts per endpoint (an endpoint may subscribe several instances), so a
    message sent with instance "*" finds its recipients without walking every
    instance map of the group.
    """

    __slots__ = ("broadcast", "directed", "promisc")

    def __init__(self) -> None:
        # normal or promisc: take to="*" messages
        self.broadcast: dict[Subscriber, int] = {}
        # normal or meonly: make a directed message's target eligible
        self.directed: dict[Subscriber, int] = {}
        # promisc: see every message of the group
        self.promisc: dict[Subscriber, int] = {}

    def add(self, ep: Subscriber, subtype: int, delta: int) -> None:
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



class SubscriptionIndex:
    """Subscriptions of every endpoint, and the cached recipient sets they imply."""

    def __init__(self, endpoints: dict[bytes, Subscriber]) -> None:
        # lname -> endpoint, shared with the router (directed messages and replies).
        self.endpoints = endpoints
        # group -> instance -> {endpoint: subtype}
        self._subs: dict[bytes, dict[bytes, dict[Subscriber, int]]] = {}
        # group -> who subscribes what kind on any instance (instance "*" sends)
        self._members: dict[bytes, _GroupMembers] = {}
        # endpoint -> {(group, instance)} for removal on disconnect
        self._owned: dict[Subscriber, set[tuple[bytes, bytes]]] = {}
        # endpoint -> {pattern: subtype}; Hat event-type patterns (Eventer, Mariner, bridges)
        self._patterns: dict[Subscriber, dict[tuple[bytes, ...], int]] = {}
        # Pattern holders by the group the pattern can reach (None: any group),
        # with pattern counts.
        self._pattern_groups: dict[bytes | None, dict[Subscriber, int]] = {}
        # Subscriptions held in all (instance subscriptions plus patterns).
        self.count = 0
        # Which cached keys to drop on a change: per group, and per directed
        # target lname (an endpoint arriving or leaving changes those).
        self._by_group: dict[bytes, set[RouteKey]] = {}
        self._by_target: dict[bytes, set[RouteKey]] = {}
        self.cache: BoundedCache[RouteKey, tuple[Subscriber, ...]] = BoundedCache(
            CACHE_LIMIT, also=(self._by_group, self._by_target))
        # Bumped on every subscription or connection change (the routing log
        # keys its own caches on it).
        self.generation = 0
        # Called with (group, True/False) when a group gains its first or
        # loses its last instance subscription, and with (pattern, ...) for
        # each Hat pattern subscription made or removed (the cluster backplane).
        self.interest: list[Callable[[bytes | tuple[bytes, ...], bool], None]] = []

    # ---- invalidation ------------------------------------------------------

    def invalidate_group(self, group: bytes | None) -> None:
        """Drop the cached recipient sets of one group (None: of every group)."""
        self.generation += 1
        if group is None:
            self.cache.clear()  # and both indexes over it
            return
        keys = self._by_group.pop(group, None)
        if keys:
            self._drop_keys(keys, self._by_target, 2)

    def invalidate_target(self, lname: bytes) -> None:
        keys = self._by_target.pop(lname, None)
        if keys:
            self._drop_keys(keys, self._by_group, 0)

    def _drop_keys(
        self, keys: set[RouteKey], other: dict[bytes, set[RouteKey]], field: int
    ) -> None:
        """Forget cached keys, also from the other index (keyed by ``key[field]``)."""
        cache = self.cache
        for key in keys:
            cache.pop(key, None)
            peers = other.get(key[field])
            if peers is not None:
                peers.discard(key)
                if not peers:
                    del other[key[field]]

    # ---- what an endpoint holds ---------------------------------------------

    def total(self, endpoint: Subscriber) -> int:
        """Subscriptions ``endpoint`` holds: instance subscriptions plus patterns."""
        return len(self._owned.get(endpoint, ())) + len(self._patterns.get(endpoint, ()))

    def subtype(self, endpoint: Subscriber, group: bytes, instance: bytes) -> int | None:
        """The subtype of ``endpoint``'s subscription to (group, instance), or None."""
        inst_map = self._subs.get(group, {}).get(instance)
        return None if inst_map is None else inst_map.get(endpoint)

    def holds_pattern(self, endpoint: Subscriber, pattern: tuple[bytes, ...]) -> bool:
        return pattern in self._patterns.get(endpoint, ())

    def instance_subscriptions(self, endpoint: Subscriber) -> Iterator[tuple[bytes, bytes, int]]:
        """(group, instance, subtype) of each instance subscription (a snapshot)."""
        for group, instance in list(self._owned.get(endpoint, ())):
            yield group, instance, self._subs[group][instance][endpoint]

    def pattern_subscriptions(self, endpoint: Subscriber) -> list[tuple[tuple[bytes, ...], int]]:
        return list(self._patterns.get(endpoint, {}).items())

    # ---- changes (the router checked permissions and limits) -----------------

    def subscribe(self, endpoint: Subscriber, group: bytes, instance: bytes,
                  subtype: int) -> None:
        """Keyed (group, instance, endpoint): re-subscribing replaces the subtype."""
        inst_map = self._subs.get(group, {}).get(instance)
        old = None if inst_map is None else inst_map.get(endpoint)
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
            self.count += 1
            self._owned.setdefault(endpoint, set()).add((group, instance))
        else:
            members.add(endpoint, old, -1)
        inst_map[endpoint] = subtype
        members.add(endpoint, subtype, 1)
        self.invalidate_group(group)

    def _remove(self, endpoint: Subscriber, group: bytes, instance: bytes) -> bool:
        gmap = self._subs.get(group)
        if gmap is None:
            return False
        inst_map = gmap.get(instance)
        if inst_map is None or endpoint not in inst_map:
            return False
        self._members[group].add(endpoint, inst_map.pop(endpoint), -1)
        self.count -= 1
        if not inst_map:
            del gmap[instance]
            if not gmap:
                del self._subs[group]
                del self._members[group]
                for callback in self.interest:
                    callback(group, False)
        return True

    def unsubscribe(self, endpoint: Subscriber, group: bytes, instance: bytes) -> None:
        """No-op when the subscription does not exist."""
        if self._remove(endpoint, group, instance):
            self._owned[endpoint].discard((group, instance))
            self.invalidate_group(group)

    def _pattern_index(self, endpoint: Subscriber, pattern: tuple[bytes, ...], delta: int) -> None:
        group = pattern_group(pattern)
        holders = self._pattern_groups.setdefault(group, {})
        n = holders.get(endpoint, 0) + delta
        if n:
            holders[endpoint] = n
        else:
            holders.pop(endpoint, None)
            if not holders:
                del self._pattern_groups[group]
        self.invalidate_group(group)

    def subscribe_pattern(self, endpoint: Subscriber, pattern: tuple[bytes, ...],
                          subtype: int) -> None:
        """Subscribe to every message whose event type matches a Hat pattern."""
        pats = self._patterns.get(endpoint)
        if pats is None or pattern not in pats:
            if pats is None:
                pats = self._patterns[endpoint] = {}
            self.count += 1
            pats[pattern] = subtype
            self._pattern_index(endpoint, pattern, 1)
            for callback in self.interest:
                callback(pattern, True)
        else:
            pats[pattern] = subtype
            self.invalidate_group(pattern_group(pattern))

    def unsubscribe_pattern(self, endpoint: Subscriber, pattern: Iterable[bytes]) -> None:
        pats = self._patterns.get(endpoint)
        pattern = tuple(pattern)
        if pats and pats.pop(pattern, None) is not None:
            self.count -= 1
            self._pattern_index(endpoint, pattern, -1)
            for callback in self.interest:
                callback(pattern, False)

    def remove(self, endpoint: Subscriber) -> None:
        """Forget every subscription of a departing endpoint (and what was cached for it)."""
        for group, instance in self._owned.pop(endpoint, ()):
            self._remove(endpoint, group, instance)
            self.invalidate_group(group)
        pats = self._patterns.pop(endpoint, None)
        if pats:
            self.count -= len(pats)
            for pattern in pats:
                self._pattern_index(endpoint, pattern, -1)
            for callback in self.interest:
                for pat in pats:
                    callback(pat, False)
        self.invalidate_target(endpoint.lname)
        self.generation += 1

    @property
    def group_count(self) -> int:
        return len(self._subs)

    def group_subscriptions(self, group: bytes) -> int:
        """Instance subscriptions currently held on ``group`` (patterns not included)."""
        return sum(len(m) for m in self._subs.get(group, {}).values())

    def groups(self) -> list[bytes]:
        return list(self._subs)

    # ---- read-only views for the connection listing -------------------------

    def subscriptions_of(
        self, endpoint: Subscriber, limit: int | None = None
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

    def group_holders(self, group: bytes) -> set[Subscriber]:
        """Subscribers whose subscriptions may take messages of ``group``: instance
        subscriptions on it, and Hat patterns whose first segment is it or a
        wildcard.  Read from the indexes: no walk over every endpoint."""
        out: set[Subscriber] = set()
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
                    if pattern_group(pattern) == key:
                        yield ep, pattern[0] if pattern else b"", None, pattern, subtype

    # ---- recipients -----------------------------------------------------------

    def _recipients(
        self, group: bytes, instance: bytes, to: bytes, reply: bool
    ) -> tuple[Subscriber, ...]:
        out: dict[Subscriber, None] = {}
        if instance == STAR:
            # Every instance of the group: the per-group tables, not the instance maps.
            members = self._members.get(group)
            if members is not None:
                if to == STAR:
                    out.update(dict.fromkeys(members.broadcast))
                else:
                    target = self.endpoints.get(to)
                    if target is not None and (
                        (reply and may_get_reply(target.perms, group)) or target in members.directed
                    ):
                        out[target] = None
                    out.update(dict.fromkeys(members.promisc))
            elif to != STAR and reply:
                target = self.endpoints.get(to)
                if target is not None and may_get_reply(target.perms, group):
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
                    (reply and may_get_reply(target.perms, group))
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
        self, endpoint: Subscriber, group: bytes, instance: bytes, to: bytes
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
    ) -> tuple[Subscriber, ...]:
        """The cached recipient set (the sender is excluded at delivery time)."""
        key = (group, instance, to, reply)
        recips = self.cache.get(key)
        if recips is None:
            recips = self.cache.put(key, self._recipients(group, instance, to, reply))
            keys = self._by_group.get(group)
            if keys is None:
                keys = self._by_group[group] = set()
            keys.add(key)
            if to != STAR:
                keys = self._by_target.get(to)
                if keys is None:
                    keys = self._by_target[to] = set()
                keys.add(key)
        return recips
