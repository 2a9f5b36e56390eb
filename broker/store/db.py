"""The on-disk store: one SQLite database in WAL mode, its schema and its start-up check.

Layout (docs/store.md has the full description):

- ``meta(key, value)``: the marker (``magic``), ``schema_version``, the
  session ceiling and the running totals of the events table;
- ``runs``: the retained routed messages, consecutive messages of one
  type in one row, across sessions too (broker/store/batch_rows.py), in routing
  (= EventId) order; indexed by EventId, by first and by last timestamp
  (alone and after the group, with the instance last so that a query for
  some types of a group filters on the index) and by source timestamp;
- ``latest``: the newest message per (group, instance), least recently
  updated evicted first;
- ``spool``: the bridges' unacknowledged messages, per bridge;
- ``resume``: a bridge's resume point (Mariner ``last_event_id``).

Opening never empties anything: a directory whose database lacks the
marker, carries another schema version or fails SQLite's own check is
refused with :class:`StoreError` naming the path and the reason; so is a
store missing a file (the WAL after an unclean stop, the main file beside
its WAL), found by cross-checking the database with the state file
(broker/store/state.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
import urllib.parse

from broker.store.state import (
    STATE_NAME,
    DbFacts,
    StateError,
    StoreState,
    check,
    new_store_id,
    read_state,
    state_path,
    wal_present,
    write_state,
)

DB_NAME = "store.sqlite3"
MAGIC = "skan-broker event store"
SCHEMA_VERSION = 2
# Versions this broker opens; older ones are upgraded in place at open
# (_upgrade_schema).  Version 2 added runs.ids: a run may span sessions
# (broker/store/batch_rows.py), which a version-1 reader would misnumber,
# so an older broker refuses a version-2 store rather than misread it.
READS_VERSIONS = (1, 2)
# The files SQLite keeps beside the database (WAL mode; -journal only if a
# tool switched the store out of WAL mode).
SIDE_FILES = ("-wal", "-shm", "-journal")
# Sessions reserved ahead of use.  The ceiling is committed before sessions
# below it are handed out, so a restart (even after SIGKILL or a clock
# stepped back) continues above every session issued before.  A broker
# routes far fewer than 10^6 batches a second, so one reservation lasts
# minutes; each costs nothing but a gap in the numbering at a restart.
SESSION_LEASE = 1_000_000_000

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
    frames BLOB NOT NULL,
    ids BLOB
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


def open_store(directory: str, *, verify: bool = True
               ) -> tuple[sqlite3.Connection, StoreState | None]:
    """Open (or create) the store in ``directory`` and verify it; raises :class:`StoreError`.

    Returns the connection and the state file as found (None when there was
    none).  Nothing is written before every check has passed: a refused
    store is left exactly as it was (the checks read a database without its
    WAL through SQLite's ``immutable`` mode, which creates no file).

    ``verify=False``: the caller knows the store was just opened and checked
    (the writer process, started by a broker that did all of this itself
    and has marked the store running): no second check (quick_check is
    linear in the file's size), no state file read.
    """
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise StoreError(directory, f"cannot create the directory: {exc.strerror}") from None
    path = os.path.join(directory, DB_NAME)
    if not verify:
        try:
            return connect(path), None
        except sqlite3.DatabaseError as exc:
            raise StoreError(path, f"damaged or not a database: {exc}") from None
    try:
        state = read_state(directory)
    except StateError as exc:
        raise StoreError(state_path(directory), f"{exc}. Restore it; or, if the database is "
                         "complete, remove it and the broker recreates it from the database"
                         ) from None
    if not os.path.exists(path):
        return _open_new(directory, path, state), state
    wal = wal_present(path)
    try:
        # Check before anything is written: switching a foreign database
        # to WAL would already change its file.  (Reading replays our own
        # WAL after a crash: SQLite's recovery, nothing is lost.)
        if wal:
            conn = sqlite3.connect(path, isolation_level=None)
        else:
            conn = sqlite3.connect(f"file:{urllib.parse.quote(path)}?immutable=1", uri=True,
                                   isolation_level=None)
        try:
            try:
                _verify(conn, path)
            except StoreError:
                if wal or state is None or state.clean:
                    raise
                # Created in the run that was killed: the main file holds
                # nothing yet (not even the tables), everything was in the WAL.
                raise StoreError(path, f"its WAL {path}-wal is missing but the broker did not "
                                 "stop cleanly, and the main file holds no store without it "
                                 f"(everything was in the WAL). Restore {DB_NAME}-wal; or, to "
                                 f"start a new empty store, remove {DB_NAME} and {DB_NAME}-shm "
                                 f"and keep {STATE_NAME} (sessions continue above the old "
                                 "store's)") from None
            facts = _facts(conn)
        finally:
            conn.close()
        reason = check(path, directory, facts, state, wal)
        if reason is not None:
            raise StoreError(path, reason)
        if state is None and facts.store_id is not None:
            log.warning("store %s: the state file %s is missing; recreated from the database "
                        "(%s)", path, STATE_NAME,
                        "its WAL is present" if wal else "it says it was stopped cleanly")
        conn = connect(path)
        _upgrade_schema(conn, path)
        _upgrade_indexes(conn, path)
    except sqlite3.DatabaseError as exc:
        raise StoreError(path, f"damaged or not a database: {exc}") from None
    return conn, state


def _open_new(directory: str, path: str, state: StoreState | None) -> sqlite3.Connection:
    """A new store where there is no database: refused if other files, or its WAL, are there."""
    left = sorted(n for n in os.listdir(directory)
                  if n.startswith(DB_NAME) and n[len(DB_NAME):] in SIDE_FILES)
    if left:
        raise StoreError(path, f"missing, but {', '.join(left)} {'is' if len(left) == 1 else 'are'}"
                         " there: the main file was lost (starting on what is left would lose "
                         f"committed events). Restore {DB_NAME}; or, to start a new empty store, "
                         f"remove {', '.join(left)} and keep {STATE_NAME} (sessions continue "
                         "above the old store's)")
    ours = {DB_NAME, STATE_NAME, STATE_NAME + ".tmp"}
    foreign = sorted(n for n in os.listdir(directory) if n not in ours)
    if foreign:
        # Someone else's files: never write a database among them.
        raise StoreError(directory, "not a broker store: the directory holds other files "
                         f"({', '.join(foreign[:5])}) and no {DB_NAME}")
    try:
        conn = connect(path)
        _create(conn, ceiling=0 if state is None else state.session_ceiling)
    except sqlite3.DatabaseError as exc:
        raise StoreError(path, f"cannot create: {exc}") from None
    if state is not None:
        log.warning("store %s: no database files, but %s is there: started a new, empty "
                    "store; sessions continue above %d (the old store's ceiling)", path,
                    STATE_NAME, state.session_ceiling)
    return conn


def _facts(conn: sqlite3.Connection) -> DbFacts:
    meta = read_meta(conn)
    clean = meta.get("clean")
    store_id = meta.get("store_id")
    return DbFacts(store_id=store_id if isinstance(store_id, str) else None,
                   session_ceiling=int(meta["session_ceiling"]),
                   clean=None if clean is None else bool(clean))


def accept_store(directory: str) -> str:
    """``skan-broker accept-store DIR``: take the database as it is (the operator's decision).

    For a store refused because a file is missing (its WAL, its state
    file) or older than the state file: marks the database clean, moves
    its session ceiling above every ceiling known (the database's, the
    state file's) plus one lease, and writes a state file that matches.
    The broker must be stopped.  Returns what it did, for the operator.
    """
    path = os.path.join(directory, DB_NAME)
    if not os.path.exists(path):
        raise StoreError(path, f"missing: there is no database to accept. Restore it; or, to "
                         "start a new empty store, remove the -wal and -shm files beside it "
                         f"and keep {STATE_NAME}")
    try:
        state = read_state(directory)
        note = ""
    except StateError as exc:
        state, note = None, f"; the state file was unreadable ({exc}) and is replaced"
    try:
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            _verify(conn, path)
            facts = _facts(conn)
        finally:
            conn.close()
        known = max(facts.session_ceiling, 0 if state is None else state.session_ceiling)
        # One lease more: sessions a lost WAL recorded stay below it.
        ceiling = known + SESSION_LEASE
        store_id = facts.store_id or new_store_id()
        conn = connect(path)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [
                ("session_ceiling", ceiling), ("store_id", store_id), ("clean", 1)])
            conn.execute("COMMIT")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise StoreError(path, f"damaged or not a database: {exc}") from None
    write_state(directory, StoreState(store_id, ceiling, True))
    return (f"store {path}: accepted as it is ({read_meta_count(path)} retained messages); "
            f"sessions continue above {ceiling}{note}")


def read_meta_count(path: str) -> int:
    conn = sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro", uri=True)
    try:
        return int(read_meta(conn)["count"])
    finally:
        conn.close()


def _create(conn: sqlite3.Connection, ceiling: int = 0) -> None:
    conn.execute("BEGIN")
    for statement in SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [
        ("magic", MAGIC), ("schema_version", SCHEMA_VERSION), ("session_ceiling", ceiling),
        ("store_id", new_store_id()), ("clean", 0),
        ("count", 0), ("bytes", 0), ("evicted", 0), ("evicted_session", None),
        ("evicted_instance", None),
    ])
    conn.execute("COMMIT")


def _upgrade_schema(conn: sqlite3.Connection, path: str) -> None:
    """Bring a version-1 store to version 2 (runs.ids; no row is rewritten)."""
    version = read_meta(conn).get("schema_version")
    if version == SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("ALTER TABLE runs ADD COLUMN ids BLOB")
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION,))
        conn.execute("COMMIT")
    except sqlite3.Error:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    log.info("store %s: schema upgraded from version %s to %d (runs may span sessions); "
             "an older broker no longer opens it", path, version, SCHEMA_VERSION)


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
    if version not in READS_VERSIONS:
        raise StoreError(path, f"schema version {version!r}; this broker reads versions "
                         f"{', '.join(map(str, READS_VERSIONS))} only")
    missing = {"runs", "latest", "spool", "resume"} - tables
    if missing:
        raise StoreError(path, f"damaged: tables missing: {', '.join(sorted(missing))}")


def read_meta(conn: sqlite3.Connection) -> dict[str, object]:
    return dict(conn.execute("SELECT key, value FROM meta"))
