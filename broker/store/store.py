"""The durable store: retained messages, bridge spools and resume points, written behind.

Routing never waits for the disk.  The router observer :meth:`Store.add`
appends one tuple to a deque (a bridge's spool changes go the same way);
a writer thread takes everything queued, waits ``flush_interval`` to
gather more, and commits it in one SQLite transaction (WAL, fsync on
commit).  After each commit the trio side learns, in commit order, up to
which EventId messages are on disk (:meth:`Store.reports`), which is when
Eventer clients that asked for persisted notifications get them.

A failed commit (disk full, I/O error) loses that batch's persistence, not
its routing: it is counted, logged at most once per :data:`LOG_INTERVAL`,
reported as not persisted, and the writer goes on with the next batch.
When the writer falls behind by more than :data:`MAX_PENDING_BYTES`, new
messages are routed but not persisted (counted as ``overload``).

Readers (queries, Mariner replay, start-up of the bridges) run in the trio
thread on their own connection; they first commit what is still queued
(:meth:`Store.flush`), so a query sees every message routed before it.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from broker.core.events import SOURCE_TIMESTAMP_TAG, source_timestamp, timestamp_parts
from broker.core.retention import RETIRED, Entry, view
from broker.core.router import Routed, Router
from broker.store.db import DB_NAME, StoreError, connect, open_store, read_meta
from wire.skan import decode_header

log = logging.getLogger(__name__)

# Operations queued for the writer thread (first element of each tuple).
EVENT, LOST, SPOOL_ADD, SPOOL_DEL, RESUME = range(5)

# Bytes of frames queued for the writer before new messages are no longer
# persisted (routing goes on): bounds the memory a stalled disk can take.
MAX_PENDING_BYTES = 64 * 1024 * 1024
# Seconds between two log lines about failed writes or overload: a full
# disk must not flood the log.
LOG_INTERVAL = 10.0
# Seconds the writer sleeps when idle before it checks max_age again.
IDLE_WAKE = 1.0
# Sessions reserved ahead of use.  The ceiling is committed before sessions
# below it are handed out, so a restart (even after SIGKILL or a clock
# stepped back) continues above every session issued before.  A broker
# routes far fewer than 10^6 batches a second, so one reservation lasts
# minutes; each costs nothing but a gap in the numbering at a restart.
SESSION_LEASE = 1_000_000_000

Report = tuple[tuple[int, int], bool]


def _us(t: float) -> int:
    s, us = timestamp_parts(t)
    return s * 1_000_000 + us


def _src_us(header: dict) -> int | None:
    src = source_timestamp(header)
    return None if src is None else _us(src)


@attrs.define
class StoreStats:
    commits: int = 0
    events_written: int = 0
    bytes_written: int = 0
    failed_commits: int = 0
    failed_events: int = 0
    overload: int = 0
    evicted: int = 0
    last_error: str = ""


def default_dir(log_dir: str) -> str:
    """``[store] dir`` when not set: ``store`` beside the routing-log directory."""
    parent = os.path.dirname(os.path.normpath(log_dir))
    return os.path.join(parent, "store")


class Store:
    """Durable retained messages (a bounded ring by count, bytes and age) plus bridge spools."""

    def __init__(self, directory: str, *, size: int, max_bytes: int, max_age: float,
                 flush_interval: float, clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self.path = os.path.join(directory, DB_NAME)
        self.size = size
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.flush_interval = flush_interval
        self.clock = clock
        self.stats = StoreStats()
        self._conn = open_store(directory)
        try:
            self._read = connect(self.path, readonly=True)
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise StoreError(self.path, f"cannot open for reading: {exc}") from None
        meta = read_meta(self._conn)
        self.count = int(meta["count"])
        self.bytes = int(meta["bytes"])
        self.evicted = int(meta["evicted"])
        self.stats.evicted = self.evicted
        es, ei = meta["evicted_session"], meta["evicted_instance"]
        # (session, instance) of the newest evicted message (replay gaps).
        self.evicted_upto: tuple[int, int] | None = None if es is None else (int(es), int(ei))
        self._ceiling = int(meta["session_ceiling"])
        self._max_session = 0
        # The types in the latest table (bounded by size) and its update counter.
        self._latest_keys: set[tuple[bytes, bytes]] = set(
            self._conn.execute("SELECT grp, inst FROM latest"))
        self._latest_seq = self._conn.execute(
            "SELECT coalesce(max(seq), 0) FROM latest").fetchone()[0]
        self._ops: deque[tuple] = deque()
        self._added_bytes = 0  # written by the trio thread only
        self._taken_bytes = 0  # written by the writer thread only
        self._signalled = False
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._reports: deque[Report] = deque()
        self._call_soon: Callable[[Callable[[], None]], None] | None = None
        # Called in the trio thread with each commit report, in commit order.
        self.on_report: list[Callable[[tuple[int, int], bool], None]] = []
        self._last_log = -LOG_INTERVAL

    # ---- life cycle ----------------------------------------------------------------

    def start_session(self, clock_session: int) -> int:
        """The session to continue from: above the clock and every session ever reserved.

        Commits the new reservation before returning (call before routing starts).
        """
        start = max(clock_session, self._ceiling)
        self._ceiling = start + SESSION_LEASE
        self._max_session = start
        self._conn.execute("UPDATE meta SET value = ? WHERE key = 'session_ceiling'",
                           (self._ceiling,))
        return start

    def attach(self, router: Router) -> None:
        """Observe every routed message and continue the router's session numbering."""
        router.session = self.start_session(router.session)
        if self.size:
            router.observers.append(self.add)

    def start(self, call_soon: Callable[[Callable[[], None]], None] | None = None) -> None:
        """Start the writer thread; ``call_soon`` runs a function in the routing thread."""
        self._call_soon = call_soon
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Commit everything queued, stop the writer, checkpoint and close."""
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            self._thread.join()
            self._thread = None
        self.flush()
        try:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            log.warning("store %s: checkpoint at close failed: %s", self.path, exc)
        self._read.close()
        self._conn.close()

    # ---- the hot path (trio thread) ------------------------------------------------

    def add(self, routed: Routed) -> None:
        """Router observer: queue a routed message for the writer."""
        if self._added_bytes - self._taken_bytes > MAX_PENDING_BYTES:
            self._ops.append((LOST, routed.session, routed.instance))
        else:
            header = routed.header
            self._ops.append((EVENT, routed.session, routed.instance, routed.timestamp,
                              routed.frame, routed.delivered, header[b"group"],
                              header[b"instance"], header))
            self._added_bytes += len(routed.frame)
        if not self._signalled:
            self._signalled = True
            self._wake.set()

    def spool_add(self, bridge: str, routed: Routed) -> None:
        self._ops.append((SPOOL_ADD, bridge, routed.session, routed.instance, routed.timestamp,
                          routed.frame))
        self._added_bytes += len(routed.frame)
        self._signal()

    def spool_remove(self, bridge: str, session: int, instance: int) -> None:
        self._ops.append((SPOOL_DEL, bridge, session, instance))
        self._signal()

    def set_resume(self, bridge: str, server: int, session: int, instance: int) -> None:
        self._ops.append((RESUME, bridge, server, session, instance))
        self._signal()

    def _signal(self) -> None:
        if not self._signalled:
            self._signalled = True
            self._wake.set()

    def pending(self) -> int:
        return len(self._ops)

    # ---- the writer ----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(IDLE_WAKE)
            self._wake.clear()
            self._signalled = False
            if self._ops and not self._stopping:
                # Gather what the routing thread adds meanwhile: one
                # transaction per flush_interval at most, not per message.
                time.sleep(self.flush_interval)
            with self._lock:
                self._commit_queued()
            if self._reports and self._call_soon is not None:
                # RunFinishedError: the trio run has ended, nobody to tell.
                with contextlib.suppress(Exception):
                    self._call_soon(self.deliver_reports)

    def flush(self) -> None:
        """Commit what is queued now, in the calling (trio) thread; then deliver reports."""
        if self._ops:
            with self._lock:
                self._commit_queued()
        if self._reports:
            self.deliver_reports()

    def deliver_reports(self) -> None:
        reports = self._reports
        while reports:
            upto, ok = reports.popleft()
            for listener in self.on_report:
                listener(upto, ok)

    def _commit_queued(self) -> None:
        ops = self._ops
        n = len(ops)
        if n == 0:
            if self.max_age:
                self._evict_only()
            return
        batch = [ops.popleft() for _ in range(n)]
        # Per message, only what SQLite needs: this loop holds the GIL that
        # routing needs too.
        rows: list[tuple] = []
        latest: dict[tuple[bytes, bytes], tuple] = {}
        spool_add: list[tuple] = []
        spool_del: list[tuple] = []
        resume: dict[str, tuple] = {}
        runs: list[Report] = []
        last_ok: tuple[int, int] | None = None
        taken = 0
        order = self._latest_seq
        max_session = self._max_session
        for op in batch:
            kind = op[0]
            if kind == EVENT:
                _, session, instance, ts, frame, delivered, grp, inst, header = op
                size = len(frame)
                taken += size
                rows.append((session, instance, ts,
                             None if SOURCE_TIMESTAMP_TAG not in header else _src_us(header),
                             grp, inst, delivered, size, frame))
                order += 1
                latest[grp, inst] = (grp, inst, order, session, instance, ts, delivered, frame)
                last_ok = (session, instance)
            elif kind == LOST:
                if last_ok is not None:
                    runs.append((last_ok, True))
                    last_ok = None
                if runs and not runs[-1][1]:
                    runs[-1] = ((op[1], op[2]), False)
                else:
                    runs.append(((op[1], op[2]), False))
                self.stats.overload += 1
            elif kind == SPOOL_ADD:
                taken += len(op[5])
                spool_add.append(op[1:])
            elif kind == SPOOL_DEL:
                spool_del.append(op[1:])
            else:
                resume[op[1]] = op[1:]
        if last_ok is not None:
            runs.append((last_ok, True))
        if rows and rows[-1][0] > max_session:
            max_session = rows[-1][0]
        events = rows
        self._taken_bytes += taken
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            if events:
                conn.executemany(
                    "INSERT OR IGNORE INTO events (session, instance, ts, src_us, grp, inst, "
                    "delivered, size, frame) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", events)
                conn.executemany(
                    "INSERT INTO latest (grp, inst, seq, session, instance, ts, delivered, frame)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (grp, inst) DO UPDATE SET "
                    "seq = excluded.seq, session = excluded.session, "
                    "instance = excluded.instance, ts = excluded.ts, "
                    "delivered = excluded.delivered, frame = excluded.frame",
                    latest.values())
            if spool_add:
                conn.executemany("INSERT OR IGNORE INTO spool VALUES (?, ?, ?, ?, ?)", spool_add)
            if spool_del:
                conn.executemany(
                    "DELETE FROM spool WHERE bridge = ? AND session = ? AND instance = ?",
                    spool_del)
            if resume:
                conn.executemany("INSERT OR REPLACE INTO resume VALUES (?, ?, ?, ?)",
                                 resume.values())
            count, nbytes = self.count + len(events), self.bytes + sum(e[7] for e in events)
            count, nbytes, evicted, upto = self._evict(count, nbytes)
            latest_keys = self._evict_latest(latest)
            ceiling = self._ceiling
            if max_session + SESSION_LEASE // 2 > ceiling:
                ceiling = max_session + SESSION_LEASE
            self._write_meta(count, nbytes, evicted, upto, ceiling)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            self._failed(len(events), exc)
            if runs:
                self._reports.append((runs[-1][0], False))
            return
        self.count, self.bytes, self._ceiling = count, nbytes, ceiling
        self._latest_keys = latest_keys
        self._latest_seq = order
        self._max_session = max_session
        if evicted != self.evicted:
            self.stats.evicted = self.evicted = evicted
            self.evicted_upto = upto
        self.stats.commits += 1
        self.stats.events_written += len(events)
        self.stats.bytes_written += taken
        self._reports.extend(runs)

    def _evict_only(self) -> None:
        """Apply max_age while no traffic arrives (the writer's idle wake-up)."""
        if not self.count:
            return
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            count, nbytes, evicted, upto = self._evict(self.count, self.bytes)
            if evicted != self.evicted:
                self._write_meta(count, nbytes, evicted, upto, self._ceiling)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            self._failed(0, exc)
            return
        self.count, self.bytes = count, nbytes
        if evicted != self.evicted:
            self.stats.evicted = self.evicted = evicted
            self.evicted_upto = upto

    def _evict(self, count: int, nbytes: int
               ) -> tuple[int, int, int, tuple[int, int] | None]:
        """Delete the oldest events beyond size / max_bytes / max_age (inside the transaction)."""
        size, max_bytes = self.size, self.max_bytes
        cutoff = self.clock() - self.max_age if self.max_age else None
        evicted, upto = self.evicted, self.evicted_upto
        if count <= size and (not max_bytes or nbytes <= max_bytes) and cutoff is None:
            return count, nbytes, evicted, upto
        last = None
        cur = self._conn.execute("SELECT size, session, instance, ts FROM events "
                                 "ORDER BY session, instance")
        for esize, session, instance, ts in cur:
            if not (count > size or (max_bytes and nbytes > max_bytes)
                    or (cutoff is not None and ts < cutoff)):
                break
            count -= 1
            nbytes -= esize
            evicted += 1
            last = upto = (session, instance)
        cur.close()
        if last is not None:
            self._conn.execute("DELETE FROM events WHERE (session, instance) <= (?, ?)", last)
        return count, nbytes, evicted, upto

    def _evict_latest(self, latest: dict) -> set[tuple[bytes, bytes]]:
        """Keep at most ``size`` types, least recently updated out first (in the transaction).

        Returns the new key set; the writer's copy changes only once committed.
        """
        keys = self._latest_keys
        new = [k for k in latest if k not in keys]
        if not new:
            return keys
        keys = keys | set(new)
        excess = len(keys) - self.size
        if excess > 0:
            gone = self._conn.execute(
                "DELETE FROM latest WHERE seq IN (SELECT seq FROM latest ORDER BY seq LIMIT ?) "
                "RETURNING grp, inst", (excess,)).fetchall()
            keys -= set(gone)
        return keys

    def _write_meta(self, count: int, nbytes: int, evicted: int,
                    upto: tuple[int, int] | None, ceiling: int) -> None:
        self._conn.executemany("UPDATE meta SET value = ? WHERE key = ?", [
            (count, "count"), (nbytes, "bytes"), (evicted, "evicted"),
            (None if upto is None else upto[0], "evicted_session"),
            (None if upto is None else upto[1], "evicted_instance"),
            (ceiling, "session_ceiling"),
        ])

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._conn.execute("ROLLBACK")

    def _failed(self, n: int, exc: sqlite3.Error) -> None:
        self.stats.failed_commits += 1
        self.stats.failed_events += n
        self.stats.last_error = str(exc)
        now = time.monotonic()
        if now - self._last_log >= LOG_INTERVAL:
            self._last_log = now
            log.error("store %s: write failed (%s); %d commits (%d messages) not persisted so "
                      "far, routing goes on", self.path, exc, self.stats.failed_commits,
                      self.stats.failed_events)

    # ---- reads (trio thread) -------------------------------------------------------

    _ENTRY = "session, instance, ts, frame, delivered, grp, inst"

    def __len__(self) -> int:
        # Committed messages (metrics read this: no flush on their path).
        return self.count

    def newest(self) -> Routed | None:
        self.flush()
        row = self._read.execute(
            f"SELECT {self._ENTRY} FROM events ORDER BY session DESC, instance DESC LIMIT 1"
        ).fetchone()
        return None if row is None else view(row)

    def entries_after(self, session: int, instance: int, limit: int | None = None
                      ) -> list[Entry]:
        """Entries strictly after EventId (session, instance), oldest first (at most ``limit``)."""
        self.flush()
        return self._read.execute(
            f"SELECT {self._ENTRY} FROM events WHERE (session, instance) > (?, ?) "
            "ORDER BY session, instance LIMIT ?",
            (session, instance, -1 if limit is None else limit)).fetchall()

    def after(self, session: int, instance: int, limit: int | None = None) -> Iterator[Routed]:
        return map(view, self.entries_after(session, instance, limit))

    def entry(self, session: int, instance: int) -> tuple[Entry, int | None] | None:
        """One entry by EventId, with its source timestamp in microseconds."""
        self.flush()
        row = self._read.execute(
            f"SELECT {self._ENTRY}, src_us FROM events WHERE session = ? AND instance = ?",
            (session, instance)).fetchone()
        return None if row is None else (row[:7], row[7])

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

    def ordered(self, *, by_source: bool, descending: bool, groups: list[bytes] | None,
                t_from: int | None, t_to: int | None, s_from: int | None, s_to: int | None,
                after: tuple | None) -> Iterator[tuple[Entry, int | None]]:
        """Events in (timestamp | source timestamp, session, instance) order, lazily.

        Times are microseconds (the resolution events are reported in); ``after``
        is the key of the last event seen (keyset pagination): the key column
        value, session and instance.  Uses the (group, ts), (ts) or (src) index.
        """
        self.flush()
        key = "src_us" if by_source else "ts"
        cond: list[str] = []
        args: list[Any] = []
        if by_source:
            cond.append("src_us IS NOT NULL")
        # Index ranges on ts with a microsecond of slack, then the exact test
        # on ts_us (the reported, rounded timestamp).
        if t_from is not None:
            cond.append("ts >= ?")
            args.append((t_from - 2) / 1e6)
        if t_to is not None:
            cond.append("ts <= ?")
            args.append((t_to + 2) / 1e6)
        if s_from is not None:
            cond.append("src_us >= ?")
            args.append(s_from)
        if s_to is not None:
            cond.append("src_us <= ?")
            args.append(s_to)
        cmp, direction = ("<", "DESC") if descending else (">", "ASC")
        if after is not None:
            cond.append(f"({key}, session, instance) {cmp} (?, ?, ?)")
            args += list(after)
        order = f"ORDER BY {key} {direction}, session {direction}, instance {direction}"
        cols = f"{self._ENTRY}, src_us, {key}"

        def run(group: bytes | None) -> Iterator[tuple]:
            where = list(cond)
            gargs = list(args)
            if group is not None:
                where.insert(0, "grp = ?")
                gargs.insert(0, group)
            sql = f"SELECT {cols} FROM events"
            if where:
                sql += " WHERE " + " AND ".join(where)
            cur = self._read.execute(f"{sql} {order}", gargs)
            while True:
                rows = cur.fetchmany(256)
                if not rows:
                    return
                yield from rows

        if groups is None or by_source:
            rows: Iterator[tuple] = run(None)
            if groups is not None:
                wanted = set(groups)
                rows = (r for r in rows if r[5] in wanted)
        elif len(groups) == 1:
            rows = run(groups[0])
        else:
            # One index walk per group, merged in order.
            rows = heapq.merge(*(run(g) for g in dict.fromkeys(groups)),
                               key=lambda r: (r[8], r[0], r[1]), reverse=descending)
        for r in rows:
            if t_from is not None or t_to is not None:
                ts_us = _us(r[2])  # the exact test, on the reported (rounded) timestamp
                if (t_from is not None and ts_us < t_from) or (t_to is not None and ts_us > t_to):
                    continue
            yield r[:7], r[7]

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

