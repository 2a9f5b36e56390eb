"""Cluster-wide Eventer queries (pure: no trio, no sockets).

Each broker keeps what entered through it (its retention store and latest
table see only messages routed from its own clients and bridges).  A query
on one broker is asked of every other broker over NATS (see
:mod:`broker.cluster.cluster_service`); each answers from its own store with
:func:`local_answer`, the answers travel as :func:`encode_answer` bytes, and
the asking broker merges them with its own by EventId (:func:`merge`).

Entries here are the retention store's 7-tuples with the origin server id
appended (index :data:`SERVER`), so the readers of raw entries (type
filters, ``visible``, ``view``) work on them unchanged.

What the remote brokers are asked: the query without ``lastEventId`` (the
sentinel may belong to any broker: the merge cuts at it) and without
``maxResults`` (the merge caps): each returns up to
:data:`broker.store.retained_query.QUERY_LIMIT` events, in the query's
order, and fewer when its reply would exceed NATS's ``max_payload``
(``moreFollows`` is then set on the merged answer).

Who asks: a request carries the asking client's user claim
(:mod:`broker.cluster.claims`) and lname; the answering broker answers
only with what *its* configuration of that user may read (section 7: the
group's subscribe permission, and promisc for messages directed to
others).  A claim that broker grants nothing (an unknown user, anonymous
where anonymous is refused) gets an empty answer, counted.  An answer
names the broker that gives it and holds only that broker's events.

Decoding is bounded: a request is at most :data:`MAX_REQUEST` bytes of
JSON; an answer's entries must fit its bytes; both raise
:class:`wire.errors.MalformedError` for anything else.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from broker.cluster import claims
from broker.cluster.subject_runs import MAX_TIMESTAMP
from broker.core.auth import Permissions
from broker.core.retention import (
    FRAME,
    GROUP,
    INSTANCE,
    SESSION,
    TIMESTAMP,
    Entry,
    RetentionStore,
    view,
)
from broker.core.router import STAR
from broker.store import Store
from broker.store.retained_query import (
    QUERY_LIMIT,
    Answer,
    LatestTable,
    Visible,
    _limit,
    _source_ts,
    run_query,
    run_store_query,
)
from wire import eventer as w
from wire.errors import MalformedError, ProtocolError
from wire.eventer.messages import query_params_from_sbs, query_params_to_sbs

SERVER = 7
# One entry on the wire: server, session, instance, timestamp, delivered, and
# the lengths of frame, group and instance name, then those bytes.
_ENTRY = struct.Struct("<QQQdQIII")
# First byte of an answer: 1 when the broker had more than it sent; then
# the answering broker's server id.
_MORE = b"\x01"
_SERVER = struct.Struct("<Q")
# Bytes of a query request at most (a query is a few patterns and bounds).
MAX_REQUEST = 64 * 1024
# An lname at most (a request names the asking client's).
MAX_LNAME = 256
# Room left in a NATS message for its subject, reply and headers.
PAYLOAD_MARGIN = 1024


@attrs.frozen
class Gathered:
    """One broker's answer: entries (with server id) and whether it had more."""

    entries: list[tuple]
    more_follows: bool


def remote_params(params: w.QueryParams) -> w.QueryParams:
    """What the other brokers are asked (see the module doc)."""
    if isinstance(params, w.QueryTimeseriesParams):
        return attrs.evolve(params, last_event_id=None, max_results=None)
    if isinstance(params, w.QueryServerParams):
        return attrs.evolve(params, max_results=None)
    return params


@attrs.frozen
class Request:
    """A query from another broker: what, for whom (claim) and to whom (lname)."""

    params: w.QueryParams
    claim: bytes
    lname: bytes


def encode_request(params: w.QueryParams, claim: bytes = claims.ANONYMOUS,
                   lname: bytes = b"") -> bytes:
    return json.dumps({"query": query_params_to_sbs(remote_params(params)),
                       "user": claim.decode(), "lname": lname.decode(errors="replace")}).encode()


def decode_request(payload: bytes) -> Request:
    """MalformedError for anything that is not a request this module writes
    (a request without ``user`` is anonymous)."""
    if len(payload) > MAX_REQUEST:
        raise MalformedError(f"cluster query of {len(payload)} bytes (at most {MAX_REQUEST})")
    try:
        fields = json.loads(payload)
        params = query_params_from_sbs(fields["query"])
        claim = fields.get("user", claims.ANONYMOUS.decode())
        lname = fields.get("lname", "")
        if type(claim) is not str or type(lname) is not str or len(lname) > MAX_LNAME:
            raise TypeError("user and lname must be short strings")
        return Request(params, claims.check(claim.encode()), lname.encode())
    except ProtocolError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError,
            OverflowError, UnicodeError) as exc:
        raise MalformedError(f"bad cluster query: {exc!r}") from None


# This broker's own answer to a query, with the asking client's filter
# (None: it may read everything).
LocalQuery = Callable[[w.QueryParams, Visible], Answer]


def local_query(store: RetentionStore | Store, latest: LatestTable | None,
                server_id: int) -> LocalQuery:
    """Queries over this broker's store: the durable one, or the in-memory ring."""
    if isinstance(store, Store):
        return lambda params, visible=None: run_store_query(params, store, server_id, visible)

    def ring(params: w.QueryParams, visible: Visible = None) -> Answer:
        if latest is None and isinstance(params, w.QueryLatestParams):
            return Answer([], False)  # no Eventer listener here: no latest table
        return run_query(params, store, latest, server_id, visible)  # type: ignore[arg-type]

    return ring


def visible_to(perms: Permissions | None, lname: bytes) -> Visible:
    """What a client with ``perms`` and ``lname`` may read of retained events
    (the rule of :meth:`Enforcer.may_read`, for a client of another broker)."""
    if perms is None:
        return None

    def visible(entry: Entry) -> bool:
        header = view(entry).header
        to = header[b"to"]
        return perms.may_subscribe(header[b"group"]) and (
            to == STAR or (bool(lname) and to == lname) or perms.promisc)

    return visible


def local_answer(params: w.QueryParams, local: LocalQuery, server_id: int,
                 visible: Visible = None) -> Gathered:
    """This broker's own events for ``params`` (those ``visible`` lets through),
    with its server id."""
    answer = local(remote_params(params), visible)
    return Gathered([(*e, server_id) for e in answer.entries], answer.more_follows)


def encode_answer(answer: Gathered, max_bytes: int, server_id: int) -> bytes:
    """The answer of broker ``server_id`` in at most ``max_bytes``; entries that
    do not fit are left out (more)."""
    parts = [_SERVER.pack(server_id)]
    size = 1 + _SERVER.size
    more = answer.more_follows
    for e in answer.entries:
        frame, group, name = e[FRAME], e[GROUP], e[6]
        part = _ENTRY.pack(e[SERVER], e[SESSION], e[INSTANCE], e[TIMESTAMP], e[4],
                           len(frame), len(group), len(name)) + frame + group + name
        if size + len(part) > max_bytes:
            more = True
            break
        parts.append(part)
        size += len(part)
    return (_MORE if more else b"\x00") + b"".join(parts)


def decode_answer(data: bytes) -> tuple[int, Gathered]:
    """(answering server id, its answer); MalformedError for bytes that are not
    an answer :func:`encode_answer` writes, or that hold another broker's events."""
    if len(data) < 1 + _SERVER.size or data[:1] not in (b"\x00", _MORE):
        raise MalformedError("bad cluster answer")
    (answering,) = _SERVER.unpack_from(data, 1)
    entries = []
    at = 1 + _SERVER.size
    view = memoryview(data)
    while at < len(data):
        if at + _ENTRY.size > len(data):
            raise MalformedError("truncated cluster answer")
        server, session, instance, ts, delivered, nf, ng, ni = _ENTRY.unpack_from(view, at)
        at += _ENTRY.size
        end = at + nf + ng + ni
        if end > len(data):
            raise MalformedError("truncated cluster answer")
        if server != answering or not (0.0 <= ts <= MAX_TIMESTAMP):
            raise MalformedError("cluster answer with another broker's event or a bad timestamp")
        frame = bytes(view[at:at + nf])
        group = bytes(view[at + nf:at + nf + ng])
        name = bytes(view[at + nf + ng:end])
        at = end
        entries.append((session, instance, ts, frame, delivered, group, name, server))
    return answering, Gathered(entries, data[:1] == _MORE)


def _event_id(e: Sequence[Any]) -> tuple[int, int, int]:
    return (e[SERVER], e[SESSION], e[INSTANCE])


def merge(params: w.QueryParams, answers: Iterable[Gathered]) -> Gathered:
    """One answer from every broker's (this one's included), as one broker would give it.

    Entries are unique by EventId (a duplicate is dropped).  Order: latest by
    timestamp; timeseries as asked (timestamp or source timestamp, then
    EventId), cut after ``lastEventId`` and capped at ``maxResults``; server
    queries in EventId order.
    """
    seen: dict[tuple[int, int, int], tuple] = {}
    more = False
    for answer in answers:
        more = more or answer.more_follows
        for e in answer.entries:
            seen.setdefault(_event_id(e), e)
    found = list(seen.values())
    if isinstance(params, w.QueryLatestParams):
        newest: dict[tuple[bytes, bytes], tuple] = {}
        for e in found:
            key = (e[GROUP], e[6])
            old = newest.get(key)
            if old is None or (e[TIMESTAMP], *_event_id(e)) > (old[TIMESTAMP], *_event_id(old)):
                newest[key] = e
        found = sorted(newest.values(), key=lambda e: (e[TIMESTAMP], *_event_id(e)))
        return Gathered(found[:QUERY_LIMIT], more or len(found) > QUERY_LIMIT)
    if isinstance(params, w.QueryServerParams):
        found.sort(key=_event_id)
        limit = _limit(params.max_results)
        return Gathered(found[:limit], more or len(found) > limit)
    if params.order_by is w.OrderBy.SOURCE_TIMESTAMP:
        keyed = [(_source_ts(e), e) for e in found]
        keyed.sort(key=lambda k: (k[0] or 0, *_event_id(k[1])))
        found = [e for _, e in keyed]
    else:
        found.sort(key=lambda e: (e[TIMESTAMP], *_event_id(e)))
    if params.order is w.Order.DESCENDING:
        found.reverse()
    last = params.last_event_id
    if last is not None and found:
        sentinel = (last.server, last.session, last.instance)
        for i, e in enumerate(found):
            if _event_id(e) == sentinel:
                found = found[i + 1:]
                break
        else:
            found = []  # as on one broker: a sentinel no longer retained ends the pages
    limit = _limit(params.max_results)
    return Gathered(found[:limit], more or len(found) > limit)


def sentinel_query(last: w.EventId) -> w.QueryServerParams:
    """The first query of a cluster-wide Mariner replay after ``last``: the
    event ``last`` itself, from the broker it entered, for its timestamp
    (then :class:`ReplayPager` pages every broker's events from it on)."""
    return w.QueryServerParams(server_id=last.server, max_results=1,
                               last_event_id=w.EventId(last.server, last.session,
                                                       last.instance - 1))


def _order_key(e: Sequence[Any]) -> tuple[float, int, int, int]:
    return (e[TIMESTAMP], e[SERVER], e[SESSION], e[INSTANCE])


@attrs.define
class ReplayPager:
    """The pages of a cluster-wide Mariner replay, however many events the
    brokers keep: each page is complete and in (timestamp, EventId) order.

    Every broker answers at most QUERY_LIMIT events (fewer when NATS's
    max_payload cuts its answer), the first ones in that order from the
    page's ``t_from``.  A page therefore holds the merged events up to the
    *horizon*: the smallest last event of the answers that had more to give
    (every broker has sent all its events up to there).  The next page
    starts at the horizon's timestamp and skips what was already given.

    ``cursor`` starts at the replay's ``last_event_id`` (timestamp, server,
    session, instance).  ``done`` once no broker had more; ``gap`` when the
    paging could not move on (one broker keeps more than QUERY_LIMIT events
    with one timestamp, or one event larger than NATS's max_payload): the
    replay then ends there, as a local replay ends at an eviction gap.
    """

    patterns: tuple[tuple[str, ...], ...]
    cursor: tuple[float, int, int, int]
    done: bool = False
    gap: bool = False

    def params(self) -> w.QueryTimeseriesParams:
        return w.QueryTimeseriesParams(event_types=self.patterns,
                                       t_from=w.Timestamp.from_float(self.cursor[0]),
                                       order=w.Order.ASCENDING)

    def take(self, answers: Iterable[Gathered]) -> list[tuple]:
        """The next page from every broker's answer to :meth:`params`."""
        horizon = None
        seen: dict[tuple[int, int, int], tuple] = {}
        for answer in answers:
            if answer.more_follows:
                if not answer.entries:
                    horizon = self.cursor  # no way on: see ``gap``
                else:
                    last = _order_key(answer.entries[-1])
                    horizon = last if horizon is None else min(horizon, last)
            for e in answer.entries:
                seen.setdefault(_event_id(e), e)
        cursor = self.cursor
        page = sorted((e for e in seen.values() if _order_key(e) > cursor
                       and (horizon is None or _order_key(e) <= horizon)), key=_order_key)
        if horizon is None:
            self.done = True
        elif not page:
            self.done = self.gap = True
        if page:
            self.cursor = _order_key(page[-1])
        return page


def as_entry(e: tuple) -> Entry:
    """The retention store's 7-tuple of a gathered entry."""
    return e[:SERVER]  # type: ignore[return-value]
