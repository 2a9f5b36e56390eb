"""GET /connections and GET /subscriptions: who is connected and what they subscribe.

In the manner of NATS's ``/connz`` and ``/subsz``: JSON, paged (``offset``,
``limit`` up to :data:`MAX_LIMIT`, the ``total`` that matched), sorted
(:data:`CONNECTION_SORTS`), filtered by protocol, user, group or lname.
docs/metrics.md ("Connections and subscriptions") is the reference.

Bounded work per request, however large the broker:

- The rows come from a **snapshot** taken by one walk over the router's
  endpoints (or subscriptions) and reused by every request for at least
  :data:`SNAPSHOT_TTL` seconds, longer when the walk was expensive
  (:data:`COST_FACTOR` times its duration), so a burst of requests or a
  client paging through costs one walk; concurrent requests share a walk in
  progress.  The walk yields to the event loop every :data:`SCAN_SLICE`
  endpoints, so clients are served during it.
- A subscription snapshot holds at most :data:`MAX_SUBSCRIPTION_ROWS` rows
  (the reply says ``truncated``; filter by ``group``, which walks only that
  group's index).
- A reply holds at most :data:`MAX_LIMIT` rows, and with ``subs=1`` at most
  :data:`SUBS_PER_CONNECTION` subscriptions per connection.
- Sorted orders are computed once per snapshot and sort key, in slices
  (sorted runs of :data:`SCAN_SLICE` rows, merged), so no request holds the
  event loop for a whole sort.

The counters read are the ones the hot path keeps anyway (per endpoint,
plain ints: ``msgs_in``, ``bytes_out``, ``dropped``...); the listing adds
nothing per message.
"""

from __future__ import annotations

import heapq
import itertools
import json
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Collection
from operator import itemgetter
from typing import Any

import attrs
import trio

from broker.core.router import MEONLY, PROMISC, Endpoint, Router

# Seconds a snapshot is reused at least (a burst or a pager costs one walk).
SNAPSHOT_TTL = 1.0
# A snapshot is reused for at least this many times the seconds its walk
# took, so the listing costs at most about 1/COST_FACTOR of the event loop
# however often it is asked (a 100,000-connection walk of ~0.1 s: one per s).
COST_FACTOR = 10.0
# Endpoints (or subscriptions) read between two checkpoints of a walk: well
# under a millisecond of work, so other connections are served during it.
SCAN_SLICE = 2000
# Rows per reply: default and maximum (as NATS's connz: 1024 max).
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
# Subscriptions listed per connection with subs=1 (the count is exact; the
# full list of one connection: /subscriptions?lname=...).
SUBS_PER_CONNECTION = 100
# Rows one subscription snapshot holds: 100,000 rows is ~20 MB of tuples;
# beyond it the reply says truncated (filter by group to see the rest).
MAX_SUBSCRIPTION_ROWS = 100_000
# Times a subscription walk starts over because the index changed under it.
MAX_RESTARTS = 2
# Snapshots kept per kind (subscriptions: one per group filter asked).
MAX_SNAPSHOTS = 8

SUBTYPE_NAMES = {0: "normal", MEONLY: "meonly", PROMISC: "promisc"}

# Connection row: tuple fields, in this order.
_FIELDS = ("lname", "protocol", "user", "auth", "remote", "since", "subscriptions",
           "queue_frames", "queue_bytes", "msgs_in", "bytes_in", "msgs_out", "bytes_out",
           "dropped", "certificate")
_IX = {name: i for i, name in enumerate(_FIELDS)}

# sort key -> (row field, default order descending?)
CONNECTION_SORTS: dict[str, tuple[str, bool]] = {
    "since": ("since", False),  # oldest first
    "lname": ("lname", False),
    "queue": ("queue_bytes", True),  # the slow consumer first
    "queue_bytes": ("queue_bytes", True),
    "queue_frames": ("queue_frames", True),
    "msgs_out": ("msgs_out", True),
    "msgs_in": ("msgs_in", True),
    "bytes_out": ("bytes_out", True),
    "bytes_in": ("bytes_in", True),
    "dropped": ("dropped", True),
    "subscriptions": ("subscriptions", True),
}
SUBSCRIPTION_SORTS = ("group", "lname")

CONNECTION_PARAMS = ("offset", "limit", "sort", "order", "protocol", "user", "group", "lname",
                     "subs")
SUBSCRIPTION_PARAMS = ("offset", "limit", "sort", "order", "protocol", "user", "group", "lname")


class BadQuery(ValueError):
    """A query parameter was refused (400); the message says which and why."""


def _text(value: bytes) -> str:
    return value.decode("utf-8", errors="replace")


def queue_depth(ep: Endpoint) -> tuple[int, int | None]:
    """(frames, bytes) waiting to go to the peer; bytes None when not tracked (bridges)."""
    queue = getattr(ep, "queue", None)
    if queue is not None:
        return len(queue.items), ep.pending_bytes()  # type: ignore[attr-defined]
    pending = getattr(ep, "pending", None)
    if pending is not None:
        return len(pending), None
    return 0, None


def connection_row(router: Router, ep: Endpoint) -> tuple:
    """One endpoint's row (see _FIELDS); a handful of attribute reads."""
    principal = ep.principal
    frames, size = queue_depth(ep)
    return (
        _text(ep.lname), str(ep.protocol),
        principal.name if principal is not None else None,
        principal.via if principal is not None else None,
        ep.remote, ep.since, router.subscription_total(ep), frames, size,
        ep.msgs_in, ep.bytes_in, ep.msgs_out, ep.bytes_out, ep.dropped, ep.cert_name,
    )


def subscription_entry(group: bytes, instance: bytes | None, pattern: tuple[bytes, ...] | None,
                       subtype: int) -> dict[str, Any]:
    if pattern is not None:
        return {"pattern": "/".join(map(_text, pattern)),
                "subtype": SUBTYPE_NAMES.get(subtype, str(subtype))}
    return {"group": _text(group), "instance": _text(instance or b""),
            "subtype": SUBTYPE_NAMES.get(subtype, str(subtype))}


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


@attrs.define(eq=False)
class Snapshot:
    rows: list[tuple]
    taken: float  # router clock (wall time)
    expires: float  # trio clock
    # The walk stopped at its bound (subscriptions only).
    truncated: bool = False
    # (sort key, descending) -> rows in that order, computed once.
    orders: dict[tuple[str, bool], list[tuple]] = attrs.Factory(dict)

    async def ordered(self, field: int, descending: bool, name: str) -> list[tuple]:
        key = (name, descending)
        rows = self.orders.get(key)
        if rows is None:
            # Ties in lname order (the sorts are stable); None (a bridge's
            # untracked bytes) last either way.
            by_lname = await sliced_sort(self.rows, itemgetter(0))
            present = [r for r in by_lname if r[field] is not None]
            present = await sliced_sort(present, itemgetter(field), descending)
            rows = self.orders[key] = present + [r for r in by_lname if r[field] is None]
        return rows


async def sliced_sort(rows: list[tuple], key: Callable[[tuple], Any],
                      reverse: bool = False) -> list[tuple]:
    """``sorted(rows, key=key, reverse=reverse)`` (stable) in slices of
    SCAN_SLICE rows with a checkpoint in between: sorted runs, then merged.
    One sort of 100,000 rows would hold the event loop for 0.1-0.5 s."""
    if len(rows) <= SCAN_SLICE:
        return sorted(rows, key=key, reverse=reverse)
    runs = []
    for start in range(0, len(rows), SCAN_SLICE):
        runs.append(sorted(rows[start:start + SCAN_SLICE], key=key, reverse=reverse))
        await trio.lowlevel.checkpoint()
    merged = heapq.merge(*runs, key=key, reverse=reverse)
    out: list[tuple] = []
    while True:
        part = list(itertools.islice(merged, SCAN_SLICE))
        out += part
        if len(part) < SCAN_SLICE:
            return out
        await trio.lowlevel.checkpoint()


class SnapshotCache:
    """Snapshots by key, reused until they expire; one walk at a time per key."""

    def __init__(self, build: Callable[[Any], Awaitable[tuple[list[tuple], bool]]],
                 clock: Callable[[], float]) -> None:
        self._build = build
        self._clock = clock
        self._snapshots: dict[Any, Snapshot] = {}
        self._building: dict[Any, trio.Event] = {}
        # Walks done (tests and docs/metrics.md: a burst costs one).
        self.walks = 0

    async def get(self, key: Any) -> Snapshot:
        while True:
            snap = self._snapshots.get(key)
            if snap is not None and trio.current_time() < snap.expires:
                return snap
            pending = self._building.get(key)
            if pending is None:
                break
            await pending.wait()
        done = self._building[key] = trio.Event()
        try:
            started = trio.current_time()
            taken = self._clock()
            rows, truncated = await self._build(key)
            self.walks += 1
            now = trio.current_time()
            ttl = max(SNAPSHOT_TTL, COST_FACTOR * (now - started))
            if len(self._snapshots) >= MAX_SNAPSHOTS and key not in self._snapshots:
                self._snapshots.pop(next(iter(self._snapshots)))
            snap = self._snapshots[key] = Snapshot(rows, taken, now + ttl, truncated)
            return snap
        finally:
            del self._building[key]
            done.set()


def _one(params: dict[str, list[str]], name: str) -> str | None:
    values = params.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise BadQuery(f"parameter {name!r} given {len(values)} times")
    return values[0]


def _int(params: dict[str, list[str]], name: str, default: int, high: int | None = None) -> int:
    raw = _one(params, name)
    if raw is None:
        return default
    if not raw.isdigit():
        raise BadQuery(f"parameter {name!r} must be a non-negative integer, not {raw[:40]!r}")
    value = int(raw)
    if high is not None and value > high:
        raise BadQuery(f"parameter {name!r} must be at most {high}")
    return value


def parse_query(target: str, known: tuple[str, ...]) -> dict[str, list[str]]:
    query = target.partition("?")[2]
    try:
        params = urllib.parse.parse_qs(query, keep_blank_values=True, strict_parsing=False,
                                       max_num_fields=32)
    except ValueError as exc:
        raise BadQuery(f"bad query string: {exc}") from None
    for name in params:
        if name not in known:
            raise BadQuery(f"unknown parameter {name[:40]!r} (known: {', '.join(known)})")
    return params


def _order(params: dict[str, list[str]], default_desc: bool) -> bool:
    order = _one(params, "order")
    if order is None:
        return default_desc
    if order not in ("asc", "desc"):
        raise BadQuery("parameter 'order' must be 'asc' or 'desc'")
    return order == "desc"


def _flag(params: dict[str, list[str]], name: str) -> bool:
    raw = _one(params, name)
    if raw is None:
        return False
    if raw.lower() in ("1", "true", "yes", "detail", ""):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise BadQuery(f"parameter {name!r} must be 1 or 0")


@attrs.frozen
class ListQuery:
    """What /connections and /subscriptions share of their query: the page,
    the order and the filters (both rows start lname, protocol, user)."""

    offset: int
    limit: int
    sort: str
    descending: bool
    protocol: str | None
    user: str | None
    group: str | None
    lname: str | None

    @classmethod
    def parse(cls, params: dict[str, list[str]], sorts: Collection[str], default_sort: str,
              default_desc: Callable[[str], bool]) -> ListQuery:
        offset = _int(params, "offset", 0)
        limit = _int(params, "limit", DEFAULT_LIMIT, MAX_LIMIT)
        sort = _one(params, "sort") or default_sort
        if sort not in sorts:
            raise BadQuery(f"parameter 'sort' must be one of {', '.join(sorts)}")
        return cls(offset, limit, sort, _order(params, default_desc(sort)),
                   _one(params, "protocol"), _one(params, "user"), _one(params, "group"),
                   _one(params, "lname"))

    def select(self, rows: list[tuple]) -> list[tuple]:
        """The rows that pass the protocol, user and lname filters."""
        if self.protocol is not None:
            rows = [r for r in rows if r[1] == self.protocol]
        if self.user is not None:
            rows = [r for r in rows if r[2] == self.user]
        if self.lname is not None:
            rows = [r for r in rows if r[0] == self.lname]
        return rows

    def page(self, rows: list[tuple]) -> list[tuple]:
        return rows[self.offset:self.offset + self.limit]

    def reply(self, head: dict[str, Any], name: str, page: list[dict[str, Any]]) -> bytes:
        """The JSON reply: ``head``, the paging and order asked, then the page as ``name``."""
        body = {**head, "offset": self.offset, "limit": self.limit, "sort": self.sort,
                "order": "desc" if self.descending else "asc", name: page}
        # Compact: the C encoder (pretty-printing falls back to Python's, ~10x slower).
        return (json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


@attrs.define(eq=False)
class Listing:
    """Answers /connections and /subscriptions from snapshots of ``router``."""

    router: Router
    connections: SnapshotCache = attrs.field(init=False)
    subscriptions: SnapshotCache = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.connections = SnapshotCache(self._walk_connections, self.router.clock)
        self.subscriptions = SnapshotCache(self._walk_subscriptions, self.router.clock)

    async def _walk_connections(self, _key: Any) -> tuple[list[tuple], bool]:
        router = self.router
        endpoints = list(router.endpoints.values())  # one C-level copy
        rows: list[tuple] = []
        for start in range(0, len(endpoints), SCAN_SLICE):
            if start:
                await trio.lowlevel.checkpoint()
            rows.extend(connection_row(router, ep) for ep in endpoints[start:start + SCAN_SLICE]
                        if not ep.closed)
        return rows, False

    async def _walk_subscriptions(self, group: str | None) -> tuple[list[tuple], bool]:
        # The router's index is walked SCAN_SLICE subscriptions at a time with
        # a checkpoint in between.  Should the index change size under the
        # walk (a subscription made or removed meanwhile), the walk starts
        # over, at most MAX_RESTARTS times; then what was read is returned,
        # marked truncated.
        for _attempt in range(MAX_RESTARTS + 1):
            walk = self.router.iter_subscriptions(None if group is None else group.encode())
            rows: list[tuple] = []
            try:
                while True:
                    chunk = list(itertools.islice(walk, SCAN_SLICE))
                    rows.extend(self._subscription_rows(chunk))
                    if len(chunk) < SCAN_SLICE:
                        return rows, False
                    if len(rows) >= MAX_SUBSCRIPTION_ROWS:
                        del rows[MAX_SUBSCRIPTION_ROWS:]
                        return rows, True
                    await trio.lowlevel.checkpoint()
            except RuntimeError:  # "dictionary changed size during iteration"
                continue
        return rows, True

    @staticmethod
    def _subscription_rows(chunk: list) -> list[tuple]:
        rows = []
        for ep, g, instance, pattern, subtype in chunk:
            p = ep.principal
            # "" for the instance of a pattern and the pattern of an instance
            # subscription: rows sort with C-level comparisons.
            rows.append((_text(ep.lname), str(ep.protocol), p.name if p else None,
                         _text(g), "" if instance is None else _text(instance),
                         "" if pattern is None else "/".join(map(_text, pattern)),
                         SUBTYPE_NAMES.get(subtype, str(subtype))))
        return rows

    # ---- /connections ------------------------------------------------------

    async def connections_json(self, target: str) -> bytes:
        params = parse_query(target, CONNECTION_PARAMS)
        q = ListQuery.parse(params, CONNECTION_SORTS, "since",
                            lambda sort: CONNECTION_SORTS[sort][1])
        subs = _flag(params, "subs")

        snap = await self.connections.get(None)
        field_name = CONNECTION_SORTS[q.sort][0]
        rows = await snap.ordered(_IX[field_name], q.descending, field_name)
        if q.group is not None:
            holders = {_text(ep.lname) for ep in self.router.group_holders(q.group.encode())}
            rows = [r for r in rows if r[0] in holders]
        rows = q.select(rows)
        now = self.router.clock()
        page = []
        for r in q.page(rows):
            row = dict(zip(_FIELDS, r, strict=True))
            since = row["since"]
            row["since"] = _iso(since)
            row["uptime"] = round(now - since, 3)
            if subs:
                ep = self.router.endpoints.get(r[0].encode())
                if ep is None:
                    row["subscription_list"] = None  # gone since the snapshot
                else:
                    row["subscription_list"] = [
                        subscription_entry(*s)
                        for s in self.router.subscriptions_of(ep, SUBS_PER_CONNECTION)]
            page.append(row)
        head = {"now": _iso(now), "snapshot": _iso(snap.taken), "total": len(rows),
                "connections_seen": len(snap.rows)}
        return q.reply(head, "connections", page)

    # ---- /subscriptions ----------------------------------------------------

    async def subscriptions_json(self, target: str) -> bytes:
        q = ListQuery.parse(parse_query(target, SUBSCRIPTION_PARAMS), SUBSCRIPTION_SORTS,
                            "group", lambda _sort: False)
        snap = await self.subscriptions.get(q.group)
        rows = snap.orders.get((q.sort, q.descending))
        if rows is None:
            key = itemgetter(3, 4, 5, 0) if q.sort == "group" else itemgetter(0, 3, 4, 5)
            rows = snap.orders[(q.sort, q.descending)] = await sliced_sort(snap.rows, key,
                                                                           q.descending)
        rows = q.select(rows)
        page = []
        for r in q.page(rows):
            entry: dict[str, Any] = {"lname": r[0], "protocol": r[1], "user": r[2]}
            if r[5]:
                entry["pattern"] = r[5]
            else:
                entry["group"] = r[3]
                entry["instance"] = r[4]
            entry["subtype"] = r[6]
            page.append(entry)
        head = {"now": _iso(self.router.clock()), "snapshot": _iso(snap.taken),
                "subscriptions_total": self.router.subscription_count,
                "groups": self.router.group_count, "total": len(rows),
                "truncated": snap.truncated}
        return q.reply(head, "subscriptions", page)
