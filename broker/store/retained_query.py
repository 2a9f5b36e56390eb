"""Eventer queries (latest, timeseries, server) over the retained routed messages.

Two sources answer them with the same results for the same history:

- the durable store (:class:`broker.store.Store`, the default): latest from
  its latest table, timeseries by index ((group, timestamp), timestamp or
  source timestamp) walked in result order with keyset pagination, server
  queries by EventId (:func:`run_store_query`);
- the in-memory ring (:class:`RetentionStore` plus :class:`LatestTable`),
  used when ``[store] enabled = false`` and kept as the reference the store
  is tested against (:func:`run_query`): timeseries and server queries scan
  its raw entries (group and instance are in each entry, so type filters
  decode nothing) and decode only the messages they return.

Latest events come from a table of the newest message per (group, instance),
bounded like the ring: the newest event of a type stays known after the ring
has let its older messages go, as Hat's latest query expects.

``persisted``: with the store, a server query sees only committed messages
(it commits what is queued first, so that is every message routed before
it); without the store nothing is persisted and ``persisted`` server queries
return nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from broker.core import events
from broker.core.eventtypes import event_type, matches, pattern_group
from broker.core.retention import (
    GROUP,
    INSTANCE,
    INSTANCE_NAME,
    SESSION,
    TIMESTAMP,
    Entry,
    RetentionStore,
    view,
)
from broker.core.router import Routed, Router
from broker.store import Store
from wire import eventer as w

# Most events one query response carries, whatever maxResults asks: bounds
# the response (about 60 bytes an event plus payloads) and the time one
# query holds the event loop.  moreFollows tells the client to page on.
QUERY_LIMIT = 10_000


# Which retained entries the asking client may read (section 7); None: all.
Visible = Callable[[Entry], bool] | None


def _only(found: list[Entry], visible: Visible) -> list[Entry]:
    return found if visible is None else [e for e in found if visible(e)]


@attrs.frozen
class Answer:
    entries: list[Entry]
    more_follows: bool


class LatestTable:
    """The newest routed message per (group, instance), least recently updated evicted first."""

    def __init__(self, limit: int) -> None:
        # limit 0 disables the table (like a retention store of size 0).
        self.limit = limit
        self._latest: dict[tuple[bytes, bytes], Entry] = {}

    def attach(self, router: Router) -> None:
        if self.limit:
            router.local_observers.append(self.observe)

    def observe(self, batch: list[Routed]) -> None:
        """Router observer: the batch's messages become their types' latest."""
        latest = self._latest
        for routed in batch:
            header = routed.header
            key = (header[b"group"], header[b"instance"])
            latest.pop(key, None)
            latest[key] = (routed.session, routed.instance, routed.timestamp, routed.frame,
                           routed.delivered, key[0], key[1])
        while len(latest) > self.limit:
            del latest[next(iter(latest))]

    def __len__(self) -> int:
        return len(self._latest)

    def entries(self) -> list[Entry]:
        return list(self._latest.values())


def _type_filter(event_types: tuple[w.EventType, ...] | None):
    if event_types is None:
        return None
    accept_type = _group_instance_filter(event_types)

    def accept(entry: Entry) -> bool:
        return accept_type(entry[GROUP], entry[INSTANCE_NAME])

    return accept


def _group_instance_filter(event_types: tuple[w.EventType, ...]):
    patterns = [events.pattern_bytes(t) for t in event_types]

    def accept_type(group: bytes, instance: bytes) -> bool:
        etype = event_type(group, instance)
        return any(matches(p, etype) for p in patterns)

    return accept_type


def _limit(max_results: int | None) -> int:
    if max_results is None:
        return QUERY_LIMIT
    return max(0, min(max_results, QUERY_LIMIT))


def _cap(found: list[Entry], limit: int) -> Answer:
    return Answer(found[:limit], len(found) > limit)


def query_latest(params: w.QueryLatestParams, latest: LatestTable,
                 visible: Visible = None) -> Answer:
    accept = _type_filter(params.event_types)
    found = _only([e for e in latest.entries() if accept is None or accept(e)], visible)
    found.sort(key=lambda e: (e[SESSION], e[INSTANCE]))
    return _cap(found, QUERY_LIMIT)


def _source_ts(entry: Entry) -> int | None:
    st = events.source_timestamp(view(entry).header)
    return None if st is None else _us(st)


def _us(t: float) -> int:
    # Compare at the microsecond resolution events are reported in, so an
    # event's own reported timestamp selects it (same rounding as reported).
    ts = w.Timestamp.from_float(t)
    return ts.s * 1_000_000 + ts.us


def _wire_us(t: w.Timestamp | None) -> int | None:
    return None if t is None else t.s * 1_000_000 + t.us


def query_timeseries(params: w.QueryTimeseriesParams, store: RetentionStore,
                     server_id: int, visible: Visible = None) -> Answer:
    accept = _type_filter(params.event_types)
    t_from = _wire_us(params.t_from)
    t_to = _wire_us(params.t_to)
    found = _only([
        e for e in store.entries()
        if (accept is None or accept(e))
        and (t_from is None or _us(e[TIMESTAMP]) >= t_from)
        and (t_to is None or _us(e[TIMESTAMP]) <= t_to)
    ], visible)
    by_source = params.order_by is w.OrderBy.SOURCE_TIMESTAMP
    if by_source or params.source_t_from is not None or params.source_t_to is not None:
        # Only these need the routing header: events without a source
        # timestamp have nothing to compare and are left out.
        s_from = _wire_us(params.source_t_from)
        s_to = _wire_us(params.source_t_to)
        keyed = []
        for e in found:
            st = _source_ts(e)
            if st is None or (s_from is not None and st < s_from) or (
                    s_to is not None and st > s_to):
                continue
            keyed.append((st, e))
        if by_source:
            keyed.sort(key=lambda k: (k[0], k[1][SESSION], k[1][INSTANCE]))
        found = [e for _, e in keyed]
    if not by_source:
        # Store order is EventId order; timestamps follow it unless the wall
        # clock stepped back, so this sort is nearly free.
        found.sort(key=lambda e: (e[TIMESTAMP], e[SESSION], e[INSTANCE]))
    if params.order is w.Order.DESCENDING:
        found.reverse()
    last = params.last_event_id
    if last is not None and found:
        key = (last.session, last.instance)
        for i, e in enumerate(found):
            if last.server == server_id and (e[SESSION], e[INSTANCE]) == key:
                found = found[i + 1:]
                break
        else:
            # The sentinel is not (or no longer) among the results: everything
            # before it was discarded, as the Eventer text describes.
            found = []
    return _cap(found, _limit(params.max_results))


def query_server(params: w.QueryServerParams, store: RetentionStore, server_id: int,
                 visible: Visible = None) -> Answer:
    if params.server_id != server_id or params.persisted:
        # In memory only: nothing is persisted.
        return Answer([], False)
    last = params.last_event_id
    if last is None or last.server < server_id:
        found = store.entries()
    elif last.server > server_id:
        found = []
    else:
        found = store.entries_after(last.session, last.instance)
    return _cap(_only(found, visible), _limit(params.max_results))


def run_query(params: w.QueryParams, store: RetentionStore, latest: LatestTable,
              server_id: int, visible: Visible = None) -> Answer:
    """Answer a query; ``visible`` leaves out what the asking client may not read."""
    if isinstance(params, w.QueryLatestParams):
        return query_latest(params, latest, visible)
    if isinstance(params, w.QueryTimeseriesParams):
        return query_timeseries(params, store, server_id, visible)
    return query_server(params, store, server_id, visible)


# ---- the durable store ---------------------------------------------------------------


def _literal_groups(event_types: tuple[w.EventType, ...] | None) -> list[bytes] | None:
    """The groups the patterns can match, or None when one matches any group."""
    if event_types is None:
        return None
    groups: list[bytes] = []
    for pattern in event_types:
        if not pattern:
            continue  # the empty pattern matches no event type
        group = pattern_group(pattern)
        if group is None:
            return None
        groups.append(group.encode())
    return list(dict.fromkeys(groups))


def store_latest(params: w.QueryLatestParams, store: Store, visible: Visible = None) -> Answer:
    accept = _type_filter(params.event_types)
    found = _only([e for e in store.latest_entries(_literal_groups(params.event_types))
                   if accept is None or accept(e)], visible)
    found.sort(key=lambda e: (e[SESSION], e[INSTANCE]))
    return _cap(found, QUERY_LIMIT)


def store_timeseries(params: w.QueryTimeseriesParams, store: Store, server_id: int,
                     visible: Visible = None) -> Answer:
    accept = _type_filter(params.event_types)
    groups = _literal_groups(params.event_types)
    t_from, t_to = _wire_us(params.t_from), _wire_us(params.t_to)
    s_from, s_to = _wire_us(params.source_t_from), _wire_us(params.source_t_to)
    by_source = params.order_by is w.OrderBy.SOURCE_TIMESTAMP
    source_filter = by_source or s_from is not None or s_to is not None
    limit = _limit(params.max_results)
    after = None
    last = params.last_event_id
    if last is not None:
        # The sentinel must be one of the results (else, as in the Eventer
        # text, everything before it was discarded and nothing follows).
        hit = store.entry(last.session, last.instance) if last.server == server_id else None
        if hit is None:
            return Answer([], False)
        entry, src = hit
        ts_us = _us(entry[TIMESTAMP])
        if ((accept is not None and not accept(entry))
                or (visible is not None and not visible(entry))
                or (t_from is not None and ts_us < t_from)
                or (t_to is not None and ts_us > t_to)
                or (source_filter and (src is None or (s_from is not None and src < s_from)
                                       or (s_to is not None and src > s_to)))):
            return Answer([], False)
        after = (src if by_source else entry[TIMESTAMP], entry[SESSION], entry[INSTANCE])
    found: list[Entry] = []
    for entry, _src in store.ordered(
            by_source=by_source, descending=params.order is w.Order.DESCENDING, groups=groups,
            t_from=t_from, t_to=t_to, s_from=s_from, s_to=s_to, after=after,
            accept_type=None if params.event_types is None
            else _group_instance_filter(params.event_types)):
        if (accept is None or accept(entry)) and (visible is None or visible(entry)):
            found.append(entry)
            if len(found) > limit:
                break
    return _cap(found, limit)


def store_server(params: w.QueryServerParams, store: Store, server_id: int,
                 visible: Visible = None) -> Answer:
    if params.server_id != server_id:
        return Answer([], False)
    limit = _limit(params.max_results)
    last = params.last_event_id
    if last is not None and last.server > server_id:
        return Answer([], False)
    cursor = (-1, -1) if last is None or last.server < server_id else (last.session,
                                                                       last.instance)
    found: list[Entry] = []
    while len(found) <= limit:
        # Pages of the EventId order until one more than the limit is visible.
        page = store.entries_after(*cursor, limit + 1)
        found += _only(page, visible)
        if len(page) <= limit:
            break
        cursor = (page[-1][SESSION], page[-1][INSTANCE])
    return _cap(found, limit)


def run_store_query(params: w.QueryParams, store: Store, server_id: int,
                    visible: Visible = None) -> Answer:
    """Answer a query from the durable store (same answers as :func:`run_query`)."""
    if isinstance(params, w.QueryLatestParams):
        return store_latest(params, store, visible)
    if isinstance(params, w.QueryTimeseriesParams):
        return store_timeseries(params, store, server_id, visible)
    return store_server(params, store, server_id, visible)
