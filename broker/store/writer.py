"""The store's writer: routed messages, bridge spools and resume points, written behind.

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

Readers (:mod:`broker.store.reader`) run in the trio thread on their own
connection; they first commit what is still queued (:meth:`StoreWriter.flush`),
so a query sees every message routed before it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter
from typing import Protocol

import attrs

from broker.core.events import SOURCE_TIMESTAMP_TAG, source_timestamp
from broker.core.router import Routed, Router
from broker.core.tally import COUNTER, Family, counter
from broker.store.batch_rows import (
    OpenRun,
    RunBuilder,
    batch_row,
    merge_rows,
    message_row,
    message_row_py,
    new_run,
    run_ids,
    unpack,
)
from broker.store.carry import SpoolCarry
from broker.store.db import (
    BUSY_TIMEOUT_MS,
    DB_NAME,
    SESSION_LEASE,
    StoreError,
    new_store_id,
    open_store,
    read_meta,
)
from broker.store.heap import trim
from broker.store.inserts import insert_runs, insert_spool, upsert_latest
from broker.store.state import StoreState, state_path, write_state
from wire.hattime import split_timestamp


class Background(Protocol):
    """The writer thread's scheduling, as the store sees it (the service sets
    broker/serving/scheduling.Background; the store does not import serving)."""

    idle: bool

    def behind(self) -> None: ...

    def caught_up(self) -> None: ...

log = logging.getLogger(__name__)

# Operations queued for the writer thread (first element of each tuple; a
# routing batch is queued as the list itself, and the open run -- batches
# merged as they were routed -- as its RunBuilder).  ALONE is the writer's
# own: a message with a source timestamp, a run of its own (_expand).  RUN
# is a merged run: what _expand gives for every run and RunBuilder.take()
# for an open one (the process writer's pipe carries it as such).
LOST, SPOOL_ADD, SPOOL_DEL, RESUME, ROW, ALONE, RUN = range(7)

# Bytes of frames queued for the writer before new messages are no longer
# persisted (routing goes on): bounds the memory a stalled disk can take.
MAX_PENDING_BYTES = 64 * 1024 * 1024
# Queued frame bytes past which a writer thread under SCHED_IDLE is behind
# and goes back to its nice value (broker/serving/scheduling.py,
# Background); it goes idle again below a quarter of it.  About 0.1 s of a
# 300,000 msgs/s flood of 100-byte messages, 400 flushes of 10,000
# isolated msgs/s.
BEHIND_BYTES = MAX_PENDING_BYTES // 16
# Seconds between two log lines about failed writes or overload: a full
# disk must not flood the log.
LOG_INTERVAL = 10.0
# Frame bytes of one write transaction, and the WAL size at which SQLite
# checkpoints and restarts it: max_bytes / WAL_SHARE each, so the
# store's files stay within about 1.5x max_bytes (docs/store.md, "Disk
# bounds"), but at least MIN_TXN_BYTES (few, large commits when max_bytes
# is small) and at most MAX_TXN_BYTES (a commit's fsync stays short).
WAL_SHARE = 8
MIN_TXN_BYTES = 256 * 1024
MAX_TXN_BYTES = 32 * 1024 * 1024
# ... and the WAL's cycle at most this (SQLite's own default: 1,000 pages).
# Measured the same writer CPU per commit at 1,000 and 8,192 pages (0.50 ms
# per 100 messages either way): a page written by many commits is copied back
# once per cycle either way.  A shorter cycle spreads the copying (a 32 MiB
# WAL's checkpoint writes some 3,400 pages inside one commit) and reaches
# the reused WAL sooner after a start (see _keep_wal_small).
WAL_CYCLE_BYTES = 4 * 1024 * 1024
# Flushes between two looks at the WAL's size (_keep_wal_small) unless a
# flush took wal_bytes / 2 of frames or more: a look is a stat, a system
# call that gives the interpreter up and takes it back (a chance to make
# the routing thread wait), and between looks SQLite's own checkpoint
# keeps the WAL at its cycle; 8 flushes of small messages add well under a
# megabyte of WAL (about 64 KiB each at 100 messages).
WAL_CHECK_FLUSHES = 8
# Frame bytes committed between two malloc_trim calls: large frames leave
# free heap behind (broker/store/heap.py); a trim costs ~0.1-1 ms.
TRIM_BYTES = 32 * 1024 * 1024
# Seconds the writer sleeps when idle before it checks max_age again.
IDLE_WAKE = 1.0
# Evicted rows (runs wholly below the watermark) deleted together: the
# watermark evicts exactly at every commit, and readers skip what lies
# below it, but a DELETE rewrites the left edge of the table and of its
# five indexes (six WAL pages) and reads what it frees: one DELETE a
# commit was 2.4 us of the broker's CPU per isolated message at 10,000
# msgs/s, a store that never evicted against one that did (docs/store.md,
# "What is left of the store's cost").  Rows wait for at most this many
# runs, or for DELETE_SHARE of max_bytes (txn_bytes without a byte bound)
# of frames: the room the disk bound leaves them.
DELETE_RUNS = 32
DELETE_SHARE = 16
# Rows of the runs table the eviction scan reads ahead of need, in run order.
# A store at its bound evicts at every commit, and reading the next rows
# every time (a SELECT and a step per row, each a GIL release the writer
# takes back -- a chance to make the routing thread wait; the run evicted in
# parts read again at every commit) was 6-7 of the writer's 25-odd GIL
# hand-overs a flush.  A page of 16 serves 16 commits of isolated messages;
# its rows are small but for their EventIds (16 bytes an event: at most
# 64 KiB a row, 1 MiB a page).
SCAN_PAGE = 16
_SCAN_RUNS = ("SELECT run, session, first, last, bytes, min_ts, max_ts, ids FROM runs "
              "WHERE run > ? ORDER BY run LIMIT ?")
# SESSION_LEASE (sessions reserved ahead of use) lives in broker/store/db.py
# with the rest of the session counter's rules (state file: state.py).

Report = tuple[tuple[int, int], bool]


def _us(t: float) -> int:
    s, us = split_timestamp(t)
    return s * 1_000_000 + us


def _src_us(header: dict) -> int | None:
    src = source_timestamp(header)
    return None if src is None else _us(src)


# Routed messages never persisted: the two ways (failed_events, overload)
# feed one series.
UNPERSISTED = Family(COUNTER, "skan_store_unpersisted_messages",
                     "Routed messages never persisted: their commit failed or the writer was "
                     "too far behind.")


@attrs.define
class StoreStats:
    """The writer's counters; those with a metric are exported as declared
    (broker/core/tally.py)."""

    commits: int = counter("skan_store_commits", "Store transactions committed.")
    events_written: int = counter("skan_store_written_messages",
                                  "Routed messages committed to the store.")
    bytes_written: int = 0
    failed_commits: int = counter(
        "skan_store_failed_commits",
        "Store transactions that failed (disk full, I/O error); routing went on.")
    failed_events: int = UNPERSISTED.field()
    overload: int = UNPERSISTED.field()
    evicted: int = 0
    last_error: str = ""
    # Bridge spool messages pushed out by [store] spool_max_bytes (oldest first).
    spool_dropped: int = counter(
        "skan_store_spool_dropped_messages",
        "Bridge messages pushed out of a spool by [store] spool_max_bytes (oldest first).")
    # Spool/resume operations of failed commits committed by a later commit,
    # and those the carry's bounds dropped (broker/store/carry.py).
    spool_retried: int = counter(
        "skan_store_spool_retried_operations",
        "Bridge spool operations of a failed commit committed by a later one.")
    spool_lost: int = counter(
        "skan_store_spool_lost_operations",
        "Bridge spool operations of failed commits dropped by the retry bound.")
    # WAL checkpoints with truncation (the WAL file passed twice its cycle:
    # after a transaction larger than the cycle, or a reader's snapshot kept
    # SQLite's own checkpoint from finishing) and those a reader's snapshot
    # kept from completing (retried after the next commit).
    checkpoints: int = 0
    checkpoints_busy: int = 0
    # Writer processes that ended unasked ([store] writer = "process";
    # broker/store/writer_process.py): each is replaced.
    writer_deaths: int = counter(
        "skan_store_writer_deaths",
        "Store writer processes that ended unasked (each is replaced; its hand-over "
        "counted as a failed commit).")


def default_dir(log_dir: str) -> str:
    """``[store] dir`` when not set: ``store`` beside the routing-log directory."""
    parent = os.path.dirname(os.path.normpath(log_dir))
    return os.path.join(parent, "store")


_frame = attrgetter("frame")


# Queued operations the writer turns into rows between two offers of the
# GIL to the routing thread.  collect() is Python code holding the GIL; a
# 50 ms flush of 10,000 isolated msgs/s is 500 operations, about 1 ms, which
# the routing thread would otherwise wait through (the interpreter's switch
# interval is 5 ms): in process its p99 lateness was 1.0-1.1 ms against
# 0.6 at 10 ms flushes (bench/writer_interference.py).  64 operations take
# about 0.1 ms.  An offer is os.sched_yield() (it releases the GIL around
# the call): about 1 us, where time.sleep(0) -- a zero-length
# clock_nanosleep -- cost 20 us of CPU and 80 us of the writer's time on the
# benchmark VM; a waiting thread gets the GIL from either (a thread of 1 ms
# Python bursts offering every 0.1 ms: another thread's p99 lateness 1.45 ms
# without offers, 0.20 with sleep(0), 0.23 with sched_yield).
YIELD_EVERY = 64


def offer_gil(background: Background | None) -> None:
    """Offer the GIL to a routing thread waiting for it, between two stretches of
    the writer's own Python.

    Measured with uprobes on the interpreter's take_gil and drop_gil in a
    broker at 10,000 isolated msgs/s: the writer's Python between two SQLite
    calls ran 0.1-0.25 ms holding the GIL at the median (taking the queue
    after the flush's sleep, building the transaction, the bookkeeping after
    COMMIT; cold caches after 10 ms asleep make them 3-5 times their warm
    cost), and the routing thread waited more than 0.1 ms for the GIL about
    200 times a second -- the store's share of the isolated p99.  An offer at
    each seam bounds those waits by the stretch between two seams
    (docs/store.md, "The writer's hold on the GIL").  Only while the writer
    keeps up (idle policy): a writer raised because it fell behind takes
    its share instead, and under a flood, where the routing thread gives the
    GIL back only when the switch interval forces it, each offer could cost
    the writer up to that interval.
    """
    if background is None or background.idle:
        os.sched_yield()  # releases the GIL around the call


def _alone_op(routed: Routed) -> tuple:
    """A message with a source timestamp: a run of its own (ALONE), or a row like
    any other (ROW) when the tag does not read as a timestamp."""
    src = _src_us(routed.header)
    return (ROW if src is None else ALONE, message_row_py(routed, src), routed.timestamp,
            routed.delivered, routed.frame)


def _batch_ops(batch: list[Routed]) -> list[tuple]:
    """A routing batch that is not one run as rows for :func:`merge_rows`: each
    stretch of one type as its row (:func:`batch_row`, in C) where it is a run,
    else a row per message.  The stretches only save work: whether rows form
    a run is merge_rows' rule alone."""
    out: list[tuple] = []
    start, n = 0, len(batch)
    while start < n:
        header = batch[start].header
        if SOURCE_TIMESTAMP_TAG in header:
            out.append(_alone_op(batch[start]))
            start += 1
            continue
        grp, inst = header[b"group"], header[b"instance"]
        end = start + 1
        while end < n:
            header = batch[end].header
            if (header[b"group"] != grp or header[b"instance"] != inst
                    or SOURCE_TIMESTAMP_TAG in header):
                break
            end += 1
        stretch = batch[start:end]
        row = batch_row(stretch)
        if row is not None:
            last = stretch[-1]
            out.append((ROW, row, last.timestamp, last.delivered, last.frame))
        else:
            out += [(ROW, message_row(r), r.timestamp, r.delivered, r.frame) for r in stretch]
        start = end
    return out


def _expand(ops: list) -> Iterator:
    """The writer's operations, ready for :func:`collect`: consecutive rows of one
    type merged into runs by :func:`merge_rows` (in C), the one rule of what
    continues a run.  A routing batch that is not one run (a list: Store.observe
    queued the others as their rows) is cut into rows first (:func:`_batch_ops`),
    so its messages merge with each other and with the rows after it by that
    same rule.  (Independent publishers' messages are a row each; merging them in
    Python was most of the writer's time holding the GIL.)  Every
    :data:`YIELD_EVERY` operations the GIL is offered to the routing thread."""
    n = 0
    i, end = 0, len(ops)
    flat = False
    while i < end:
        op = ops[i]
        n += 1
        if n >= YIELD_EVERY:
            n = 0
            os.sched_yield()  # releases the GIL: a waiting routing thread takes it
        if type(op) is RunBuilder:
            # An open run: merged as it was routed (batch_rows.RunBuilder).
            merged = op.take()
            if merged is not None:
                yield merged
            i += 1
            continue
        if type(op) is list:
            # The first batch that is not one run: the rest of the queue with
            # every such batch as its rows (a row merged before it stays apart).
            assert not flat
            rest: list = []
            for later in ops[i:]:
                if type(later) is list:
                    rest += _batch_ops(later)
                else:
                    rest.append(later)
            ops, i, end, flat = rest, 0, len(rest), True
            continue
        kind = op[0]
        if kind == ROW:
            j, row, events = merge_rows(ops, i, end, ROW)
            last = ops[j - 1]
            # (RUN, the run's row, its last message's timestamp, delivery
            # count, frame and session, its number of messages)
            yield (RUN, row, last[2], last[3], last[4], last[1][0], events)
            n += j - i - 1
            i = j
        elif kind == ALONE:
            row = op[1]
            yield (RUN, (*row, None), op[2], op[3], op[4], row[0], 1)
            i += 1
        else:
            yield op  # RUN (from the process writer's pipe), spool, resume, LOST
            i += 1

# The counters a commit keeps in meta, in one statement (_write_meta).
_META_KEYS = ("count", "bytes", "evicted", "evicted_session", "evicted_instance",
              "session_ceiling")
_UPDATE_META = ("UPDATE meta SET value = CASE key "
                + " ".join(f"WHEN '{k}' THEN ?{i}" for i, k in enumerate(_META_KEYS, 1))
                + " END WHERE key IN (" + ", ".join(f"'{k}'" for k in _META_KEYS) + ")")
@attrs.define
class Transaction:
    """One write transaction's contents (:func:`collect`)."""

    rows: list[tuple]
    latest: dict[tuple[bytes, bytes], tuple]
    spool_add: list[tuple]
    spool_del: list[tuple]
    resume: dict[str, tuple]
    # (EventId, persisted) reports, cumulative, in commit order.
    runs: list[Report]
    taken: int  # frame bytes taken off the queue
    new_events: int
    order: int  # the latest table's update counter after these rows
    overload: int  # messages routed but not persisted (MAX_PENDING_BYTES)
    last_session: int  # the session of the last message written (-1: none)


def collect(ops: Iterable, order: int) -> Transaction:
    """What one transaction writes: the runs :func:`_expand` yields (consecutive
    messages of one type as one run, across sessions too), latest updates,
    spool and resume changes, and the reports to give once committed.
    ``order`` is the latest table's update counter.
    """
    rows: list[tuple] = []
    latest: dict[tuple[bytes, bytes], tuple] = {}
    spool_add: list[tuple] = []
    spool_del: list[tuple] = []
    resume: dict[str, tuple] = {}
    runs: list[Report] = []
    taken = overload = 0
    new_events = 0
    last_id: tuple[int, int] | None = None  # the EventId of the last message so far
    for op in ops:
        kind = op[0]
        if kind == RUN:
            # (RUN, row, last timestamp, last delivered, last frame, last session, events)
            row = op[1]
            order += 1
            rows.append(row)
            # The run's last event becomes its type's latest.
            latest[row[3], row[4]] = (row[3], row[4], order, op[5], row[2], op[2], op[3], op[4])
            new_events += op[6]
            taken += row[8]
            last_id = (op[5], row[2])
        elif kind == LOST:
            ok_id = last_id
            if ok_id is not None and (not runs or runs[-1][0] < ok_id):
                # Everything routed before the lost messages is in this batch.
                runs.append((ok_id, True))
            if runs and not runs[-1][1]:
                runs[-1] = ((op[1], op[2]), False)
            else:
                runs.append(((op[1], op[2]), False))
            overload += op[3]
        elif kind == SPOOL_ADD:
            taken += len(op[5])
            spool_add.append(op[1:])
        elif kind == SPOOL_DEL:
            spool_del.append(op[1:])
        else:
            resume[op[1]] = op[1:]
    if last_id is not None and (not runs or runs[-1][0] < last_id):
        runs.append((last_id, True))
    return Transaction(rows, latest, spool_add, spool_del, resume, runs, taken, new_events,
                       order, overload, -1 if last_id is None else last_id[0])


class StoreWriter:
    """The write side of the store: the queue, the writer thread, commits and eviction.

    Retained messages form a ring bounded by count, bytes and age; bridge
    spools and resume points share its transactions.
    """

    def __init__(self, directory: str, *, size: int, max_bytes: int, max_age: float,
                 flush_interval: float, spool_max_bytes: int = 0,
                 clock: Callable[[], float] = time.time, verify: bool = True) -> None:
        self.directory = directory
        self.path = os.path.join(directory, DB_NAME)
        self.size = size
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.flush_interval = flush_interval
        share = max_bytes // WAL_SHARE if max_bytes else MAX_TXN_BYTES
        self.txn_bytes = max(MIN_TXN_BYTES, min(MAX_TXN_BYTES, share))
        # Frame bytes of evicted rows that may wait for their DELETE.
        self.delete_bytes = max_bytes // DELETE_SHARE if max_bytes else self.txn_bytes
        self.wal_bytes = min(self.txn_bytes, WAL_CYCLE_BYTES)
        # Frame bytes each bridge's spool keeps (0: no bound; broker/store/spool.py).
        self.spool_max_bytes = spool_max_bytes
        self.clock = clock
        self.stats = StoreStats()
        self._conn, _ = open_store(directory, verify=verify)
        # SQLite's own checkpoint once the WAL holds wal_bytes of pages, and
        # the WAL file cut back to twice that when it restarts (_keep_wal_small
        # truncates it when a reader kept the automatic one from finishing).
        # Twice: a cycle ends a little past wal_bytes (frame headers, the last
        # commit), and cutting the file back to wal_bytes at every restart
        # made the last commits of every cycle grow it again (an ftruncate
        # every 0.6 s at 10,000 msgs/s, strace).
        page = self._conn.execute("PRAGMA page_size").fetchone()[0]
        self._conn.execute(f"PRAGMA wal_autocheckpoint = {max(1, self.wal_bytes // page)}")
        self._conn.execute(f"PRAGMA journal_size_limit = {2 * self.wal_bytes}")
        meta = read_meta(self._conn)
        self.count = int(meta["count"])
        self.bytes = int(meta["bytes"])
        self.evicted = int(meta["evicted"])
        self.stats.evicted = self.evicted
        es, ei = meta["evicted_session"], meta["evicted_instance"]
        # (session, instance) of the newest evicted message (replay gaps).
        self.evicted_upto: tuple[int, int] | None = None if es is None else (int(es), int(ei))
        self._ceiling = int(meta["session_ceiling"])
        # The store's identity, in the database and the state file (a store
        # written before state files existed gets one at start_session).
        self.store_id = str(meta.get("store_id") or new_store_id())
        # The ceiling the state file records (written by start_session and
        # by the writer when it raises the ceiling).
        self._state_ceiling = -1
        self._max_session = 0
        # The types in the latest table (bounded by size) and its update counter.
        self._latest_keys: set[tuple[bytes, bytes]] = set(
            self._conn.execute("SELECT grp, inst FROM latest"))
        self._latest_seq = self._conn.execute(
            "SELECT coalesce(max(seq), 0) FROM latest").fetchone()[0]
        self._ops: deque[tuple | list | OpenRun] = deque()
        # The open run: the queue's last operation while batches continue it
        # (routing thread; None once anything else is queued after it).
        self._open: OpenRun | None = None
        # Evicted rows waiting for their DELETE (writer thread): every run up
        # to the first is evicted (waiting or gone; 0 after a start: not
        # known), the second and third count the waiting rows and their
        # frame bytes.  Applied only once its transaction committed.
        self._waiting: tuple[int, int, int] = (0, 0, 0)
        # The rows the eviction scan reads next (_scan_runs): those after the
        # last evicted run, in order; a read-ahead only, dropped at any failed
        # commit (it may hold rows that commit inserted).
        self._scan_ahead: deque[tuple] = deque()
        # The run being evicted in parts: its key and arrays (_run_arrays).
        self._evicting: tuple[tuple[int, int, int], array, array,
                              list[tuple[int, int]] | None] | None = None
        # Spool and resume operations of failed commits (broker/store/carry.py).
        self._carry = SpoolCarry()
        self._added_bytes = 0  # written by the trio thread only
        self._taken_bytes = 0  # written by the writer thread only
        self._trimmed_at = 0
        self._wal_checked_at = 0  # _taken_bytes at the last look at the WAL
        self._unchecked_flushes = 0
        self._signalled = False
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._reports: deque[Report] = deque()
        self._call_soon: Callable[[Callable[[], None]], None] | None = None
        # The writer thread's scheduling (set by the service before start).
        self.background: Background | None = None
        # check_progress: (operations were waiting, commits) at the last check.
        self._watched = (False, -1)
        self._thread_setup: Callable[[], object] | None = None
        # Called in the trio thread with each commit report, in commit order.
        self.on_report: list[Callable[[tuple[int, int], bool], None]] = []
        # Whether a report is awaited now (an Eventer connection asked for
        # persisted notifications).  When not, a commit does not wake the
        # routing thread just to say so: reports are cumulative ("committed
        # up to"), so the next one awaited covers everything before it.
        self.reports_wanted: Callable[[], bool] = lambda: bool(self.on_report)
        self._last_log = -LOG_INTERVAL
        self._failing = False  # the last commit failed (writer thread)
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
        # One transaction: the new ceiling, and "not stopped cleanly" until
        # close() says otherwise (a WAL missing then is noticed at open).
        self._conn.execute("BEGIN IMMEDIATE")
        self._conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [
            ("session_ceiling", self._ceiling), ("store_id", self.store_id), ("clean", 0)])
        self._conn.execute("COMMIT")
        # Then the state file, before anything routes: it outlives the loss
        # of any database file (broker/store/state.py).
        try:
            self._save_state(clean=False)
        except OSError as exc:
            raise StoreError(state_path(self.directory), f"cannot write: {exc.strerror}"
                             ) from None
        return start

    def _save_state(self, *, clean: bool) -> None:
        ceiling = self._ceiling
        write_state(self.directory, StoreState(self.store_id, ceiling, clean))
        self._state_ceiling = ceiling

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

    def stop_thread(self) -> None:
        """Stop the writer thread after its current commit (close() calls it first)."""
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Commit everything queued, stop the writer, checkpoint and close."""
        self.stop_thread()
        self.flush()
        if self._carry:
            with self._lock:  # a last try for spool operations of failed commits
                self._commit_queued()
            if self._carry:
                log.error("store %s: %d bridge spool operations of failed commits are lost at "
                          "close", self.path, len(self._carry))
        clean = True
        try:
            self._conn.execute("UPDATE meta SET value = 1 WHERE key = 'clean'")
            busy = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            clean = not busy
        except sqlite3.Error as exc:
            clean = False
            log.warning("store %s: checkpoint at close failed: %s", self.path, exc)
        self._conn.close()
        if clean:
            # Only now: everything is in the main file.
            try:
                self._save_state(clean=True)
            except OSError as exc:
                log.warning("store %s: cannot mark the state file clean (%s); the next start "
                            "checks the database as after a crash", self.path, exc.strerror)

    # ---- the hot path (trio thread) ------------------------------------------------

    def observe(self, batch: list[Routed]) -> None:
        """Router observer: queue a routing batch for the writer (the list itself).

        The router hands over only messages that entered this broker: a
        cluster peer's messages keep their own server's EventIds, whose
        sessions interleave with ours (each broker of a cluster keeps what
        entered it).
        """
        last = batch[-1]
        pending = self._added_bytes - self._taken_bytes
        if pending > BEHIND_BYTES and self.background is not None and self.background.idle:
            self.background.behind()  # an idle writer starved of CPU gets its share back
        if pending > MAX_PENDING_BYTES:
            self._open = None
            self._ops.append((LOST, last.session, last.instance, len(batch)))
        else:
            self._queue_batch(batch)
        if not self._signalled:
            self._signalled = True
            self._wake.set()

    def _queue_batch(self, batch: list[Routed]) -> None:
        """A routing batch onto the queue: into the open run when it continues it,
        else as a new open run, its row, or (not one run) the list itself.

        The run is built here, while the batch is hot in the cache and the
        routing thread holds the GIL anyway, and in C (RunBuilder.add):
        the writer then takes a flush's run as one object.  Merging a row
        per batch in the writer (independent publishers: 100-odd a flush)
        held the GIL about 0.1 ms a flush on cold caches, which routing
        waited through (docs/store.md, "The open run").
        """
        # RunBuilder.add: an int >= 0 appended, -1 one run but not the open
        # one's, None not one run, NotImplemented the reference's path.
        added = NotImplemented
        if RunBuilder is not None:
            open_run = self._open
            added = -1 if open_run is None else open_run.add(batch)
            if type(added) is int and added < 0:
                open_run = new_run(RUN)
                added = open_run.add(batch)
                if type(added) is int and added >= 0:
                    self._ops.append(open_run)
                    self._open = open_run
            if type(added) is int and added >= 0:
                self._added_bytes += added
                return
        self._open = None
        # None: not one run (RunBuilder.add read it; batch_row would say so too).
        row = None if added is None else batch_row(batch)
        if row is None:
            self._ops.append(batch)
            self._added_bytes += sum(map(len, map(_frame, batch)))
        else:
            last = batch[-1]
            self._ops.append((ROW, row, last.timestamp, last.delivered, last.frame))
            self._added_bytes += row[8]

    def check_progress(self) -> None:
        """Trio thread, every scheduling.WATCH_INTERVAL: a writer under SCHED_IDLE
        that committed nothing between two checks that both found operations
        waiting is starved by other work on the machine: it gets its nice value
        back (and goes idle again once it has caught up)."""
        commits = self.stats.commits + self.stats.failed_commits
        waiting = bool(self._ops)
        background = self.background
        if (waiting and self._watched[0] and commits == self._watched[1]
                and background is not None and background.idle):
            background.behind()
        self._watched = (waiting, commits)

    def spool_add(self, bridge: str, routed: Routed) -> None:
        self._open = None
        self._ops.append((SPOOL_ADD, bridge, routed.session, routed.instance, routed.timestamp,
                          routed.frame))
        self._added_bytes += len(routed.frame)
        self._signal()

    def spool_remove(self, bridge: str, session: int, instance: int) -> None:
        self._open = None
        self._ops.append((SPOOL_DEL, bridge, session, instance))
        self._signal()

    def set_resume(self, bridge: str, server: int, session: int, instance: int) -> None:
        self._open = None
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
            offer_gil(self.background)
            background = self.background
            if (background is not None and not background.idle
                    and self._added_bytes - self._taken_bytes < BEHIND_BYTES // 4):
                background.caught_up()
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
        """Commit what is queued now, in transactions of at most ``txn_bytes`` frame bytes.

        Only what was queued when the flush began: the routing thread keeps
        queueing while a commit runs (SQLite releases the GIL), and chasing
        that made a transaction of the few messages each commit's duration
        let in, so the writer committed (and fsynced) every millisecond
        instead of every ``flush_interval`` -- 2,700 commits a second at
        10,000 isolated msgs/s, measured (bench/writer_interference.py).
        """
        left = len(self._ops)
        left -= self._commit_some(left)
        while left > 0:
            left -= self._commit_some(left)
        self._unchecked_flushes += 1
        if (self._unchecked_flushes >= WAL_CHECK_FLUSHES
                or self._taken_bytes - self._wal_checked_at >= self.wal_bytes // 2):
            self._unchecked_flushes, self._wal_checked_at = 0, self._taken_bytes
            self._keep_wal_small()
        if self._taken_bytes - self._trimmed_at >= TRIM_BYTES:
            # The frames of these commits are free now: hand the heap back
            # (broker/store/heap.py), at most once per TRIM_BYTES written.
            self._trimmed_at = self._taken_bytes
            trim()

    def _take(self, limit: int) -> list:
        """The queued operations of one transaction: at most ``limit`` of them, and at
        least one, at most ``txn_bytes`` of frames (a transaction's pages pass through
        the WAL and, before its eviction frees them, the database: its size is what the
        files may exceed max_bytes by)."""
        ops = self._ops
        if ops and self._added_bytes - self._taken_bytes <= self.txn_bytes:
            # All that is queued fits the budget (the usual case): no look at
            # each operation.  The loop below held the GIL 0.1 ms a flush on
            # cold caches (100-odd isolated messages), which routing waited
            # through.  Only the routing thread appends, at the right.
            popleft = ops.popleft
            taken = [popleft() for _ in range(min(limit, len(ops)))]
        else:
            taken = []
            budget = self.txn_bytes
            while ops and budget > 0 and len(taken) < limit:
                op = ops.popleft()
                taken.append(op)
                if type(op) is RunBuilder:
                    op.seal()  # its bytes are counted now
                    budget -= op.nbytes
                elif type(op) is list:
                    budget -= sum(map(len, map(_frame, op)))
                elif op[0] == ROW or op[0] == RUN:  # RUN: from the process writer's pipe
                    budget -= op[1][8]
                elif op[0] == SPOOL_ADD:
                    budget -= len(op[5])
        # The open run is the queue's last operation: taken, it takes no more
        # batches (the routing thread starts another).
        if taken and type(taken[-1]) is RunBuilder:
            taken[-1].seal()
        return taken

    def _keep_wal_small(self) -> None:
        """Checkpoint and truncate the WAL once it passes ``2 * wal_bytes`` (writer's lock
        held): after a transaction larger than the WAL's cycle, or when a reader's
        snapshot kept SQLite's own checkpoint from finishing.

        Otherwise SQLite checkpoints after the commit that passes ``wal_bytes``
        of pages, restarts the WAL at its beginning and cuts the file back to
        ``wal_bytes`` (journal_size_limit): the file's blocks are then
        overwritten, not appended.  That matters for every commit: its fsync
        of a WAL that grows also journals the file's new size (ext4 here):
        0.41-0.48 against 0.26-0.42 ms of CPU per commit of 100 isolated
        messages, growing against overwritten (docs/store.md, "Disk bounds").
        Truncating to zero at every cycle, as this did before, made every
        commit a growing one.  A reader holding an old snapshot (a query in
        progress) makes the checkpoint return busy: the next commit tries
        again.
        """
        try:
            size = os.stat(self.path + "-wal").st_size
        except OSError:
            return
        if size <= 2 * self.wal_bytes:
            return
        conn = self._conn
        try:
            # No waiting for readers here (the busy timeout is for the writer's lock).
            conn.execute("PRAGMA busy_timeout = 0")
            try:
                busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            finally:
                conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        except sqlite3.Error as exc:
            log.warning("store %s: checkpoint failed: %s", self.path, exc)
            return
        self.stats.checkpoints += 1
        if busy:
            self.stats.checkpoints_busy += 1

    def _commit_some(self, limit: int) -> int:
        """One transaction of at most ``limit`` queued operations; returns how many it took."""
        if not limit and not self._carry:
            if self.max_age:
                self._evict_only()
            return 0
        taken = self._take(limit)
        offer_gil(self.background)
        self._apply(collect(_expand(taken), self._latest_seq))
        return len(taken)

    def _apply(self, tx: Transaction) -> None:
        """Write one transaction, evict beyond the bounds, commit; then the counters follow."""
        rows, latest, runs, taken, new_events = tx.rows, tx.latest, tx.runs, tx.taken, tx.new_events
        self.stats.overload += tx.overload
        carried = len(self._carry)
        spool_add, spool_del, resume = self._carry.take(tx.spool_add, tx.spool_del, tx.resume)
        max_session = self._max_session
        if tx.last_session > max_session:
            max_session = tx.last_session
        self._taken_bytes += taken
        conn = self._conn
        offer_gil(self.background)
        try:
            conn.execute("BEGIN IMMEDIATE")
            if rows:
                insert_runs(conn, rows)
                upsert_latest(conn, list(latest.values()))
            if spool_add:
                insert_spool(conn, spool_add)
            if spool_del:
                conn.executemany(
                    "DELETE FROM spool WHERE bridge = ? AND session = ? AND instance = ?",
                    spool_del)
            if resume:
                conn.executemany("INSERT OR REPLACE INTO resume VALUES (?, ?, ?, ?)",
                                 resume.values())
            count, nbytes = self.count + new_events, self.bytes + sum(r[8] for r in rows)
            count, nbytes, evicted, upto, waiting = self._evict(count, nbytes)
            latest_keys = self._evict_latest(latest)
            ceiling = self._ceiling
            if max_session + SESSION_LEASE // 2 > ceiling:
                ceiling = max_session + SESSION_LEASE
            self._write_meta(count, nbytes, evicted, upto, ceiling)
            conn.execute("COMMIT")
            offer_gil(self.background)
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
        self._waiting = waiting
        if ceiling != self._state_ceiling and self._state_ceiling >= 0:
            self._raise_state_ceiling()
        self._latest_keys = latest_keys
        self._latest_seq = tx.order
        self._max_session = max_session
        if evicted != self.evicted:
            self.stats.evicted = self.evicted = evicted
            self.evicted_upto = upto
        if self._failing:
            self._failing = False
            log.warning("store %s: writing again after %d failed commits (%d messages not "
                        "persisted so far)", self.path, self.stats.failed_commits,
                        self.stats.failed_events)
        self.stats.commits += 1
        self.stats.spool_retried += carried
        self.stats.events_written += new_events
        self.stats.bytes_written += taken
        self._reports.extend(runs)

    def _evict_only(self) -> None:
        """Apply max_age while no traffic arrives (the writer's idle wake-up)."""
        if not self.count:
            return
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            count, nbytes, evicted, upto, waiting = self._evict(self.count, self.bytes)
            if evicted != self.evicted:
                self._write_meta(count, nbytes, evicted, upto, self._ceiling)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            self._failed(0, exc)
            return
        self.count, self.bytes, self._waiting = count, nbytes, waiting
        if evicted != self.evicted:
            self.stats.evicted = self.evicted = evicted
            self.evicted_upto = upto

    def _evict(self, count: int, nbytes: int
               ) -> tuple[int, int, int, tuple[int, int] | None, tuple[int, int, int]]:
        """Evict the oldest events beyond size / max_bytes / max_age (inside the transaction).

        The newest evicted EventId is the watermark below which readers see
        nothing; runs wholly below it are deleted, :data:`DELETE_RUNS` at a
        time (or :attr:`delete_bytes` of them, or all once nothing is
        retained).  Returns the new count, bytes, evicted count and
        watermark, and the rows waiting for their DELETE (``_waiting``).
        """
        size, max_bytes = self.size, self.max_bytes
        cutoff = self.clock() - self.max_age if self.max_age else None
        evicted, upto = self.evicted, self.evicted_upto
        if count <= size and (not max_bytes or nbytes <= max_bytes) and cutoff is None:
            return count, nbytes, evicted, upto, self._waiting
        scan_from, waiting_runs, waiting_bytes = self._waiting
        # The scan starts past the rows that wait: each of them would cost a
        # read of its ids, which lie after its frames (a whole overflow chain).
        for run, session, first, last, run_bytes, min_ts, max_ts, ids_b in self._scan_runs(
                scan_from):
            if ids_b is None:
                n = last - first + 1
                last_id = (session, last)
            else:  # a run across sessions (broker/store/batch_rows.py)
                n = len(ids_b) // 16
                last_id = tuple(unpack("q", ids_b[-16:]))
            if upto is not None and last_id <= upto:
                pass  # evicted before (a row that waited across a restart)
            # Each bound is monotone along a run (fewer messages, fewer bytes,
            # later timestamps): if one still calls for eviction at its last
            # message, the whole run goes without decoding it.
            elif (upto is None or upto < (session, first)) and (
                    count - n >= size or (max_bytes and nbytes - run_bytes >= max_bytes)
                    or (cutoff is not None and max_ts < cutoff)):
                count -= n
                nbytes -= run_bytes
                evicted += n
                upto = last_id
            elif not (count > size or (max_bytes and nbytes > max_bytes)
                      or (cutoff is not None and min_ts < cutoff)):
                break  # not even its first message goes
            else:
                # Part of the run goes: its first `start` messages went before.
                # Each bound is monotone along the run, so the number to evict
                # is the largest of the three bounds' own (no loop per message).
                offsets, times, ids = self._run_arrays(run, session, first, last, ids_b)
                if upto is None or upto < (session, first):
                    start = 0
                else:
                    start = upto[1] - first + 1 if ids is None else bisect_right(ids, upto)
                k = count - size
                if max_bytes and nbytes > max_bytes:
                    # offsets are cumulative: the fewest messages whose bytes
                    # bring nbytes down to max_bytes.
                    k = max(k, bisect_left(offsets, nbytes - max_bytes + offsets[start],
                                           start) - start)
                if cutoff is not None:
                    k = max(k, bisect_left(times, cutoff, start) - start)
                k = min(k, n - start)
                if k > 0:
                    count -= k
                    nbytes -= offsets[start + k] - offsets[start]
                    evicted += k
                    upto = (session, first + start + k - 1) if ids is None else ids[start + k - 1]
                if start + k < n:
                    break
            # The whole run is evicted now: a row that waits for its DELETE.
            scan_from = run
            waiting_runs += 1
            waiting_bytes += run_bytes
        if waiting_runs and (waiting_runs >= DELETE_RUNS or waiting_bytes >= self.delete_bytes
                             or not count):
            self._conn.execute("DELETE FROM runs WHERE run <= ?", (scan_from,))
            waiting_runs = waiting_bytes = 0
            if not count:
                # The table is empty now, and SQLite numbers the next row 1.
                scan_from = 0
                self._scan_ahead.clear()
        return count, nbytes, evicted, upto, (scan_from, waiting_runs, waiting_bytes)

    def _scan_runs(self, scan_from: int) -> Iterator[tuple]:
        """The runs table's rows after run ``scan_from``, in order, read :data:`SCAN_PAGE`
        at a time ahead of need and kept (:attr:`_scan_ahead`) for the next commits.

        Rows are never changed once written and only rows up to an evicted
        run are deleted, so the kept rows stay true; new rows always come
        after them (SQLite numbers a row past the largest, and the table's
        largest row goes only when the table is emptied, which drops what is
        kept).  Nothing is consumed here: what a commit evicts is dropped at
        the next scan, once that commit's ``scan_from`` is the writer's.
        """
        rows = self._scan_ahead
        while rows and rows[0][0] <= scan_from:
            rows.popleft()
        i = 0
        while True:
            if i == len(rows):
                after = rows[-1][0] if rows else scan_from
                more = self._conn.execute(_SCAN_RUNS, (after, SCAN_PAGE)).fetchall()
                if not more:
                    return
                rows.extend(more)
            yield rows[i]
            i += 1

    def _run_arrays(self, run: int, session: int, first: int, last: int, ids_b: bytes | None
                    ) -> tuple[array, array, list[tuple[int, int]] | None]:
        """Cumulative frame offsets, timestamps and (across sessions) EventIds of a run
        being evicted in parts.

        Kept for the next commit (which usually evicts more of the same run)
        instead of reading and unpacking its arrays again; keyed by EventId,
        which is never reused (a row id may be, once the newest row is gone).
        """
        cached = self._evicting
        if cached is not None and cached[0] == (run, session, first):
            return cached[1], cached[2], cached[3]
        ts_b, offsets_b = self._conn.execute("SELECT ts, offsets FROM runs WHERE run = ?",
                                             (run,)).fetchone()
        offsets, times = unpack("q", offsets_b), unpack("d", ts_b)
        ids = None if ids_b is None else run_ids(session, first, last, ids_b)
        self._evicting = ((run, session, first), offsets, times, ids)
        return offsets, times, ids

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
        # One statement, not six: each SQLite call gives the interpreter up
        # and takes it back, and each taking back can make the routing
        # thread wait (docs/store.md, "Keeping routing's latency").
        self._conn.execute(_UPDATE_META, (
            count, nbytes, evicted, None if upto is None else upto[0],
            None if upto is None else upto[1], ceiling))

    def _raise_state_ceiling(self) -> None:
        """The state file follows a raised ceiling (writer thread; rare, see SESSION_LEASE)."""
        try:
            self._save_state(clean=False)
        except OSError as exc:
            now = time.monotonic()
            if now - self._last_log >= LOG_INTERVAL:
                self._last_log = now
                log.error("store %s: cannot update the state file (%s); sessions stay safe "
                          "while the database files are intact", self.path, exc.strerror)

    def _rollback(self) -> None:
        # The read-ahead may hold rows of the transaction rolled back.
        self._scan_ahead.clear()
        with contextlib.suppress(sqlite3.Error):
            self._conn.execute("ROLLBACK")

    def _failed(self, n: int, exc: sqlite3.Error) -> None:
        self._failing = True  # until a commit succeeds again (logged then)
        self.stats.failed_commits += 1
        self.stats.failed_events += n
        self.stats.last_error = str(exc)
        now = time.monotonic()
        if now - self._last_log >= LOG_INTERVAL:
            self._last_log = now
            log.error("store %s: write failed (%s); %d commits (%d messages) not persisted so "
                      "far, routing goes on", self.path, exc, self.stats.failed_commits,
                      self.stats.failed_events)

    def __len__(self) -> int:
        # Committed messages (metrics read this: no flush on their path).
        return self.count

