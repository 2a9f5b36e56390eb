"""How a transaction's rows reach SQLite (broker/store/inserts.py).

Large blobs are streamed (inserted as ``zeroblob(n)``, then written with
``Blob.write``, which gives the GIL up) rather than bound: the rows must
read back the same, runs in their order, and the statements show which way
each row went.
"""

from __future__ import annotations

import random
import sqlite3
import struct

import pytest

from broker.store.db import open_store
from broker.store.inserts import STREAM_BYTES, insert_runs, insert_spool, upsert_latest

SIZES = (100, STREAM_BYTES - 1, STREAM_BYTES, 7, 4 << 20, 3 * STREAM_BYTES, 5, 9, 1 << 20)


# Whether each statement of the test's connection sized a blob (zeroblob):
# the trace has the statement as run, its parameters written out.
STATEMENTS: list[bool] = []


@pytest.fixture
def conn(tmp_path):
    conn, _state = open_store(str(tmp_path))
    STATEMENTS.clear()
    conn.set_trace_callback(lambda sql: STATEMENTS.append("zeroblob(" in sql))
    yield conn
    conn.close()


def _blob(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


def _run_row(rng: random.Random, i: int, size: int) -> tuple:
    frames = _blob(rng, size)
    offsets = struct.pack("<2q", 0, size)
    return (1, 10 * i, 10 * i, b"g%d" % i, b"i", float(i), float(i), None, size,
            struct.pack("<d", float(i)), struct.pack("<q", 0), offsets, frames, None)


def _commit(conn, insert, rows: list[tuple]) -> None:
    conn.execute("BEGIN IMMEDIATE")
    insert(conn, rows)
    conn.execute("COMMIT")


def _streamed() -> int:
    """How many rows went in streamed."""
    return sum(STATEMENTS)


def test_runs_keep_their_order_and_bytes_whatever_their_size(conn):
    rng = random.Random(7)
    rows = [_run_row(rng, i, size) for i, size in enumerate(SIZES * 2)]
    _commit(conn, insert_runs, rows)
    got = conn.execute("SELECT session, first, last, grp, inst, min_ts, max_ts, src_us, bytes, "
                       "ts, delivered, offsets, frames, ids FROM runs ORDER BY run").fetchall()
    assert got == rows
    assert _streamed() == sum(size >= STREAM_BYTES for size in SIZES * 2)


def test_latest_rows_are_inserted_and_replaced_whatever_their_size(conn):
    rng = random.Random(8)

    def latest(key: int, seq: int, size: int) -> tuple:
        return (b"g%d" % key, b"i", seq, 1, seq, float(seq), 0, _blob(rng, size))

    first = [latest(key, key, size) for key, size in enumerate(SIZES)]
    # Every key again, its size swapped with another's: large over small and
    # small over large, updates of the upsert (no lastrowid) both ways.
    second = [latest(key, 100 + key, size) for key, size in enumerate(reversed(SIZES))]
    for rows in (first, second):
        _commit(conn, upsert_latest, rows)
        got = conn.execute("SELECT grp, inst, seq, session, instance, ts, delivered, frame "
                           "FROM latest ORDER BY seq").fetchall()
        assert got == rows
    assert _streamed() == 2 * sum(size >= STREAM_BYTES for size in SIZES)


def test_a_spool_row_already_there_is_kept_whatever_its_size(conn):
    rng = random.Random(9)
    rows = [("b", 1, i, float(i), _blob(rng, size)) for i, size in enumerate(SIZES)]
    again = [("b", 1, i, 0.5, _blob(rng, size)) for i, size in enumerate(SIZES)]
    new = [("b", 2, 1, 1.0, _blob(rng, 2 * STREAM_BYTES))]
    for batch in (rows, again + new):
        _commit(conn, insert_spool, batch)
    got = conn.execute("SELECT * FROM spool ORDER BY session, instance").fetchall()
    assert got == rows + new
    # Sized twice (the second time ignored, nothing written), and the new row.
    assert _streamed() == 2 * sum(size >= STREAM_BYTES for size in SIZES) + 1


def test_a_failed_transaction_leaves_no_streamed_row(conn):
    rng = random.Random(10)
    conn.execute("BEGIN IMMEDIATE")
    insert_runs(conn, [_run_row(rng, 0, 4 << 20)])
    upsert_latest(conn, [(b"g", b"i", 1, 1, 1, 1.0, 0, _blob(rng, 4 << 20))])
    conn.execute("ROLLBACK")
    assert conn.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM latest").fetchone() == (0,)
    with pytest.raises(sqlite3.OperationalError):
        # Outside a transaction the row a stream would write into is gone too.
        conn.blobopen("runs", "frames", 1)
