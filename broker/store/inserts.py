"""How a transaction's rows reach SQLite: few statements, large blobs streamed.

Two costs of the ``sqlite3`` module shape the writer's statements, both paid
by routing when the writer holds the GIL that routing waits for:

- It gives the GIL up and takes it back around every step of a statement:
  rows go in multi-row INSERTs (:func:`insert_many`), one step for up to
  :data:`MAX_ROWS_PER_INSERT` rows.
- It binds a ``bytes`` parameter with ``SQLITE_TRANSIENT``: SQLite copies
  the value while the GIL is held.  A blob of :data:`STREAM_BYTES` or more
  is inserted as ``zeroblob(n)`` and written by ``Blob.write``, which gives
  the GIL up while SQLite copies it (:func:`stream`).

docs/store.md, "Large frames reach SQLite without the GIL", has the
measurements.
"""

from __future__ import annotations

import sqlite3
from itertools import chain

INSERT_RUNS = ("INSERT INTO runs (session, first, last, grp, inst, min_ts, max_ts, src_us, "
               "bytes, ts, delivered, offsets, frames, ids) VALUES ")
INSERT_LATEST = ("INSERT INTO latest (grp, inst, seq, session, instance, ts, delivered, frame) "
                 "VALUES ")
UPSERT_LATEST = (" ON CONFLICT (grp, inst) DO UPDATE SET seq = excluded.seq, "
                 "session = excluded.session, instance = excluded.instance, ts = excluded.ts, "
                 "delivered = excluded.delivered, frame = excluded.frame")
INSERT_SPOOL = "INSERT OR IGNORE INTO spool VALUES (?, ?, ?, ?, ?)"

# Rows per multi-row INSERT, the largest of the power-of-two statement shapes.
# executemany steps SQLite once per row, and the sqlite3 module releases and
# takes back the GIL at every step: with isolated messages (one row each)
# that was two GIL hand-overs per message, each a chance for the writer to
# make the routing thread wait.  One statement of up to 256 rows is one step
# (14 x 256 parameters, far below SQLite's 32,766); power-of-two shapes keep
# the statements few (the connection caches them).
MAX_ROWS_PER_INSERT = 256

# A blob this large is streamed (:func:`stream`), not bound.  Bound, a 4 MiB
# frame held the GIL 10-14 ms in the writer (SQLite's copy and its fresh
# mapping's page faults), streamed 1-1.5 ms; and a writer at nice 10 on a busy
# machine is preempted while it holds the GIL, which stretched such holds
# tenfold: a bystander of 4 MiB frames saw routing stop for 100-250 ms.  A
# copy of 64 KiB takes about 10 us, less than the statement, the open and the
# write that streaming costs a row, so smaller blobs stay in the multi-row
# INSERTs (a run of small messages reaches 64 KiB only in floods).
STREAM_BYTES = 64 << 10

# The columns holding the large blobs.
_RUN_FRAMES = 12
_LATEST_FRAME = 7
_SPOOL_FRAME = 4


def insert_many(conn: sqlite3.Connection, head: str, ncols: int, tail: str,
                rows: list) -> None:
    """``head`` VALUES (..), (..), ... ``tail`` for ``rows``, in few statements."""
    one = "(" + ", ".join("?" * ncols) + ")"
    i, n = 0, len(rows)
    size = MAX_ROWS_PER_INSERT
    while i < n:
        while size > n - i:
            size //= 2
        conn.execute(head + ", ".join([one] * size) + tail,
                     list(chain.from_iterable(rows[i:i + size])))
        i += size


def stream(conn: sqlite3.Connection, table: str, column: str, rowid: int,
           data: bytes) -> None:
    """Writes ``data`` into a row's ``zeroblob(len(data))``, the GIL given up meanwhile."""
    with conn.blobopen(table, column, rowid) as blob:
        blob.write(data)


def _zeroblob_values(ncols: int, at: int) -> str:
    """``(?, ..., zeroblob(?), ...)``: column ``at`` is sized, not bound."""
    marks = ["?"] * ncols
    marks[at] = "zeroblob(?)"
    return "(" + ", ".join(marks) + ")"


def _sized(row: tuple, at: int) -> tuple:
    """``row`` with its blob at ``at`` replaced by the blob's length."""
    return (*row[:at], len(row[at]), *row[at + 1:])


_INSERT_RUN_SIZED = INSERT_RUNS + _zeroblob_values(14, _RUN_FRAMES)
_UPSERT_LATEST_SIZED = INSERT_LATEST + _zeroblob_values(8, _LATEST_FRAME) + UPSERT_LATEST
_INSERT_SPOOL_SIZED = "INSERT OR IGNORE INTO spool VALUES " + _zeroblob_values(5, _SPOOL_FRAME)


def insert_runs(conn: sqlite3.Connection, rows: list[tuple]) -> None:
    """The runs rows, in their order (a run's number is its place in the
    eviction's order): multi-row INSERTs, a row with a large frames column
    on its own, streamed."""
    start = 0
    for i, row in enumerate(rows):
        frames = row[_RUN_FRAMES]
        if len(frames) >= STREAM_BYTES:
            if start < i:
                insert_many(conn, INSERT_RUNS, 14, "", rows[start:i])
            rowid = conn.execute(_INSERT_RUN_SIZED, _sized(row, _RUN_FRAMES)).lastrowid
            assert rowid is not None  # an INSERT into a rowid table
            stream(conn, "runs", "frames", rowid, frames)
            start = i + 1
    insert_many(conn, INSERT_RUNS, 14, "", rows[start:] if start else rows)


def upsert_latest(conn: sqlite3.Connection, rows: list[tuple]) -> None:
    """The latest table's new rows (one per group and instance; any order)."""
    large = [row for row in rows if len(row[_LATEST_FRAME]) >= STREAM_BYTES]
    if large:
        rows = [row for row in rows if len(row[_LATEST_FRAME]) < STREAM_BYTES]
    insert_many(conn, INSERT_LATEST, 8, UPSERT_LATEST, rows)
    for row in large:
        conn.execute(_UPSERT_LATEST_SIZED, _sized(row, _LATEST_FRAME))
        # An upsert that updated has no lastrowid: the key finds the row.
        (rowid,) = conn.execute("SELECT rowid FROM latest WHERE grp = ? AND inst = ?",
                                row[:2]).fetchone()
        stream(conn, "latest", "frame", rowid, row[_LATEST_FRAME])


def insert_spool(conn: sqlite3.Connection, rows: list[tuple]) -> None:
    """Bridge spool rows; one already there (a retried commit's) is kept as it is."""
    large = [row for row in rows if len(row[_SPOOL_FRAME]) >= STREAM_BYTES]
    if large:
        rows = [row for row in rows if len(row[_SPOOL_FRAME]) < STREAM_BYTES]
    conn.executemany(INSERT_SPOOL, rows)
    for row in large:
        cursor = conn.execute(_INSERT_SPOOL_SIZED, _sized(row, _SPOOL_FRAME))
        if cursor.rowcount == 1 and cursor.lastrowid is not None:
            stream(conn, "spool", "frame", cursor.lastrowid, row[_SPOOL_FRAME])
