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
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator
from operator import attrgetter
from typing import Any

import attrs

from broker.core.events import SOURCE_TIMESTAMP_TAG, source_timestamp
from broker.core.retention import RETIRED, Entry, view
from broker.core.router import Routed, Router
from broker.store.batch_rows import (
    MAX_RUN,
    MAX_RUN_BYTES,
    MAX_RUN_SPAN,
    RUN_COLUMNS,
    RunBuilder,
    batch_row,
    decode,
    unpack,
)
from broker.store.carry import SpoolCarry
from broker.store.db import DB_NAME, StoreError, connect, open_store, read_meta
from wire.hattime import split_timestamp
from wire.skan import decode_header

log = logging.getLogger(__name__)

# Operations queued for the writer thread (first element of each tuple; a
# routing batch is queued as the list itself).
LOST, SPOOL_ADD, SPOOL_DEL, RESUME, ROW = range(5)

# Bytes of frames queued for the writer before new messages are no longer
# persisted (routing goes on): bounds the memory a stalled disk can take.
MAX_PENDING_BYTES = 64 * 1024 * 1024
# Seconds between two log lines about failed writes or overload: a full
# disk must not flood the log.
LOG_INTERVAL = 10.0
# Types of one group a timeseries query names in its walk of the group index
# (tested on the index: the other types' rows are never read); beyond it the
# walk reads every row of the group and skips the other types in Python.
# Bounds the SQL statement (one parameter per type).
MAX_QUERY_TYPES = 64
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
    s, us = split_timestamp(t)
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
    # Bridge spool messages pushed out by [store] spool_max_bytes (oldest first).
    spool_dropped: int = 0
    # Spool/resume operations of failed commits committed by a later commit,
    # and those the carry's bounds dropped (broker/store/carry.py).
    spool_retried: int = 0
    spool_lost: int = 0


def default_dir(log_dir: str) -> str:
    """``[store] dir`` when not set: ``store`` beside the routing-log directory."""
    parent = os.path.dirname(os.path.normpath(log_dir))
    return os.path.join(parent, "store")


def _nothing(value: object) -> None:
    pass


_frame = attrgetter("frame")


def _expand(ops: list) -> Iterator:
    """The writer's operations with each routing batch that is not one run
    (a list: Store.observe built the others' rows) as its messages."""
    for op in ops:
        if type(op) is list:
            yield from op
        else:
            yield op


class Store:
    """Durable retained messages (a bounded ring by count, bytes and age) plus bridge spools."""

    def __init__(self, directory: str, *, size: int, max_bytes: int, max_age: float,
                 flush_interval: float, spool_max_bytes: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self.path = os.path.join(directory, DB_NAME)
        self.size = size
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.flush_interval = flush_interval
        # Frame bytes each bridge's spool keeps (0: no bound; broker/store/spool.py).
        self.spool_max_bytes = spool_max_bytes
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
        # The run being evicted in parts: its key and arrays (_run_arrays).
        self._evicting: tuple[tuple[int, int, int], array, array] | None = None
        # Spool and resume operations of failed commits (broker/store/carry.py).
        self._carry = SpoolCarry()
        self._added_bytes = 0  # written by the trio thread only
        self._taken_bytes = 0  # written by the writer thread only
        self._signalled = False
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._reports: deque[Report] = deque()
        self._call_soon: Callable[[Callable[[], None]], None] | None = None
        self._thread_setup: Callable[[], object] | None = None
        # Called in the trio thread with each commit report, in commit order.
        self.on_report: list[Callable[[tuple[int, int], bool], None]] = []
        # Whether a report is awaited now (an Eventer connection asked for
        # persisted notifications).  When not, a commit does not wake the
        # routing thread just to say so: reports are cumulative ("committed
        # up to"), so the next one awaited covers everything before it.
        self.reports_wanted: Callable[[], bool] = lambda: bool(self.on_report)
        self._last_log = -LOG_INTERVAL
        self._last_spool_log = -LOG_INTERVAL
        self._router: Router | None = None  # attach: flush() takes its open batch

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
        self._router = router
        if self.size:
            # Only what entered this broker: in a cluster, each broker keeps its own.
            router.local_observers.append(self.observe)

    def start(self, call_soon: Callable[[Callable[[], None]], None] | None = None,
              thread_setup: Callable[[], object] | None = None) -> None:
        """Start the writer thread; ``call_soon`` runs a function in the routing thread.

        ``thread_setup`` runs first in the writer thread (its scheduler priority).
        """
        self._call_soon = call_soon
        self._thread_setup = thread_setup
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
        if self._carry:
            with self._lock:  # a last try for spool operations of failed commits
                self._commit_queued()
            if self._carry:
                log.error("store %s: %d bridge spool operations of failed commits are lost at "
                          "close", self.path, len(self._carry))
        try:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            log.warning("store %s: checkpoint at close failed: %s", self.path, exc)
        self._read.close()
        self._conn.close()

    # ---- the hot path (trio thread) ------------------------------------------------

    def observe(self, batch: list[Routed]) -> None:
        """Router observer: queue a routing batch for the writer (the list itself).

        The router hands over only messages that entered this broker: a
        cluster peer's messages keep their own server's EventIds, whose
        sessions interleave with ours (each broker of a cluster keeps what
        entered it).
        """
        last = batch[-1]
        if self._added_bytes - self._taken_bytes > MAX_PENDING_BYTES:
            self._ops.append((LOST, last.session, last.instance, len(batch)))
        else:
            # The row is built here, while the batch is hot in the cache and
            # the routing thread holds the GIL anyway: measured, this costs
            # the routing thread less than the writer thread's build took
            # from it in GIL time, and the queue then holds bytes, not
            # Routed objects (less for the garbage collector to walk).
            row = batch_row(batch)
            if row is None:
                self._ops.append(batch)
                self._added_bytes += sum(map(len, map(_frame, batch)))
            else:
                self._ops.append((ROW, row, last.timestamp, last.delivered, last.frame))
                self._added_bytes += row[8]
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

    def spool_overflow(self, bridge: str, n: int, bound: int) -> None:
        """Count ``n`` messages pushed out of ``bridge``'s spool by the byte bound."""
        self.stats.spool_dropped += n
        now = time.monotonic()
        if now - self._last_spool_log >= LOG_INTERVAL:
            self._last_spool_log = now
            log.warning("bridge %s: spool full (spool_max_bytes %d): dropped the %d oldest "
                        "messages; %d dropped from spools so far", bridge, bound, n,
                        self.stats.spool_dropped)

    def _signal(self) -> None:
        if not self._signalled:
            self._signalled = True
            self._wake.set()

    def pending(self) -> int:
        """Operations not yet committed: queued, and carried over from failed commits."""
        return len(self._ops) + len(self._carry)

    # ---- the writer ----------------------------------------------------------------

    def _run(self) -> None:
        if self._thread_setup is not None:
            self._thread_setup()
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
                if not self.reports_wanted():
                    self._reports.clear()
                    continue
                # RunFinishedError: the trio run has ended, nobody to tell.
                with contextlib.suppress(Exception):
                    self._call_soon(self.deliver_reports)

    def flush(self) -> None:
        """Commit what is queued now, in the calling (trio) thread; then deliver reports."""
        if self._router is not None:
            self._router.hand_over()  # what the open batch routed so far counts too
        # Always through the lock: the writer thread may have taken the queued
        # operations already and be committing them; a read that did not wait
        # for that commit would miss messages routed (and notified) before it.
        with self._lock:
            if self._ops:
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
        if n == 0 and not self._carry:
            if self.max_age:
                self._evict_only()
            return
        batch = _expand([ops.popleft() for _ in range(n)])
        # Per message, only what SQLite needs: this loop holds the GIL that
        # routing needs too (see broker/store/batch_rows.py for why runs).
        rows: list[tuple] = []
        latest: dict[tuple[bytes, bytes], tuple] = {}
        spool_add: list[tuple] = []
        spool_del: list[tuple] = []
        resume: dict[str, tuple] = {}
        runs: list[Report] = []
        taken = 0
        order = self._latest_seq
        new_events = 0
        run: RunBuilder | None = None
        # The open run in locals (the loop's hot part): next instance, type,
        # first and last timestamp, events and bytes so far.
        r_session = r_next = -1
        r_grp = r_inst = b""
        r_first = r_last = 0.0
        r_n = r_bytes = 0
        add_ts = add_delivered = add_frame = _nothing
        max_run, max_bytes, max_span = MAX_RUN, MAX_RUN_BYTES, MAX_RUN_SPAN
        row_id: tuple[int, int] | None = None  # last EventId of the last ROW
        for op in batch:
            if type(op) is Routed:
                header = op.header
                ts = op.timestamp
                frame = op.frame
                size = len(frame)
                taken += size
                if (op.instance == r_next and op.session == r_session
                        and header[b"group"] == r_grp and header[b"instance"] == r_inst
                        and r_last <= ts <= r_first + max_span and r_n < max_run
                        and r_bytes + size <= max_bytes and SOURCE_TIMESTAMP_TAG not in header):
                    add_ts(ts)
                    add_delivered(op.delivered)
                    add_frame(frame)
                    r_next += 1
                    r_last = ts
                    r_n += 1
                    r_bytes += size
                    continue
                if run is not None:
                    order += 1
                    rows.append(self._close_run(run, r_next - 1, r_bytes, order, latest))
                new_events += r_n
                r_session, r_grp, r_inst = op.session, header[b"group"], header[b"instance"]
                src = _src_us(header) if SOURCE_TIMESTAMP_TAG in header else None
                run = RunBuilder(r_session, op.instance, r_grp, r_inst, src, ts, op.delivered,
                                 frame)
                # A message with a source timestamp is a run of its own.
                r_next = op.instance + 1 if src is None else -1
                r_first = r_last = ts
                r_n, r_bytes = 1, size
                add_ts, add_delivered, add_frame = (run.ts.append, run.delivered.append,
                                                    run.frames.append)
                continue
            kind = op[0]
            if kind == ROW:
                # A whole routing batch as one run, built in C-level calls.
                if run is not None:
                    order += 1
                    rows.append(self._close_run(run, r_next - 1, r_bytes, order, latest))
                    new_events += r_n
                    run, r_n, r_next = None, 0, -1
                row = op[1]
                order += 1
                rows.append(row)
                latest[row[3], row[4]] = (row[3], row[4], order, row[0], row[2], op[2], op[3],
                                          op[4])
                new_events += row[2] - row[1] + 1
                taken += row[8]
                row_id = (row[0], row[2])
            elif kind == LOST:
                ok_id = row_id
                if run is not None:
                    # Everything routed before the lost messages is in this batch.
                    ok_id = (run.session, r_next - 1 if run.src is None else run.first)
                if ok_id is not None and (not runs or runs[-1][0] < ok_id):
                    runs.append((ok_id, True))
                if runs and not runs[-1][1]:
                    runs[-1] = ((op[1], op[2]), False)
                else:
                    runs.append(((op[1], op[2]), False))
                self.stats.overload += op[3]
            elif kind == SPOOL_ADD:
                taken += len(op[5])
                spool_add.append(op[1:])
            elif kind == SPOOL_DEL:
                spool_del.append(op[1:])
            else:
                resume[op[1]] = op[1:]
        ok_id = row_id
        if run is not None:
            order += 1
            rows.append(self._close_run(run, r_next - 1, r_bytes, order, latest))
            new_events += r_n
            ok_id = (run.session, run.last)
        if ok_id is not None and (not runs or runs[-1][0] < ok_id):
            runs.append((ok_id, True))
        carried = len(self._carry)
        spool_add, spool_del, resume = self._carry.take(spool_add, spool_del, resume)
        max_session = self._max_session
        if rows and rows[-1][0] > max_session:
            max_session = rows[-1][0]
        self._taken_bytes += taken
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            if rows:
                conn.executemany(
                    "INSERT INTO runs (session, first, last, grp, inst, min_ts, max_ts, src_us, "
                    "bytes, ts, delivered, offsets, frames) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
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
            count, nbytes = self.count + new_events, self.bytes + sum(r[8] for r in rows)
            count, nbytes, evicted, upto = self._evict(count, nbytes)
            latest_keys = self._evict_latest(latest)
            ceiling = self._ceiling
            if max_session + SESSION_LEASE // 2 > ceiling:
                ceiling = max_session + SESSION_LEASE
            self._write_meta(count, nbytes, evicted, upto, ceiling)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            self._failed(new_events, exc)
            if runs:
                self._reports.append((runs[-1][0], False))
            if spool_add or spool_del or resume:
                lost = self._carry.keep(spool_add, spool_del, resume)
                self.stats.spool_lost += lost
                now = time.monotonic()
                if lost and now - self._last_spool_log >= LOG_INTERVAL:
                    self._last_spool_log = now
                    log.error("store %s: failed commits kept more bridge spool operations than "
                              "the carry's bound: %d dropped so far", self.path,
                              self.stats.spool_lost)
            return
        self.count, self.bytes, self._ceiling = count, nbytes, ceiling
        self._latest_keys = latest_keys
        self._latest_seq = order
        self._max_session = max_session
        if evicted != self.evicted:
            self.stats.evicted = self.evicted = evicted
            self.evicted_upto = upto
        self.stats.commits += 1
        self.stats.spool_retried += carried
        self.stats.events_written += new_events
        self.stats.bytes_written += taken
        self._reports.extend(runs)

    @staticmethod
    def _close_run(run: RunBuilder, last: int, nbytes: int, order: int,
                   latest: dict[tuple[bytes, bytes], tuple]) -> tuple:
        """The row of a finished run; its last event becomes its type's latest."""
        if run.src is None:
            run.last = last
        run.nbytes = nbytes
        latest[run.grp, run.inst] = (run.grp, run.inst, order, run.session, run.last,
                                     run.ts[-1], run.delivered[-1], run.frames[-1])
        return run.row()

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
        """Evict the oldest events beyond size / max_bytes / max_age (inside the transaction).

        The newest evicted EventId is the watermark below which readers see
        nothing; runs wholly below it are deleted.
        """
        size, max_bytes = self.size, self.max_bytes
        cutoff = self.clock() - self.max_age if self.max_age else None
        evicted, upto = self.evicted, self.evicted_upto
        if count <= size and (not max_bytes or nbytes <= max_bytes) and cutoff is None:
            return count, nbytes, evicted, upto
        done_run = None
        cur = self._conn.execute("SELECT run, session, first, last, bytes, min_ts, max_ts "
                                 "FROM runs ORDER BY run")
        for run, session, first, last, run_bytes, min_ts, max_ts in cur:
            if upto is not None and (session, last) <= upto:
                done_run = run
                continue
            n = last - first + 1
            # Each bound is monotone along a run (fewer messages, fewer bytes,
            # later timestamps): if one still calls for eviction at its last
            # message, the whole run goes without decoding it.
            if (upto is None or upto < (session, first)) and (
                    count - n >= size or (max_bytes and nbytes - run_bytes >= max_bytes)
                    or (cutoff is not None and max_ts < cutoff)):
                count -= n
                nbytes -= run_bytes
                evicted += n
                upto = (session, last)
                done_run = run
                continue
            if not (count > size or (max_bytes and nbytes > max_bytes)
                    or (cutoff is not None and min_ts < cutoff)):
                break  # not even its first message goes
            # Part of the run goes: its first `start` messages went before.
            # Each bound is monotone along the run, so the number to evict
            # is the largest of the three bounds' own (no loop per message).
            offsets, times = self._run_arrays(run, session, first)
            start = 0 if upto is None or upto < (session, first) else upto[1] - first + 1
            k = count - size
            if max_bytes and nbytes > max_bytes:
                # offsets are cumulative: the fewest messages whose bytes
                # bring nbytes down to max_bytes.
                k = max(k, bisect_left(offsets, nbytes - max_bytes + offsets[start], start) - start)
            if cutoff is not None:
                k = max(k, bisect_left(times, cutoff, start) - start)
            k = min(k, n - start)
            if k > 0:
                count -= k
                nbytes -= offsets[start + k] - offsets[start]
                evicted += k
                upto = (session, first + start + k - 1)
            if start + k < n:
                break
            done_run = run
        cur.close()
        if done_run is not None:
            self._conn.execute("DELETE FROM runs WHERE run <= ?", (done_run,))
        return count, nbytes, evicted, upto

    def _run_arrays(self, run: int, session: int, first: int) -> tuple[array, array]:
        """Cumulative frame offsets and timestamps of a run being evicted in parts.

        Kept for the next commit (which usually evicts more of the same run)
        instead of reading and unpacking its arrays again; keyed by EventId,
        which is never reused (a row id may be, once the newest row is gone).
        """
        cached = self._evicting
        if cached is not None and cached[0] == (run, session, first):
            return cached[1], cached[2]
        ts_b, offsets_b = self._conn.execute("SELECT ts, offsets FROM runs WHERE run = ?",
                                             (run,)).fetchone()
        offsets, times = unpack("q", offsets_b), unpack("d", ts_b)
        self._evicting = ((run, session, first), offsets, times)
        return offsets, times

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
        floor = self.evicted_upto
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
        cond: list[str] = []
        args: list[Any] = []
        if by_source:
            key_col, index_key = "src_us", "src_us, session, first"
            cond.append("src_us IS NOT NULL")
            if s_from is not None:
                cond.append("src_us >= ?")
                args.append(s_from)
            if s_to is not None:
                cond.append("src_us <= ?")
                args.append(s_to)
            if after is not None:
                cond.append(f"(src_us, session, first) {'<' if descending else '>'} (?, ?, ?)")
                args += list(after)
            # Runs with a source timestamp are single messages (min_ts = ts);
            # both tests run on the index, with the exact ones below.
            if t_from is not None:
                cond.append("min_ts >= ?")
                args.append((t_from - 2) / 1e6)
            if t_to is not None:
                cond.append("min_ts <= ?")
                args.append((t_to + 2) / 1e6)
            if groups is not None:
                cond.append(f"grp IN ({', '.join('?' * len(groups))})")
                args += groups
        else:
            key_col = "max_ts" if descending else "min_ts"
            index_key = ("max_ts, session, last" if descending else "min_ts, session, first")
            if s_from is not None or s_to is not None:
                # Only single-event runs carry a source timestamp.
                cond.append("src_us IS NOT NULL")
                if s_from is not None:
                    cond.append("src_us >= ?")
                    args.append(s_from)
                if s_to is not None:
                    cond.append("src_us <= ?")
                    args.append(s_to)
            # A microsecond of slack around the index ranges; the exact test is
            # on each event's reported (rounded) timestamp below.  Runs span at
            # most MAX_RUN_SPAN seconds.
            lo = None if t_from is None else (t_from - 2) / 1e6
            hi = None if t_to is None else (t_to + 2) / 1e6
            if after is not None:
                if descending:
                    hi = after[0] if hi is None else min(hi, after[0])
                else:
                    lo = after[0] if lo is None else max(lo, after[0])
            if lo is not None:
                cond.append("max_ts >= ?")
                args.append(lo)
                if not descending:
                    cond.append("min_ts >= ?")
                    args.append(lo - MAX_RUN_SPAN)
            if hi is not None:
                cond.append("min_ts <= ?")
                args.append(hi)
                if descending:
                    cond.append("max_ts <= ?")
                    args.append(hi + MAX_RUN_SPAN)
        direction = "DESC" if descending else "ASC"
        order = ", ".join(f"{c.strip()} {direction}" for c in index_key.split(","))
        cols = f"{RUN_COLUMNS}, {key_col}, session, {'last' if descending else 'first'}"

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
            end = "max" if descending else "min"
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
            *walks, key=lambda r: r[10:13], reverse=descending)  # also none: no such type
        if accept_type is not None:
            runs = (r for r in runs if accept_type(r[3], r[4]))
        floor = self.evicted_upto
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


def _merge(runs: Iterator[tuple], descending: bool, by_source: bool,
           floor: tuple[int, int] | None) -> Iterator[tuple[Entry, int | None]]:
    """The events of runs (sorted by their first event in the walk's order) in exact order.

    Each run is internally sorted; a run's events are pushed into a heap
    when the run arrives, and the heap gives up an event only once no later
    run can hold a smaller one (every later run starts at or after it).
    Runs do not overlap unless the clock stepped back, so the heap holds one
    run most of the time.
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

    for row in runs:
        start = (sign * row[10], sign * row[11], sign * row[12])
        while heap and heap[0][0] < start:
            _, _, entry, src, it = heapq.heappop(heap)
            yield entry, src
            push(it)
        push(decode(row[:10], floor, descending))
    while heap:
        _, _, entry, src, it = heapq.heappop(heap)
        yield entry, src
        push(it)
