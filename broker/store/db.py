"""The on-disk store: one SQLite database in WAL mode, its schema and its start-up check.

Layout (docs/store.md has the full description):

- ``meta(key, value)``: the marker (``magic``), ``schema_version``, the
  session ceiling and the running totals of the events table;
- ``runs``: the retained routed messages, consecutive messages of one
  type and one session in one row (broker/store/batch_rows.py), in routing
  (= EventId) order; indexed by EventId, by first and by last timestamp
  (alone and after the group, with the instance last so that a query for
  some types of a group filters on the index) and by source timestamp;
- ``latest``: the newest message per (group, instance), least recently
  updated evicted first;
- ``spool``: the bridges' unacknowledged messages, per bridge;
- ``resume``: a bridge's resume point (Mariner ``last_event_id``).

Opening never empties anything: a directory whose database lacks the
marker, carries another schema version or fails SQLite's own check is
refused with :class:`StoreError` naming the path and the reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time

DB_NAME = "store.sqlite3"
MAGIC = "skan-broker event store"
SCHEMA_VERSION = 1

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE runs (
    run INTEGER PRIMARY KEY,
    session INTEGER NOT NULL,
    first INTEGER NOT NULL,
    last INTEGER NOT NULL,
    grp BLOB NOT NULL,
    inst BLOB NOT NULL,
    min_ts REAL NOT NULL,
    max_ts REAL NOT NULL,
    src_us INTEGER,
    bytes INTEGER NOT NULL,
    ts BLOB NOT NULL,
    delivered BLOB NOT NULL,
    offsets BLOB NOT NULL,
    frames BLOB NOT NULL
);
CREATE UNIQUE INDEX runs_id ON runs (session, first);
CREATE INDEX runs_min ON runs (min_ts, session, first);
{grp_indexes}
CREATE INDEX runs_max ON runs (max_ts, session, last);
CREATE INDEX runs_src ON runs (src_us, session, first, grp, min_ts) WHERE src_us IS NOT NULL;
CREATE TABLE latest (
    grp BLOB NOT NULL,
    inst BLOB NOT NULL,
    seq INTEGER NOT NULL,
    session INTEGER NOT NULL,
    instance INTEGER NOT NULL,
    ts REAL NOT NULL,
    delivered INTEGER NOT NULL,
    frame BLOB NOT NULL,
    PRIMARY KEY (grp, inst)
);
CREATE INDEX latest_seq ON latest (seq);
CREATE TABLE spool (
    bridge TEXT NOT NULL,
    session INTEGER NOT NULL,
    instance INTEGER NOT NULL,
    ts REAL NOT NULL,
    frame BLOB NOT NULL,
    PRIMARY KEY (bridge, session, instance)
);
CREATE TABLE resume (
    bridge TEXT PRIMARY KEY,
    server INTEGER NOT NULL,
    session INTEGER NOT NULL,
    instance INTEGER NOT NULL
);
"""

# The group indexes end with the instance (since after version 1 was first
# released): a query for some types of a group tests the instance on the
# index and reads only the rows it wants.  A store whose group indexes lack
# it gets them rebuilt at open; same names and leading columns, so an older
# broker reads either kind (no version bump).
GRP_INDEXES = """
CREATE INDEX runs_grp_min ON runs (grp, min_ts, session, first, inst);
CREATE INDEX runs_grp_max ON runs (grp, max_ts, session, last, inst);
"""
SCHEMA = SCHEMA.format(grp_indexes=GRP_INDEXES.strip())

# Milliseconds a connection waits for the other one's lock (the writer
# thread against a query's flush) before SQLite reports "database is locked".
BUSY_TIMEOUT_MS = 10_000


class StoreError(OSError):
    """The store directory cannot be used; the message names the path and the reason.

    An OSError, so the command line reports it like any other start-up failure.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"store {path}: {reason}")
        self.path = path
        self.reason = reason


def connect(path: str, *, readonly: bool = False) -> sqlite3.Connection:
    """One connection with the store's settings (WAL, fsync of every commit)."""
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None,
                               check_same_thread=False)
    else:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    if not readonly:
        # WAL: readers (queries) never block the writer.  synchronous FULL:
        # a commit is on disk (WAL fsynced) when it returns, so a power loss
        # takes at most what was not yet committed (flush_interval).
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise sqlite3.OperationalError(f"cannot switch to WAL mode (got {mode})")
        conn.execute("PRAGMA synchronous = FULL")
        # Some builds zero deleted content (SQLITE_SECURE_DELETE): evicting
        # would then write every evicted byte once more.
        conn.execute("PRAGMA secure_delete = OFF")
    return conn


def open_store(directory: str, *, verify: bool = True) -> sqlite3.Connection:
    """Open (or create) the store in ``directory`` and verify it; raises :class:`StoreError`.

    ``verify=False``: the caller knows it was just verified (the writer
    process, started by a broker that opened and checked the store itself):
    no second quick_check, which is linear in the file's size.
    """
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise StoreError(directory, f"cannot create the directory: {exc.strerror}") from None
    path = os.path.join(directory, DB_NAME)
    fresh = not os.path.exists(path)
    if fresh:
        foreign = sorted(n for n in os.listdir(directory) if not n.startswith(DB_NAME))
        if foreign:
            # Someone else's files: never write a database among them.
            raise StoreError(directory, "not a broker store: the directory holds other files "
                             f"({', '.join(foreign[:5])}) and no {DB_NAME}")
    try:
        if fresh:
            conn = connect(path)
            _create(conn)
        elif not verify:
            conn = connect(path)
        else:
            # Check before anything is written: switching a foreign database
            # to WAL would already change its file.  (Reading replays our own
            # WAL after a crash: SQLite's recovery, nothing is lost.)
            conn = sqlite3.connect(path, isolation_level=None)
            try:
                _verify(conn, path)
            finally:
                conn.close()
            conn = connect(path)
            _upgrade_indexes(conn, path)
    except sqlite3.DatabaseError as exc:
        raise StoreError(path, f"damaged or not a database: {exc}") from None
    return conn


def _create(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN")
    for statement in SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [
        ("magic", MAGIC), ("schema_version", SCHEMA_VERSION), ("session_ceiling", 0),
        ("count", 0), ("bytes", 0), ("evicted", 0), ("evicted_session", None),
        ("evicted_instance", None),
    ])
    conn.execute("COMMIT")


def _upgrade_indexes(conn: sqlite3.Connection, path: str) -> None:
    """Rebuild group indexes written without the instance (one transaction, once)."""
    columns = [row[2] for row in conn.execute("PRAGMA index_info(runs_grp_min)")]
    if "inst" in columns:
        return
    started = time.monotonic()
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DROP INDEX IF EXISTS runs_grp_min")
        conn.execute("DROP INDEX IF EXISTS runs_grp_max")
        for statement in GRP_INDEXES.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute("COMMIT")
    except sqlite3.OperationalError as exc:
        # E.g. no disk space for the new indexes: the old ones stay (rolled
        # back) and answer every query, only slower; tried again next start.
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        log.warning("store %s: group indexes not rebuilt (%s); queries for some types of a "
                    "group stay slower", path, exc)
        return
    log.info("store %s: group indexes rebuilt with the instance in %.1fs", path,
             time.monotonic() - started)


def _verify(conn: sqlite3.Connection, path: str) -> None:
    # SQLite's own structural check of the pages (quick_check is linear in
    # the database size without comparing index contents to the tables).
    problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
    if problems != ["ok"]:
        raise StoreError(path, f"damaged: {'; '.join(problems)}")
    tables = {row[0] for row in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "meta" not in tables:
        raise StoreError(path, "not a broker store: no meta table (a foreign SQLite database)")
    meta = dict(conn.execute("SELECT key, value FROM meta"))
    if meta.get("magic") != MAGIC:
        raise StoreError(path, "not a broker store: the marker is missing or wrong")
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise StoreError(path, f"schema version {version!r}; this broker reads version "
                         f"{SCHEMA_VERSION} only")
    missing = {"runs", "latest", "spool", "resume"} - tables
    if missing:
        raise StoreError(path, f"damaged: tables missing: {', '.join(sorted(missing))}")


def read_meta(conn: sqlite3.Connection) -> dict[str, object]:
    return dict(conn.execute("SELECT key, value FROM meta"))
