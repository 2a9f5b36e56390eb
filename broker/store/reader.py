"""The store's reader: queries, Mariner replay and the bridges' start-up, in the trio thread.

Reads use their own read-only connection (WAL: they never block the
writer).  Each first calls ``before_read`` (the writer's flush: commit what
is queued), so it sees every message routed before it, and skips what
``floor()`` says was evicted (the newest evicted EventId: the writer
deletes a run only once all of it is evicted).
"""

from __future__ import annotations

import heapq
import math
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

from broker.core.retention import RETIRED, Entry, view
from broker.core.router import Routed
from broker.store.batch_rows import MAX_RUN_SPAN, RUN_COLUMNS, RUN_WIDTH, decode
from broker.store.db import StoreError, connect
from wire.hattime import split_timestamp
from wire.skan import decode_header

# Types of one group a timeseries query names in its walk of the group index
# (tested on the index: the other types' rows are never read); beyond it the
# walk reads every row of the group and skips the other types in Python.
# Bounds the SQL statement (one parameter per type).
MAX_QUERY_TYPES = 64


def _us(t: float) -> int:
    s, us = split_timestamp(t)
    return s * 1_000_000 + us


class StoreReader:
    """Queries over the committed store (one read-only connection)."""

    _ENTRY = "session, instance, ts, frame, delivered, grp, inst"

    def __init__(self, path: str, before_read: Callable[[], None],
                 floor: Callable[[], tuple[int, int] | None]) -> None:
        self.path = path
        self.flush = before_read
        self._floor = floor
        try:
            self._read = connect(path, readonly=True)
        except sqlite3.DatabaseError as exc:
            raise StoreError(path, f"cannot open for reading: {exc}") from None

    def close(self) -> None:
        self._read.close()

    def _runs(self, sql: str, args: tuple | list = ()) -> Iterator[tuple]:
        cur = self._read.execute(sql, args)
        while True:
            rows = cur.fetchmany(16)
            if not rows:
                return
            yield from rows

    def _events(self, sql: str, args: tuple | list = (), after: tuple[int, int] | None = None,
                reverse: bool = False) -> Iterator[tuple[Entry, int | None]]:
        """Events of the selected runs (not evicted, after ``after``), run by run."""
        floor = self._floor()
        if after is None or (floor is not None and floor > after):
            after = floor
        for row in self._runs(sql, args):
            yield from decode(row, after, reverse)

    def newest(self) -> Routed | None:
        self.flush()
        for entry, _ in self._events(
                f"SELECT {RUN_COLUMNS} FROM runs ORDER BY run DESC LIMIT 1", reverse=True):
            return view(entry)
        return None

    def _run_at(self, session: int, instance: int) -> int | None:
        """The ``run`` of the run holding EventId (session, instance) or the last before it."""
        row = self._read.execute(
            "SELECT run FROM runs WHERE (session, first) <= (?, ?) "
            "ORDER BY session DESC, first DESC LIMIT 1", (session, instance)).fetchone()
        return None if row is None else row[0]

    def entries_after(self, session: int, instance: int, limit: int | None = None
                      ) -> list[Entry]:
        """Entries strictly after EventId (session, instance), oldest first (at most ``limit``)."""
        self.flush()
        start = self._run_at(session, instance) or 0
        found: list[Entry] = []
        if limit == 0:
            return found
        for entry, _ in self._events(f"SELECT {RUN_COLUMNS} FROM runs WHERE run >= ? "
                                     "ORDER BY run", (start,), after=(session, instance)):
            found.append(entry)
            if limit is not None and len(found) >= limit:
                break
        return found

    def after(self, session: int, instance: int, limit: int | None = None) -> Iterator[Routed]:
        return map(view, self.entries_after(session, instance, limit))

    def entry(self, session: int, instance: int) -> tuple[Entry, int | None] | None:
        """One entry by EventId, with its source timestamp in microseconds."""
        self.flush()
        run = self._run_at(session, instance)
        if run is None:
            return None
        for entry, src in self._events(f"SELECT {RUN_COLUMNS} FROM runs WHERE run = ?", (run,),
                                       after=(session, instance - 1)):
            return (entry, src) if entry[0] == session and entry[1] == instance else None
        return None

    def latest_entries(self, groups: list[bytes] | None) -> list[Entry]:
        """The latest table (of the given groups only, or all)."""
        self.flush()
        if groups is None:
            return self._read.execute(
                f"SELECT {self._ENTRY} FROM latest ORDER BY seq").fetchall()
        found: list[Entry] = []
        for g in groups:
            found += self._read.execute(
                f"SELECT {self._ENTRY} FROM latest WHERE grp = ?", (g,)).fetchall()
        return found

    def _wanted_types(self, group: bytes, accept_type: Callable[[bytes, bytes], bool]
                   ) -> list[bytes] | None:
        """The instances of ``group`` a query wants, when they are some of the group's
        types but at most :data:`MAX_QUERY_TYPES` (else None: walk the whole group).

        The latest table lists every type that has retained events: a type
        leaves it only once ``size`` other types were updated after it, that
        is after ``size`` newer messages, which the count bound has already
        evicted its events for (in the same transaction).
        """
        accepted: list[bytes] = []
        rejected = False
        for (inst,) in self._read.execute("SELECT inst FROM latest WHERE grp = ?", (group,)):
            if accept_type(group, inst):
                accepted.append(inst)
                if len(accepted) > MAX_QUERY_TYPES:
                    return None
            else:
                rejected = True
        return accepted if rejected or not accepted else None

    def ordered(self, *, by_source: bool, descending: bool, groups: list[bytes] | None,
                t_from: int | None, t_to: int | None, s_from: int | None, s_to: int | None,
                after: tuple | None,
                accept_type: Callable[[bytes, bytes], bool] | None = None
                ) -> Iterator[tuple[Entry, int | None]]:
        """Events in (timestamp | source timestamp, session, instance) order, lazily.

        Times are microseconds (the resolution events are reported in); ``after``
        is the key of the last event seen (keyset pagination): the key value,
        session and instance; ``accept_type(group, instance)`` skips runs of
        other types before they are decoded (a run has one type).  Runs come
        from the (group,) first/last-timestamp indexes in the order of their
        first (ascending) or last (descending) event and are merged exactly
        (:func:`_merge`).
        """
        self.flush()
        if groups is not None and not groups:
            return  # only empty patterns: they match no event type
        cond, args = _conditions(by_source=by_source, descending=descending, t_from=t_from,
                                 t_to=t_to, s_from=s_from, s_to=s_to, after=after,
                                 groups=groups if by_source else None)
        end = "max" if descending else "min"
        boundary = "last" if descending else "first"
        key_col = "src_us" if by_source else f"{end}_ts"
        index_key = "src_us, session, first" if by_source else f"{end}_ts, session, {boundary}"
        direction = "DESC" if descending else "ASC"
        order = ", ".join(f"{c.strip()} {direction}" for c in index_key.split(","))
        cols = f"{RUN_COLUMNS}, {key_col}, session, {boundary}"

        def runs_of(group: bytes | None, insts: list[bytes] | None = None) -> Iterator[tuple]:
            where = list(cond)
            gargs = list(args)
            if insts is not None:
                where[:0] = ["grp = ?", f"inst IN ({', '.join('?' * len(insts))})"]
                gargs[:0] = [group, *insts]
            elif group is not None:
                where.insert(0, "grp = ?")
                gargs.insert(0, group)
            # The walk must follow the order's index (a page is the first rows
            # of it), not an index that filters better and then sorts them all.
            index = "runs_src" if by_source else (
                f"runs_grp_{end}" if group is not None else f"runs_{end}")
            sql = f"SELECT {cols} FROM runs INDEXED BY {index}"
            if where:
                sql += " WHERE " + " AND ".join(where)
            return self._runs(f"{sql} ORDER BY {order}", gargs)

        if groups is None or by_source:
            walks = [runs_of(None)]
        else:
            walks = []
            for g in dict.fromkeys(groups):
                types = None if accept_type is None else self._wanted_types(g, accept_type)
                if types is None:
                    walks.append(runs_of(g))
                elif types:
                    walks.append(runs_of(g, types))
        # One index walk per group, merged in run order.
        runs: Iterator[tuple] = walks[0] if len(walks) == 1 else heapq.merge(
            *walks, key=_walk_key, reverse=descending)  # also none: no such type
        if accept_type is not None:
            runs = (r for r in runs if accept_type(r[3], r[4]))
        floor = self._floor()
        for entry, src in _merge(runs, descending, by_source, floor):
            if t_from is not None or t_to is not None:
                ts_us = _us(entry[2])  # the exact test, on the reported (rounded) timestamp
                if (t_from is not None and ts_us < t_from) or (t_to is not None and ts_us > t_to):
                    continue
            if after is not None:
                key = (src if by_source else entry[2], entry[0], entry[1])
                if (key <= after) if not descending else (key >= after):
                    continue
            yield entry, src

    # ---- bridges --------------------------------------------------------------------

    def spooled(self, bridge: str) -> list[Routed]:
        """A bridge's unacknowledged messages from before the restart, oldest first."""
        self.flush()
        rows = self._read.execute(
            "SELECT session, instance, ts, frame FROM spool WHERE bridge = ? "
            "ORDER BY session, instance", (bridge,)).fetchall()
        return [Routed(frame, decode_header(frame, 4), RETIRED, (), 0, session, instance, ts)
                for session, instance, ts, frame in rows]

    def resume_point(self, bridge: str) -> tuple[int, int, int] | None:
        self.flush()
        row = self._read.execute("SELECT server, session, instance FROM resume WHERE bridge = ?",
                                 (bridge,)).fetchone()
        return None if row is None else (row[0], row[1], row[2])


def _conditions(*, by_source: bool, descending: bool, t_from: int | None, t_to: int | None,
                s_from: int | None, s_to: int | None, after: tuple | None,
                groups: list[bytes] | None) -> tuple[list[str], list[Any]]:
    """The WHERE terms of an ordered walk over the runs' indexed columns, and their values.

    They select every run that can hold a matching event (and few others);
    :meth:`StoreReader.ordered` then tests each event exactly.
    """
    cond: list[str] = []
    args: list[Any] = []

    def term(sql: str, *values: Any) -> None:
        cond.append(sql)
        args.extend(values)

    # Only single-event runs carry a source timestamp: a walk in its order,
    # or a range of it, reads only those.
    if by_source or s_from is not None or s_to is not None:
        term("src_us IS NOT NULL")
        if s_from is not None:
            term("src_us >= ?", s_from)
        if s_to is not None:
            term("src_us <= ?", s_to)
    # A microsecond of slack around the index ranges; the exact test is on
    # each event's reported (rounded) timestamp.
    lo = None if t_from is None else (t_from - 2) / 1e6
    hi = None if t_to is None else (t_to + 2) / 1e6
    if by_source:
        if after is not None:
            term(f"(src_us, session, first) {'<' if descending else '>'} (?, ?, ?)", *after)
        # Single messages: min_ts is the message's timestamp.
        if lo is not None:
            term("min_ts >= ?", lo)
        if hi is not None:
            term("min_ts <= ?", hi)
        if groups is not None:
            term(f"grp IN ({', '.join('?' * len(groups))})", *groups)
        return cond, args
    # In timestamp order ``after`` narrows the time range.  A run holds
    # events between its min_ts and max_ts and spans at most MAX_RUN_SPAN
    # seconds, which bounds the other end of the index range too.
    if after is not None:
        if descending:
            hi = after[0] if hi is None else min(hi, after[0])
        else:
            lo = after[0] if lo is None else max(lo, after[0])
    if lo is not None:
        term("max_ts >= ?", lo)
        if not descending:
            term("min_ts >= ?", lo - MAX_RUN_SPAN)
    if hi is not None:
        term("min_ts <= ?", hi)
        if descending:
            term("max_ts <= ?", hi + MAX_RUN_SPAN)
    return cond, args


def _walk_key(row: tuple) -> tuple:
    """The key the walks of several groups merge on (their index's order)."""
    return row[RUN_WIDTH:RUN_WIDTH + 3]


def _merge(runs: Iterator[tuple], descending: bool, by_source: bool,
           floor: tuple[int, int] | None) -> Iterator[tuple[Entry, int | None]]:
    """The events of runs (sorted by their first event in the walk's order) in exact order.

    Each run is internally sorted; a run's events are pushed into a heap
    when the run arrives, and the heap gives up an event only once no later
    run can hold a smaller one (every later run starts at or after it).
    Runs do not overlap unless the clock stepped back, so the heap holds one
    run most of the time.

    A run's walk key is its first event's (ascending) or its last
    timestamp with its *first* session (descending: the index holds no
    last session for a run across sessions), so descending, an event whose
    timestamp equals the next run's last one waits for that run (its
    session and instance cannot be compared with the key).
    """
    sign = -1 if descending else 1
    heap: list[tuple] = []
    counter = 0

    def push(it: Iterator[tuple[Entry, int | None]]) -> None:
        nonlocal counter
        for entry, src in it:
            k = src if by_source else entry[2]
            heapq.heappush(heap, ((sign * k, sign * entry[0], sign * entry[1]), counter,
                                  entry, src, it))
            counter += 1
            return

    w = RUN_WIDTH
    for row in runs:
        if descending:
            start = (sign * row[w], -math.inf, -math.inf)
        else:
            start = (row[w], row[w + 1], row[w + 2])
        while heap and heap[0][0] < start:
            _, _, entry, src, it = heapq.heappop(heap)
            yield entry, src
            push(it)
        push(decode(row[:w], floor, descending))
    while heap:
        _, _, entry, src, it = heapq.heappop(heap)
        yield entry, src
        push(it)

